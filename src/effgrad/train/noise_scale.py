"""The gradient noise scale ``B_simple`` (McCandlish et al. 2018) from the micro-batch gradients a step makes anyway.

``build_train_step(..., micro_batches=k, noise_scale=True)`` adds each
micro-batch's squared gradient norm as backprop makes it (a scalar per
micro-batch, no extra buffer) and compares it with the whole batch's:
:func:`terms` turns the two into unbiased ``|G|^2`` and ``tr(Sigma)``, and
:class:`GradientNoiseScale` keeps their moving averages, whose ratio is
``logs["noise_scale"]``. See ``docs/diagnostics.md``.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["GradientNoiseScale", "add_micro_batch", "terms"]


def add_micro_batch(sums: dict, squared_norm, local_rows, loss_scale) -> dict:
    """``sums`` with one micro-batch's ``|g_i|^2`` added: ``squared_norm`` is its gradient's, made of a
    scaled (``loss_scale``) sum over ``local_rows``; ``g_i`` is its MEAN-loss gradient (``sums["size"]`` rows)."""
    size = sums["size"]
    factor = tf.math.divide_no_nan(local_rows, loss_scale * size)
    return {
        "size": size,
        "small_sq": sums["small_sq"] + squared_norm * factor**2,
        "inverse_size": sums["inverse_size"] + tf.math.divide_no_nan(1.0, size),
        "count": sums["count"] + tf.cast(size > 0, tf.float32),
    }


def terms(small_sq_sum, inverse_size_sum, count, big_sq, big_size):
    """Unbiased ``(|G|^2, tr(Sigma))`` from small- and big-batch gradient norms (McCandlish et al. 2018, A.1).

    For a gradient ``g_b`` of a mean loss over ``b`` i.i.d. examples,
    ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``. Given ``count`` small-batch
    gradients (sizes ``b_i``, ``small_sq_sum = sum |g_i|^2``,
    ``inverse_size_sum = sum 1/b_i``) and the big-batch gradient over all of
    them (``big_sq = |g_B|^2``, ``big_size = B``)::

        mean_small = small_sq_sum / count          # E = |G|^2 + tr(Sigma) * mean(1/b_i)
        tr(Sigma)  = (mean_small - big_sq) / (mean(1/b_i) - 1/B)
        |G|^2      = big_sq - tr(Sigma) / B

    With equal sizes ``b = B/k`` this is the paper's pair of estimators.
    Returns ``(grad_sq, trace, valid)``; ``valid`` is False when there are
    fewer than two small batches.
    """
    count = tf.cast(count, tf.float32)
    mean_small = tf.math.divide_no_nan(small_sq_sum, count)
    gap = tf.math.divide_no_nan(inverse_size_sum, count) - tf.math.divide_no_nan(1.0, big_size)
    trace = tf.math.divide_no_nan(mean_small - big_sq, gap)
    grad_sq = big_sq - tf.math.divide_no_nan(trace, big_size)
    valid = (count >= 2) & (gap > 0) & tf.math.is_finite(trace) & tf.math.is_finite(grad_sq)
    return grad_sq, trace, valid


class GradientNoiseScale(tf.Module):
    """Exponential moving averages of ``|G|^2`` and ``tr(Sigma)``; ``B_simple`` is their ratio.

    ``B_simple = tr(Sigma) / |G|^2`` predicts the critical batch size: well
    below it, doubling the batch nearly halves the steps needed; well above
    it, a bigger batch mostly wastes compute. Single-step estimates are very
    noisy (``|G|^2`` can come out negative), so the numerator and the
    denominator are averaged separately and divided, as the paper advises.

    Args:
        decay: EMA decay per applied step (bias-corrected, as Adam's moments).
    """

    def __init__(self, decay: float = 0.99):
        super().__init__(name="gradient_noise_scale")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}.")
        self.decay = float(decay)

        def variable(dtype, name):
            return tf.Variable(
                tf.zeros([], dtype),
                trainable=False,
                name=name,
                synchronization=tf.VariableSynchronization.ON_WRITE,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

        self.grad_sq = variable(tf.float32, "grad_sq")
        self.trace = variable(tf.float32, "trace")
        self.updates = variable(tf.float32, "updates")

    def update(self, grad_sq, trace, apply) -> tf.Operation:
        """Folds one estimate in when ``apply`` (a bool tensor); branch-free, replica-context safe."""
        d = self.decay
        return tf.group(
            self.grad_sq.assign(tf.where(apply, d * self.grad_sq + (1 - d) * grad_sq, self.grad_sq)),
            self.trace.assign(tf.where(apply, d * self.trace + (1 - d) * trace, self.trace)),
            self.updates.assign(tf.where(apply, self.updates + 1, self.updates)),
        )

    def fold(self, sums: dict, big_sq, big_size, applied) -> dict:
        """Folds a step's estimate in (from :func:`add_micro_batch`'s ``sums`` and the whole batch's ``|g_B|^2``,
        when ``applied``: skipped steps do not count); the logs, after it."""
        grad_sq, trace, valid = terms(sums["small_sq"], sums["inverse_size"], sums["count"], big_sq, big_size)
        with tf.control_dependencies([self.update(grad_sq, trace, applied & valid)]):
            return {k: tf.identity(v) for k, v in self.logs().items()}

    def logs(self) -> dict:
        correction = 1.0 - tf.pow(self.decay, self.updates)  # 0 before the first update
        return {
            "noise_scale": tf.math.divide_no_nan(tf.convert_to_tensor(self.trace), tf.convert_to_tensor(self.grad_sq)),
            "noise_scale_trace": tf.math.divide_no_nan(tf.convert_to_tensor(self.trace), correction),
            "noise_scale_grad_sq": tf.math.divide_no_nan(tf.convert_to_tensor(self.grad_sq), correction),
        }
