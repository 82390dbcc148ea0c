"""Pure gradient accumulation over micro-batches inside one compiled step.

Algorithm (``k`` = ``micro_batches``, ``B`` = rows of this batch)::

    m = max(ceil(B / k), 1)          # rows per micro-batch
    n = ceil(B / m)                  # micro-batches that hold real rows (<= k)
    for i in range(n):               # a tf.while_loop, one iteration at a time
        rows  = i*m + [0, ..., m-1]
        valid = rows < B             # the last micro-batch may be short:
        take  = min(rows, B - 1)     # ... pad it by repeating the last row
        objective, aux = micro_step(batch[take], valid)
        grads += d objective / d variables   (float32)
        sums  += aux

Every micro-batch has the same static shape ``[m, ...]``, so the loop body
traces once and also compiles under XLA. Padded rows are real data (a repeat
of the last row, so no NaN from made-up zeros) and ``micro_step`` gives them
zero weight through ``valid``. Only one micro-batch's activations are alive at
a time (``parallel_iterations=1``); the batch itself is never copied whole.

Trap: normalizing inside ``micro_step`` by the micro-batch's own weight (a
mean of micro-batch means) is wrong whenever micro-batches carry different
total weight; return the unnormalized sums and divide once by the global
total, as ``effgrad.build_train_step`` does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

__all__ = ["batch_size", "accumulate_gradients", "broadcast_weights"]


def batch_size(batch) -> tf.Tensor:
    """The leading dimension of the first tensor in ``batch`` (an int32 scalar)."""
    leaves = [t for t in tf.nest.flatten(batch) if t is not None]
    return tf.shape(leaves[0])[0]


def _take(batch, indices):
    return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, indices), batch)


def broadcast_weights(weights: tf.Tensor, losses: tf.Tensor) -> tf.Tensor:
    """Broadcasts per-row ``weights`` ``[m, ...]`` to ``losses`` ``[m, ...]``.

    Missing trailing axes are added on the right (Keras's convention: a
    ``[B]`` sample weight weights every token of a ``[B, T]`` loss).

    Raises:
        ValueError: if the trailing shapes cannot broadcast.
    """
    weights = tf.cast(weights, tf.float32)
    if weights.shape.rank is not None and losses.shape.rank is not None:
        if weights.shape.rank > losses.shape.rank:
            raise ValueError(
                f"sample_weight of shape {weights.shape} has more axes than the unreduced loss "
                f"{losses.shape}; pass one weight per example ([batch]) or per loss element."
            )
        while weights.shape.rank < losses.shape.rank:
            weights = weights[..., tf.newaxis]
        for w_dim, l_dim in zip(weights.shape[1:], losses.shape[1:]):
            if w_dim is not None and l_dim is not None and w_dim not in (1, l_dim):
                raise ValueError(
                    f"sample_weight of shape {weights.shape} does not broadcast against the "
                    f"unreduced loss of shape {losses.shape}; give it shape [batch] or "
                    f"{[None] + losses.shape[1:].as_list()}."
                )
    return tf.broadcast_to(weights, tf.shape(losses))


def accumulate_gradients(
    micro_step: Callable,
    variables: Sequence[tf.Variable],
    batch,
    micro_batches: int,
    num_aux: int,
):
    """Sums ``micro_step``'s gradients and auxiliary values over micro-batches.

    Args:
        micro_step: ``(batch_i, valid_i) -> (objective, aux)``; ``objective``
            is differentiated, ``aux`` is a tuple of float32 scalars to sum.
            ``valid_i`` is a ``[m]`` bool mask of the real rows.
        variables: What to differentiate with respect to.
        batch: A nest of tensors sharing the leading (batch) dimension.
        micro_batches: ``k >= 1``.
        num_aux: The length of ``aux`` (the loop carries one sum for each).

    Returns:
        ``(grads, aux)``: float32 gradient sums (zeros where unconnected) and
        the summed ``aux``. With no rows at all both are zeros.
    """
    variables = list(variables)

    def differentiate(batch_i, valid):
        with tf.GradientTape() as tape:
            objective, aux = micro_step(batch_i, valid)
        grads = tape.gradient(objective, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads], tuple(aux)

    rows = batch_size(batch)
    if micro_batches == 1:  # no loop, no gather: exactly the plain step
        return differentiate(batch, tf.ones([rows], tf.bool))

    per_micro = tf.maximum((rows + micro_batches - 1) // micro_batches, 1)
    num_micro = (rows + per_micro - 1) // per_micro

    def body(i, grads, aux):
        row_ids = i * per_micro + tf.range(per_micro)
        batch_i = _take(batch, tf.minimum(row_ids, rows - 1))
        grads_i, aux_i = differentiate(batch_i, row_ids < rows)
        return (
            i + 1,
            [g + gi for g, gi in zip(grads, grads_i)],
            tuple(a + ai for a, ai in zip(aux, aux_i)),
        )

    zeros = [tf.zeros(v.shape, tf.float32) for v in variables]
    aux0 = tuple(tf.zeros([], tf.float32) for _ in range(num_aux))
    _, grads, aux = tf.while_loop(
        lambda i, *_: i < num_micro,
        body,
        (tf.constant(0), zeros, aux0),
        parallel_iterations=1,  # one micro-batch's activations alive at a time
    )
    return grads, aux
