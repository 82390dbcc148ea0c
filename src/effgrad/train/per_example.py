"""Per-example gradient norms without per-example gradients.

DP-SGD and per-example clipping need ``|grad l_i|`` for every example ``i``.
Forming each example's gradient costs batch x weights memory; instead each
layer's share of ``|grad l_i|^2`` follows from the layer's input ``x`` and the
gradient ``g`` of its (pre-activation) output, which backprop computes anyway
(ghost norms: Goodfellow 2015; Li et al. 2022; Bu et al. 2023). For a
``Dense`` kernel, with ``x_i``: ``[T, d_in]`` and ``g_i``: ``[T, d_out]``
(``T`` positions of example ``i``, 1 for flat inputs)::

    grad_i(kernel) = x_i^T g_i
    |grad_i|^2     = sum_{t,s} (x_it . x_is) (g_it . g_is)      # T x T Gram matrices: no d_in x d_out
                   = |x_i|^2 |g_i|^2                            # T = 1
    |grad_i(bias)|^2 = |sum_t g_it|^2

and the smaller of ``T^2`` and ``d_in x d_out`` decides whether the Gram
matrices or the per-example kernel gradient are formed (one layer at a time,
inside backprop). Closed forms exist here for ``Dense``, ``EinsumDense``,
``Embedding`` (and keras_hub's ``ReversibleEmbedding`` both ways, its
``PositionEmbedding``), ``Conv1D``/``Conv2D`` (as a ``Dense`` on the input
patches) and ``LayerNormalization``, so the keras_hub transformer blocks
built from them are covered. Any other layer with weights falls back to
per-example gradients of that layer alone (``tf.vectorized_map`` of a
vector-Jacobian product; one warning names it).

How the numbers leave backprop: every layer call gets a "tap", an identity
on its output whose custom gradient passes the output gradient through
unchanged and returns the layer's ``[batch]`` share of ``|grad l_i|^2`` as
the gradient of a ``[batch]`` zero tensor the tape watches. One backward
pass to those zeros yields every share; only ``[batch]`` vectors are kept.

A weight used by several calls (a tied embedding: the lookup and the output
projection) does not add norms: ``|a + b|^2 != |a|^2 + |b|^2``. Those calls
give their per-example gradients instead, summed before the norm (exact, at
batch x weight memory for that weight alone).

Traps:
    Examples must not interact: BatchNormalization (batch statistics) is
    refused. The norms are those of each example's loss SUMMED over its
    elements (tokens), weighted by sample weights and masks; regularizers
    are not per-example and are not included.
"""

from __future__ import annotations

import contextlib
import math
import string
import warnings

import keras
import tensorflow as tf

from effgrad import _compat

__all__ = ["NormTaps", "per_example_norms"]

_LARGE = 256 * 2**20  # per-example gradients of a shared weight above this many bytes: warned


def _f32(t) -> tf.Tensor:
    return tf.cast(t, tf.float32)


def _rows(t, width: int | None = None) -> tf.Tensor:
    """``t`` as ``[batch, positions, width]`` (positions = every axis between the first and the last)."""
    t = _f32(t)
    width = width if width is not None else t.shape[-1]
    return tf.reshape(t, [tf.shape(t)[0], -1, width])


def _sum_squares(t) -> tf.Tensor:
    """``[batch]``: the squared norm of each row of ``t``."""
    return tf.reduce_sum(tf.square(tf.reshape(_f32(t), [tf.shape(t)[0], -1])), axis=1)


def _linear_norm_sq(x, g, *, bias: bool) -> tf.Tensor:
    """``[batch]`` squared norms of ``x_i^T g_i`` (and of ``sum_t g_it`` when the layer has a bias).

    ``x``: ``[m, T, i]``, ``g``: ``[m, T, o]``.
    """
    t, i, o = x.shape[1], x.shape[2], g.shape[2]

    def gram():
        return tf.reduce_sum(
            tf.linalg.matmul(x, x, transpose_b=True) * tf.linalg.matmul(g, g, transpose_b=True), [1, 2]
        )

    def direct():
        return _sum_squares(tf.einsum("mti,mto->mio", x, g))

    if t == 1:
        kernel = _sum_squares(x) * _sum_squares(g)
    elif t is not None:
        kernel = gram() if t * t <= i * o else direct()
    else:  # a sequence of unknown length: decided per batch
        length = tf.shape(x)[1]
        kernel = tf.cond(length * length <= i * o, gram, direct)
    return kernel + _sum_squares(tf.reduce_sum(g, axis=1)) if bias else kernel


class _Use:
    """One call of a layer: how its own weights' per-example gradients follow from its output gradient."""

    def __init__(self, layer, variables):
        self.layer, self.variables = layer, list(variables)

    def norm_sq(self, g) -> tf.Tensor:
        """``[batch]``: the squared norm of each example's gradient of ``self.variables``."""
        return tf.add_n([_sum_squares(p) for p in self.gradients(g)])

    def gradients(self, g) -> list[tf.Tensor]:
        """Per-example gradients ``[batch, *variable.shape]``, one per variable (for shared weights)."""
        raise NotImplementedError


class _Linear(_Use):
    """``z = x @ W (+ b)`` over positions: Dense, the patches of a convolution, a reversed embedding."""

    def __init__(self, layer, kernel, bias, x, *, transposed: bool = False, channels_first: str | None = None):
        super().__init__(layer, [kernel] + ([bias] if bias is not None else []))
        self.x, self.transposed, self.bias = x, transposed, bias is not None
        self.channels_first = channels_first == "channels_first"  # a convolution's output gradient: channels on axis 1

    def _outputs(self, g):
        if self.channels_first:
            g = tf.transpose(g, [0, *range(2, len(g.shape)), 1])
        return _rows(g)

    def norm_sq(self, g):
        return _linear_norm_sq(_rows(self.x), self._outputs(g), bias=self.bias)

    def gradients(self, g):
        x, g = _rows(self.x), self._outputs(g)
        kernel = tf.einsum("mti,mto->moi" if self.transposed else "mti,mto->mio", x, g)  # transposed: [V, d]
        kernel = tf.reshape(kernel, [tf.shape(kernel)[0], *self.variables[0].shape])
        return [kernel] + ([tf.reduce_sum(g, axis=1)] if self.bias else [])


class _Einsum(_Use):
    """``EinsumDense``: a Dense on reshaped axes where the equation allows it, else its per-example einsum."""

    def __init__(self, layer, x):
        super().__init__(layer, [layer.kernel] + ([layer.bias] if layer.bias is not None else []))
        self.x = x
        inputs, kernel, output = _einsum_letters(layer.equation, len(x.shape))
        self.letters = inputs, kernel, output
        batch = inputs[0]
        contracted = [c for c in kernel if c in inputs and c not in output]
        free = [c for c in inputs[1:] if c in output and c not in kernel]
        produced = [c for c in kernel if c in output and c not in inputs]
        plain = (
            batch not in kernel
            and sorted(inputs) == sorted([batch, *free, *contracted])
            and sorted(output) == sorted([batch, *free, *produced])
            and sorted(kernel) == sorted([*contracted, *produced])
        )
        self.plan = (batch, free, contracted, produced) if plain else None

    def _bias_gradient(self, g):
        output = self.letters[2]
        axes = [i for i, c in enumerate(output) if i > 0 and c not in self.layer.bias_axes]
        summed = tf.reduce_sum(_f32(g), axis=axes, keepdims=True)
        return tf.reshape(summed, [tf.shape(g)[0], *self.variables[1].shape])

    def norm_sq(self, g):
        if self.plan is None:
            return super().norm_sq(g)
        batch, free, contracted, produced = self.plan
        inputs, kernel, output = self.letters
        x = tf.einsum(f"{inputs}->{batch}{''.join(free + contracted)}", _f32(self.x))
        g32 = tf.einsum(f"{output}->{batch}{''.join(free + produced)}", _f32(g))
        shape = self.variables[0].shape  # the kernel's sizes are known when tensors' may not be
        width_in = math.prod(shape[kernel.index(c)] for c in contracted)
        width_out = math.prod(shape[kernel.index(c)] for c in produced)
        kernel = _linear_norm_sq(_rows(x, width_in), _rows(g32, width_out), bias=False)
        return kernel + (_sum_squares(self._bias_gradient(g)) if len(self.variables) > 1 else 0.0)

    def gradients(self, g):
        inputs, kernel, output = self.letters
        per_example = tf.einsum(f"{inputs},{output}->{inputs[0]}{kernel}", _f32(self.x), _f32(g))
        return [per_example] + ([self._bias_gradient(g)] if len(self.variables) > 1 else [])


def _einsum_letters(equation: str, input_rank: int) -> tuple[str, str, str]:
    """``(input, kernel, output)`` letters of an EinsumDense equation, ``...`` spelled out."""
    left, output = equation.replace(" ", "").split("->")
    inputs, kernel = left.split(",")
    if "..." in inputs:
        spare = [c for c in string.ascii_letters if c not in equation]
        dots = "".join(spare[: input_rank - len(inputs.replace("...", ""))])
        inputs, output = inputs.replace("...", dots), output.replace("...", dots)
    return inputs, kernel, output


class _Lookup(_Use):
    """``Embedding``: example ``i``'s gradient of row ``v`` is the sum of ``g_it`` over its positions with id ``v``."""

    def __init__(self, layer, variable, ids):
        super().__init__(layer, [variable])
        self.ids = ids

    def norm_sq(self, g):
        g = _rows(g)
        ids = tf.reshape(tf.cast(self.ids, tf.int32), [tf.shape(g)[0], -1])
        if ids.shape[1] == 1:
            return _sum_squares(g)
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float32)
        return tf.reduce_sum(same * tf.linalg.matmul(g, g, transpose_b=True), [1, 2])

    def gradients(self, g):
        g = _rows(g)
        rows, vocabulary = tf.shape(g)[0], self.variables[0].shape[0]
        ids = tf.reshape(tf.cast(self.ids, tf.int32), [rows, -1])
        segments = ids + vocabulary * tf.range(rows)[:, None]
        summed = tf.math.unsorted_segment_sum(g, segments, rows * vocabulary)
        return [tf.reshape(summed, [rows, *self.variables[0].shape])]


class _Rows(_Use):
    """keras_hub ``PositionEmbedding``: the output IS rows ``start..start+T`` of the weight, per example."""

    def __init__(self, layer, start):
        super().__init__(layer, [layer.position_embeddings])
        self.start = start

    def norm_sq(self, g):
        return _sum_squares(g)

    def gradients(self, g):
        g = _rows(g)
        table = self.variables[0].shape[0]
        after = table - self.start - tf.shape(g)[1]
        return [tf.pad(g, [[0, 0], [self.start, after], [0, 0]])]


class _Affine(_Use):
    """``LayerNormalization``: ``y = gamma * xhat + beta`` with ``xhat`` recomputed from the input in backprop."""

    def __init__(self, layer, x):
        super().__init__(layer, [v for v in (layer.gamma, layer.beta) if v is not None])
        self.x = x

    def gradients(self, g):
        layer, g = self.layer, _f32(g)
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        axes = sorted(a % len(g.shape) for a in axes)
        summed = [a for a in range(1, len(g.shape)) if a not in axes]
        out = []
        if layer.gamma is not None:
            xhat = keras.ops.layer_normalization(
                _f32(self.x), None, None, axis=axes, epsilon=layer.epsilon, rms_scaling=layer.rms_scaling
            )
            out.append(tf.reduce_sum(g * xhat, axis=summed))
        if layer.beta is not None:
            out.append(tf.reduce_sum(g, axis=summed))
        return [tf.reshape(p, [tf.shape(g)[0], *v.shape]) for p, v in zip(out, self.variables)]


class _Generic(_Use):
    """Any other layer: per-example gradients of its own weights by a vectorized vector-Jacobian product."""

    def __init__(self, layer, variables, args, kwargs):
        super().__init__(layer, variables)
        self.args, self.kwargs = args, kwargs

    def gradients(self, g):
        flat = tf.nest.flatten((self.args, self.kwargs))
        rows = g.shape[0]
        mapped = [
            i
            for i, t in enumerate(flat)
            if tf.is_tensor(t) and t.shape.rank and (t.shape[0] is None or rows is None or t.shape[0] == rows)
        ]

        def one(elements):
            *slices, g_i = elements
            values = list(flat)
            for i, s in zip(mapped, slices):
                values[i] = s[None]
            args, kwargs = tf.nest.pack_sequence_as((self.args, self.kwargs), values)
            with tf.GradientTape() as tape, keras.StatelessScope():
                out = self.layer(*args, **kwargs)  # __call__: the layer's own casting and autocast
            return tape.gradient(out, self.variables, output_gradients=g_i[None])

        grads = tf.vectorized_map(one, [flat[i] for i in mapped] + [g])
        return [tf.zeros([tf.shape(g)[0], *v.shape]) if p is None else _f32(p) for p, v in zip(grads, self.variables)]


def _is(layer, cls) -> bool:
    """``layer`` is a ``cls`` whose ``call`` is ``cls.call`` (a subclass that overrides it is another layer)."""
    return isinstance(layer, cls) and type(layer).call is cls.call


def _keras_hub_layer(layer, name: str) -> bool:
    return type(layer).__name__ == name and type(layer).__module__.startswith("keras_hub")


class NormTaps:
    """Which layers of ``model`` carry weights, and the taps that read their per-example norms.

    Example:
        >>> taps = NormTaps(model)                      # doctest: +SKIP
        >>> with tf.GradientTape() as tape:             # doctest: +SKIP
        ...     with taps.recording(tape) as recorder:
        ...         y_pred = recorder.hook(lambda: model(x, training=True))
        ...     per_example_losses = ...                # [batch]
        >>> norms = recorder.norms(per_example_losses)  # doctest: +SKIP
    """

    def __init__(self, model):
        from effgrad.remat.checkpointing import Checkpoint, CheckpointedModel

        trained = {id(v) for v in model.trainable_variables}
        self.owners = []  # (layer, its own trained variables)
        for layer in _compat.flatten_layers(model):
            if isinstance(layer, (Checkpoint, CheckpointedModel)):
                raise ValueError(
                    f"{layer.name} recomputes its activations in backprop (effgrad checkpointing), where the taps "
                    "that read each example's gradient norm cannot see them. Train the model without "
                    "checkpointing for per-example clipping (micro_batches bound its memory instead)."
                )
            own = [v for v in _compat.own_variables(layer) if id(v) in trained]
            if not own:
                continue
            if isinstance(layer, keras.layers.BatchNormalization):
                raise ValueError(
                    f"{layer.name} is a BatchNormalization layer: in training its output mixes the examples of a "
                    "batch, so an example's gradient (and DP-SGD's clipping of it) is not defined. Use "
                    "LayerNormalization or GroupNormalization, or freeze it (layer.trainable = False)."
                )
            self.owners.append((layer, own))
        self._warned: set[str] = set()

    @contextlib.contextmanager
    def recording(self, tape: tf.GradientTape):
        """A :class:`Recorder` for one forward pass under ``tape``."""
        yield Recorder(self, tape)

    def _warn_fallback(self, layer) -> None:
        name = type(layer).__name__
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"effgrad: per-example gradient norms of {name} layers (e.g. {layer.name!r}) have no closed form "
                "here; they are computed from per-example gradients of that layer's weights (vectorized), "
                "which costs batch x its weights in memory during backprop.",
                UserWarning,
                stacklevel=4,
            )

    def use(self, layer, own, original, args, kwargs):
        """``(z, _Use, after)``: one call of ``layer`` up to where its tap goes, and what follows the tap.

        The layers with a closed form are computed here as their own ``call``
        computes them, stopping before the activation (the tap needs the
        gradient of the pre-activation output); the others run as they are.
        """
        x = args[0] if args else None
        ops = keras.ops
        whole = len(own) == len(layer.trainable_weights)  # no weight of a sublayer or of another owner
        plain = whole and not getattr(layer, "lora_enabled", False) and not getattr(layer, "quantization_mode", None)
        if plain and _is(layer, keras.layers.Dense):
            z = ops.matmul(x, layer.kernel)
            z = z if layer.bias is None else ops.add(z, layer.bias)
            return z, _Linear(layer, layer.kernel, layer.bias, x), layer.activation
        if plain and _is(layer, keras.layers.EinsumDense):
            z = ops.einsum(layer.equation, x, layer.kernel)
            z = z if layer.bias is None else ops.add(z, layer.bias)
            return z, _Einsum(layer, x), layer.activation
        if plain and _patches_apply(layer, x):
            inputs, padding = x, layer.padding
            if padding == "causal":  # Conv1D: as its call pads
                left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
                time = 1 if layer.data_format == "channels_last" else 2
                inputs = ops.pad(x, [[left, 0] if axis == time else [0, 0] for axis in range(3)])
                padding = "valid"
            z = ops.conv(
                inputs,
                layer.kernel,
                strides=list(layer.strides),
                padding=padding,
                dilation_rate=layer.dilation_rate,
                data_format=layer.data_format,
            )
            bias = layer.bias if layer.use_bias else None
            if bias is not None:
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
                if layer.data_format == "channels_first":
                    shape = (1, layer.filters) + (1,) * layer.rank
                z = ops.add(z, ops.reshape(bias, shape))
            grad_of = _Linear(layer, layer.kernel, bias, _patches(layer, x), channels_first=layer.data_format)
            return z, grad_of, layer.activation
        embedding_calls = (keras.layers.Embedding.call, keras.layers.ReversibleEmbedding.call)
        if plain and isinstance(layer, keras.layers.Embedding) and type(layer).call in embedding_calls:
            reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
            if not reverse:
                return original(*args, **kwargs), _Lookup(layer, layer.embeddings, x), None
            if layer.reverse_dtype is None:  # keras.layers.ReversibleEmbedding.call, reverse=True
                kernel = layer.embeddings if layer.tie_weights else layer.reverse_embeddings
                z = ops.matmul(x, ops.transpose(kernel) if layer.tie_weights else kernel)
                cap = layer.logit_soft_cap
                after = None if cap is None else (lambda t: ops.multiply(ops.tanh(ops.divide(t, cap)), cap))
                return z, _Linear(layer, kernel, None, x, transposed=layer.tie_weights), after
        if whole and _is(layer, keras.layers.LayerNormalization):
            return original(*args, **kwargs), _Affine(layer, x), None
        if whole and _keras_hub_layer(layer, "PositionEmbedding") and kwargs.get("positions") is None:
            start = kwargs.get("start_index", 0)
            if isinstance(start, int):
                return original(*args, **kwargs), _Rows(layer, start), None
        self._warn_fallback(layer)
        return original(*args, **kwargs), _Generic(layer, own, args, kwargs), None


def _after_the_gradient(activation):
    """``activation`` whose derivative is computed only once the upstream gradient exists.

    TensorFlow orders some derivatives after the upstream gradient by a control dependency
    alone (``Erf``'s, in exact GELU), which Grappler's dependency optimizer removes: with two
    backward passes over one forward pass, the second pass's derivatives then run right
    after the forward pass and wait for it, three activation-sized tensors per layer
    (measured: 192 MiB on 16 Dense 1024 GELU layers at batch 1024; 377 MiB on BERT-tiny at
    batch 256). Here the derivative is taken at ``z + 0 * g[0]``, a data dependency on the
    upstream gradient ``g`` that no optimizer removes (``0 * x`` is not folded for floats:
    x may be inf). Same values, same forward pass.
    """

    @tf.custom_gradient
    def apply(z):
        def grad(g):
            anchor = tf.reshape(g, [-1])[:1] * 0
            with tf.GradientTape() as tape:
                at = z + tf.cast(anchor, z.dtype)
                tape.watch(at)
                y = activation(at)
            return tape.gradient(y, at, output_gradients=g)

        return activation(z), grad

    return apply


def _patches_apply(layer, x) -> bool:
    """A Conv1D/Conv2D whose per-example gradient is a Dense's on the input patches."""
    conv1d = isinstance(layer, keras.layers.Conv1D) and type(layer).call is keras.layers.Conv1D.call
    if not (conv1d or _compat.plain_convolution(layer)) or layer.rank not in (1, 2) or layer.groups != 1:
        return False
    if layer.data_format == "channels_first" and layer.use_bias:
        # keras.ops.add (TF backend) adds a (1, C, 1, ...) bias along the LAST axis when that axis also
        # has C entries (Keras 3.15): which axis the bias took is Keras's choice, so the fallback
        # differentiates the real layer there.
        last = layer.compute_output_shape(tuple(x.shape))[-1]
        return last is not None and last != layer.filters
    return True


def _patches(layer, x) -> tf.Tensor:
    """``[batch, positions, kernel inputs]``: the input patches each output position of the convolution sees."""
    if layer.data_format == "channels_first":
        x = tf.transpose(x, [0, *range(2, layer.rank + 2), 1])
    if layer.rank == 1:
        padding = layer.padding
        if padding == "causal":
            x = tf.pad(x, [[0, 0], [layer.dilation_rate[0] * (layer.kernel_size[0] - 1), 0], [0, 0]])
            padding = "valid"
        x = x[:, None]
        sizes, strides, rates = (1, *layer.kernel_size), (1, *layer.strides), (1, *layer.dilation_rate)
    else:
        padding = layer.padding
        sizes, strides, rates = layer.kernel_size, layer.strides, layer.dilation_rate
    patches = tf.image.extract_patches(
        x, sizes=[1, *sizes, 1], strides=[1, *strides, 1], rates=[1, *rates, 1], padding=padding.upper()
    )
    return tf.reshape(patches, [tf.shape(patches)[0], -1, patches.shape[-1]])


class Recorder:
    """The taps of one forward pass; :meth:`norms` reads every example's gradient norm after it."""

    def __init__(self, taps: NormTaps, tape: tf.GradientTape):
        self.taps, self.tape = taps, tape
        self.uses: list[tuple[_Use, tf.Tensor]] = []  # (use, its [batch] zero tensor)
        self.shared_ids: set[int] = set()
        self._stash: dict[int, list] | None = None  # filled only while norms() backprops

    def hook(self, call_model):
        """Runs ``call_model()`` with every weighted layer's call tapped."""
        with contextlib.ExitStack() as stack:
            for layer, own in self.taps.owners:
                stack.enter_context(_compat.intercepted_call(layer, self._tapped(layer, own)))
            return call_model()

    def _tapped(self, layer, own):
        def call(original, *args, **kwargs):
            z, use, after = self.taps.use(layer, own, original, args, kwargs)
            out = self._tap(z, use)
            mask = _compat.get_keras_mask(z)
            if after is not None:
                out = _after_the_gradient(after)(out)
            if mask is not None:
                _compat.set_keras_mask(out, mask)
            return out

        return call

    def _tap(self, z, use: _Use):
        if not tf.is_tensor(z) or not z.dtype.is_floating:
            raise ValueError(
                f"effgrad: the per-example norms of {use.layer.name} need one float output from its call, got {z!r}."
            )
        zero = tf.zeros(tf.shape(z)[:1], tf.float32)
        self.tape.watch(zero)
        index = len(self.uses)
        self.uses.append((use, zero))

        @tf.custom_gradient
        def tap(z, zero):
            def grad(g):
                if self._stash is None:  # the second pass: only the output gradient matters
                    return g, tf.zeros_like(zero)
                if index in self._shared:
                    self._stash[index] = use.gradients(g)
                    return g, tf.zeros_like(zero)
                return g, use.norm_sq(g)

            return tf.identity(z), grad

        return tap(z, zero)

    @property
    def _shared(self) -> set[int]:
        """Uses whose weights another use also has (a tied embedding): their norms do not add."""
        seen: dict[int, list[int]] = {}
        for i, (use, _) in enumerate(self.uses):
            for v in use.variables:
                seen.setdefault(id(v), []).append(i)
        return {i for uses in seen.values() if len(uses) > 1 for i in uses}

    def norms(self, per_example: tf.Tensor, scale=1.0) -> tf.Tensor:
        """``[batch]`` float32: ``|grad per_example[i]|`` over every tapped weight (one backward pass).

        ``per_example`` must have been computed under the tape. Backprop starts from ``scale``
        (a float16 model's loss scale, so small gradients do not underflow); the norms are divided
        by it again.
        """
        if not self.uses:
            raise ValueError("No layer with trainable weights was called: there is no gradient to take the norm of.")
        self._stash = {}
        try:
            seed = tf.fill(tf.shape(per_example), tf.cast(scale, per_example.dtype))
            shares = self.tape.gradient(per_example, [zero for _, zero in self.uses], output_gradients=seed)
            stash = self._stash
        finally:
            self._stash = None
        squares = [s for s in shares if s is not None]
        grouped: dict[int, tuple] = {}
        for index, grads in stash.items():
            for v, p in zip(self.uses[index][0].variables, grads):
                total, _ = grouped.get(id(v), (None, v))
                grouped[id(v)] = (p if total is None else total + p, v)
        for total, v in grouped.values():
            size = 4 * math.prod(v.shape) * (total.shape[0] or 1)
            if size > _LARGE:
                warnings.warn(
                    f"effgrad: {v.path} is used by several layer calls (tied weights), so its per-example "
                    f"gradients are formed to take their norm ({size / 2**20:,.0f} MiB for this batch).",
                    UserWarning,
                    stacklevel=3,
                )
            squares.append(_sum_squares(total))
        zeros = tf.zeros_like(_f32(per_example))
        return tf.sqrt(tf.add_n([zeros, *squares])) / tf.cast(scale, tf.float32)


def per_example_norms(model, loss, x, y, sample_weight=None, *, training: bool = False) -> tf.Tensor:
    """The gradient norm of each example's loss, without per-example gradients.

    Algorithm: one forward pass with a tap on every layer that has weights,
    one backward pass to the taps; each tap turns its layer's input and
    output gradient into that layer's ``[batch]`` share of ``|grad l_i|^2``
    (closed forms for Dense, EinsumDense, Embedding, Conv1D/2D,
    LayerNormalization and keras_hub's embeddings; see the module docstring).

    Example:
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
        >>> norms = effgrad.per_example_norms(model, "mse", x, y)
        >>> tuple(norms.shape)
        (4,)

    Args:
        model: A built Keras model (no BatchNormalization in training).
        loss: A Keras loss, a loss name or an unreduced callable.
        x: A batch of inputs (a nest for several inputs).
        y: Its targets.
        sample_weight: Optional weights (``[batch]`` or per loss element).
        training: Run the model in training mode (dropout draws differ per call).

    Returns:
        A ``[batch]`` float32 tensor: ``|d l_i / d weights|`` with
        ``l_i = sum over example i's loss elements of w * l`` (sample weights
        and Keras masks included; regularizers not: they are not per-example).
    """
    from effgrad.train import objective as objective_lib

    objective = objective_lib.Objective.of_loss(loss, "sum")
    taps = NormTaps(model)
    x, y, sample_weight = tf.nest.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight)
    )

    def norms(x, y, sample_weight):
        with tf.GradientTape() as tape, keras.StatelessScope():  # no state written (seeds, statistics)
            with taps.recording(tape) as recorder:
                y_pred = recorder.hook(lambda: model(x, training=training))
            per_example = objective.per_example(y, y_pred, sample_weight)
        return recorder.norms(per_example)

    return tf.function(norms, autograph=False)(x, y, sample_weight)
