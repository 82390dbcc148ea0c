"""A large variable's optimizer update in parts: stand-ins the optimizer's own update reads and writes.

An optimizer whose update of each number depends on that number alone
(``optimizers.ELEMENTWISE``) gives the whole update when it runs on flat parts
of a variable and its slots; Adam and AdamW on a sparse gradient
(``optimizers.SPARSE_BY_ROWS``) give it on parts of whole rows, each from the
slices of its own rows (:func:`rows_of`). Inside an XLA loop each part is read,
updated and written back with :func:`place`, so only one part's temporaries
exist at a time. :class:`Part` is what the optimizer's ``update_step`` gets for
the variable (or for a float32 slot): it reads like a tensor and takes Keras's
``assign*`` writes.
"""

from __future__ import annotations

import tensorflow as tf

from effgrad import _compat

__all__ = ["PART_ELEMENTS", "Part", "Window", "place", "rows_of"]

PART_ELEMENTS = 2**18  # numbers (1 MiB of float32) updated at a time


class Part:
    """A variable's new value (or a part of it), as the optimizer's update writes it.

    Keras's update reads it like the variable and writes it with ``assign*``;
    the caller places the value back (one dense write: row writes would put
    the variable in TensorFlow's copy-on-read mode, where every later read
    copies it). ``stands_for`` is the variable, whose slots the optimizer
    looks up.
    """

    def __init__(self, variable, value):
        self.stands_for, self.value = variable, value
        self.dtype, self.shape = variable.dtype, tuple(value.shape)

    def __tf_tensor__(self, dtype=None, name=None):
        return self.value if dtype is None else tf.cast(self.value, dtype)

    def write(self, method: str, value) -> None:
        value = tf.cast(dense(value), self.dtype)
        self.value = _WRITES[method](self.value, value)

    # What a Keras optimizer's own assign* calls on the variable it is given.
    def assign(self, value) -> None:
        self.write("assign", value)

    def assign_add(self, value) -> None:
        self.write("assign_add", value)

    def assign_sub(self, value) -> None:
        self.write("assign_sub", value)


_WRITES = {"assign": lambda old, new: new, "assign_add": tf.add, "assign_sub": tf.subtract}


class Window(Part):
    """The rows ``[begin[0], begin[0] + shape[0])`` of ``whole`` (a variable's or slot's value in an XLA
    loop), which the optimizer's update reads and writes there: each write is placed into ``whole`` at
    once, and later reads slice the written ``whole``.

    So a value read after it was written (Adam's new moments, read by the variable's update) is read
    from where it was placed. With the new value carried as an expression instead, XLA recomputes it
    inside the variable's write from the old moments, which the moments' own writes overwrite: it then
    copies both whole at every part.
    """

    def __init__(self, variable, whole, begin, shape):
        self.stands_for, self.whole, self.begin = variable, whole, begin
        self.dtype, self.shape = variable.dtype, tuple(shape)

    @property
    def value(self):
        return tf.slice(self.whole, self.begin, self.shape)

    def write(self, method: str, value) -> None:
        new = _WRITES[method](self.value, tf.cast(dense(value), self.dtype))
        self.whole = place(self.whole, new, self.begin)


def dense(value):
    return tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value


def place(whole, part, offsets):
    """``part`` written into ``whole`` at ``offsets``: in place inside XLA's loop (an update-slice; a
    scatter of numbers would be a copy per number)."""
    return _compat.dynamic_update_slice(whole, part, offsets)


def rows_of(gradient: tf.IndexedSlices, first, shape) -> tf.IndexedSlices:
    """Rows ``[first, first + shape[0])`` of a sparse gradient, as a sparse gradient of those rows: the
    same values (not copied), the slices of other rows given index -1.

    Densifying the result (``tf.convert_to_tensor``, TensorFlow's ``unsorted_segment_sum``) drops a
    slice with a negative index, and so does XLA's scatter, which skips an index out of bounds: each
    part then reads the slices without making a masked copy of them (same count, so XLA sees fixed
    shapes). Keras's sparse-preserving ops (``ops.square``) keep the index with its value.
    """
    indices = gradient.indices
    first = tf.cast(first, indices.dtype)
    inside = (indices >= first) & (indices < first + shape[0])
    dense_shape = tf.constant(shape, gradient.dense_shape.dtype if gradient.dense_shape is not None else tf.int64)
    return tf.IndexedSlices(gradient.values, tf.where(inside, indices - first, -tf.ones_like(indices)), dense_shape)
