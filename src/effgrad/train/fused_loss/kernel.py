"""The fused kernel: ``SparseCategoricalCrossentropy(from_logits=True)`` of a projection, in chunks.

See :mod:`effgrad.train.fused_loss` for the algorithm and its traps.
"""

from __future__ import annotations

import math  # noqa: F401

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.train.fused_loss import deferred

__all__ = ["fused_sparse_cross_entropy", "cross_entropy", "CHUNK_ELEMENTS"]

# Elements of one chunk's logits: 16 MiB of float32 (83 rows per chunk at 50,257 classes).
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
    losses, _ = cross_entropy(hidden, kernel, labels, bias, transposed, soft_cap, ignore_class, chunk_rows, False)
    return losses


def cross_entropy(hidden, kernel, labels, bias, transposed, soft_cap, ignore_class, chunk_rows, ranks: bool):
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


def _classes(w, b, start, width: int, transposed: bool, has_bias: bool):
    """The kernel's and the bias's classes ``start:start + width`` (``start`` may be a tensor: the
    size stays static, as XLA needs)."""
    w_j = tf.slice(w, [start, 0], [width, -1]) if transposed else tf.slice(w, [0, start], [-1, width])
    return w_j, (tf.slice(b, [start], [width]) if has_bias else b)


def _over_classes(vocabulary: int, block, state, first_alone: bool = False):
    """``block(start, width, state) -> state`` over the classes, one chunk of ``_VOCAB_CHUNK`` at a
    time: the full chunks in one ``tf.while_loop``, the last, shorter one after it, so the graph is
    the same size whatever the vocabulary (unrolled, 13 chunks of a 50,257-class vocabulary took a step's trace from 1.7
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
            # A stateful op in the loop: with only stateless ones the loops held more memory at a
            # real vocabulary and were no faster.
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

    @_compat.custom_gradient
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
            # skinny, slower [16 MiB / V, V].
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
        # logits.
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
            later = deferred.pending()
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
    (TensorFlow's scatter-add does not update its input in place).

    Chunks of the vocabulary (a loop, one at a time), and of rows inside each: the kernel's
    gradient is summed per vocabulary chunk in a small ``[d, chunk]`` buffer, then written in place
    into the one kernel-sized buffer. Summing whole ``[d, V]`` gradients over row chunks would keep
    three kernel-sized buffers alive (the sum, the addend, the result); concatenating the chunks at
    the end, two (measured: a kernel-sized buffer more).
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
            # them in place (TensorStridedSliceUpdate's generic strided copy is several times slower)
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
            # its big operand (dz): the pair measured 10% faster at a tied 50,257-class head than dz^T @ h.
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
    part = tf.slice(gradient, begin, [width if a == class_axis else -1 for a in range(rank)])
    part.set_shape(like.shape)  # a tensor `start` leaves the other axes unknown: the loop's buffer needs them
    return part
