"""Activation checkpointing that is right with Dropout, BatchNorm, kwargs and XLA.

A checkpointed call keeps only its inputs for the backward pass and runs the
forward computation a second time to get the gradients::

    forward:   with writes-to-state recorded, not applied:
                   y = f(x)                       # nothing kept for backprop
               snapshot = state before f          # seeds, moving stats: small
               state <- state written by f        # applied exactly once
    backward:  with state read from `snapshot`, writes discarded:
                   y' = f(x)                      # same dropout masks as y
               return d y'/d (x, weights) · dy

``tf.recompute_grad`` and ``keras.remat`` run ``f`` twice against the live
state, so on TF 2.21 a Keras Dropout draws a *new* mask in the recompute
(gradients of a different function), its seed generator advances twice, and
BatchNorm updates its moving statistics twice. effgrad runs both passes in a
``keras.StatelessScope``: the forward collects the state it writes and applies
it once; the recompute reads the pre-forward snapshot and its writes go
nowhere. Keyword arguments are bound in a closure (``tf.custom_gradient``
refuses them in graph mode). An identical recompute would be merged back into
the forward pass by common-subexpression elimination, silently keeping every
activation alive again (measured): in graphs its inputs pass through an
optimization barrier with the incoming gradient; under XLA, whose CPU backend
strips barriers before CSE, it runs inside a conditional instead.

Example:
    >>> block = effgrad.Checkpoint(keras.Sequential([Dense(1024, "relu"), Dropout(0.1)]))
    >>> deep = effgrad.checkpoint_sequential(model, segments="sqrt")

Trap:
    Only Keras variables are seen by the state capture: a function that
    mutates a raw ``tf.Variable`` in its forward pass would do so twice. Layers
    must be built before their first checkpointed call (effgrad raises if a
    variable is created inside one, since it would get no gradient).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad.state import StateScope

__all__ = ["checkpoint", "Checkpoint", "checkpoint_sequential"]


def _is_tensor(value) -> bool:
    return tf.is_tensor(value) or isinstance(value, tf.Variable)


def _differentiable(t) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def _call_with_recompute(fn: Callable, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` whose activations are recomputed in backprop."""
    structure = (args, kwargs)
    flat = tf.nest.flatten(structure)
    positions = [i for i, leaf in enumerate(flat) if _is_tensor(leaf)]
    if not positions:
        return fn(*args, **kwargs)

    def call(tensors):
        leaves = list(flat)
        for i, t in zip(positions, tensors):
            leaves[i] = t
        call_args, call_kwargs = tf.nest.pack_sequence_as(structure, leaves)
        return fn(*call_args, **call_kwargs)

    out_structure = []

    @tf.custom_gradient
    def forward(*tensors):
        scope = StateScope()
        with scope, _compat.stop_recording():  # keep no activation for backprop
            outputs = call(tensors)
        written = list(scope.written.values())
        # The scope kept the writes off the variables: they still hold the
        # pre-forward state, which is what the recompute must replay.
        snapshot = [tf.identity(v.value) for v in written]
        with tf.control_dependencies(snapshot):
            for v in written:
                v.assign(scope.get_current_value(v))
        out_structure.append(outputs)
        flat_out = [tf.identity(t) for t in tf.nest.flatten(outputs)]

        def grad(*output_grads, variables=None):
            variables = list(variables or [])
            watched = [t for t in tensors if _differentiable(t)]

            def recompute_and_differentiate(replay=tensors):
                sources = [t for t in replay if _differentiable(t)]
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    with StateScope(zip(written, snapshot)):  # same seeds; writes discarded
                        recomputed = tf.nest.flatten(call(replay))
                pairs = [(o, g) for o, g in zip(recomputed, output_grads) if g is not None and _differentiable(o)]
                grads = tape.gradient(
                    [o for o, _ in pairs],
                    sources + variables,
                    output_gradients=[g for _, g in pairs],
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
                return [tf.convert_to_tensor(g) for g in grads]

            if tf.executing_eagerly():
                grads = recompute_and_differentiate()
            elif _compat.in_xla_context():
                # XLA's CSE would merge the recompute back into the forward
                # pass (XLA:CPU strips optimization barriers before CSE), but
                # it does not look inside a conditional. The predicate on the
                # incoming gradients also keeps the recompute from running
                # early; the other branch only runs when they are inf/NaN and
                # returns NaN, so loss scaling still sees the overflow.
                incoming = [tf.reduce_all(tf.math.is_finite(g)) for g in output_grads if g is not None]
                grads = tf.cond(
                    tf.reduce_all(incoming),
                    recompute_and_differentiate,
                    lambda: [tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype)) for t in watched + variables],
                )
            else:
                # Grappler would merge an identical recompute with the forward
                # pass; routing the inputs through a barrier together with the
                # incoming gradients makes them different tensors, available
                # only once backprop reaches this block.
                barrier = _compat.optimization_barrier(*tensors, *[g for g in output_grads if g is not None])
                grads = recompute_and_differentiate(list(barrier[: len(tensors)]))
            watched_grads = iter(grads[: len(watched)])
            input_grads = [next(watched_grads) if _differentiable(t) else None for t in tensors]
            return input_grads, grads[len(watched) :]

        return flat_out, grad

    flat_out = forward(*[tf.convert_to_tensor(flat[i]) for i in positions])
    return tf.nest.pack_sequence_as(out_structure[-1], flat_out)


@keras.saving.register_keras_serializable(package="effgrad")
class Checkpoint(keras.layers.Wrapper):
    """A Keras layer that recomputes ``layer``'s activations in backprop.

    Outputs, gradients, random values and state updates equal those of
    ``layer`` itself; only the memory differs. Saves and loads with
    ``model.save("m.keras")`` / ``keras.models.load_model`` (import effgrad
    before loading).

    Example:
        >>> inputs = keras.Input((1024,))
        >>> h = effgrad.Checkpoint(keras.layers.Dense(1024, activation="relu"))(inputs)

    Args:
        layer: The layer (or model) to checkpoint.
        **kwargs: Keras layer arguments (``name``, ...).
    """

    def __init__(self, layer: keras.layers.Layer, **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"effgrad.Checkpoint wraps a keras.Layer or keras.Model, got {type(layer).__name__}; "
                "for a plain function use effgrad.checkpoint(fn)."
            )
        super().__init__(layer, **kwargs)

    def build(self, input_shape=None):
        if not self.layer.built:
            # A symbolic call builds sublayers too (layer.build() alone does
            # not for subclassed layers); variables must exist before the
            # first checkpointed call, or they would get no gradient.
            self.layer(keras.tree.map_shape_structure(lambda shape: keras.KerasTensor(shape), input_shape))
        self.built = True

    def _inner_kwargs(self, kwargs, training, mask):
        # `training` is resolved now, while Keras's call context is alive. The
        # recompute runs later, outside that context, so it is always passed
        # explicitly (Layer.__call__ takes it even when `call` does not, and
        # hands it to sublayers such as Dropout through a new context).
        if training is not None:
            kwargs["training"] = training
        if mask is not None and "mask" in inspect.signature(self.layer.call).parameters:
            kwargs["mask"] = mask
        return kwargs

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._inner_kwargs(kwargs, training, mask)
        n_variables = len(self.layer.variables)
        outputs = _call_with_recompute(self.layer, (inputs, *args), kwargs)
        if len(self.layer.variables) != n_variables:
            raise ValueError(
                f"{self.layer.name} created variables inside a checkpointed call, which would get no "
                "gradient. Give it a build() method that creates them, or call it once before wrapping."
            )
        return outputs

    def compute_output_shape(self, *args, **kwargs):
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._inner_kwargs(kwargs, training, mask)
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs, mask=None):
        return self.layer.compute_mask(inputs, mask)


def checkpoint(f: Callable) -> Callable:
    """Returns ``f`` with its activations recomputed during backprop.

    Args:
        f: A ``keras.Layer``/``keras.Model`` (returns an
            :class:`effgrad.Checkpoint` layer) or any function of tensors
            (nested inputs/outputs and keyword arguments allowed).

    Returns:
        A callable with ``f``'s signature and results.

    Example:
        >>> f = effgrad.checkpoint(lambda x, *, training: block(x, training=training))
        >>> with tf.GradientTape() as tape:
        ...     y = f(x, training=True)
    """
    if isinstance(f, keras.layers.Layer):
        return Checkpoint(f)
    if not callable(f):
        raise TypeError(f"effgrad.checkpoint needs a function, keras.Layer or keras.Model, got {type(f).__name__}.")

    def checkpointed(*args, **kwargs):
        return _call_with_recompute(f, args, kwargs)

    checkpointed.__name__ = f"checkpointed_{getattr(f, '__name__', 'fn')}"
    checkpointed.__doc__ = getattr(f, "__doc__", None)
    checkpointed.__wrapped__ = f
    return checkpointed


def _sequential_layers(layers_or_sequential):
    if isinstance(layers_or_sequential, keras.Sequential):
        return list(layers_or_sequential.layers), layers_or_sequential
    if isinstance(layers_or_sequential, (list, tuple)):
        layers = list(layers_or_sequential)
        bad = [type(layer).__name__ for layer in layers if not isinstance(layer, keras.layers.Layer)]
        if bad:
            raise TypeError(f"checkpoint_sequential needs keras layers, got {bad}.")
        return layers, None
    if isinstance(layers_or_sequential, keras.Model):
        raise ValueError(
            f"{type(layers_or_sequential).__name__} is not a linear stack of layers, so it cannot be split "
            "into segments. Wrap its blocks individually with effgrad.Checkpoint(block), or pass a "
            "keras.Sequential / list of layers."
        )
    raise TypeError(
        "checkpoint_sequential needs a keras.Sequential or a list of layers, "
        f"got {type(layers_or_sequential).__name__}."
    )


def checkpoint_sequential(layers_or_sequential, segments="sqrt") -> keras.Sequential:
    """Splits a stack of layers into segments and checkpoints each one.

    With ``n`` layers in ``s`` segments the backward pass keeps the ``s``
    segment inputs plus one segment's activations at a time: memory
    ``O(s + n/s)`` layers, smallest at ``s = sqrt(n)`` (``segments="sqrt"``,
    ``ceil(sqrt(n))`` segments), for one extra forward pass of compute.

    Example:
        >>> deep = keras.Sequential([keras.Input((1024,))] + [Dense(1024, "relu") for _ in range(64)])
        >>> light = effgrad.checkpoint_sequential(deep, segments="sqrt")  # 8 segments of 8 layers

    Args:
        layers_or_sequential: A ``keras.Sequential`` or a list of layers
            applied one after the other. The layers (and weights) are shared,
            not copied.
        segments: ``"sqrt"`` or an int in ``[1, number of layers]``.

    Returns:
        A ``keras.Sequential`` of :class:`effgrad.Checkpoint` segments.
    """
    layers, sequential = _sequential_layers(layers_or_sequential)
    n = len(layers)
    if n == 0:
        raise ValueError("checkpoint_sequential got no layers to checkpoint.")
    if segments == "sqrt":
        segments = math.ceil(math.sqrt(n))
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise ValueError(f'segments must be "sqrt" or an int, got {segments!r}.')
    if not 1 <= segments <= n:
        raise ValueError(f"segments must be between 1 and the number of layers ({n}), got {segments}.")
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    blocks = [
        Checkpoint(keras.Sequential(layers[start:stop], name=f"segment_{i}"), name=f"checkpoint_{i}")
        for i, (start, stop) in enumerate(zip(bounds, bounds[1:]))
    ]
    stack = []
    if sequential is not None and sequential.built and sequential.inputs:
        stack.append(keras.Input(batch_shape=sequential.inputs[0].shape, dtype=sequential.inputs[0].dtype))
    return keras.Sequential(stack + blocks, name=f"checkpointed_{sequential.name if sequential else 'stack'}")
