"""Writes to state in a forward pass, recorded instead of applied.

A forward pass writes non-trainable state: BatchNorm moving statistics, the
seed generators of Dropout and every Keras random op. Two things need those
writes held back instead of applied on the spot:

* the train step commits them only when the step is applied, so a skipped
  (non-finite) step leaves no NaN in a moving mean;
* a checkpointed block applies them once, and its recompute replays the
  state from before the forward pass (same Dropout mask).

Both run the forward pass inside :class:`StateScope`, a
``keras.StatelessScope`` that starts from the pending values of an enclosing
scope and remembers which variables were written::

    with StateScope(zip(variables, pending)) as scope:
        y = model(x, training=True)          # reads see `pending`, writes are recorded
    pending = [scope.get_current_value(v) for v in variables]
    ...
    commit(variables, pending, scope.written)  # later, only if the step is applied
"""

from __future__ import annotations

import keras

from effgrad import _compat

__all__ = ["StateScope", "written_in"]


class StateScope(keras.StatelessScope):
    """A StatelessScope that remembers which variables were written.

    It starts from the enclosing scope's pending values, so a nested scope
    sees the state its parent has advanced but not yet applied.
    """

    def __init__(self, state_mapping=(), collect_losses: bool = False):
        super().__init__(state_mapping=list(state_mapping), collect_losses=collect_losses)
        parent = _compat.get_stateless_scope()
        if parent is not None:
            for key, value in parent.state_mapping.items():
                self.state_mapping.setdefault(key, value)
        self.written: dict[int, keras.Variable] = {}

    def add_update(self, update):
        super().add_update(update)
        self.written[id(update[0])] = update[0]


def written_in(scope: StateScope, variables) -> tuple[set[int], list]:
    """``(indices of variables written, other variables written)`` in ``scope``.

    The others are state a layer keeps outside its tracked weights (a
    stateful RNN's ``rnn_state``); the caller decides whether it can hold
    them back too.
    """
    ids = {id(v): i for i, v in enumerate(variables)}
    stray = [v for key, v in scope.written.items() if key not in ids]
    return {ids[key] for key in scope.written if key in ids}, stray
