"""Which Keras optimizers effgrad may change how they run: only these exact classes.

Each reads and writes a variable's slots only through ``self.assign*`` and ops on the slot, in a
``update_step`` of that variable alone: ``compact_state`` can store their slots compactly, and
``inplace`` can compile a variable's update. A subclass may compute anything, so it is never one of them.
"""

from __future__ import annotations

import keras

__all__ = ["PER_VARIABLE", "ELEMENTWISE", "SPARSE_BY_ROWS"]

PER_VARIABLE = (
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
ELEMENTWISE = tuple(c for c in PER_VARIABLE if c not in (keras.optimizers.Adafactor, keras.optimizers.Lamb))
# Whose update reads a sparse gradient (an embedding's IndexedSlices) only through ``cast``, ``square``
# (each slice apart, as Keras does) and a ``subtract`` that densifies it: each row's update depends on
# that row's slices alone, and a zero slice adds nothing. So rows of the variable can be updated apart,
# from the slices of those rows, the others zeroed (Keras's own arithmetic, repeated rows included).
SPARSE_BY_ROWS = (keras.optimizers.Adam, keras.optimizers.AdamW)
