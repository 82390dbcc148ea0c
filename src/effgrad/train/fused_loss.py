"""Cross-entropy over a large vocabulary without ever holding the ``[rows, vocabulary]`` logits.

A language model's last layer projects each position's hidden state ``h``
(``d`` numbers) onto the vocabulary (``V`` numbers, 50,257 for GPT-2), and the
loss is a softmax cross-entropy over those logits. Computed plainly, the
logits of a batch (``rows = batch * T``) are one ``[rows, V]`` float32 tensor
(393 MiB at batch 8, T=256 for GPT-2's vocabulary) and backprop holds about
two more of its size. Fused, in chunks of rows (Cut Cross-Entropy, Wijmans et
al. 2025; Liger's fused linear cross-entropy)::

    forward, per chunk c of rows and     z = h_c @ W_j (+ b_j) (soft-capped: cap * tanh(z / cap))
    j of 4,096 classes:                  running max m_c and sum s_c of exp(z - m_c): the logsumexp
                                         a_c: the running sum of exp(z - m_c) @ W_j^T, rescaled as m_c grows
                                         keep lse_c = m_c + log s_c (one number per row) and
                                         g_c = a_c / s_c - W[label_c] (d loss_c / d h_c: [rows, d]); drop z
    backward:                            dh_c = dloss_c * g_c
    W's gradient, per chunk j of         z recomputed;  dz = (exp(z_cj - lse_c) - onehot(label)) * dloss_c
    4,096 classes and c of rows:         dW_j += h_c^T @ dz;  db_j += sum(dz); each dW_j written in place

Only one chunk's logits (16 MiB of float32 by default) exist at a time (with
rank metrics the forward chunks hold all classes of fewer rows: a rank needs
the label's logit before the others are counted), and
the kernel's gradient is summed per class chunk in a small buffer (summing
whole kernel-sized gradients over row chunks would keep three of them
alive). The loss and every gradient equal the plain computation's (the
chunks run in float32 whatever the compute dtype). Four matmuls of the
head's size, where the plain loss does three: the logits are made twice.

Because the hidden states' gradient is made in the forward pass (an online
softmax, as flash attention's), the kernel's gradient needs nothing from
backprop but ``dloss`` (a number per row), so it can wait: inside
:func:`kernel_gradients_later` (the train step's backprop) it is made after
the backward pass of the whole model under the head, instead of being held
through it (49 MiB at GPT-2's vocabulary, where that backward pass peaks).

Trap:
    The saving is in the loss, not the model: anything else that reads the
    logits needs them. Compiled accuracy and top-k metrics (``attach``) are
    computed from the chunks (each position's rank among the classes);
    with any other compiled metric the step does not fuse and warns, rather
    than report a metric computed on something else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import warnings

import keras
import tensorflow as tf

from effgrad import _compat, _proof

__all__ = ["fused_sparse_cross_entropy", "Head", "find_head", "decide", "readers_of_logits", "kernel_gradients_later"]

# Elements of one chunk's logits: 16 MiB of float32 (GPT-2's vocabulary: 83 rows per chunk).
CHUNK_ELEMENTS = 2**22
# Columns of the kernel per chunk in backprop (1,024 rows at a time: 16 MiB of logits).
_VOCAB_CHUNK = 4096


def _chunk_rows(vocabulary: int, chunk_rows: int | None) -> int:
    if chunk_rows is None:
        return max(8, CHUNK_ELEMENTS // max(vocabulary, 1))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}.")
    return chunk_rows


# No AutoGraph: nothing here branches on tensors, so a caller's tf.function need not convert it.
@tf.autograph.experimental.do_not_convert
def fused_sparse_cross_entropy(
    hidden,
    kernel,
    labels,
    *,
    bias=None,
    transposed: bool = False,
    soft_cap: float | None = None,
    ignore_class: int | None = None,
    chunk_rows: int | None = None,
    from_logits: bool = True,
) -> tf.Tensor:
    """``SparseCategoricalCrossentropy(from_logits=True)`` of ``hidden @ kernel (+ bias)``, unreduced.

    Example:
        >>> hidden = tf.random.normal([2, 5, 16])                 # [batch, T, d]
        >>> kernel = tf.random.normal([16, 1000])                 # [d, vocabulary]
        >>> labels = tf.random.uniform([2, 5], 0, 1000, tf.int32)
        >>> loss = effgrad.fused_sparse_cross_entropy(hidden, kernel, labels)
        >>> plain = keras.losses.sparse_categorical_crossentropy(labels, hidden @ kernel, from_logits=True)
        >>> bool(tf.reduce_max(tf.abs(loss - plain)) < 1e-4)
        True

    Args:
        hidden: ``[..., d]`` inputs of the projection (any float dtype).
        kernel: ``[d, V]`` (a ``Dense`` kernel), or ``[V, d]`` with
            ``transposed=True`` (an embedding matrix used in reverse, as
            keras_hub's tied ``ReversibleEmbedding``).
        labels: ``[...]`` integer class ids, the leading shape of ``hidden``.
        bias: Optional ``[V]``.
        transposed: See ``kernel``.
        soft_cap: Logits are ``soft_cap * tanh(z / soft_cap)`` (Gemma 2).
        ignore_class: Labels equal to it give loss 0 and no gradient; the
            result carries a Keras mask marking them, as Keras's loss does.
        chunk_rows: Rows per chunk; default: 16 MiB of logits per chunk.
        from_logits: Must be True (the projection's output is logits).

    Returns:
        ``[...]`` float32 per-position losses (reduce them yourself, or let
        the train step normalize them over the whole batch).
    """
    if not from_logits:
        raise ValueError("fused_sparse_cross_entropy computes the softmax itself: it needs from_logits=True.")
    losses, _ = _cross_entropy(hidden, kernel, labels, bias, transposed, soft_cap, ignore_class, chunk_rows, False)
    return losses


def _cross_entropy(hidden, kernel, labels, bias, transposed, soft_cap, ignore_class, chunk_rows, ranks: bool):
    """``(losses, ranks or None)``: :func:`fused_sparse_cross_entropy`, and with ``ranks`` each
    position's ``[2]`` float32 ``(classes whose logit beats the label's, classes tying it with a
    smaller id)``; a label outside ``[0, V)`` counts every class as beating it.

    Accuracy (Keras's argmax, first maximum wins) is "both are 0"; top-k (``tf.math.in_top_k``:
    ties straddling the boundary are in) is "the first is below k".
    """
    # The variables themselves, for kernel_gradients_later (a tensor has no gradient to defer).
    owners = tuple(t if isinstance(t, (tf.Variable, keras.Variable)) else None for t in (kernel, bias))
    hidden = tf.convert_to_tensor(hidden)
    kernel = tf.convert_to_tensor(kernel)
    labels = tf.convert_to_tensor(labels)
    if kernel.shape.rank != 2:
        raise ValueError(f"kernel must be 2-D ([d, V], or [V, d] with transposed=True), got shape {kernel.shape}.")
    depth, vocabulary = (kernel.shape[1], kernel.shape[0]) if transposed else (kernel.shape[0], kernel.shape[1])
    if hidden.shape[-1] is not None and hidden.shape[-1] != depth:
        raise ValueError(
            f"hidden's last axis ({hidden.shape[-1]}) must equal the kernel's input size ({depth}; kernel shape "
            f"{kernel.shape}, transposed={transposed})."
        )
    if labels.dtype.is_floating:
        labels = tf.cast(labels, tf.int32)
    rows_shape = tf.shape(labels)
    flat_labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
    given = flat_labels  # the metrics rank the label as given, ignored class included (as Keras's do)
    valid = None
    if ignore_class is not None:
        valid = tf.not_equal(flat_labels, ignore_class)
        flat_labels = tf.where(valid, flat_labels, 0)
    flat_hidden = tf.reshape(hidden, [-1, depth])
    flat_labels, flat_hidden = _checked(flat_labels, flat_hidden, given, int(vocabulary))
    # Without ranks a chunk is [rows, 4,096 classes] (see _fused's forward_in_blocks).
    size = _chunk_rows(vocabulary if ranks else min(vocabulary, _VOCAB_CHUNK), chunk_rows)
    losses, rank = _fused(
        flat_hidden, kernel, bias, flat_labels, valid, transposed, soft_cap, size, given if ranks else None, owners
    )
    losses = tf.reshape(losses, rows_shape)
    if valid is not None:
        _compat.set_keras_mask(losses, tf.reshape(valid, rows_shape))
    if rank is not None:
        rank = tf.reshape(rank, tf.concat([rows_shape, [2]], 0))
    return losses, rank


def _checked(labels, hidden, given, vocabulary: int):
    """``(labels, hidden)``, refusing a label outside ``[0, vocabulary)`` as Keras's cross-entropy does.

    Outside XLA, TensorFlow's kernel raises ``InvalidArgumentError`` naming the
    range: so does this (before any gradient exists). Under XLA the plain loss
    is NaN there, and so are its gradients: the rows of such labels become NaN
    here, so the loss and every gradient are, and the step is skipped.
    """
    in_range = (labels >= 0) & (labels < vocabulary)
    if not _compat.in_xla_context():
        offending = tf.boolean_mask(given, tf.logical_not(in_range))
        check = tf.debugging.Assert(
            tf.reduce_all(in_range),
            [f"Received a label value outside the valid range of [0, {vocabulary}) (the fused sparse "
             "cross-entropy; Keras's raises the same): labels from", tf.reduce_min(offending), "to",
             tf.reduce_max(offending)],
        )  # fmt: skip
        with tf.control_dependencies([check]):
            return tf.identity(labels), hidden
    poison = tf.where(in_range, 0.0, float("nan"))
    return labels, hidden + tf.cast(poison, hidden.dtype)[:, None]


_deferred = threading.local()


def _later() -> list | None:
    return getattr(_deferred, "pending", None)


@contextlib.contextmanager
def kernel_gradients_later(variables):
    """Inside, the fused loss's backprop leaves the projection's weight gradients for afterwards.

    Yields ``finish(grads) -> grads``: call it with ``tape.gradient(target,
    variables)`` (made inside the block); it makes the kernel's and the bias's
    gradients once every other gradient exists and adds them in.

    Why: backprop meets the loss first, so the kernel's gradient (``d x V``,
    49 MiB at GPT-2's vocabulary) would otherwise be alive through the whole
    backward pass of the model under it, where the peak is. Made last, from
    the rows' ``logsumexp`` and upstream gradients (a few numbers per row), it
    costs the same matmuls: the forward pass already made the hidden states'
    gradient. An embedding tied to the kernel gets its lookup gradient
    (IndexedSlices, or dense from a checkpointed segment) added into that
    buffer chunk by chunk.
    """
    pending: list = []
    outer, _deferred.pending = _later(), pending  # per thread: MirroredStrategy traces replicas in threads
    variables = list(variables)

    def finish(grads):
        grads = list(grads)
        made = [t for g in grads if g is not None for t in ((g.values,) if isinstance(g, tf.IndexedSlices) else (g,))]
        for owners, weights in pending:
            where = [next((i for i, v in enumerate(variables) if v is o), None) for o in owners]
            if all(i is None for i in where):  # a frozen projection: no gradient wanted
                continue
            with tf.control_dependencies(made):  # after the rest of backprop: not alive through it
                made_here = weights([None if i is None else grads[i] for i in where])
            for i, owner, gradient in zip(where, owners, made_here):
                if i is not None:
                    grads[i] = tf.cast(gradient, owner.dtype)
        pending.clear()
        return grads

    try:
        yield finish
    finally:
        _deferred.pending = outer


def _classes(w, b, start, width: int, transposed: bool, has_bias: bool):
    """The kernel's and the bias's classes ``start:start + width`` (``start`` may be a tensor: the
    size stays static, as XLA needs)."""
    w_j = tf.slice(w, [start, 0], [width, -1]) if transposed else tf.slice(w, [0, start], [-1, width])
    return w_j, (tf.slice(b, [start], [width]) if has_bias else b)


def _over_classes(vocabulary: int, block, state, first_alone: bool = False):
    """``block(start, width, state) -> state`` over the classes, one chunk of ``_VOCAB_CHUNK`` at a
    time: the full chunks in one ``tf.while_loop``, the last, shorter one after it, so the graph is
    the same size whatever the vocabulary (unrolled, GPT-2's 13 chunks took a step's trace from 1.7
    to 2.9 s). ``first_alone``: the first chunk is unrolled too (it makes a buffer the loop carries).
    """
    full, tail = divmod(vocabulary, _VOCAB_CHUNK)
    first = 0
    if first_alone or not full:
        width = _VOCAB_CHUNK if full else tail
        state, first = block(0, width, state), 1
        full, tail = (full - 1, tail) if full else (0, 0)

    def body(j, *state):
        if not _compat.in_xla_context():
            # A stateful op in the loop: with only stateless ones the loops held 26 MiB more at
            # GPT-2's head (114 vs 88 MiB added, in each of 3 fresh processes) and were no faster.
            with tf.control_dependencies([tf.timestamp()]):
                j = tf.identity(j)
        return (j + 1, *block(j * _VOCAB_CHUNK, _VOCAB_CHUNK, state))

    if full:
        state = tf.while_loop(
            lambda j, *_: j < first + full,
            body,
            (tf.constant(first), *state),
            maximum_iterations=full,
            parallel_iterations=1,  # one chunk's logits at a time
        )[1:]
    if tail:
        state = block((first + full) * _VOCAB_CHUNK, tail, tuple(state))
    return tuple(state)


def _in_chunk(ids, start, width: int):
    """``(each id's index in the class chunk start:start + width, or 0; whether it is in it)``."""
    local = ids - start
    inside = (local >= 0) & (local < width)
    return tf.where(inside, local, 0), inside


def _logits(h, w, b, transposed: bool, soft_cap, classes_first: bool = False):
    """``(z, dz / d(h @ w + b) or None)``: a chunk's logits, and the soft cap's slope if there is one.

    ``classes_first`` (a ``[V, d]`` kernel): ``z`` is ``[classes, rows]``, ``w @ h^T``.
    """
    if classes_first:
        z = tf.matmul(w, h, transpose_b=True)
        if b is not None:
            z = z + b[:, None]
    else:
        z = tf.matmul(h, w, transpose_b=transposed)
        if b is not None:
            z = z + b
    if soft_cap is None:
        return z, None
    capped = tf.tanh(z / soft_cap)
    return soft_cap * capped, 1.0 - tf.square(capped)


def _fused(hidden, kernel, bias, labels, valid, transposed, soft_cap, size, given=None, owners=(None, None)):
    """``([rows] losses, [rows, 2] ranks of ``given`` or None)``.

    The forward pass also makes each row's gradient of its loss with respect to ``hidden`` (an
    online softmax, as flash attention's); backprop only scales it, and recomputes each chunk's
    logits for the kernel's gradient. ``owners``: the variables behind ``kernel`` and ``bias``:
    inside :func:`kernel_gradients_later` their gradient is left to be made after the rest of
    backprop.
    """
    has_bias = bias is not None
    bias = tf.zeros([0], tf.float32) if bias is None else tf.convert_to_tensor(bias)
    rows = tf.shape(hidden)[0]
    # Never a chunk larger than the batch (padding 64 rows to 838 would multiply the work); under
    # XLA `rows` is a compile-time constant, so the size stays static there.
    size = tf.maximum(tf.minimum(size, rows), 1)
    chunks = (rows + size - 1) // size
    pad = chunks * size - rows

    def padded(t):
        return tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1))

    def logits_of(h_chunk, w, b):
        return _logits(h_chunk, w, b if has_bias else None, transposed, soft_cap)

    def chunk(t, i):
        # A static-size slice: XLA needs static shapes, and the padding makes every chunk full.
        return tf.slice(t, [i * size] + [0] * (t.shape.rank - 1), [size] + [-1] * (t.shape.rank - 1))

    @tf.custom_gradient
    def fused(h, w, b):
        # stop_gradient: the loops are differentiated by `grad` below, so while_v2 must not keep
        # per-iteration accumulators (each chunk's logits) for a gradient of its own.
        h32, w32, b32 = (tf.stop_gradient(tf.cast(t, tf.float32)) for t in (h, w, b))
        vocabulary = int(w.shape[0] if transposed else w.shape[1])
        h_pad, labels_pad = padded(h32), padded(labels)
        if given is not None:
            given_pad = padded(given)
            class_ids = tf.range(vocabulary)

        def classes(start, width):
            return _classes(w32, b32, start, width, transposed, has_bias)

        def back_to_hidden(p, w_j):  # p @ W_j^T: [rows, classes] -> [rows, d]
            return tf.matmul(p, w_j, transpose_b=not transposed)

        def minus_label_rows(acc, labels_c, label_logit):
            # d loss / d h = softmax @ W^T - W[:, label] (times the cap's slope at each logit).
            local, inside = _in_chunk(labels_c, 0, vocabulary)
            w_label = tf.gather(w32, local) if transposed else tf.transpose(tf.gather(w32, local, axis=1))
            slope = tf.where(inside, 1.0, 0.0)
            if soft_cap is not None:
                slope *= 1.0 - tf.square(label_logit / soft_cap)
            return acc - slope[:, None] * w_label

        def forward_in_blocks(i, lse_parts, loss_parts, dh_parts):
            # Without ranks a row's logits need not exist whole: the logsumexp runs over chunks of
            # 4,096 classes (a running max and sum, and the sum of softmax-weighted kernel rows
            # rescaled with them), so each matmul is [size, 4,096], the shape backprop uses, not a
            # skinny [16 MiB / V, V] (measured at GPT-2's vocabulary, 2,048 rows: 0.16 s against 0.24 s).
            h_i, labels_i = chunk(h_pad, i), chunk(labels_pad, i)

            def block(start, width, state):
                top, total, picked, acc = state
                with tf.control_dependencies([total, picked, acc]):  # one class chunk's logits at a time
                    w_j, b_j = classes(start, width)
                    z, slope = logits_of(h_i, w_j, b_j)
                new_top = tf.maximum(top, tf.reduce_max(z, axis=1))
                rescale = tf.exp(top - new_top)
                e = tf.exp(z - new_top[:, None])
                total = total * rescale + tf.reduce_sum(e, axis=1)
                acc = acc * rescale[:, None] + back_to_hidden(e if slope is None else e * slope, w_j)
                local, inside = _in_chunk(labels_i, start, width)
                picked += tf.where(inside, tf.gather(z, local, batch_dims=1), 0.0)
                return new_top, total, picked, acc

            top = tf.fill(tf.shape(labels_i), float("-inf"))
            top, total, picked, acc = _over_classes(
                vocabulary, block, (top, tf.zeros_like(top), tf.zeros_like(top), tf.zeros_like(h_i))
            )
            lse = top + tf.math.log(total)
            dh = minus_label_rows(acc / total[:, None], labels_i, picked)
            return i + 1, lse_parts.write(i, lse), loss_parts.write(i, lse - picked), dh_parts.write(i, dh)

        def forward(i, lse_parts, loss_parts, dh_parts, rank_parts):
            z, slope = logits_of(chunk(h_pad, i), w32, b32)
            lse = tf.reduce_logsumexp(z, axis=1)
            labels_i = chunk(labels_pad, i)
            picked = tf.gather(z, labels_i, batch_dims=1)
            p = tf.exp(z - lse[:, None])
            dh = minus_label_rows(back_to_hidden(p if slope is None else p * slope, w32), labels_i, picked)
            # The metrics' share: two counts per row from logits that exist anyway.
            label, inside = _in_chunk(chunk(given_pad, i), 0, vocabulary)
            target = tf.gather(z, label, batch_dims=1)[:, None]
            beaten = tf.reduce_sum(tf.cast(z > target, tf.float32), axis=1)
            tied = tf.reduce_sum(tf.cast((z == target) & (class_ids < label[:, None]), tf.float32), axis=1)
            beaten = tf.where(inside, beaten, float(vocabulary))
            return (
                i + 1,
                lse_parts.write(i, lse),
                loss_parts.write(i, lse - picked),
                dh_parts.write(i, dh),
                rank_parts.write(i, tf.stack([beaten, tied], axis=1)),
            )

        depth = h.shape[-1]
        arrays = [tf.TensorArray(tf.float32, size=chunks, element_shape=[None]) for _ in range(2)]
        arrays.append(tf.TensorArray(tf.float32, size=chunks, element_shape=[None, depth]))
        if given is not None:
            arrays.append(tf.TensorArray(tf.float32, size=chunks, element_shape=[None, 2]))
        # One chunk at a time (parallel_iterations=1): running several at once holds several chunks'
        # logits (measured: 632 vs 162 MiB for 2,048 rows of GPT-2's vocabulary).
        _, lse_parts, loss_parts, dh_parts, *rank_parts = tf.while_loop(
            lambda i, *_: i < chunks,
            forward if given is not None else forward_in_blocks,
            (tf.constant(0), *arrays),
            maximum_iterations=chunks,
            parallel_iterations=1,
        )
        lse = tf.reshape(lse_parts.stack(), [-1])[:rows]  # one number per row is all backprop keeps
        d_hidden = tf.reshape(dh_parts.stack(), [-1, depth])[:rows]  # [rows, d]: the size of `hidden`
        loss = tf.reshape(loss_parts.stack(), [-1])[:rows]
        if valid is not None:
            loss = tf.where(valid, loss, 0.0)
        outputs = (loss,)
        if given is not None:
            outputs += (tf.reshape(rank_parts[0].stack(), [-1, 2])[:rows],)

        def grad(upstream, *_rank_gradient):  # the ranks are counts: no gradient flows through them
            d_loss = tf.cast(upstream, tf.float32)
            if valid is not None:
                d_loss = tf.where(valid, d_loss, 0.0)
            dh = tf.cast(d_loss[:, None] * d_hidden, h.dtype)
            later = _later()
            if later is not None and all(o is not None for o in owners[: 1 + has_bias]):

                def weights(others):
                    return _weight_gradients(h32, w32, b32, labels, lse, d_loss, transposed, soft_cap, has_bias, others)

                later.append((owners, weights))
                return dh, None, None
            dw, db = _weight_gradients(h32, w32, b32, labels, lse, d_loss, transposed, soft_cap, has_bias)
            return dh, tf.cast(dw, w.dtype), tf.cast(db, b.dtype)

        return outputs, grad

    outputs = fused(hidden, kernel, bias)
    return outputs[0], (outputs[1] if given is not None else None)


def _weight_gradients(h32, w32, b32, labels, lse, d_loss, transposed, soft_cap, has_bias, others=(None, None)):
    """``(dW, db)`` of ``sum(d_loss * loss)``, each chunk's logits made again from ``lse``.

    ``others``: gradients of the kernel and the bias from elsewhere (a tied embedding's lookup:
    IndexedSlices, or dense from a checkpointed segment, which then is the buffer), added chunk by
    chunk: added to the whole kernel-sized result they would take a second kernel-sized buffer
    (TensorFlow's scatter-add does not update its input in place: measured 128 vs 64 MiB).

    Chunks of the vocabulary (a loop, one at a time), and of rows inside each: the kernel's
    gradient is summed per vocabulary chunk in a small ``[d, chunk]`` buffer, then written in place
    into the one kernel-sized buffer. Summing whole ``[d, V]`` gradients over row chunks would keep
    three kernel-sized buffers alive (the sum, the addend, the result); concatenating the chunks at
    the end, two (measured: 49 MiB more at GPT-2's).
    """
    vocabulary = int(w32.shape[0] if transposed else w32.shape[1])
    rows = tf.shape(h32)[0]
    rc = tf.maximum(tf.minimum(max(1, CHUNK_ELEMENTS // _VOCAB_CHUNK), rows), 1)
    row_chunks = (rows + rc - 1) // rc
    extra = row_chunks * rc - rows

    def rows_of(t, i):
        return tf.slice(t, [i * rc] + [0] * (t.shape.rank - 1), [rc] + [-1] * (t.shape.rank - 1))

    h_b, d_b, lse_b, labels_b = (
        tf.pad(t, [[0, extra]] + [[0, 0]] * (t.shape.rank - 1)) for t in (h32, d_loss, lse, labels)
    )
    xla = _compat.in_xla_context()
    sparse = others[0] if isinstance(others[0], tf.IndexedSlices) else None
    dense = others[0] is not None and sparse is None
    # A dense gradient from elsewhere (a checkpointed segment's lookup) is the buffer itself: each
    # chunk is added to its slice of it, in place. Else the first chunk makes the buffer.
    dw = tf.cast(others[0], tf.float32) if dense else None

    def write(buffer, part, start, width: int, axis: int, own: bool):
        """``part`` into classes ``start:start + width`` (along ``axis``) of ``buffer``, in place."""
        rank = part.shape.rank
        if buffer is None:  # the first chunk padded with zeros (a zeros tensor would be folded
            # into a kernel-sized constant that the graph keeps for good)
            return tf.pad(part, [[0, vocabulary - width] if a == axis else [0, 0] for a in range(rank)])
        begin = tf.stack([start if a == axis else 0 for a in range(rank)])
        if xla:  # XLA updates in place (it has no kernel for InplaceUpdate)
            return _compat.dynamic_update_slice(buffer, part, begin)
        if axis == 0 and own:  # rows of a buffer made here, which nothing else reads: InplaceUpdate copies
            # them in place (TensorStridedSliceUpdate's generic strided copy took 1.4 ms per 4 MiB chunk,
            # 17 ms a step at GPT-2's vocabulary)
            return tf.raw_ops.InplaceUpdate(x=buffer, i=tf.range(start, start + width), v=part)
        end = tf.stack([start + width if a == axis else part.shape[a] for a in range(rank)])
        # in place: TensorFlow forwards the buffer nothing else reads
        return tf.raw_ops.TensorStridedSliceUpdate(input=buffer, begin=begin, end=end, strides=[1] * rank, value=part)

    def block(start, width: int, state):
        dw, db = state
        with tf.control_dependencies([t for t in state if t is not None]):  # one vocabulary chunk at a time
            w_j, b_j = _classes(w32, b32, start, width, transposed, has_bias)
        local, inside = _in_chunk(labels_b, start, width)

        def backward(i, dw_j, db_j):
            h_i, d_i, lse_i = rows_of(h_b, i), rows_of(d_b, i), rows_of(lse_b, i)
            # A [V, d] kernel's chunk is computed as [classes, rows]: then neither matmul transposes
            # its big operand (dz): the pair measured 10% faster at GPT-2's tied head than dz^T @ h.
            z, slope = _logits(h_i, w_j, b_j if has_bias else None, transposed, soft_cap, classes_first=transposed)
            per_row = (lambda t: t[None, :]) if transposed else (lambda t: t[:, None])
            dz = tf.exp(z - per_row(lse_i)) * per_row(d_i)
            # minus d_loss at each row's label (if in this chunk): a scatter, not a one-hot
            picks = tf.stack([tf.range(rc), rows_of(local, i)], axis=1)
            picks = tf.reverse(picks, axis=[1]) if transposed else picks
            dz = tf.tensor_scatter_nd_sub(dz, picks, tf.where(rows_of(inside, i), d_i, 0.0))
            if slope is not None:
                dz = dz * slope
            dw_i = tf.matmul(dz, h_i) if transposed else tf.matmul(h_i, dz, transpose_a=True)
            db_j = db_j + tf.reduce_sum(dz, axis=1 if transposed else 0) if has_bias else db_j
            return i + 1, dw_j + dw_i, db_j

        _, dw_j, db_j = tf.while_loop(
            lambda i, *_: i < row_chunks,
            backward,
            (
                tf.constant(0),
                _part(dw if dense else sparse, start, width, 0 if transposed else 1, w_j),
                _part(others[1], start, width, 0, b_j),
            ),
            maximum_iterations=row_chunks,
            parallel_iterations=1,
        )
        dw = write(dw, dw_j, start, width, 0 if transposed else 1, own=not dense)
        return dw, (write(db, db_j, start, width, 0, own=True) if has_bias else db)

    # No bias: its empty stand-in rides along (a loop cannot carry None).
    return _over_classes(vocabulary, block, (dw, None if has_bias else b32), first_alone=True)


def _part(gradient, start, width: int, class_axis: int, like):
    """Classes ``start:start + width`` (along ``class_axis``) of a kernel's or bias's ``gradient``:
    dense, IndexedSlices (a lookup's rows) or None (zeros), shaped as ``like``."""
    if gradient is None:
        return tf.zeros_like(like)
    if isinstance(gradient, tf.IndexedSlices) and class_axis == 0:  # the looked-up rows in the chunk
        local, inside = _in_chunk(tf.cast(gradient.indices, tf.int32), start, width)
        values = tf.cast(gradient.values, tf.float32)
        values = tf.where(tf.reshape(inside, [-1] + [1] * (values.shape.rank - 1)), values, 0.0)
        return tf.tensor_scatter_nd_add(tf.zeros_like(like), local[:, None], values)
    gradient = tf.cast(tf.convert_to_tensor(gradient), tf.float32)
    rank = gradient.shape.rank
    begin = tf.stack([start if a == class_axis else 0 for a in range(rank)])
    return tf.slice(gradient, begin, [width if a == class_axis else -1 for a in range(rank)])


def readers_of_logits(on_micro_batch, y=None, logits=None) -> list[str]:
    """What in ``on_micro_batch`` needs the logits themselves: ``[]`` when nothing does.

    A callback computable from each position's rank (compiled accuracy and
    top-k metrics: ``attach``'s ``CompiledMetrics``) has
    ``readers_of_logits(y, logits)`` (``logits``: a ``keras.KerasTensor``
    with their shape, to resolve metrics such as ``"accuracy"``) and
    ``update_from_ranks(y, ranks, sample_weight, mask)``; any other callback
    reads ``y_pred``.
    """
    if on_micro_batch is None:
        return []
    readers = getattr(on_micro_batch, "readers_of_logits", None)
    return ["given to on_micro_batch"] if readers is None else readers(y, logits)


@dataclasses.dataclass(frozen=True)
class Head:
    """A model's final projection, found by :func:`find_head`: the step computes its loss fused.

    Attributes:
        trunk: A ``keras.Model`` from the model's inputs to the projection's
            input (the same layers and variables).
        layer: The projection layer.
        transposed: Its kernel is ``[V, d]`` (a tied embedding).
        soft_cap: Logit soft-capping, if the layer applies it.
    """

    trunk: keras.Model
    layer: keras.layers.Layer
    transposed: bool
    soft_cap: float | None

    @property
    def sizes(self) -> tuple[int, int]:
        """``(d, V)``: the projection's inputs and classes."""
        shape = self.kernel().shape
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    def positions(self, hint: tuple[int, int]) -> int:
        """Rows of the logits of a batch of ``batch_shape`` ``hint`` (``(rows, largest other axis)``)."""
        return hint[0] * math.prod(hint[1] if d is None else d for d in self.trunk.output.shape[1:-1])

    def kernel(self):
        layer = self.layer
        if isinstance(layer, keras.layers.Dense):
            return layer.kernel
        return layer.embeddings if layer.tie_weights else layer.reverse_embeddings

    def bias(self):
        return getattr(self.layer, "bias", None) if isinstance(self.layer, keras.layers.Dense) else None

    def losses(self, hidden, labels, ignore_class=None, ranks: bool = False):
        """``(per-position losses, ranks or None)`` of ``labels`` against the projection of ``hidden``.

        ``ranks``: each position's two counts for accuracy and top-k metrics (see ``_cross_entropy``).
        """
        return _cross_entropy(
            hidden, self.kernel(), labels, self.bias(), self.transposed, self.soft_cap, ignore_class, None, ranks
        )


def find_head(model) -> Head | str:
    """The model's final projection as a :class:`Head`, or why there is none (a sentence).

    Applies to a functional model (keras_hub task models included) with one
    output made by a linear ``Dense`` or by keras_hub's ``ReversibleEmbedding``
    called with ``reverse=True``.
    """
    parts = _compat.functional_graph(model)
    if parts is None:
        return f"{type(model).__name__} is not a functional model, so its last layer cannot be split off"
    _, inputs_struct, outputs = parts
    outputs = keras.tree.flatten(outputs)
    if len(outputs) != 1:
        return f"the model has {len(outputs)} outputs"
    layer, node = _compat.producer(outputs[0])
    if isinstance(layer, keras.layers.Dense):
        if why := _proof.stands_in_for(layer, keras.layers.Dense, _LAYER_CODE):
            return f"its last layer {layer.name!r} is not Keras's Dense as such: {why}"
        if layer.activation not in (None, keras.activations.linear) or getattr(layer, "lora_enabled", False):
            return f"its last layer {layer.name!r} applies an activation (the loss needs the logits)"
        if len(layer.kernel.shape) != 2:
            return f"its last layer {layer.name!r} has a kernel that is not 2-D"
        transposed, soft_cap = False, None
    elif isinstance(layer, keras.layers.ReversibleEmbedding) and node.kwargs.get("reverse"):
        # keras_hub's ReversibleEmbedding subclasses Keras's, inheriting its code.
        if why := _proof.stands_in_for(layer, keras.layers.ReversibleEmbedding, _LAYER_CODE):
            return f"its last layer {layer.name!r} is not Keras's ReversibleEmbedding as such: {why}"
        if getattr(layer, "reverse_dtype", None):
            return f"its last layer {layer.name!r} projects in another dtype"
        transposed, soft_cap = bool(layer.tie_weights), layer.logit_soft_cap
    else:
        return f"its last layer {layer.name!r} is a {type(layer).__name__}, not a Dense or a reversed embedding"
    if getattr(layer, "quantization_mode", None) or layer.activity_regularizer is not None:
        return f"its last layer {layer.name!r} is quantized or adds an activity regularization loss"
    inputs = node.inputs
    if len(inputs) != 1:
        return f"its last layer {layer.name!r} takes {len(inputs)} inputs"
    trunk = keras.Model(inputs_struct, inputs[0], name=f"{model.name}_trunk")
    return Head(trunk=trunk, layer=layer, transposed=transposed, soft_cap=soft_cap)


# What the fused computation reimplements of the layer and the loss: a subclass must inherit these.
_LAYER_CODE = ("call", "__call__", "compute_output_spec", "quantized_call")
_LOSS_CODE = ("call", "__call__")


def not_the_loss(loss) -> str | None:
    """``None`` when ``loss`` is Keras's ``SparseCategoricalCrossentropy(from_logits=True)`` over the last
    axis, running its own code (what the chunks compute); else why not, a sentence."""
    if loss is None:
        return "the loss has several terms or loss weights"
    described = repr(loss) if isinstance(loss, str) else type(loss).__name__
    if isinstance(loss, str):
        loss = keras.losses.get(loss)  # a name: Keras's default arguments (from_logits=False)
    sparse = keras.losses.SparseCategoricalCrossentropy
    if not isinstance(loss, sparse):
        return f"the loss {described} is not SparseCategoricalCrossentropy(from_logits=True)"
    if why := _proof.stands_in_for(loss, sparse, _LOSS_CODE):
        return f"the loss is not Keras's own SparseCategoricalCrossentropy: {why}"
    if loss.fn is not keras.losses.sparse_categorical_crossentropy:
        return f"the loss computes {getattr(loss.fn, '__name__', loss.fn)!r}, not the sparse cross-entropy"
    arguments = _compat.loss_function_arguments(loss)
    if not arguments.get("from_logits") or arguments.get("axis", -1) != -1:
        return f"the loss is {described}({arguments}), not from_logits=True over the last axis"
    return None


def decide(
    options, objective, model, hint: tuple[int, int] | None, *, private: bool = False, y=None
) -> tuple[Head | None, str]:
    """``(head to fuse the loss with, or None; one sentence saying why or why not)``.

    Chunks hold one kernel-sized buffer (the kernel's gradient) and one chunk's logits where the
    plain loss holds two or three logits-sized ones, for a third more of the head's matmuls: "auto"
    fuses when a batch has more than ``4 d`` positions (``d`` = the projection's input size) and
    its logits do not fit in one chunk. Measured at 512 rows, d = 256: 0.97x the unfused peak at
    1.20x its time; GPT-2 at 2,048 positions: 0.49x. ``fused_loss=True`` raises where it cannot apply.
    """
    option, why_not, head = options.fused_loss, None, None
    loss = objective.single
    if option is False:
        why_not = "fused_loss=False"
    elif private:
        why_not = "per_example_clip needs the gradient of the logits to take each example's norm"
    elif why := not_the_loss(loss):
        why_not = why
    else:
        head = find_head(model)
        if isinstance(head, str):
            head, why_not = None, head
        elif option == "auto" and hint is not None:
            depth, classes = head.sizes
            positions = head.positions(hint)
            if positions * classes <= CHUNK_ELEMENTS:
                why_not = (
                    f"the batch's logits ({positions:,} x {classes:,}) fit in one chunk: nothing to save; "
                    "fused_loss=True forces it"
                )
            elif positions <= 4 * depth:
                why_not = (
                    f"a batch of {positions:,} positions is too few next to the projection's "
                    f"{depth:,} inputs for chunks to save memory (from {4 * depth + 1:,}); "
                    "fused_loss=True forces it"
                )
    readers = []
    if why_not is None:
        logits = keras.KerasTensor((*head.trunk.output.shape[:-1], head.sizes[1]), dtype=head.layer.compute_dtype)
        readers = readers_of_logits(options.on_micro_batch, y, logits)
    if readers:
        why_not = (
            f"the metrics {', '.join(readers)} read the logits of every micro-batch (accuracy and top-k "
            "metrics are computed from the chunks; compile without the others to fuse)"
        )
        if option == "auto":  # the memory the user expected is not saved: say so where it will be seen
            warnings.warn(
                f"effgrad: the loss is not fused with {head.layer.name!r}, so every batch's logits are made: "
                f"{why_not}.",
                UserWarning,
                stacklevel=4,
            )
    if why_not is not None:
        if option is True:
            raise ValueError(f"fused_loss=True cannot apply: {why_not}.")
        return None, f"fused loss not used: {why_not}."
    return head, (
        f"fused loss: {head.layer.name} ({head.sizes[1]:,} classes) and the cross-entropy computed in "
        "chunks of rows; the logits are never made."
    )
