"""Pure gradient accumulation over micro-batches inside one compiled step.

Algorithm (``k`` = ``micro_batches``, ``B`` = rows of this batch)::

    m = max(ceil(B / k), 1)           # rows per micro-batch
    n = ceil(B / m)                   # micro-batches (<= k), the last may be short
    for i in range(n - 1):            # a tf.while_loop, one iteration at a time
        objective, aux = micro_step(batch[i*m : i*m + m])
        grads += d objective / d variables   (float32)
        sums  += aux
    objective, aux = micro_step(batch[(n-1)*m : B])   # the last, B - (n-1)*m rows
    grads += ...; sums += aux

Every loop iteration has the same static shape ``[m, ...]``; the last
micro-batch is peeled off after the loop, so its (possibly smaller) size is
static too once the batch shape is known. That is what lets XLA compile the
step, and it means no padding rows: metrics and BatchNorm only ever see real
examples. Only one micro-batch's activations are alive at a time: the next
iteration's slice depends on the current iteration's gradients.

Trap: normalizing inside ``micro_step`` by the micro-batch's own weight (a
mean of micro-batch means) is wrong whenever micro-batches carry different
total weight; return the unnormalized sums and divide once by the global
total, as ``effgrad.build_train_step`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = ["batch_size", "accumulate_gradients", "broadcast_weights"]


def batch_size(batch) -> tf.Tensor:
    """The leading dimension of the first tensor in ``batch`` (an int32 scalar)."""
    leaves = [t for t in tf.nest.flatten(batch) if t is not None]
    return tf.shape(leaves[0])[0]


def _rows(batch, start, size=None):
    """``batch[start:start+size]`` (or ``batch[start:]``) for every tensor."""
    stop = None if size is None else start + size
    return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], batch)


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
        micro_step: ``batch_i -> (objective, aux)``; ``objective`` is
            differentiated, ``aux`` is a tuple of float32 scalars to sum.
        variables: What to differentiate with respect to.
        batch: A nest of tensors sharing the leading (batch) dimension.
        micro_batches: ``k >= 1``.
        num_aux: The length of ``aux`` (the loop carries one sum for each).

    Returns:
        ``(grads, aux)``: float32 gradient sums (zeros where unconnected) and
        the summed ``aux``.
    """
    variables = list(variables)

    def differentiate(batch_i):
        with tf.GradientTape() as tape:
            objective, aux = micro_step(batch_i)
        grads = tape.gradient(objective, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads], tuple(aux)

    if micro_batches == 1:  # no loop, no slicing: exactly the plain step
        return differentiate(batch)

    rows = batch_size(batch)
    per_micro = tf.maximum((rows + micro_batches - 1) // micro_batches, 1)
    num_micro = (rows + per_micro - 1) // per_micro

    def body(i, grads, aux):
        grads_i, aux_i = differentiate(_rows(batch, i * per_micro, per_micro))
        # The next micro-batch's slice waits for this one's gradients, so at
        # most one micro-batch's activations are alive. (parallel_iterations=1
        # would also do that, but it throttles TF's op parallelism: 1.8x slower.)
        with tf.control_dependencies(grads_i):
            next_i = i + 1
        return (
            next_i,
            [g + gi for g, gi in zip(grads, grads_i)],
            tuple(a + ai for a, ai in zip(aux, aux_i)),
        )

    zeros = [tf.zeros(v.shape, tf.float32) for v in variables]
    aux0 = tuple(tf.zeros([], tf.float32) for _ in range(num_aux))
    _, grads, aux = tf.while_loop(
        lambda i, *_: i < num_micro - 1,
        body,
        (tf.constant(0), zeros, aux0),
    )
    _, grads, aux = body(tf.maximum(num_micro - 1, 0), grads, aux)  # the last, maybe short
    return grads, aux
