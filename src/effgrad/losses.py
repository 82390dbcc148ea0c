"""Unreduced losses and their global normalization, as Keras defines it.

The train step sums over micro-batches and replicas and divides ONCE, so a
loss is handled as two sums per micro-batch::

    weights    = sample_weight * keras_mask            (broadcast to the losses)
    total      = sum(weights * losses)
    normalizer = sum(weights)          for "mean_with_sample_weight"
               = valid loss elements   for "sum_over_batch_size" (mask sum, else their count)
               = 0 (unused)            for "sum"
    L = sum_i total_i / sum_i normalizer_i   (or sum_i total_i for "sum")

which is exactly Keras's ``Loss.__call__`` on the whole batch: its mask
rescaling ``total / valid`` for ``"sum_over_batch_size"`` divides by the valid
elements, and ``"mean_with_sample_weight"`` divides by the summed weights.

Trap:
    ``Loss.call`` alone never sees the Keras mask (``y_pred._keras_mask``,
    e.g. from ``Embedding(mask_zero=True)``): ``Loss.__call__`` reads it off
    ``y_pred``. Read it before casting ``y_pred``, which drops it.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from effgrad import _compat

__all__ = ["REDUCTIONS", "reduction_of", "unreduced", "weighted_terms", "normalize"]

REDUCTIONS = ("mean_with_sample_weight", "sum_over_batch_size", "sum")
_ALIASES = {"mean": "sum_over_batch_size"}


def check_reduction(reduction: str) -> str:
    """A Keras reduction name, standardized; ``ValueError`` for the others."""
    reduction = _ALIASES.get(reduction, reduction)
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {REDUCTIONS} (Keras's names, computed over the whole batch), "
            f"got {reduction!r}. 'none' cannot train: a step needs one scalar loss."
        )
    return reduction


def reduction_of(loss) -> str:
    """The reduction Keras's ``compile`` uses for ``loss`` (its default for names and functions)."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    return check_reduction(getattr(loss, "reduction", None) or "sum_over_batch_size")


def unreduced(loss) -> Callable:
    """``fn(y_true, y_pred) -> per-example/element losses`` for a Keras loss, name or callable."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss.call  # `__call__` would reduce
    if callable(loss):
        return loss
    raise TypeError(
        f"loss must be a keras.losses.Loss, a loss name or a callable(y_true, y_pred) "
        f"returning unreduced losses, got {type(loss).__name__}."
    )


def _broadcast(weights: tf.Tensor, losses: tf.Tensor, name: str) -> tf.Tensor:
    """``weights`` ``[m, ...]`` broadcast to ``losses``; missing trailing axes added on the right."""
    weights = tf.cast(weights, tf.float32)
    weights, _ = _compat.squeeze_or_expand_to_same_rank(weights, losses)  # Keras's own alignment
    if weights.shape.rank is not None and losses.shape.rank is not None:
        if weights.shape.rank > losses.shape.rank:
            raise ValueError(
                f"{name} of shape {weights.shape} has more axes than the unreduced loss "
                f"{losses.shape}; pass one weight per example ([batch]) or per loss element."
            )
        while weights.shape.rank < losses.shape.rank:
            weights = weights[..., tf.newaxis]
        for w_dim, l_dim in zip(weights.shape[1:], losses.shape[1:]):
            if w_dim is not None and l_dim is not None and w_dim not in (1, l_dim):
                raise ValueError(
                    f"{name} of shape {weights.shape} does not broadcast against the unreduced loss of "
                    f"shape {losses.shape}; give it shape [batch] or {[None] + losses.shape[1:].as_list()}."
                )
    return tf.broadcast_to(weights, tf.shape(losses))


def weighted_terms(losses, sample_weight, mask, reduction: str):
    """``(sum(w * l), normalizer)`` of one micro-batch (see the module docstring), float32."""
    losses = tf.cast(losses, tf.float32)
    weights = None
    if sample_weight is not None:
        weights = _broadcast(sample_weight, losses, "sample_weight")
    if mask is not None:
        mask = _broadcast(mask, losses, "the Keras mask of y_pred")
        weights = mask if weights is None else weights * mask
    total = tf.reduce_sum(losses if weights is None else weights * losses)
    if reduction == "sum":
        normalizer = tf.zeros([], tf.float32)
    elif reduction == "sum_over_batch_size" and mask is not None:
        normalizer = tf.reduce_sum(mask)
    elif reduction == "mean_with_sample_weight" and weights is not None:
        normalizer = tf.reduce_sum(weights)
    else:
        # A count from the shape, not sum(ones_like(losses)): under XLA a
        # dynamically sliced tensor can be padded to its bound, and ones_like
        # then counts the padding (measured: 4x too many at k=4).
        normalizer = tf.cast(tf.size(losses), tf.float32)
    return total, normalizer


def normalize(total, normalizer, reduction: str):
    """The loss ``L`` from the global sums (0 when every weight is 0)."""
    if reduction == "sum":
        return total
    return tf.math.divide_no_nan(total, normalizer)


def keras_mask(y_pred):
    """The Keras mask carried by ``y_pred`` (a single output), or None."""
    return _compat.get_keras_mask(y_pred)
