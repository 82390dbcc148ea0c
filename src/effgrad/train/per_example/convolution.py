"""Closed forms of convolutions: a Dense on the input patches, group by group.

A convolution's output at position ``p`` is ``patch_p(x) @ W`` where
``patch_p`` holds the ``K = prod(kernel_size)`` input pixels its window
sees (strides, dilation and padding decide which), so its per-example
kernel gradient is ``sum_p patch_p (x) g_p`` (:class:`forms.Outer` with
``T`` = output positions). With ``groups`` the channels split into groups
that never meet: group ``j``'s kernel slice sees only its input channels.
A depthwise convolution is the extreme case: one group per input channel,
``m = K`` window positions, ``n = depth_multiplier``.

Covered: ``Conv1D`` (causal too), ``Conv2D``, ``Conv3D`` (any strides,
dilation, padding, groups, data format), ``DepthwiseConv1D``/``2D``.
Not covered (they fall back): transposed and separable convolutions.

Trap: ``keras.ops.add`` on the TensorFlow backend adds a channels_first
bias ``(1, C, 1, ...)`` along the LAST axis when that axis also has ``C``
entries (Keras 3.15); which axis it took is asked of Keras itself
(:func:`_bias_axis`), so the bias gradient follows what the layer computed.
"""

from __future__ import annotations

import functools
import itertools
import math

import keras
import numpy as np
import tensorflow as tf

from effgrad import _compat
from effgrad.train.per_example.forms import Direct, Outer, View, by_rows
from effgrad.train.per_example.rules import NotApplicable, activate, bind, register

__all__: list[str] = []

ops = keras.ops


def patches(x, kernel_size, strides, dilation, padding: str) -> tf.Tensor:
    """``[B, P, K, C]``: for each of the ``P`` output positions, the ``K`` input pixels its window sees.

    ``x``: channels last, static spatial sizes. ``padding`` "same" pads as
    TensorFlow does (the extra pixel after).
    """
    spatial = list(x.shape[1:-1])
    if padding == "same":
        pads = []
        for i, (n, k, s, d) in enumerate(zip(spatial, kernel_size, strides, dilation)):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append([total // 2, total - total // 2])
            spatial[i] = n + total
        x = tf.pad(x, [[0, 0], *pads, [0, 0]])
    outs = [(n - (k - 1) * d - 1) // s + 1 for n, k, s, d in zip(spatial, kernel_size, strides, dilation)]
    windows = []
    for offsets in itertools.product(*[range(k) for k in kernel_size]):
        begin = [0, *(o * d for o, d in zip(offsets, dilation)), 0]
        end = [0, *(b + (o - 1) * s + 1 for b, o, s in zip(begin[1:], outs, strides)), 0]
        windows.append(
            tf.strided_slice(x, begin, end, [1, *strides, 1], begin_mask=1 | (1 << (len(spatial) + 1)),
                             end_mask=1 | (1 << (len(spatial) + 1)))
        )  # fmt: skip
    stacked = tf.stack(windows, axis=-2)  # [B, *outs, K, C]
    return tf.reshape(stacked, [tf.shape(x)[0], math.prod(outs), len(windows), x.shape[-1]])


def _channels_last(t, data_format: str) -> tf.Tensor:
    if data_format == "channels_first":
        return tf.transpose(t, [0, *range(2, len(t.shape)), 1])
    return t


@functools.lru_cache(maxsize=64)
def _bias_axis(shape: tuple, channels: int, data_format: str, dtype: str) -> int:
    """The axis of ``shape`` along which ``keras.ops.add`` adds this layer's bias (asked of Keras, eagerly)."""
    rank = len(shape) - 2
    declared = len(shape) - 1 if data_format == "channels_last" else 1
    if channels == 1:
        return declared
    bias_shape = [1] * len(shape)
    bias_shape[declared] = channels
    with tf.init_scope():
        probe = np.asarray(
            ops.add(tf.zeros((1, *shape[1:]), dtype), ops.reshape(tf.range(channels, dtype=dtype), bias_shape))
        )
    axes = [a for a in range(1, rank + 2) if probe.std(axis=a).max() > 0]
    if len(axes) != 1:
        raise NotApplicable("keras.ops.add spreads its bias over several axes")
    return axes[0]


def _bias(layer, z, channels: int):
    """``z + bias`` as the layer's call adds it, and the bias's part as a function of the output gradient."""
    rank = layer.rank
    bias_shape = (
        (1,) * (rank + 1) + (channels,) if layer.data_format == "channels_last" else (1, channels) + (1,) * rank
    )
    if None in z.shape[1:]:
        raise NotApplicable("its output has unknown sizes")
    axis = _bias_axis(tuple(z.shape), channels, layer.data_format, z.dtype.name)
    z = ops.add(z, ops.reshape(layer.bias, bias_shape))
    summed = [a for a in range(1, len(z.shape)) if a != axis]
    return z, lambda g: Direct(layer.bias, tf.reduce_sum(tf.cast(g, tf.float32), axis=summed))


def _window(layer, x, padded: bool):
    """``(x channels last, padding)`` as the patches of this layer's call see them."""
    if None in x.shape[1:]:
        raise NotApplicable("its input has unknown sizes")
    return _channels_last(x, layer.data_format), "valid" if padded else layer.padding


def _convolution(layer, call, args, kwargs, tap, *, causal_padding: bool):
    x = bind(call, args, kwargs)["inputs"]
    inputs = x
    if causal_padding and layer.padding == "causal":  # Conv1D.call: pad the past, then a valid convolution
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        time = 1 if layer.data_format == "channels_last" else 2
        inputs = ops.pad(x, [[left, 0] if axis == time else [0, 0] for axis in range(3)])
    source, padding = _window(layer, inputs, padded=inputs is not x)
    if causal_padding:
        z = ops.conv(inputs, layer.kernel, strides=list(layer.strides), padding=padding,
                     dilation_rate=layer.dilation_rate, data_format=layer.data_format)  # fmt: skip
    else:
        z = layer.convolution_op(inputs, layer.kernel)
    bias = None
    if layer.use_bias:
        z, bias = _bias(layer, z, layer.filters)
    kernel = layer.kernel
    *window, per_group, filters = kernel.shape
    groups = source.shape[-1] // per_group
    r = len(window)
    view = View(
        (groups, *window, per_group, filters // groups), (*range(1, r + 1), r + 1, 0, r + 2), tuple(kernel.shape)
    )

    def left():
        p = patches(source, layer.kernel_size, layer.strides, layer.dilation_rate, padding)  # [B, P, K, C]
        p = tf.reshape(p, [tf.shape(p)[0], p.shape[1], p.shape[2], groups, per_group])
        return by_rows(tf.transpose(p, [0, 1, 3, 2, 4]), p.shape[1], groups, -1)

    def parts(g):
        g_last = _channels_last(g, layer.data_format)
        right = by_rows(g_last, -1, groups, filters // groups)
        return [Outer(kernel, left, right, view)] + ([bias(g)] if bias is not None else [])

    z = tap(z, parts)
    return activate(layer.activation, z)


register(keras.layers.Conv1D)(functools.partial(_convolution, causal_padding=True))
register(_compat.BaseConv, methods=("call", "convolution_op"))(functools.partial(_convolution, causal_padding=False))


@register(_compat.BaseDepthwiseConv)
def _depthwise(layer, call, args, kwargs, tap):
    x = bind(call, args, kwargs)["inputs"]
    source, padding = _window(layer, x, padded=False)
    channels, multiplier = layer.kernel.shape[-2], layer.kernel.shape[-1]
    z = ops.depthwise_conv(x, layer.kernel, strides=layer.strides, padding=layer.padding,
                           dilation_rate=layer.dilation_rate, data_format=layer.data_format)  # fmt: skip
    bias = None
    if layer.use_bias:
        z, bias = _bias(layer, z, channels * multiplier)
    window = tuple(layer.kernel.shape[:-2])
    r = len(window)
    view = View((channels, *window, multiplier), (*range(1, r + 1), 0, r + 1), tuple(layer.kernel.shape))

    def left():  # [B, P, C, K]: channel c's window
        p = patches(source, layer.kernel_size, layer.strides, layer.dilation_rate, padding)
        return tf.transpose(p, [0, 1, 3, 2])

    def parts(g):
        right = by_rows(_channels_last(g, layer.data_format), -1, channels, multiplier)
        return [Outer(layer.kernel, left, right, view)] + ([bias(g)] if bias is not None else [])

    z = tap(z, parts)
    return activate(layer.activation, z)
