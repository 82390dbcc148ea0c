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

Trap:
    XLA compiles each large variable's update once, at the first step (a
    fraction of a second each). Sparse gradients (an embedding's
    ``IndexedSlices``), small variables, optimizers other than Keras's own
    per-variable ones (subclasses included; ``compact_state`` compiles its
    own updates), and updates under a ``tf.distribute`` strategy other than
    the default run op by op, as Keras runs them.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from effgrad import _compat
from effgrad.train.optimizers import PER_VARIABLE

__all__ = ["MIN_ELEMENTS", "PER_VARIABLE", "compiled"]

# 4 MiB of float32: below it the temporaries are small, and a compilation costs more than it saves.
MIN_ELEMENTS = 2**20


@contextlib.contextmanager
def compiled(optimizer):
    """While it is open, ``optimizer.update_step`` runs large dense updates as XLA functions.

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
        if (
            isinstance(gradient, tf.IndexedSlices)
            or variable.shape.num_elements() is None
            or variable.shape.num_elements() < MIN_ELEMENTS
            or tf.distribute.has_strategy()
        ):
            return plain(gradient, variable, learning_rate)
        if id(variable) not in cache:  # the function holds the variable: its id stays its own
            cache[id(variable)] = tf.function(
                lambda g, lr, variable=variable: plain(g, variable, lr), jit_compile=True, autograph=False
            )
        cache[id(variable)](gradient, tf.convert_to_tensor(learning_rate))

    with _compat.replaced(optimizer, "update_step", update_step):  # gone when apply() returns
        yield
