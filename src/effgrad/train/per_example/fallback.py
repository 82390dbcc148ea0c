"""Per-example gradients of a layer without a closed form: its own call, one example at a time, vectorized.

For a layer ``f(x; w)`` whose output gradient ``g`` backprop gives, each
example's gradient of ``w`` is the vector-Jacobian product of ``f`` at that
example alone::

    G_i = vjp(w -> f(x_i; w), g_i)          # tf.vectorized_map over i

exact whatever the layer computes, at batch x ``w`` memory for that layer
only. The layer is called through ``__call__`` (its own casting, masks,
autocast) under a ``StatelessScope``: nothing it writes is kept.

Trap: a layer that draws random numbers in training (dropout inside it)
would draw other numbers here than in the forward pass: :func:`call`
refuses it (the draws advance a seed generator, which is how it is seen).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.train.per_example.forms import Direct

__all__ = ["call", "per_example"]


def call(layer, original, args, kwargs):
    """``original(*args, **kwargs)``, refused if it advanced a seed generator (random draws)."""
    scope = _compat.get_stateless_scope()
    seeds = _compat.seed_states(layer) if scope is not None else []
    before = [scope.get_current_value(s) for s in seeds]
    out = original(*args, **kwargs)
    if any(scope.get_current_value(s) is not b for s, b in zip(seeds, before)):
        raise ValueError(
            f"effgrad: {layer.name} ({type(layer).__name__}) has no closed form for per-example gradients and draws "
            "random numbers in its call (dropout), which recomputing it per example cannot repeat: set its dropout "
            "to 0 for per-example clipping (a Dropout layer before or after it is fine)."
        )
    return out


def per_example(layer, variables, args, kwargs, outputs: list[int], gradients: list) -> list[Direct]:
    """Every example's gradient of ``variables`` from the output gradients (``outputs``: which flat outputs)."""
    flat = tf.nest.flatten((args, kwargs))
    rows = gradients[0].shape[0]
    mapped = [
        i
        for i, t in enumerate(flat)
        if tf.is_tensor(t) and t.shape.rank and (t.shape[0] is None or rows is None or t.shape[0] == rows)
    ]

    def one(elements):
        slices, upstream = elements[: len(mapped)], elements[len(mapped) :]
        values = list(flat)
        for i, s in zip(mapped, slices):
            values[i] = s[None]
        args_i, kwargs_i = tf.nest.pack_sequence_as((args, kwargs), values)
        with tf.GradientTape() as tape, keras.StatelessScope():
            out = tf.nest.flatten(layer(*args_i, **kwargs_i))  # __call__: the layer's own casting and autocast
        return tape.gradient([out[i] for i in outputs], variables, output_gradients=[g[None] for g in upstream])

    grads = tf.vectorized_map(one, [flat[i] for i in mapped] + list(gradients))
    return [
        Direct(v, tf.zeros([tf.shape(gradients[0])[0], *v.shape]) if p is None else tf.cast(p, tf.float32))
        for p, v in zip(grads, variables)
    ]
