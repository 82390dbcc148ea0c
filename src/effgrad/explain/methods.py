"""Saliency methods: one small class each, one method to implement.

Every method maps ``(score_fn, x)`` to attributions with ``x``'s shape, where
``score_fn(x) -> [B]`` is the differentiated score of each example (its
target logit). Shared behaviour lives once in :class:`SaliencyMethod`:
input gradients, and averaging over noise samples or path steps one at a time
(a sequential ``tf.while_loop``), so memory is one batch's worth whatever
``samples`` or ``steps`` is.

=====================  =====================================================
``gradient``           ``d score / d x``
``gradient_x_input``   ``x * d score / d x``
``smoothgrad``         ``mean_s d score / d x (x + N(0, (noise * (max x - min x))^2))``
``integrated_gradients`` ``(x - x0) * mean_k d score / d x (x0 + a_k (x - x0))``,
                       trapezoid over ``a_k = k / steps``; ``sum(map) ~= f(x) - f(x0)``
=====================  =====================================================
"""

from __future__ import annotations

import hashlib

import numpy as np
import tensorflow as tf

from effgrad import _checks

__all__ = ["SaliencyMethod", "Gradient", "GradientXInput", "SmoothGrad", "IntegratedGradients", "get", "METHODS"]


def input_gradients(score_fn, x: tf.Tensor) -> tf.Tensor:
    """``d sum(score_fn(x)) / d x``: each example's score w.r.t. its own input."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        scores = score_fn(x)
    return tape.gradient(scores, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)


def sequential_sum(n: int, term, like: tf.Tensor) -> tf.Tensor:
    """``sum(term(i) for i in range(n))``, one term alive at a time."""

    def body(i, total):
        value = term(i)
        with tf.control_dependencies([value]):  # the next term starts after this one
            return i + 1, total + value

    _, total = tf.while_loop(lambda i, _: i < n, body, (tf.constant(0), tf.zeros_like(like)))
    return total


class SaliencyMethod:
    """Base class: subclasses implement :meth:`attribute`."""

    name = ""
    defaults: dict = {}
    # True when attribute() evaluates score_fn exactly once, at x itself: the
    # arg-max target can then be read off the differentiated forward pass
    # instead of a second one.
    scores_at_input = False

    def __init__(self, **options):
        unknown = set(options) - set(self.defaults)
        if unknown:
            known = ", ".join(self.defaults) or "none"
            raise TypeError(f"{self.name} got unknown option(s) {sorted(unknown)}; its options are: {known}.")
        self.options = {**self.defaults, **options}

    def attribute(self, score_fn, x: tf.Tensor, row_offset: tf.Tensor) -> tf.Tensor:
        """Attributions for the batch ``x`` (rows ``row_offset...`` of the dataset)."""
        raise NotImplementedError

    def config(self) -> dict:
        """JSON-able identity of the method (what a resume must match)."""

        def plain(value):
            if isinstance(value, np.ndarray):
                return {"array_sha1": hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()}
            return value

        return {"method": self.name, **{k: plain(v) for k, v in sorted(self.options.items())}}


class Gradient(SaliencyMethod):
    """Vanilla gradient (Simonyan et al., 2013)."""

    name = "gradient"
    scores_at_input = True

    def attribute(self, score_fn, x, row_offset):
        return input_gradients(score_fn, x)


class GradientXInput(SaliencyMethod):
    """Gradient times input (Shrikumar et al., 2016)."""

    name = "gradient_x_input"
    scores_at_input = True

    def attribute(self, score_fn, x, row_offset):
        return x * input_gradients(score_fn, x)


class SmoothGrad(SaliencyMethod):
    """Gradient averaged over noisy copies of the input (Smilkov et al., 2017).

    Options: ``samples`` (25), ``noise`` (0.15: the noise's standard deviation
    as a fraction of each example's value range ``max(x) - min(x)``), ``seed``
    (0). Each row's noise is drawn with stateless RNG from ``(seed, sample,
    row index in the dataset)``: reproducible, and independent of
    ``batch_size`` and of the number of replicas.
    """

    name = "smoothgrad"
    defaults = {"samples": 25, "noise": 0.15, "seed": 0}

    def __init__(self, **options):
        super().__init__(**options)
        samples, noise = self.options["samples"], self.options["noise"]
        self.options["samples"] = _checks.positive_int(samples, "smoothgrad samples")
        if not isinstance(noise, (int, float)) or noise < 0:
            raise ValueError(f"smoothgrad noise must be a number >= 0 (a fraction of the value range), got {noise!r}.")

    def attribute(self, score_fn, x, row_offset):
        samples, seed = int(self.options["samples"]), int(self.options["seed"])
        axes = list(range(1, x.shape.rank))
        spread = tf.reduce_max(x, axis=axes, keepdims=True) - tf.reduce_min(x, axis=axes, keepdims=True)
        sigma = float(self.options["noise"]) * spread
        rows = tf.cast(row_offset, tf.int64) + tf.range(tf.shape(x, out_type=tf.int64)[0])

        def one_sample(i):
            # Each row's noise depends on (seed, sample, dataset row) only, so
            # maps do not change with batch_size or the number of replicas.
            def row_noise(row):
                key = tf.stack([tf.cast(seed, tf.int64) * samples + tf.cast(i, tf.int64), row])
                return tf.random.stateless_normal(tf.shape(x)[1:], seed=key, dtype=x.dtype)

            noise = tf.map_fn(row_noise, rows, fn_output_signature=tf.TensorSpec(x.shape[1:], x.dtype))
            return input_gradients(score_fn, x + sigma * noise)

        return sequential_sum(samples, one_sample, x) / samples


class IntegratedGradients(SaliencyMethod):
    """Path integral of gradients from a baseline (Sundararajan et al., 2017).

    Options: ``steps`` (64: trapezoid intervals, ``steps + 1`` gradients) and
    ``baseline`` (``None`` = zeros; or an array broadcastable to one input).
    Completeness: ``sum(map) ~= score(x) - score(baseline)`` up to the
    trapezoid error, which falls as ``1 / steps**2`` for smooth models.
    """

    name = "integrated_gradients"
    defaults = {"steps": 64, "baseline": None}

    def __init__(self, **options):
        super().__init__(**options)
        steps = self.options["steps"]
        self.options["steps"] = _checks.positive_int(steps, "integrated_gradients steps")
        if self.options["baseline"] is not None:
            self.options["baseline"] = np.asarray(self.options["baseline"], dtype="float32")

    def attribute(self, score_fn, x, row_offset):
        steps = int(self.options["steps"])
        baseline = self.options["baseline"]
        baseline = tf.zeros_like(x) if baseline is None else tf.broadcast_to(tf.cast(baseline, x.dtype), tf.shape(x))
        delta = x - baseline

        def point(k):
            alpha = tf.cast(k, x.dtype) / steps
            weight = tf.where((k == 0) | (k == steps), 0.5, 1.0)  # trapezoid rule
            return tf.cast(weight, x.dtype) * input_gradients(score_fn, baseline + alpha * delta)

        return delta * sequential_sum(steps + 1, point, x) / steps


METHODS = {cls.name: cls for cls in (Gradient, GradientXInput, SmoothGrad, IntegratedGradients)}


def get(method: str | SaliencyMethod, **options) -> SaliencyMethod:
    """A method instance from its name (or the instance itself)."""
    if isinstance(method, SaliencyMethod):
        if options:
            raise TypeError("Pass method options to the method's constructor, not to saliency().")
        return method
    if method not in METHODS:
        raise ValueError(f"Unknown saliency method {method!r}; choose one of {', '.join(METHODS)}.")
    return METHODS[method](**options)
