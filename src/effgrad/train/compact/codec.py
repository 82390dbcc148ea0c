"""The int8 codec of compact optimizer state: block-wise, companded (fourth-root) codes.

Each block of ``block_size`` numbers keeps its float32 scale (the block's largest magnitude), and
each number ``x`` one byte ``q``::

    u = |x| / scale                       in [0, 1]
    q = round(L * u ** (1/4))             L = 255 if the block has no negative number, else 127 (and a sign)
    x ~ sign * (q / L) ** 4 * scale       the scale's sign records which of the two L was used

Example:
    >>> codes, scales = quantize(tf.constant([0.5, -1.0, 2.0, 0.0]), block_size=2)
    >>> codes.dtype.name, [round(float(v), 2) for v in dequantize(codes, scales, (4,))]  # within the rounding
    ('int8', [0.5, -1.0, 2.0, 0.0])
"""

from __future__ import annotations

import math

import tensorflow as tf

__all__ = ["quantize", "dequantize"]


@tf.function(jit_compile=True, autograph=False)
def quantize(x: tf.Tensor, block_size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(codes int8 [blocks, block_size], scales float32 [blocks])`` of ``x``.

    Blocks with no negative number use all 256 codes for magnitudes (their
    scale is stored negated to say so); other blocks use a sign and 127.
    """
    flat = tf.reshape(tf.cast(x, tf.float32), [-1])
    flat = tf.pad(flat, [[0, -tf.size(flat) % block_size]])
    blocks = tf.reshape(flat, [-1, block_size])
    absmax = tf.reduce_max(tf.abs(blocks), axis=1)
    unsigned = tf.reduce_min(blocks, axis=1) >= 0.0
    # Per block, not per number: one division per block (a multiply per number).
    per_block = tf.where(unsigned, 255.0, 127.0) * tf.math.divide_no_nan(1.0, tf.sqrt(tf.sqrt(absmax)))
    q = tf.round(tf.sqrt(tf.sqrt(tf.abs(blocks))) * per_block[:, None])  # L * (|x| / scale) ** (1/4)
    codes = tf.where(unsigned[:, None], q - 128.0, tf.sign(blocks) * q)
    return tf.cast(codes, tf.int8), tf.where(unsigned, -absmax, absmax)


@tf.function(jit_compile=True, autograph=False)
def dequantize(codes: tf.Tensor, scales: tf.Tensor, shape) -> tf.Tensor:
    """The float32 tensor of ``shape`` that :func:`quantize` encoded (up to its rounding)."""
    codes = tf.cast(codes, tf.float32)
    unsigned = scales < 0.0
    offset = tf.where(unsigned, 128.0, 0.0)[:, None]
    step = tf.where(unsigned, 1.0 / 255.0, 1.0 / 127.0)[:, None]
    q = (codes + offset) * step
    blocks = q * tf.abs(q) * tf.square(q) * tf.abs(scales)[:, None]  # sign * |q| ** 4 * scale
    size = math.prod(shape)
    return tf.reshape(tf.reshape(blocks, [-1])[:size], shape)
