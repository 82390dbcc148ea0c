"""One micro-batch: its forward pass (state writes held back) and how its gradients are made.

The step threads a :class:`Sums` carry through its micro-batches::

    for each micro-batch:
        y_pred, state = model(x_i)               # writes recorded, not applied (StateScope)
        total_i, normalizer_i = loss sums          # normalized once, over the whole batch
        grads_i = differentiate(S * total_i / divisor)   # a tape; DP: per-example clipped, one pass
        -> added into the accumulators as they arrive (effgrad.train.accumulate)

Two ways to differentiate a micro-batch:

* :func:`tape_gradients`: one tape, the plain gradient.
* :func:`clipped_gradients` (DP-SGD): one backward pass to taps on every
  layer call with weights gives every example's gradient norm and keeps
  what the clipped sum ``sum_i min(1, C / norm_i) grad l_i`` is then
  formed from (:mod:`effgrad.train.per_example`; Bu et al.'s book-keeping).

Backprop through a while loop (a recurrent layer) runs one iteration at a
time. With Keras's ``parallel_iterations=32`` the gradient loop runs ahead up
to 32 iterations, each holding its own weight-gradient temporaries, while the
step waits to see every gradient finite before applying any: about twice
Keras's own step on a stacked LSTM, against less than it one at a time
(tests/test_step_memory.py).

What a trace learns about the model (which state variables the forward pass
writes, state outside the model's variables) is recorded in a :class:`Facts`
object that belongs to that one trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from effgrad import _compat, state
from effgrad.train import fused_loss
from effgrad.train.accumulate import dense

__all__ = ["Facts", "Sums", "Forward", "tape_gradients", "clipped_gradients"]


@dataclasses.dataclass
class Facts:
    """What one trace of the step learned while it ran the model's Python code."""

    written: set = dataclasses.field(default_factory=set)  # indices of state variables written
    stray: list = dataclasses.field(default_factory=list)  # (variable, value): state outside the model's variables


class Sums(NamedTuple):
    """The carry of the micro-batch loop (tensors only)."""

    total: tf.Tensor  # sum(w * l)
    normalizer: tf.Tensor  # what L divides total by (summed the same way)
    pending: list  # every state variable's value after the forward passes so far
    noise: dict  # sums of the gradient noise scale ({} when off)

    @classmethod
    def start(cls, state_variables, noise_scale: bool) -> Sums:
        zero = tf.zeros([], tf.float32)
        noise = {"size": zero, "small_sq": zero, "inverse_size": zero, "count": zero} if noise_scale else {}
        return cls(zero, zero, [tf.convert_to_tensor(v) for v in state_variables], noise)


class Forward:
    """Runs the model on one micro-batch with its state writes held back, and sums its loss.

    Args:
        model: What computes the predictions (the model, its checkpointed
            copy, or its trunk when the loss is fused with its last layer).
        objective: The :class:`effgrad.train.objective.Objective`.
        state_variables: The model's non-trainable variables, in a fixed order.
        split: Whether the batch is split into micro-batches: state outside
            the model's variables (row i continues row i of the last batch)
            cannot be split with it.
        on_micro_batch: ``fn(x, y, y_pred, sample_weight)`` per micro-batch (metrics).
    """

    def __init__(self, model, objective, state_variables, *, split: bool, on_micro_batch=None):
        self.model, self.objective, self.state_variables = model, objective, list(state_variables)
        self.split, self.on_micro_batch = split, on_micro_batch

    def __call__(self, batch, pending, facts: Facts, hook: Callable | None = None):
        """``(y_pred, pending)``: the predictions and every state variable's value after this pass.

        ``hook`` wraps the model call (per-example norm taps).
        """
        x, y, sample_weight = batch
        with state.StateScope(zip(self.state_variables, pending), collect_losses=True) as scope:
            y_pred = self.model(x, training=True) if hook is None else hook(lambda: self.model(x, training=True))
        indices, others = state.written_in(scope, self.state_variables)
        facts.written.update(indices)
        if others and self.split:
            raise ValueError(
                f"The forward pass writes state outside the model's weights: {[v.path for v in others]} "
                "(a stateful RNN's rnn_state: row i of a batch continues row i of the previous batch). "
                "Micro-batches would split those rows; use micro_batches=1 for such a model."
            )
        facts.stray.extend((v, scope.get_current_value(v)) for v in others)  # one micro-batch: committed as usual
        if scope.losses:
            raise NotImplementedError(
                "The model adds losses in its forward pass (add_loss / activity_regularizer). They are "
                "batch statistics that effgrad cannot renormalize over the whole batch; move the term "
                "into the loss function or use a kernel regularizer instead."
            )
        if self.on_micro_batch is not None:
            self.on_micro_batch(x, y, y_pred, sample_weight)
        return y_pred, [scope.get_current_value(v) for v in self.state_variables]


def tape_gradients(forward: Forward, multiplier: Callable, variables, facts: Facts, *, exact: bool, on_gradients=None):
    """``differentiate(batch_i, sums) -> (grads, sums)``: one tape per micro-batch.

    The micro-batch's loss sum is differentiated times ``multiplier(normalizer_i)`` (the loss scale
    over the divisor); ``exact``: this micro-batch is the whole batch, so several loss terms are
    normalized as they stand; ``on_gradients(grads, sums) -> sums`` sees each micro-batch's gradients.
    """

    def differentiate(batch, sums: Sums):
        x, y, sample_weight = batch
        # A fused loss's kernel gradient is made after the rest of backprop (not alive through it).
        with fused_loss.kernel_gradients_later(variables) as finish:
            with tf.GradientTape() as tape:
                y_pred, pending = forward(batch, sums.pending, facts)
                total, normalizer = forward.objective.sums(y, y_pred, sample_weight, exact=exact)
                target = total * multiplier(normalizer)
            with _compat.loops_one_iteration_at_a_time():  # see the module docstring
                grads = finish(tape.gradient(target, variables))
        if not exact:  # summed into dense accumulators, or across replicas
            grads = dense(grads)
        sums = Sums(sums.total + total, sums.normalizer + normalizer, pending, _sized(sums.noise, normalizer))
        if on_gradients is not None:
            sums = on_gradients(grads, sums)
        return grads, sums

    return differentiate


def clipped_gradients(
    forward: Forward, multiplier: Callable, scale, clip_norm: float, variables, facts, taps, on_gradients=None
):
    """``differentiate(batch_i, sums) -> (grads, sums)``: the sum of per-example gradients, each clipped.

    Algorithm (DP-SGD's clipping in one backward pass: book-keeping, Bu et al. 2023)::

        l_i = sum over example i's loss elements of w * l     (per-token losses summed)
        forward once; every layer call with weights is tapped (effgrad.train.per_example)
        backprop S / B * sum_i l_i to the taps only: each layer turns its input and output
            gradient into its share of |grad l_i|^2 and keeps what its clipped sum needs
            (the per-example gradient, or its two factors, whichever is smaller)
        c_i = min(1, C / |grad l_i|)
        grads = sum_i c_i grad l_i * multiplier, per weight, from what was kept: a^T (c * g)

    No weight gradient exists before ``c``, and there is no second backward pass.
    ``sums.total`` is ``sum_i l_i`` and ``sums.normalizer`` the number of
    examples: DP-SGD divides the noisy sum by the batch size. ``scale`` is
    the loss scale ``S`` (backprop runs in the model's dtype, scaled).
    """
    bound = tf.constant(clip_norm, tf.float32)

    def differentiate(batch, sums: Sums):
        x, y, sample_weight = batch
        with tf.GradientTape(watch_accessed_variables=False) as tape:  # only the taps are differentiated to
            with taps.recording(tape) as recorder:
                y_pred, pending = forward(batch, sums.pending, facts, hook=recorder.hook)
            per_example = forward.objective.per_example(y, y_pred, sample_weight)
        rows = tf.cast(tf.shape(per_example)[0], tf.float32)
        # Backprop from S / rows per example: the magnitudes of a mean loss scaled by S, as the plain step
        # has them (from S, a float16 backward would overflow where the plain step's does not).
        seed = tf.cast(scale, tf.float32) / rows
        backward = recorder.backward(per_example, seed)
        norms = backward.norms
        factors = tf.where(norms > bound, bound / norms, tf.ones_like(norms))
        # A non-finite norm (float16 overflow) stays non-finite in the gradient: the step is skipped.
        factors = tf.where(tf.math.is_finite(norms), factors, norms)
        # What the backward pass kept is scaled by the seed; multiplier(rows) carries S: divide it once.
        weights = factors * tf.cast(multiplier(rows), tf.float32) / seed
        grads = backward.gradients(variables, weights)
        sums = Sums(sums.total + tf.reduce_sum(per_example), sums.normalizer + rows, pending, _sized(sums.noise, rows))
        if on_gradients is not None:
            sums = on_gradients(grads, sums)
        return grads, sums

    return differentiate


def _sized(noise: dict, size) -> dict:
    """The noise-scale sums with this micro-batch's size, for the gradient-norm hook that follows."""
    return {**noise, "size": size} if noise else noise
