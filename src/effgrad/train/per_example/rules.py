"""Closed forms of per-example gradients: one small rule per layer type, in a registry keyed by class.

A rule runs one call of its layer as the layer's own ``call`` does, puts a
tap where the output gradient ``g`` is needed (before the activation), and
says how each weight's per-example gradient follows from ``g`` and the
tensors of the forward pass (:mod:`effgrad.train.per_example.forms`)::

    @register(keras.layers.Dense)
    def dense(layer, call, args, kwargs, tap):
        x = args[0]
        z = x @ kernel + bias
        z = tap(z, lambda g: [Outer(kernel, x, g, ...), Direct(bias, sum_t g)])
        return activation(z)

A rule stands in for the layer's code, so it applies only where it is that
code: its class, or a subclass that inherits every method the rule mirrors
(``methods``) unchanged. A subclass that overrides one is another layer:
:func:`find` says so and the caller falls back (per-example gradients of
that layer, exactly). ``config(layer)`` names a configuration the rule does
not mirror (LoRA, quantization) the same way; a rule may also raise
:class:`NotApplicable` while tracing (a shape it does not cover), before
it taps anything.

This module holds the dense, embedding and normalization rules;
:mod:`~effgrad.train.per_example.convolution` and
:mod:`~effgrad.train.per_example.recurrent` register theirs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import string
import sys
from collections.abc import Callable

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad._proof import stands_in_for
from effgrad.train.per_example.forms import Direct, Ids, Outer, View, by_rows

__all__ = ["Rule", "NotApplicable", "register", "find", "positions", "summed_positions", "bind", "activate"]

ops = keras.ops


class NotApplicable(Exception):
    """Raised by a rule, while tracing and before it taps anything: this call is not one it mirrors."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """``apply(layer, call, args, kwargs, tap) -> outputs``; ``call`` is the layer's own (bound) call."""

    cls: type
    apply: Callable
    methods: tuple[str, ...] = ("call",)
    config: Callable | None = None  # layer -> the reason this configuration is not mirrored, or None


_RULES: dict[type, Rule] = {}
_LAZY: list[tuple[str, str, Callable, tuple, Callable | None]] = []  # classes of packages imported later


def register(cls, methods: tuple[str, ...] = ("call",), config: Callable | None = None):
    """Decorator: ``apply`` is the closed form of ``cls`` (``methods``: what it mirrors)."""

    def add(apply):
        _RULES[cls] = Rule(cls, apply, methods, config)
        return apply

    return add


def register_later(module: str, name: str, methods=("call",), config=None):
    """Like :func:`register` for ``module.name``, registered once ``module`` is imported (keras_hub)."""

    def add(apply):
        _LAZY.append((module, name, apply, methods, config))
        return apply

    return add


def find(layer) -> tuple[Rule | None, str | None]:
    """``(rule, None)``, or ``(None, why no closed form applies to this layer)``."""
    for module, name, apply, methods, config in list(_LAZY):
        if module in sys.modules:
            cls = getattr(sys.modules[module], name, None)
            if cls is not None:
                _RULES[cls] = Rule(cls, apply, methods, config)
            _LAZY.remove((module, name, apply, methods, config))
    kind = type(layer)
    for cls in kind.__mro__:
        rule = _RULES.get(cls)
        if rule is None:
            continue
        reason = stands_in_for(layer, cls, rule.methods)
        if reason is None and rule.config is not None:
            reason = rule.config(layer)
        return (None, reason) if reason else (rule, None)
    return None, f"{kind.__name__} has no closed form"


# ------------------------------------------------------------------ helpers


def bind(call, args, kwargs) -> dict:
    """The arguments of one call by name, defaults filled in."""
    bound = inspect.signature(call).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def positions(t) -> tf.Tensor:
    """``t`` as ``[B, T, 1, width]``: every axis between the first and the last is a position."""
    return by_rows(t, -1, 1, t.shape[-1])


def summed_positions(g) -> tf.Tensor:
    """``[B, width]`` float32: ``g`` summed over its positions (a bias's per-example gradient)."""
    return tf.reduce_sum(by_rows(tf.cast(g, tf.float32), -1, g.shape[-1]), axis=1)


def activate(activation, z):
    """``activation(z)`` (None: ``z``), its derivative computed only once the upstream gradient exists.

    TensorFlow orders some derivatives after the upstream gradient by a control dependency alone
    (``Erf``'s, in exact GELU), which Grappler's dependency optimizer removes: the derivative then
    runs right after the forward pass and its tensors wait there through the whole backward pass
    (three activation-sized tensors per layer, held through backprop). Here the
    derivative is taken at ``z + 0 * g[0]``, a data dependency on the upstream gradient ``g`` that
    no optimizer removes (``0 * x`` is not folded for floats: x may be inf). Same values.
    """
    if activation is None:
        return z

    @_compat.custom_gradient
    def apply(z):
        def grad(g):
            anchor = tf.reshape(g, [-1])[:1] * 0
            with tf.GradientTape() as tape:
                at = z + tf.cast(anchor, z.dtype)
                tape.watch(at)
                y = activation(at)
            return tape.gradient(y, at, output_gradients=g)

        return activation(z), grad

    return apply(z)


def _adapters(layer) -> str | None:
    if getattr(layer, "lora_enabled", False):
        return "LoRA is enabled (its kernel is a sum of weights)"
    if getattr(layer, "quantization_mode", None):
        return f"it is quantized ({layer.quantization_mode})"
    return None


# ------------------------------------------------------------------ Dense, EinsumDense


@register(keras.layers.Dense, config=_adapters)
def _dense(layer, call, args, kwargs, tap):
    x = bind(call, args, kwargs)["inputs"]
    z = ops.matmul(x, layer.kernel)
    if layer.bias is not None:
        z = ops.add(z, layer.bias)

    def parts(g):
        out = [Outer(layer.kernel, positions(x), positions(g), View(tuple(layer.kernel.shape)))]
        return out + ([Direct(layer.bias, summed_positions(g))] if layer.bias is not None else [])

    z = tap(z, parts)
    return activate(layer.activation, z)


def _letters(equation: str, input_rank: int) -> tuple[str, str, str]:
    """``(input, kernel, output)`` letters of an EinsumDense equation, ``...`` spelled out."""
    left, output = equation.replace(" ", "").split("->")
    inputs, kernel = left.split(",")
    if "..." in inputs:
        spare = [c for c in string.ascii_letters if c not in equation]
        dots = "".join(spare[: input_rank - len(inputs.replace("...", ""))])
        inputs, output = inputs.replace("...", dots), output.replace("...", dots)
    return inputs, kernel, output


@register(keras.layers.EinsumDense, config=_adapters)
def _einsum_dense(layer, call, args, kwargs, tap):
    x = bind(call, args, kwargs)["inputs"]
    inputs, kernel, output = _letters(layer.equation, len(x.shape))
    batch = inputs[0]
    contracted = [c for c in kernel if c in inputs and c not in output]
    free = [c for c in inputs[1:] if c in output and c not in kernel]
    produced = [c for c in kernel if c in output and c not in inputs]
    plain = (  # a Dense on reshaped axes: x [B, free, contracted] @ W [contracted, produced]
        batch not in kernel
        and sorted(inputs) == sorted([batch, *free, *contracted])
        and sorted(output) == sorted([batch, *free, *produced])
        and sorted(kernel) == sorted([*contracted, *produced])
    )
    z = ops.einsum(layer.equation, x, layer.kernel)
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    shape = tuple(layer.kernel.shape)

    def bias_part(g):
        axes = [i for i, c in enumerate(output) if i > 0 and c not in layer.bias_axes]
        summed = tf.reduce_sum(tf.cast(g, tf.float32), axis=axes, keepdims=True)
        return Direct(layer.bias, tf.reshape(summed, [tf.shape(g)[0], *layer.bias.shape]))

    def parts(g):
        if plain:
            size = {c: shape[kernel.index(c)] for c in kernel}
            width_in, width_out = math.prod(size[c] for c in contracted), math.prod(size[c] for c in produced)
            left = tf.einsum(f"{inputs}->{batch}{''.join(free + contracted)}", x)
            right = tf.einsum(f"{output}->{batch}{''.join(free + produced)}", g)
            order = contracted + produced
            view = View(tuple(size[c] for c in order), tuple(order.index(c) for c in kernel))
            out = [Outer(layer.kernel, by_rows(left, -1, 1, width_in), by_rows(right, -1, 1, width_out), view)]
        else:  # the per-example einsum itself
            per_example = tf.einsum(
                f"{inputs},{output}->{batch}{kernel}", tf.cast(x, tf.float32), tf.cast(g, tf.float32)
            )
            out = [Direct(layer.kernel, per_example)]
        return out + ([bias_part(g)] if layer.bias is not None else [])

    z = tap(z, parts)
    return activate(layer.activation, z)


# ------------------------------------------------------------------ embeddings


def _ids(ids) -> tf.Tensor:
    ids = ids if ids.dtype in (tf.int32, tf.int64) else tf.cast(ids, tf.int32)  # as Embedding.call casts
    return by_rows(ids, -1)


def _lookup(layer, call, args, kwargs, tap, ids):
    z = call(*args, **kwargs)  # the gather itself: its output gradient is the rows' gradient
    table = layer.embeddings
    view = View(tuple(table.shape))
    return tap(z, lambda g: [Outer(table, Ids(_ids(ids), table.shape[0]), positions(g), view)])


@register(keras.layers.Embedding, config=_adapters)
def _embedding(layer, call, args, kwargs, tap):
    return _lookup(layer, call, args, kwargs, tap, bind(call, args, kwargs)["inputs"])


@register(keras.layers.ReversibleEmbedding, config=_adapters)
def _reversible_embedding(layer, call, args, kwargs, tap):
    arguments = bind(call, args, kwargs)
    inputs, reverse = arguments["inputs"], arguments["reverse"]
    if not isinstance(reverse, bool):
        raise NotApplicable("its reverse argument is not a Python bool")
    if not reverse:
        return _lookup(layer, call, args, kwargs, tap, inputs)
    # ReversibleEmbedding.call, reverse=True: logits = h @ E^T (tied) or h @ R (untied)
    kernel = ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
    if layer.reverse_dtype is not None:
        inputs, kernel = ops.cast(inputs, layer.reverse_dtype), ops.cast(kernel, layer.reverse_dtype)
    logits = ops.matmul(inputs, kernel)

    def parts(g):
        h, g = positions(inputs), positions(g)
        if layer.tie_weights:  # E [V, d]: sum_t g_t (x) h_t
            return [Outer(layer.embeddings, g, h, View(tuple(layer.embeddings.shape)))]
        return [Outer(layer.reverse_embeddings, h, g, View(tuple(layer.reverse_embeddings.shape)))]

    logits = tap(logits, parts)
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    return logits


@register_later("keras_hub.layers", "PositionEmbedding")
def _position_embedding(layer, call, args, kwargs, tap):
    arguments = bind(call, args, kwargs)
    inputs, start, given = arguments["inputs"], arguments["start_index"], arguments["positions"]
    if len(inputs.shape) != 3:
        raise NotApplicable(f"its input has rank {len(inputs.shape)}, not 3")
    z = call(*args, **kwargs)  # rows start..start+T of the table (or `positions`), broadcast over the batch
    table = layer.position_embeddings

    def parts(g):
        rows, length = tf.shape(g)[0], g.shape[1] or tf.shape(g)[1]
        if given is None:
            ids = tf.cast(start, tf.int32) + tf.range(length)
        else:
            ids = tf.cast(given, tf.int32)
        ids = tf.broadcast_to(tf.reshape(ids, [-1, length]), [rows, length])
        return [Outer(table, Ids(ids, table.shape[0]), positions(g), View(tuple(table.shape)))]

    return tap(z, parts)


# ------------------------------------------------------------------ normalization


def _affine(scale: str, shift: str | None, axes: Callable):
    """``y = xhat * scale + shift`` per feature: ``xhat`` is the layer's own output at scale 1, shift 0."""

    def apply(layer, call, args, kwargs, tap):
        z = call(*args, **kwargs)
        weights = [getattr(layer, scale, None), getattr(layer, shift, None) if shift else None]

        def parts(g):
            rank = len(g.shape)
            kept = {a % rank for a in axes(layer)}
            summed = [a for a in range(1, rank) if a not in kept]
            g32, rows, out = tf.cast(g, tf.float32), tf.shape(g)[0], []
            gamma, beta = weights
            if gamma is not None:
                neutral = [(gamma, tf.ones(gamma.shape, gamma.dtype))]
                neutral += [(beta, tf.zeros(beta.shape, beta.dtype))] if beta is not None else []
                with keras.StatelessScope(state_mapping=neutral):
                    xhat = call(*args, **kwargs)  # recomputed in backprop: not kept through it
                product = tf.reduce_sum(g32 * tf.cast(xhat, tf.float32), axis=summed)
                out.append(Direct(gamma, tf.reshape(product, [rows, *gamma.shape])))
            if beta is not None:
                out.append(Direct(beta, tf.reshape(tf.reduce_sum(g32, axis=summed), [rows, *beta.shape])))
            return out

        return tap(z, parts)

    return apply


def _listed(axis) -> list:
    return list(axis) if isinstance(axis, (list, tuple)) else [axis]


register(keras.layers.LayerNormalization)(_affine("gamma", "beta", lambda layer: _listed(layer.axis)))
register(keras.layers.RMSNormalization)(_affine("scale", None, lambda layer: _listed(layer.axis)))
register(keras.layers.GroupNormalization, methods=("call", "_apply_normalization", "_reshape_into_groups"))(
    _affine("gamma", "beta", lambda layer: [layer.axis])
)
