"""The fused loss's kernel gradient, made after the rest of backprop: ``kernel_gradients_later``."""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

__all__ = ["kernel_gradients_later", "pending"]

_deferred = threading.local()


def pending() -> list | None:
    """The gradients left for later inside :func:`kernel_gradients_later` on this thread (None outside)."""
    return getattr(_deferred, "pending", None)


@contextlib.contextmanager
def kernel_gradients_later(variables):
    """Inside, the fused loss's backprop leaves the projection's weight gradients for afterwards.

    Yields ``finish(grads) -> grads``: call it with ``tape.gradient(target,
    variables)`` (made inside the block); it makes the kernel's and the bias's
    gradients once every other gradient exists and adds them in.

    Why: backprop meets the loss first, so the kernel's gradient (``d x V``,
    a ``[d, V]`` buffer) would otherwise be alive through the whole
    backward pass of the model under it, where the peak is. Made last, from
    the rows' ``logsumexp`` and upstream gradients (a few numbers per row), it
    costs the same matmuls: the forward pass already made the hidden states'
    gradient. An embedding tied to the kernel gets its lookup gradient
    (IndexedSlices, or dense from a checkpointed segment) added into that
    buffer chunk by chunk.
    """
    waiting: list = []
    outer, _deferred.pending = pending(), waiting  # per thread: MirroredStrategy traces replicas in threads
    variables = list(variables)

    def finish(grads):
        grads = list(grads)
        made = [t for g in grads if g is not None for t in ((g.values,) if isinstance(g, tf.IndexedSlices) else (g,))]
        for owners, weights in waiting:
            where = [next((i for i, v in enumerate(variables) if v is o), None) for o in owners]
            if all(i is None for i in where):  # a frozen projection: no gradient wanted
                continue
            with tf.control_dependencies(made):  # after the rest of backprop: not alive through it
                made_here = weights([None if i is None else grads[i] for i in where])
            for i, owner, gradient in zip(where, owners, made_here):
                if i is not None:
                    grads[i] = tf.cast(gradient, owner.dtype)
        waiting.clear()
        return grads

    try:
        yield finish
    finally:
        _deferred.pending = outer
