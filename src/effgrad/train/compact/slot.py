"""A compact slot: int8 blocks or bfloat16, read as float32."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from effgrad.train.compact.codec import dequantize, quantize
from effgrad.train.parts import dense, place

__all__ = ["CompactSlot"]


class CompactSlot:
    """One optimizer slot kept in int8 blocks or bfloat16; reads as float32.

    Within one update (the compact optimizer's ``update_step``) the slot is
    :meth:`load`-ed with its stored tensors (or a part's), the optimizer's
    own update reads it like a tensor and writes it through ``assign*``;
    the update uses the exact new moment (as bitsandbytes does), and
    :meth:`result` compresses it once at the end. Nothing here touches a
    variable: reading and writing the storage are :meth:`read` and
    :meth:`write`, outside the compiled update.
    """

    def __init__(self, optimizer, reference, name: str, initializer):
        self.shape = tuple(reference.shape)
        self.dtype = "float32"
        self.name = name
        self._mode = optimizer.compact_dtype
        self._block = optimizer.block_size
        self.forget()
        initializer = keras.initializers.get(initializer)
        zeros = isinstance(initializer, keras.initializers.Zeros)

        def initial(index):
            # Non-zero initial slots (Adagrad's, Ftrl's accumulators) are encoded once.
            def make(shape, dtype):
                return quantize(initializer(self.shape, "float32"), self._block)[index]

            return "zeros" if zeros else make

        if self._mode == "bfloat16":
            self._storage = (optimizer.add_storage(reference, name, self.shape, "bfloat16", initializer),)
        else:
            blocks = -(-math.prod(self.shape) // self._block)
            self._storage = (
                optimizer.add_storage(reference, f"{name}_codes", (blocks, self._block), "int8", initial(0)),
                optimizer.add_storage(reference, f"{name}_scales", (blocks,), "float32", initial(1)),
            )

    def read(self) -> tuple:
        # Read here, in this device's update context: a distributed variable captured by a
        # tf.function would be read there as its first replica's copy.
        return tuple(tf.convert_to_tensor(variable) for variable in self._storage)

    def write(self, stored) -> None:
        for variable, tensor in zip(self._storage, stored):
            variable.assign(tensor)

    def load(self, stored, shape=None) -> None:
        """Makes ``stored`` (this slot's tensors, or a part's) the value the update reads."""
        self._input, self._shape, self._current, self._written = tuple(stored), shape or self.shape, None, False

    def result(self) -> tuple:
        """The stored form of the slot after the update (its input if the update did not write it)."""
        if not self._written:
            return self._input
        if self._mode == "bfloat16":
            return (tf.cast(self._current, tf.bfloat16),)
        return quantize(self._current, self._block)

    def forget(self) -> None:
        self._input = self._shape = self._current = None
        self._written = False

    def value(self) -> tf.Tensor:
        """The slot as float32, kept for the rest of this update (outside one: its stored value)."""
        if self._input is None:
            return self._decode(self.read(), self.shape)
        if self._current is None:
            self._current = self._decode(self._input, self._shape)
        return self._current

    def _decode(self, stored, shape) -> tf.Tensor:
        if self._mode == "int8":
            return dequantize(*stored, shape)
        stored = tf.bitcast(stored[0], tf.bfloat16) if stored[0].dtype == tf.int16 else stored[0]  # see flat()
        return tf.reshape(tf.cast(stored, tf.float32), shape)

    def assign(self, value) -> None:
        if isinstance(value, tf.IndexedSlices):  # Keras's assign of rows
            value = tf.tensor_scatter_nd_update(self.value(), value.indices[:, None], value.values)
        self._current, self._written = tf.cast(tf.convert_to_tensor(value), tf.float32), True

    def assign_add(self, value) -> None:
        self.assign(self.value() + dense(value))

    def assign_sub(self, value) -> None:
        self.assign(self.value() - dense(value))

    # A large variable's update works on its flat parts: these cut and place a part of the storage.
    def flat(self, stored) -> tuple:
        """``stored`` as parts are cut from it: int8 codes as they are, bfloat16 flat and viewed as int16.

        int16, because XLA on CPU has no bfloat16 scatter or update-slice of
        its own: it would convert the whole slot to float32 and back at every part.
        """
        if self._mode == "int8":
            return tuple(stored)
        return (tf.bitcast(tf.reshape(stored[0], [-1]), tf.int16),)

    def unflat(self, stored) -> tuple:
        if self._mode == "int8":
            return tuple(stored)
        return (tf.reshape(tf.bitcast(stored[0], tf.bfloat16), self.shape),)

    def slice(self, stored, start, size: int) -> tuple:
        """The stored form of numbers ``[start, start + size)`` (``start`` on a block boundary) of :meth:`flat`."""
        if self._mode == "bfloat16":
            return (tf.slice(stored[0], [start], [size]),)
        first, blocks = start // self._block, -(-size // self._block)
        return tf.slice(stored[0], [first, 0], [blocks, self._block]), tf.slice(stored[1], [first], [blocks])

    def place(self, stored, part, start) -> tuple:
        """:meth:`flat` ``stored`` with the part that :meth:`slice` cut at ``start`` replaced by ``part``."""
        if self._mode == "bfloat16":
            return (place(stored[0], tf.bitcast(tf.reshape(part[0], [-1]), tf.int16), [start]),)
        first = start // self._block
        return place(stored[0], part[0], [first, 0]), place(stored[1], part[1], [first])

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
