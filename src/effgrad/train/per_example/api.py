"""``effgrad.per_example_norms``: every example's gradient norm, without per-example gradients."""

from __future__ import annotations

import collections
import functools

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.train.per_example.taps import NormTaps

__all__ = ["per_example_norms"]

_CACHED = 8  # traced functions kept per model (loss x training x input signature), least recently used dropped


def per_example_norms(model, loss, x, y, sample_weight=None, *, training: bool = False) -> tf.Tensor:
    """The gradient norm of each example's loss, without per-example gradients.

    Algorithm: one forward pass with a tap on every layer call that has
    weights, one backward pass to the taps; each tap turns its layer's
    input and output gradient into that layer's ``[batch]`` share of
    ``|grad l_i|^2`` (ghost norms or the per-example gradient, whichever is
    smaller; :mod:`effgrad.train.per_example.forms`). Closed forms cover
    Dense, EinsumDense, Embedding, keras_hub's reversible and position
    embeddings, convolutions (grouped, depthwise), Layer/RMS/Group
    normalization and LSTM/GRU/SimpleRNN; other layers fall back to their
    own per-example gradients, with one warning naming them.

    The traced function is cached on the model per loss, ``training`` and
    input signature (batch size free): calling again does not retrace. Pass
    the same loss object to reuse it.

    Example:
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
        >>> norms = effgrad.per_example_norms(model, "mse", x, y)
        >>> tuple(norms.shape)
        (4,)

    Args:
        model: A Keras model (built from ``x`` if it is not yet; no
            BatchNormalization in training).
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
    batch = tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight))
    if not model.built:
        model(tf.nest.map_structure(lambda t: t[:1], batch[0]), training=False)  # as fit builds it
    if not model.trainable_variables:
        raise ValueError(f"{model.name} has no trainable weights: there is no gradient to take the norm of.")
    leaves = [t for t in tf.nest.flatten(batch) if t is not None]
    return _traced(model, loss, training, batch)(*leaves)


def _traced(model, loss, training: bool, batch):
    """The cached ``tf.function`` for this model, loss, mode and input signature (batch size free)."""
    specs = tf.nest.map_structure(lambda t: None if t is None else tf.TensorSpec([None, *t.shape[1:]], t.dtype), batch)
    key = (
        loss if isinstance(loss, str) else id(loss),
        training,
        repr(tf.nest.map_structure(lambda s: None, specs)),  # the nest's structure
        tuple(tf.nest.flatten(specs)),
    )
    cache = _compat.model_state(model).setdefault("per_example_norms", collections.OrderedDict())
    if key in cache:
        cache.move_to_end(key)
        return cache[key][0]
    from effgrad.train import objective as objective_lib

    objective = objective_lib.Objective.of_loss(loss, "sum")
    taps = NormTaps(model, training=training)  # refusals and fallback warnings: now, before any trace
    flat_specs = tf.nest.flatten(specs)
    present = [i for i, s in enumerate(flat_specs) if s is not None]

    # A partial, not a closure: TensorFlow counts traces per code object, and each model's function is its
    # own. The first trace has the batch's static shapes (a smaller graph, quicker to trace); a second batch
    # size relaxes them once (reduce_retracing), and no later call traces again.
    function = tf.function(
        functools.partial(_norms, model, taps, objective, training, specs, present),
        reduce_retracing=True,
        autograph=False,
    )
    cache[key] = (function, loss)  # the loss is kept: its id stays its own while the entry lives
    if len(cache) > _CACHED:
        cache.popitem(last=False)
    return function


def _norms(model, taps, objective, training, specs, present, *leaves):
    flat = [None] * len(tf.nest.flatten(specs))
    for i, t in zip(present, leaves):
        flat[i] = t
    x, y, sample_weight = tf.nest.pack_sequence_as(specs, flat)
    with tf.GradientTape(watch_accessed_variables=False) as tape, keras.StatelessScope():  # no state written
        with taps.recording(tape) as recorder:
            y_pred = recorder.hook(lambda: model(x, training=training))
        per_example = objective.per_example(y, y_pred, sample_weight)
    return recorder.backward(per_example).norms
