"""Reductions applied on the device, before maps cross to the host.

``None`` and ``"abs"`` keep the input's shape; the others reduce the last
(channel) axis, so an image map ``[H, W, C]`` becomes ``[H, W]`` and
``C`` times smaller to copy and store.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["REDUCTIONS", "reduce_map", "reduced_shape", "check"]

REDUCTIONS = {
    None: lambda m: m,
    "abs": tf.abs,
    "abs_max": lambda m: tf.reduce_max(tf.abs(m), axis=-1),
    "abs_sum": lambda m: tf.reduce_sum(tf.abs(m), axis=-1),
    "l2": lambda m: tf.sqrt(tf.reduce_sum(tf.square(m), axis=-1)),
    "sum": lambda m: tf.reduce_sum(m, axis=-1),
}


def check(reduce) -> None:
    if reduce not in REDUCTIONS:
        names = ", ".join(repr(k) for k in REDUCTIONS)
        raise ValueError(f"Unknown reduce {reduce!r}; choose one of {names}.")


def reduce_map(maps: tf.Tensor, reduce) -> tf.Tensor:
    return REDUCTIONS[reduce](maps)


def reduced_shape(example_shape: tuple, reduce) -> tuple:
    """Shape of one example's map."""
    if reduce in (None, "abs"):
        return tuple(example_shape)
    if len(example_shape) == 0:
        raise ValueError(f"reduce={reduce!r} reduces the last axis, but the inputs are scalars per example.")
    return tuple(example_shape[:-1])
