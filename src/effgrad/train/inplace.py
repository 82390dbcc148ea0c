"""Optimizer updates without temporaries: a large variable's update as one XLA function, in place.

Keras runs an optimizer's update of a variable op by op. Adam's

    m += (g - m) (1 - b1);   v += (g^2 - v) (1 - b2);   theta -= m alpha / (sqrt(v) + eps)

makes a variable-sized temporary at nearly every op, several alive at once.
Compiled by XLA, the same update is one fused loop that reads ``g, m, v,
theta`` and writes the three variables in place (tests/test_inplace_update.py
compares the two). The step's peak falls and the step is faster
(``python -m benchmarks run step_floor``).

So while the train step's ``optimizer.apply`` runs, :func:`compiled` makes
the update of each variable of at least ``MIN_ELEMENTS`` numbers one
``tf.function(jit_compile=True)`` around Keras's own ``update_step``: the
same arithmetic, the same slots, the same checkpoints.

A sparse gradient (an embedding's ``IndexedSlices``) of Adam or AdamW
(``optimizers.SPARSE_BY_ROWS``) is applied the same way, by parts of whole
rows inside one XLA loop (``effgrad.train.parts``): each part's update gets
the slices of its own rows, Keras's arithmetic on repeated rows kept, and
only one part of the table's densified gradient and temporaries exists at a
time, where Keras's update makes several of the whole table.

Trap:
    XLA compiles each large variable's update once, at the first step (a
    fraction of a second each), and again for a sparse gradient with
    another number of slices. Small variables, sparse gradients of other
    optimizers (whose repeated rows Keras treats its own way), optimizers
    other than Keras's own per-variable ones (subclasses included;
    ``compact_state`` compiles its own updates), and updates under a
    ``tf.distribute`` strategy other than the default run op by op, as
    Keras runs them.
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from effgrad import _compat
from effgrad.train import parts
from effgrad.train.optimizers import PER_VARIABLE, SPARSE_BY_ROWS

__all__ = ["MIN_ELEMENTS", "PER_VARIABLE", "compiled"]

# 4 MiB of float32: below it the temporaries are small, and a compilation costs more than it saves.
MIN_ELEMENTS = 2**20


@contextlib.contextmanager
def compiled(optimizer):
    """While it is open, ``optimizer.update_step`` runs large updates as XLA functions.

    Only the exact classes of ``PER_VARIABLE`` are changed (a subclass may
    compute what XLA cannot). The compiled updates are kept on the optimizer
    (one per variable), so a retraced step reuses them.
    """
    if type(optimizer) not in PER_VARIABLE:
        yield
        return
    plain = optimizer.update_step
    cache = optimizer.__dict__.setdefault("_effgrad_compiled_updates", {})

    def update_step(gradient, variable, learning_rate):
        size = variable.shape.num_elements()
        if size is None or size < MIN_ELEMENTS or tf.distribute.has_strategy():
            return plain(gradient, variable, learning_rate)
        sparse = isinstance(gradient, tf.IndexedSlices)
        slices = gradient.values.shape[0] if sparse else None
        if sparse and (
            type(optimizer) not in SPARSE_BY_ROWS
            or (slices is not None and slices >= variable.shape[0])  # as large as the table: dense in effect
            or _compat.adam_slots(optimizer, variable) is None
        ):
            return plain(gradient, variable, learning_rate)
        key = (id(variable), sparse)  # the function holds the variable: its id stays its own
        if key not in cache:
            if sparse:
                update = functools.partial(_by_rows, optimizer, plain, variable)
            else:
                update = lambda g, lr, variable=variable: plain(g, variable, lr)  # noqa: E731
            cache[key] = tf.function(update, jit_compile=True, autograph=False)
        cache[key](gradient, tf.convert_to_tensor(learning_rate))

    with _compat.replaced(optimizer, "update_step", update_step):  # gone when apply() returns
        yield


def _by_rows(optimizer, update, variable, gradient: tf.IndexedSlices, learning_rate) -> None:
    """Adam's or AdamW's ``update`` (its own ``update_step``) of ``variable`` and its slots by parts of
    whole rows, each from the slices of its rows, in place.

    A part is ``parts.PART_ELEMENTS`` numbers (at least one row). Every part reads every slice where
    it lies (``parts.rows_of``): beside one part, the update holds about twice the slices' size (their
    square among it), where Keras's holds two table-sized temporaries and the slices. So a gradient with
    as many slices as the table has rows (known when traced) is left to Keras's own update, dense in
    effect; traced for any number of slices, one of more than twice the table's rows holds more here.
    """
    slots = _compat.adam_slots(optimizer, variable)
    rows, width = variable.shape[0], variable.shape.num_elements() // variable.shape[0]
    count = max(1, parts.PART_ELEMENTS // width)  # rows per part

    def one(first, n, values):
        shape = (n, *variable.shape[1:])
        begin = [first] + [0] * (len(shape) - 1)
        windows = [parts.Window(v, x, begin, shape) for v, x in zip([variable, *slots], values)]
        with _compat.slots_standing_in(optimizer, variable, windows[1:]):
            update(parts.rows_of(gradient, first, shape), windows[0], learning_rate)
        return [window.whole for window in windows]

    values = [tf.convert_to_tensor(v) for v in [variable, *slots]]
    full = rows // count
    if full:  # (XLA checks the body's slices against the shapes even if it never runs)
        _, *values = tf.while_loop(
            lambda i, *_: i < full, lambda i, *v: (i + 1, *one(i * count, count, v)), (tf.constant(0), *values)
        )
    if rows % count:
        values = one(full * count, rows % count, values)
    for v, value in zip([variable, *slots], values):
        v.assign(value)
