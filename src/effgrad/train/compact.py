"""Optimizer state in fewer bits: int8 block-wise or bfloat16 moments for Keras optimizers.

Adam keeps two float32 numbers per weight, twice the model's own size: in a
fine-tuning step whose gradients are consumed in backward
(``fused_update``) they are the largest thing left. :func:`compact_state`
returns the same optimizer with each slot stored in 8 or 16 bits; each
variable's slots are expanded to float32, updated and compressed again
inside that variable's own update (large variables in parts of rows, one
after another), so no float32 copy of all slots exists.

int8 is block-wise (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", ICLR 2022): the slot is cut into blocks of ``block_size``
numbers, each with its float32 scale (the block's largest magnitude), and
each number ``x`` is stored as one byte ``q`` on a companded (fourth-root)
scale::

    u = |x| / scale                       in [0, 1]
    q = round(L * u ** (1/4))             L = 255 if the block has no negative number, else 127 (and a sign)
    x ~ sign * (q / L) ** 4 * scale       the scale's sign records which of the two L was used

Why companded and not linear: Adam's second moment spans many decades
within a block, and linear codes round its small entries to 0, where
``m / (sqrt(v) + eps)`` explodes. Measured on a trained MLP's slots
(``benchmarks/compact_state.py``): linear codes zeroed 17% of ``v`` and
moved the 99th percentile of the update by 138 (median update 0.2);
bitsandbytes' dynamic-tree map zeroed 1.6% (largest error 5.1); the
fourth-root scale zeroed 0.07% with a largest error of 0.5. It is also
a few multiplies per number and compiles with XLA (no table search).

bfloat16 keeps each slot as a bfloat16 variable (rounded to nearest): half
the bytes, 3 significant digits.

Example:
    >>> import keras, effgrad
    >>> opt = effgrad.compact_state(keras.optimizers.Adam(1e-3), dtype="int8")
    >>> isinstance(opt, keras.optimizers.Adam)
    True
    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128)])
    >>> opt.build(model.trainable_variables)
    >>> sorted({str(v.dtype) for v in opt.variables})  # codes, scales, small slots, step
    ['float32', 'int64', 'int8']

Trap:
    Slots of variables smaller than ``min_size`` (biases, norms) stay
    float32: compressing them saves nothing and their scale would cost more.
    Keras's EMA weights (``use_ema``) and its own gradient accumulators stay
    float32 too: they are weights and gradients, not moment estimates.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from effgrad import _checks, _compat

DTYPES = ("int8", "bfloat16")
FLOAT32_SLOTS = ("average", "gradient_accumulator")  # EMA weights, Keras's own accumulation

PART_ELEMENTS = 2**20  # large variables are updated this many numbers (4 MiB of float32) at a time

# Keras's per-variable optimizers: each reads and writes its slots only through
# `self.assign*` and ops on the slot, which a CompactSlot answers.
SUPPORTED = (
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Lion,
    keras.optimizers.SGD,
    keras.optimizers.Adafactor,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Lamb,
    keras.optimizers.Ftrl,
)
# Whose update of each number depends on that number alone: they can update a variable in parts.
ELEMENTWISE = tuple(c for c in SUPPORTED if c not in (keras.optimizers.Adafactor, keras.optimizers.Lamb))


@tf.function(jit_compile=True, autograph=False)
def quantize(x: tf.Tensor, block_size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(codes int8 [blocks, block_size], scales float32 [blocks])`` of ``x``.

    Blocks with no negative number use all 256 codes for magnitudes (their
    scale is stored negated to say so); other blocks use a sign and 127.
    """
    flat = tf.reshape(tf.cast(x, tf.float32), [-1])
    flat = tf.pad(flat, [[0, -tf.size(flat) % block_size]])
    blocks = tf.reshape(flat, [-1, block_size])
    absmax = tf.reduce_max(tf.abs(blocks), axis=1)
    unsigned = tf.reduce_min(blocks, axis=1) >= 0.0
    # Per block, not per number: one division per block (a multiply per number).
    per_block = tf.where(unsigned, 255.0, 127.0) * tf.math.divide_no_nan(1.0, tf.sqrt(tf.sqrt(absmax)))
    q = tf.round(tf.sqrt(tf.sqrt(tf.abs(blocks))) * per_block[:, None])  # L * (|x| / scale) ** (1/4)
    codes = tf.where(unsigned[:, None], q - 128.0, tf.sign(blocks) * q)
    return tf.cast(codes, tf.int8), tf.where(unsigned, -absmax, absmax)


@tf.function(jit_compile=True, autograph=False)
def dequantize(codes: tf.Tensor, scales: tf.Tensor, shape) -> tf.Tensor:
    """The float32 tensor of ``shape`` that :func:`quantize` encoded (up to its rounding)."""
    codes = tf.cast(codes, tf.float32)
    unsigned = scales < 0.0
    offset = tf.where(unsigned, 128.0, 0.0)[:, None]
    step = tf.where(unsigned, 1.0 / 255.0, 1.0 / 127.0)[:, None]
    q = (codes + offset) * step
    blocks = q * tf.abs(q) * tf.square(q) * tf.abs(scales)[:, None]  # sign * |q| ** 4 * scale
    size = math.prod(shape)
    return tf.reshape(tf.reshape(blocks, [-1])[:size], shape)


class CompactSlot:
    """One optimizer slot kept in int8 blocks or bfloat16; reads as float32.

    The optimizer's update reads it like a tensor and writes it through
    ``assign*``. Within one variable's update the float32 value is kept
    (the update uses the exact new moment, as bitsandbytes does) and
    compressed once per write; the optimizer drops it when the update ends.
    """

    def __init__(self, optimizer, reference, name: str, initializer):
        self.shape = tuple(reference.shape)
        self.dtype = "float32"
        self.name = name
        self._mode = optimizer.compact_dtype
        self._block = optimizer.block_size
        self._owner = optimizer
        self._current = None
        self._window = None  # (first row, end row) while a large variable is updated in parts
        initializer = keras.initializers.get(initializer)
        zeros = isinstance(initializer, keras.initializers.Zeros)

        def initial(index):
            # Non-zero initial slots (Adagrad's, Ftrl's accumulators) are encoded once.
            def make(shape, dtype):
                return quantize(initializer(self.shape, "float32"), self._block)[index]

            return "zeros" if zeros else make

        if self._mode == "bfloat16":
            self._storage = (optimizer._add_storage(reference, name, self.shape, "bfloat16", initializer),)
        else:
            blocks = -(-math.prod(self.shape) // self._block)
            self._storage = (
                optimizer._add_storage(reference, f"{name}_codes", (blocks, self._block), "int8", initial(0)),
                optimizer._add_storage(reference, f"{name}_scales", (blocks,), "float32", initial(1)),
            )

    def value(self) -> tf.Tensor:
        """The slot (or its rows in the current window) as float32, kept for the rest of this update."""
        if self._current is None:
            # Read here, in this device's update context: a distributed variable passed into
            # a tf.function would be read there as its first replica's copy.
            stored = [self._read(variable) for variable in self._storage]
            if self._mode == "bfloat16":
                self._current = tf.cast(stored[0], tf.float32)
            else:
                self._current = dequantize(*stored, self._window_shape())
            self._owner._touched.append(self)
        return self._current

    def assign(self, value) -> None:
        value = tf.cast(tf.convert_to_tensor(value), tf.float32)
        if self._mode == "bfloat16":
            stored = (tf.cast(value, tf.bfloat16),)
        else:
            stored = quantize(value, self._block)
        for variable, tensor in zip(self._storage, stored):
            if self._window is None:
                variable.assign(tensor)
            else:
                variable.value.scatter_update(tf.IndexedSlices(tensor, self._window_indices()))
        self._owner._stored.extend(stored)
        if self._current is None:
            self._owner._touched.append(self)
        self._current = value

    def _read(self, variable):
        if self._window is None:
            return tf.convert_to_tensor(variable)
        # The window's copy (the read itself aliases the buffer and is gone before the write).
        return tf.gather(tf.convert_to_tensor(variable), self._window_indices())

    def _window_shape(self):
        if self._window is None:
            return self.shape
        first, last = self._window
        return (last - first, *self.shape[1:])

    def _window_indices(self):
        # Storage rows of the window: the variable's rows for bfloat16, int8 blocks otherwise
        # (windows start on a block boundary; the last one may end in the padding).
        first, last = self._window
        if self._mode == "bfloat16":
            return tf.range(first, last)
        per_row = math.prod(self.shape[1:])
        return tf.range(first * per_row // self._block, -(-last * per_row // self._block))

    def assign_add(self, value) -> None:
        self.assign(self.value() + _dense(value))

    def assign_sub(self, value) -> None:
        self.assign(self.value() - _dense(value))

    def forget(self) -> None:
        self._current = None
        self._window = None

    def __tf_tensor__(self, dtype=None, name=None):
        value = self.value()
        return value if dtype is None else tf.cast(value, dtype)

    def __repr__(self) -> str:
        return f"<CompactSlot {self.name} shape={self.shape} stored as {self._mode}>"

    # Some updates use Python operators on slots (`m * (momentum - 1)`).
    def __neg__(self):
        return -self.value()

    def __add__(self, other):
        return self.value() + other

    def __radd__(self, other):
        return other + self.value()

    def __sub__(self, other):
        return self.value() - other

    def __rsub__(self, other):
        return other - self.value()

    def __mul__(self, other):
        return self.value() * other

    def __rmul__(self, other):
        return other * self.value()

    def __truediv__(self, other):
        return self.value() / other

    def __rtruediv__(self, other):
        return other / self.value()

    def __pow__(self, other):
        return self.value() ** other


class _Rows:
    """Rows ``[first, end)`` of a model variable, read and written in place (gather and scatter)."""

    def __init__(self, variable, first: int, end: int):
        self.parent = variable
        self.dtype = variable.dtype
        self.shape = (end - first, *variable.shape[1:])
        self._indices = tf.range(first, end)

    def __tf_tensor__(self, dtype=None, name=None):
        value = self.parent.sparse_read(self._indices)
        return value if dtype is None else tf.cast(value, dtype)

    def write(self, method: str, value) -> None:
        value = tf.cast(_dense(value), self.dtype)
        getattr(self.parent, method)(tf.IndexedSlices(value, self._indices))


# Keras's assign* on rows of a weight, as in-place row writes.
_SCATTER = {"assign": "scatter_update", "assign_add": "scatter_add", "assign_sub": "scatter_sub"}


def _dense(value):
    return tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value


class _CompactState:
    """Mixed into a Keras optimizer class: its large slots become :class:`CompactSlot`."""

    def __init__(self, *args, compact_dtype: str = "int8", block_size: int = 2048, min_size: int = 4096, **kwargs):
        if compact_dtype not in DTYPES:
            raise ValueError(f"compact_state dtype must be one of {DTYPES}, got {compact_dtype!r}.")
        _checks.positive_int(block_size, "block_size")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"min_size must be an int >= 0, got {min_size!r}.")
        super().__init__(*args, **kwargs)
        self.compact_dtype = compact_dtype
        self.block_size = int(block_size)
        self.min_size = min_size
        # Per variable update, the slots it expanded and what it stored; then, per device, what the
        # last update stored (the next one waits for it). Not state: kept out of tracking.
        self.__dict__.update(_touched=[], _stored=[], _chain={}, _chain_graph=None, _slots_of={})

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        size = math.prod(reference_variable.shape)
        if name in FLOAT32_SLOTS or size < self.min_size or not keras.backend.is_float_dtype(reference_variable.dtype):
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        path = getattr(reference_variable, "path", reference_variable.name)
        slot = CompactSlot(self, reference_variable, f"{path.replace('/', '_')}_{name or 'var'}", initializer)
        self._slots_of.setdefault(self._var_key(reference_variable), []).append(slot)
        return slot

    def _add_storage(self, reference, name, shape, dtype, initializer):
        # Next to the weight it describes, as Keras places its own slots.
        colocate = reference.value if isinstance(reference, keras.Variable) else reference
        with self._distribution_strategy.extended.colocate_vars_with(colocate):
            return self.add_variable(shape=shape, initializer=initializer, dtype=dtype, name=name)

    def apply(self, grads, trainable_variables=None):
        """Keras's ``apply``, updating the variables from the last to the first.

        Each update expands its variable's slots to float32; run side by side
        (nothing orders them in a graph), they would all be expanded at once.
        :meth:`update_step` chains them, and last-to-first is the order in
        which backprop produces gradients (``fused_update`` updates each as
        its gradient arrives).
        """
        variables = _compat.built_for(self) if trainable_variables is None else list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name):
                self.build(variables)  # in the model's order: saved state lines up with the model's
        return super().apply(list(grads)[::-1], variables[::-1])

    def update_step(self, gradient, variable, learning_rate):
        """The optimizer's update, in parts of rows for large variables, each after the previous.

        Expanded to float32, one update holds about seven copies of its slots' size (old and
        new moments, the gradient's square, the step); a 16 MiB kernel's would outweigh its
        int8 state. Elementwise optimizers update rows ``[first, end)`` at a time instead.
        """
        parts = self._parts(gradient, variable)
        if not parts:
            return self._update_part(gradient, variable, learning_rate)
        slots = self._slots_of[self._var_key(variable)]
        for first, end in parts:
            for slot in slots:
                slot._window = (first, end)
            self._update_part(gradient[first:end], _Rows(variable, first, end), learning_rate)
        for slot in slots:  # also those this optimizer's update did not touch
            slot.forget()

    def _parts(self, gradient, variable) -> list[tuple[int, int]]:
        """Row ranges to update one after another, or ``[]``: the variable at once."""
        if (
            self._base not in ELEMENTWISE
            or isinstance(gradient, tf.IndexedSlices)
            or math.prod(variable.shape) <= PART_ELEMENTS
            or self._var_key(variable) not in self._slots_of
        ):
            return []
        per_row, rows = math.prod(variable.shape[1:]), variable.shape[0]
        # Whole int8 blocks per part: a part's first row starts a block.
        align = 1 if self.compact_dtype == "bfloat16" else self.block_size // math.gcd(per_row, self.block_size)
        step = max(align, PART_ELEMENTS // per_row // align * align)
        return [(first, min(first + step, rows)) for first in range(0, rows, step)] if step < rows else []

    def _update_part(self, gradient, variable, learning_rate):
        try:
            if tf.executing_eagerly():
                return super().update_step(gradient, variable, learning_rate)
            graph = tf.compat.v1.get_default_graph()
            if self._chain_graph is not graph:
                self._chain.clear()
                self.__dict__["_chain_graph"] = graph
            device = getattr(variable, "device", None) or getattr(variable.parent, "device", "")
            # After its gradient (expanding a slot needs only the slot: it could otherwise run at
            # once, before backprop) and after the previous part on this device stored its slots.
            ready = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
            with tf.control_dependencies([ready, *self._chain.get(device, [])]):
                super().update_step(gradient, variable, learning_rate)
            if self._stored:
                self._chain[device] = list(self._stored)
        finally:
            # The float32 values belong to this part's update (and this graph).
            for slot in self._touched:
                slot.forget()
            self._touched.clear()
            self._stored.clear()

    def _get_variable_index(self, variable):
        return super()._get_variable_index(variable.parent if isinstance(variable, _Rows) else variable)

    def assign(self, variable, value):
        return self._write("assign", variable, value)

    def assign_add(self, variable, value):
        return self._write("assign_add", variable, value)

    def assign_sub(self, variable, value):
        return self._write("assign_sub", variable, value)

    def _write(self, method: str, variable, value):
        """Keras's ``assign*``, routed to the part of a weight or the compact slot it names."""
        if isinstance(variable, _Rows):
            return variable.write(_SCATTER[method], value)
        if isinstance(variable, CompactSlot):
            if method == "assign" and isinstance(value, tf.IndexedSlices):
                value = tf.tensor_scatter_nd_update(variable.value(), value.indices[:, None], value.values)
            return getattr(variable, method)(value)
        return getattr(super(), method)(variable, value)

    def get_config(self):
        return {
            **super().get_config(),
            "compact_dtype": self.compact_dtype,
            "block_size": self.block_size,
            "min_size": self.min_size,
        }


def _compact_class(base):
    name = f"Compact{base.__name__}"
    cls = type(
        name,
        (_CompactState, base),
        {
            "__module__": __name__,
            "__doc__": f"``keras.optimizers.{base.__name__}`` with compact state (effgrad).",
            "_base": base,
        },
    )
    # Registered at import: a .keras file with this optimizer loads after `import effgrad`.
    return keras.saving.register_keras_serializable(package="effgrad", name=name)(cls)


_CLASSES = {base: _compact_class(base) for base in SUPPORTED}


def compact_state(
    optimizer: keras.optimizers.Optimizer,
    dtype: str = "int8",
    block_size: int = 2048,
    min_size: int = 4096,
) -> keras.optimizers.Optimizer:
    """The same optimizer with its slots (moments) stored in int8 blocks or bfloat16.

    Algorithm: see the module docstring. Each slot of a variable with at
    least ``min_size`` numbers is stored compactly; its update expands it to
    float32, runs the optimizer's own update and stores it again. The result
    is an instance of the optimizer's class (``isinstance(opt, Adam)``), with
    the same configuration and learning rate (schedules included); its
    state saves and loads with ``.keras`` files and ``tf.train.Checkpoint``.

    Args:
        optimizer: A Keras per-variable optimizer that has not run yet (Adam,
            AdamW, Adamax, Nadam, RMSprop, Lion, SGD, Adafactor, Adagrad,
            Adadelta, Lamb, Ftrl). It is not changed.
        dtype: ``"int8"`` (block-wise, about 0.25x float32 with scales) or
            ``"bfloat16"`` (0.5x).
        block_size: Numbers per int8 block (one float32 scale each).
        min_size: Variables with fewer numbers keep float32 slots.

    Returns:
        A new optimizer of the same kind.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, is a
            ``LossScaleOptimizer`` or of a kind whose update effgrad cannot follow.
        ValueError: it has already built its state, or a bad ``dtype`` /
            ``block_size`` / ``min_size``.

    Example:
        >>> import keras, effgrad
        >>> opt = effgrad.compact_state(keras.optimizers.AdamW(1e-4), dtype="bfloat16")
        >>> type(opt).__name__, opt.get_config()["compact_dtype"]
        ('CompactAdamW', 'bfloat16')
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"compact_state needs a keras.optimizers.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "compact_state got a LossScaleOptimizer: compact its inner optimizer and wrap that, "
            "keras.optimizers.LossScaleOptimizer(effgrad.compact_state(inner)) "
            "(effgrad's train step scales the loss itself: wrapping is rarely needed)."
        )
    if isinstance(optimizer, _CompactState):
        raise TypeError(f"{type(optimizer).__name__} already keeps compact state.")
    if type(optimizer) not in _CLASSES:
        names = ", ".join(base.__name__ for base in SUPPORTED)
        raise TypeError(
            f"compact_state supports Keras's per-variable optimizers ({names}), got "
            f"{type(optimizer).__name__}: its update may use its state in ways effgrad cannot compress."
        )
    if optimizer.built:
        raise ValueError(
            f"{type(optimizer).__name__} has already built its float32 state; call compact_state on a "
            "new optimizer, before the first step (model.compile(optimizer=effgrad.compact_state(...)))."
        )
    schedule = _compat.learning_rate(optimizer)
    compact = _CLASSES[type(optimizer)].from_config(
        {**optimizer.get_config(), "compact_dtype": dtype, "block_size": block_size, "min_size": min_size}
    )
    if not isinstance(schedule, keras.Variable):
        _compat.set_learning_rate(compact, schedule)  # the caller's schedule or callable itself, not a copy
    return compact
