"""``compact_state``: a Keras optimizer whose large slots are :class:`~effgrad.train.compact.slot.CompactSlot`."""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf

from effgrad import _checks, _compat
from effgrad.train import optimizers, parts
from effgrad.train.compact.slot import CompactSlot

__all__ = ["compact_state", "DTYPES"]

DTYPES = ("int8", "bfloat16")
FLOAT32_SLOTS = ("average", "gradient_accumulator")  # EMA weights, Keras's own accumulation


class _CompactState(_compat.SlotsOfStandIns):
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
        # Per device, what the last whole update produced (the next one waits for it); the
        # compiled update of each variable. Not state: kept out of tracking.
        self.__dict__.update(_chain={}, _chain_graph=None, _slots_of={}, _compiled={})

    @property
    def updates_in_flight(self) -> float:
        """How many largest variables' updates ``fused_update`` lets run while it makes the next gradient.

        An int8 update is one XLA loop on one thread: with one at a time (1, as
        for any optimizer), a bias between two kernels keeps the next kernel
        waiting and a core idle. One more kernel in flight costs one kernel's
        memory and keeps both cores busy.
        """
        return 2 if self.compact_dtype == "int8" else 1

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        # A replica's shard of a variable (shard_state) is stored as the whole variable would be.
        size = getattr(reference_variable, "unsharded_size", None) or math.prod(reference_variable.shape)
        if name in FLOAT32_SLOTS or size < self.min_size or not keras.backend.is_float_dtype(reference_variable.dtype):
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        path = getattr(reference_variable, "path", reference_variable.name)
        slot = CompactSlot(self, reference_variable, f"{path.replace('/', '_')}_{name or 'var'}", initializer)
        self._slots_of.setdefault(_compat.variable_key(self, reference_variable), []).append(slot)
        return slot

    def add_storage(self, reference, name, shape, dtype, initializer):
        """A variable of a compact slot's storage, next to the weight it describes (as Keras places slots)."""
        colocate = reference.value if isinstance(reference, keras.Variable) else reference
        with _compat.optimizer_strategy(self).extended.colocate_vars_with(colocate):
            return self.add_variable(shape=shape, initializer=initializer, dtype=dtype, name=name)

    def apply(self, grads, trainable_variables=None):
        """Keras's ``apply``, updating the variables from the last to the first.

        Last-to-first is the order in which backprop produces gradients
        (``fused_update`` updates each as its gradient arrives), and the
        order in which :meth:`update_step` chains the updates it runs whole.
        """
        variables = _compat.built_for(self) if trainable_variables is None else list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name):
                self.build(variables)  # in the model's order: saved state lines up with the model's
        return super().apply(list(grads)[::-1], variables[::-1])

    def update_step(self, gradient, variable, learning_rate):
        """The optimizer's own update of ``variable``, its compact slots expanded only inside it.

        A dense gradient of an elementwise optimizer is applied by one
        XLA-compiled function per variable: a loop over flat parts of
        ``parts.PART_ELEMENTS`` numbers that expands each part's slots, runs the
        optimizer's update on it and compresses them again, fused into a few
        passes over memory. A sparse gradient (an embedding's rows) of Adam or
        AdamW is applied the same way by parts of whole rows, each from its
        rows' slices (``optimizers.SPARSE_BY_ROWS``: Keras's arithmetic on
        repeated rows kept). Other updates (a sparse gradient of another
        optimizer, whose repeated rows Keras treats its own way; Adafactor,
        Lamb) run whole, op by op, one after another. Each runs after its
        gradient exists.
        """
        slots = self._slots_of.get(_compat.variable_key(self, variable))
        if not slots:
            return super().update_step(gradient, variable, learning_rate)
        learning_rate = tf.convert_to_tensor(learning_rate)
        sparse = isinstance(gradient, tf.IndexedSlices)
        if self._base not in (optimizers.SPARSE_BY_ROWS if sparse else optimizers.ELEMENTWISE):
            with self._after_previous(gradient, variable):
                stored = [slot.read() for slot in slots]
            # In place on the variable (Keras's scatter of rows), the slots written once.
            stored = self._update(gradient, variable, learning_rate, slots, stored)
            if not tf.executing_eagerly():
                self._chain[self._device(variable)] = [tensor for part in stored for tensor in part]
        elif not tf.distribute.has_strategy():
            # Reads and writes inside XLA: the variable and its slots are updated in place.
            self._compiled_update(variable, slots, in_place=True)(gradient, learning_rate)
            return
        else:  # a replica's variable is read here, in its device's update context (see CompactSlot.read)
            stored = [slot.read() for slot in slots]
            update = self._compiled_update(variable, slots, in_place=False)
            value, stored = update(gradient, tf.convert_to_tensor(variable), learning_rate, stored)
            self.assign(variable, value)  # one dense write (see parts.Part)
        for slot, part in zip(slots, stored):
            slot.write(part)

    def _update(self, gradient, variable, learning_rate, slots, stored, shape=None):
        """Keras's update of ``variable`` with each slot loaded from ``stored``; the slots' new stored form."""
        for slot, part in zip(slots, stored):
            slot.load(part, shape)
        try:
            super().update_step(gradient, variable, learning_rate)
            return [slot.result() for slot in slots]
        finally:
            for slot in slots:
                slot.forget()

    def _compiled_update(self, variable, slots, in_place: bool):
        key = (_compat.variable_key(self, variable), in_place)
        if key not in self._compiled:

            def update(gradient, value, learning_rate, stored):
                return self._update_in_parts(gradient, variable, value, learning_rate, slots, stored)

            def update_in_place(gradient, learning_rate):
                stored = [slot.read() for slot in slots]
                value, stored = update(gradient, tf.convert_to_tensor(variable), learning_rate, stored)
                variable.assign(value)
                for slot, part in zip(slots, stored):
                    slot.write(part)

            fn = update_in_place if in_place else update
            self._compiled[key] = tf.function(fn, jit_compile=True, autograph=False)
        return self._compiled[key]

    def _update_in_parts(self, gradient, variable, value, learning_rate, slots, stored):
        """``(new value, new stored slots)``: the variable updated ``parts.PART_ELEMENTS`` numbers at a time.

        An elementwise update of each number depends on that number alone, so
        parts of the flat variable give the whole update. Inside XLA's loop
        each part of the value is read and written back in place (when
        ``value`` is the variable's own buffer, as in the in-place update,
        nothing variable-sized is made), and each part's slots are read from
        ``stored`` and written into new zeroed buffers: written back in place
        as well, XLA fuses the reads of the old codes into the writes and
        copies the whole slot at every part. Only one part's
        float32 slots exist at a time.
        """
        size = math.prod(variable.shape)
        if size <= parts.PART_ELEMENTS:
            target = parts.Part(variable, value)
            stored = self._update(gradient, target, learning_rate, slots, stored)
            return target.value, stored
        value = tf.reshape(value, [-1])
        stored = [slot.flat(s) for slot, s in zip(slots, stored)]
        part = max(self.block_size, parts.PART_ELEMENTS // self.block_size * self.block_size)  # whole int8 blocks
        sparse = isinstance(gradient, tf.IndexedSlices)
        if sparse:  # parts of whole rows, each on whole int8 blocks
            width = size // variable.shape[0]
            unit = self.block_size // math.gcd(width, self.block_size)  # rows per whole number of blocks
            part = max(unit, parts.PART_ELEMENTS // width // unit * unit) * width
        else:  # a densified embedding gradient has no static shape: the variable's is its own
            gradient = tf.reshape(gradient, [-1])

        def one(start, length, new_value, new_stored):
            if sparse:
                shape = (length // width, *variable.shape[1:])
                piece_gradient = parts.rows_of(gradient, start // width, shape)
            else:
                shape, piece_gradient = (length,), tf.slice(gradient, [start], [length])
            target = parts.Part(variable, tf.reshape(tf.slice(new_value, [start], [length]), shape))
            pieces = [slot.slice(s, start, length) for slot, s in zip(slots, stored)]
            pieces = self._update(piece_gradient, target, learning_rate, slots, pieces, shape)
            new_stored = [slot.place(s, p, start) for slot, s, p in zip(slots, new_stored, pieces)]
            return parts.place(new_value, tf.reshape(target.value, [-1]), [start]), new_stored

        def body(i, new_value, new_stored):
            return (i + 1, *one(i * part, part, new_value, new_stored))

        full = size // part
        new_value, new_stored = value, tf.nest.map_structure(tf.zeros_like, stored)
        if full:  # (XLA checks the body's slices against the shapes even if it never runs)
            _, new_value, new_stored = tf.while_loop(
                lambda i, *_: i < full, body, (tf.constant(0), new_value, new_stored)
            )
        if size % part:
            new_value, new_stored = one(full * part, size % part, new_value, new_stored)
        return tf.reshape(new_value, variable.shape), [slot.unflat(s) for slot, s in zip(slots, new_stored)]

    def _after_previous(self, gradient, variable):
        """In a graph: after ``gradient`` exists and after the previous whole update on its device.

        Expanding a slot needs only the slot: it could otherwise run at once, before backprop.
        A whole update (op by op) expands all of its slots, several float32 copies of them:
        those run one after another on each device. A compiled update holds its slots' new
        stored form and one part's float32 slots, less than Keras's own float32 Adam update, and runs
        beside the others, which is faster than chaining them for a few MiB more.
        """
        if tf.executing_eagerly():
            return contextlib.nullcontext()
        graph = tf.compat.v1.get_default_graph()
        if self._chain_graph is not graph:
            self._chain.clear()
            self.__dict__["_chain_graph"] = graph
        ready = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
        previous = self._chain.get(self._device(variable), [])
        return tf.control_dependencies([ready, *previous])

    @staticmethod
    def _device(variable) -> str:
        return getattr(variable, "device", "") or ""

    def assign(self, variable, value):
        return self._write("assign", variable, value)

    def assign_add(self, variable, value):
        return self._write("assign_add", variable, value)

    def assign_sub(self, variable, value):
        return self._write("assign_sub", variable, value)

    def _write(self, method: str, variable, value):
        """Keras's ``assign*``, routed to the new value of a weight or the compact slot it names."""
        if isinstance(variable, CompactSlot):
            return getattr(variable, method)(value)
        if isinstance(variable, parts.Part):
            return variable.write(method, value)
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


_CLASSES = {base: _compact_class(base) for base in optimizers.PER_VARIABLE}


def elementwise(optimizer) -> bool:
    """Whether ``optimizer`` updates each number from that number alone (it may update a variable in parts).

    Keras's own elementwise optimizers (exact classes: a subclass may compute anything) and their
    :func:`compact_state` versions.
    """
    cls = type(optimizer)
    return cls in optimizers.ELEMENTWISE or any(cls is _CLASSES[base] for base in optimizers.ELEMENTWISE)


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
        names = ", ".join(base.__name__ for base in optimizers.PER_VARIABLE)
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
    config, exclusions = _compat.config_and_exclusions(optimizer)
    compact = _CLASSES[type(optimizer)].from_config(
        {**config, "compact_dtype": dtype, "block_size": block_size, "min_size": min_size}
    )
    if not isinstance(schedule, keras.Variable):
        _compat.set_learning_rate(compact, schedule)  # the caller's schedule or callable itself, not a copy
    _compat.set_exclusions(compact, exclusions)  # exclude_from_weight_decay(...): not in the config
    return compact
