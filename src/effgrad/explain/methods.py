"""Saliency methods: one small class each, one method to implement.

Every method maps ``(score_fn, xs)`` to attributions, one per tensor of
``xs`` (the differentiated inputs, or a layer's output: see
:mod:`effgrad.explain.wrt`) and of its shape, where ``score_fn(xs) -> [B]``
is the differentiated score of each example (its target logit). Shared
behaviour lives once: input gradients, and weighted sums of gradients over
noise samples or path points (``weighted_gradient_sum``: ``*_per_pass``
points stacked into one evaluation, passes one after another in a
``tf.while_loop``), so memory is ``*_per_pass`` batches whatever ``samples``
or ``steps`` is.

=====================  =====================================================
``gradient``           ``d score / d x``
``gradient_x_input``   ``x * d score / d x``
``smoothgrad``         ``mean_s d score / d x (x + N(0, (noise * (max x - min x))^2))``
``integrated_gradients`` ``(x - x0) * mean_k d score / d x (x0 + a_k (x - x0))``,
                       trapezoid over ``a_k = k / steps``; ``sum(map) ~= f(x) - f(x0)``
=====================  =====================================================
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import tensorflow as tf

from effgrad import _checks

__all__ = [
    "SaliencyMethod",
    "Gradient",
    "GradientXInput",
    "SmoothGrad",
    "IntegratedGradients",
    "get",
    "METHODS",
    "counter_normal",
]


def input_gradients(score_fn, xs: list) -> list:
    """``d sum(score_fn(xs)) / d x`` for each ``x`` of ``xs``: each example's score w.r.t. its own inputs."""
    with tf.GradientTape() as tape:
        tape.watch(xs)
        scores = score_fn(xs)
    return tape.gradient(scores, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)


def sequential_sum(n: int, term, like: list) -> list:
    """``sum(term(i) for i in range(n))`` (lists of tensors shaped as ``like``), one term alive at a time."""

    def body(i, total):
        value = term(i)
        with tf.control_dependencies(value):  # the next term starts after this one
            return i + 1, [t + v for t, v in zip(total, value)]

    _, total = tf.while_loop(lambda i, _: i < n, body, (tf.constant(0), [tf.zeros_like(t) for t in like]))
    return total


def weighted_gradient_sum(score_fn, xs: list, count: int, per_pass: int, point, weight) -> list:
    """``sum_k weight(k) * d score / d x at point(k)`` for ``k < count``, for each ``x`` of ``xs``.

    ``point(ks) -> [[P, B, ...] per x]`` builds the inputs of ``P`` points at
    once; ``per_pass`` points are stacked along the batch axis into one
    gradient evaluation (``per_pass x B`` rows: better use of a wide
    accelerator), and passes run one after another, so memory is
    ``per_pass`` batches whatever ``count`` is. A last partial pass pads
    with zero-weight points.
    """
    passes = -(-count // per_pass)

    def one_pass(i):
        ks = i * per_pass + tf.range(per_pass)
        valid = ks < count
        ks = tf.minimum(ks, count - 1)
        stacked = point(ks)
        flat = [tf.reshape(p, tf.concat([[-1], tf.shape(x)[1:]], 0)) for p, x in zip(stacked, xs)]
        grads = input_gradients(score_fn, flat)
        sums = []
        for x, p, g in zip(xs, stacked, grads):
            w = tf.where(valid, tf.cast(weight(ks), x.dtype), tf.zeros([], x.dtype))
            sums.append(tf.tensordot(w, tf.reshape(g, tf.shape(p)), axes=1))
        return sums

    return sequential_sum(passes, one_pass, xs)


_M32 = 0xFFFFFFFF


def _mul32(h: tf.Tensor, c: int) -> tf.Tensor:
    """``h * c mod 2**32`` for ``h < 2**32`` in int64, with no signed overflow."""
    lo = tf.bitwise.bitwise_and(h, 0xFFFF) * c
    hi = tf.bitwise.left_shift(tf.bitwise.bitwise_and(tf.bitwise.right_shift(h, 16) * c, 0xFFFF), 16)
    return tf.bitwise.bitwise_and(lo + hi, _M32)


def _mix32(h: tf.Tensor) -> tf.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32)."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))
    h = _mul32(h, 0x7FEB352D)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 15))
    h = _mul32(h, 0x846CA68B)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))


def counter_normal(seed: int, samples: tf.Tensor, rows: tf.Tensor, example_shape, dtype) -> tf.Tensor:
    """Standard normal noise ``[P, B, *example_shape]``, a pure function of
    ``(seed, sample, dataset row, element)``.

    Counter-based (hash, then Box-Muller), so every row's noise is drawn in one
    vectorized op and does not depend on which batch or replica the row is in
    (``tf.random.stateless_normal`` takes one seed per call: per-row seeds
    needed a ``map_fn`` over rows).
    """
    size = int(np.prod(example_shape, dtype=np.int64))
    key = _mix32(tf.bitwise.bitwise_xor(_mix32(tf.constant(seed & _M32, tf.int64)), tf.cast(samples, tf.int64)))
    rows = tf.cast(rows, tf.int64)
    row_key = _mix32(tf.bitwise.bitwise_and(rows, _M32) ^ _mix32(tf.bitwise.right_shift(rows, 32)))
    key = _mix32(tf.bitwise.bitwise_xor(key[:, None], row_key[None, :]))[..., None]  # [P, B, 1]
    element = 2 * tf.range(size, dtype=tf.int64)
    h1 = _mix32(tf.bitwise.bitwise_xor(key, _mix32(element)))
    h2 = _mix32(tf.bitwise.bitwise_xor(key, _mix32(element + 1)))
    scale = 2.0**-24
    u1 = (tf.cast(tf.bitwise.right_shift(h1, 8), tf.float32) + 1.0) * scale  # (0, 1]: log is finite
    u2 = tf.cast(tf.bitwise.right_shift(h2, 8), tf.float32) * scale
    z = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * np.pi * u2)
    shape = tf.concat([tf.shape(key)[:2], tf.constant(example_shape, tf.int32)], 0)
    return tf.cast(tf.reshape(z, shape), dtype)


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

    def attribute(self, score_fn, xs: list, row_offset: tf.Tensor) -> list:
        """Attributions for the batch ``xs`` (rows ``row_offset...`` of the dataset), one per tensor."""
        raise NotImplementedError

    def for_tensors(self, names: list[str]) -> SaliencyMethod:
        """The method ready for the differentiated tensors ``names`` (checks per-tensor options)."""
        return self

    def config(self) -> dict:
        """JSON-able identity of the method (what a resume must match)."""

        def plain(value):
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in sorted(value.items())}
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, np.ndarray) or tf.is_tensor(value):
                data = np.ascontiguousarray(np.asarray(value, "float32")).tobytes()
                return {"array_sha1": hashlib.sha1(data).hexdigest()}
            return value

        return {"method": self.name, **{k: plain(v) for k, v in sorted(self.options.items())}}


class Gradient(SaliencyMethod):
    """Vanilla gradient (Simonyan et al., 2013)."""

    name = "gradient"
    scores_at_input = True

    def attribute(self, score_fn, xs, row_offset):
        return input_gradients(score_fn, xs)


class GradientXInput(SaliencyMethod):
    """Gradient times input (Shrikumar et al., 2016)."""

    name = "gradient_x_input"
    scores_at_input = True

    def attribute(self, score_fn, xs, row_offset):
        return [x * g for x, g in zip(xs, input_gradients(score_fn, xs))]


class SmoothGrad(SaliencyMethod):
    """Gradient averaged over noisy copies of the input (Smilkov et al., 2017).

    Algorithm::

        sigma = noise * (max(x) - min(x))              # per example
        map   = mean over s < samples of  d score / d x  at  x + sigma * N_s(row)

    Options: ``samples`` (25), ``noise`` (0.15: the noise's standard deviation
    as a fraction of each example's value range), ``seed`` (0),
    ``samples_per_pass`` (1: how many noisy copies share one gradient
    evaluation; more uses a wide accelerator better, at that many batches of
    memory). Each row's noise is a pure function of ``(seed, sample, row
    index in the dataset)``: reproducible, and independent of ``batch_size``,
    ``samples_per_pass`` and the number of replicas.
    """

    name = "smoothgrad"
    defaults = {"samples": 25, "noise": 0.15, "seed": 0, "samples_per_pass": 1}

    def __init__(self, **options):
        super().__init__(**options)
        samples, noise = self.options["samples"], self.options["noise"]
        self.options["samples"] = _checks.positive_int(samples, "smoothgrad samples")
        self.options["samples_per_pass"] = min(
            _checks.positive_int(self.options["samples_per_pass"], "smoothgrad samples_per_pass"),
            self.options["samples"],
        )
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
            raise ValueError(f"smoothgrad noise must be a number >= 0 (a fraction of the value range), got {noise!r}.")
        if isinstance(self.options["seed"], bool) or not isinstance(self.options["seed"], (int, np.integer)):
            raise ValueError(f"smoothgrad seed must be an int, got {self.options['seed']!r}.")

    def config(self) -> dict:
        config = super().config()
        del config["samples_per_pass"]  # how, not what: a resume may change it
        return config

    def attribute(self, score_fn, xs, row_offset):
        samples, seed = self.options["samples"], int(self.options["seed"])
        rows = tf.cast(row_offset, tf.int64) + tf.range(tf.shape(xs[0], out_type=tf.int64)[0])
        sigmas = []
        for x in xs:  # each input's own value range
            axes = list(range(1, x.shape.rank))
            spread = tf.reduce_max(x, axis=axes, keepdims=True) - tf.reduce_min(x, axis=axes, keepdims=True)
            sigmas.append(float(self.options["noise"]) * spread)

        def point(ks):
            # Input j's noise has its own stream (seed + j * golden ratio): inputs of one shape get different noise.
            return [
                x[None]
                + sigma[None] * counter_normal(seed + j * 0x9E3779B9, ks, rows, tuple(x.shape[1:].as_list()), x.dtype)
                for j, (x, sigma) in enumerate(zip(xs, sigmas))
            ]

        total = weighted_gradient_sum(
            score_fn, xs, samples, self.options["samples_per_pass"], point, lambda ks: tf.ones_like(ks)
        )
        return [t / samples for t in total]


class IntegratedGradients(SaliencyMethod):
    """Path integral of gradients from a baseline (Sundararajan et al., 2017).

    Algorithm (trapezoid rule over ``steps`` intervals)::

        a_k   = k / steps,  k = 0 .. steps;   w_k = 1/2 at both ends, else 1
        map   = (x - x0) * sum_k w_k * d score / d x  at  x0 + a_k (x - x0)  / steps

    Options: ``steps`` (64), ``baseline`` (``None`` = zeros; an array
    broadcastable to one example; for several differentiated inputs a dict
    ``{name: array}`` or a tuple, one per input, ``None`` entries being
    zeros; with ``layer=``, it lives in that layer's output space) and ``steps_per_pass`` (1: path points per
    gradient evaluation, as SmoothGrad's ``samples_per_pass``).
    Completeness: ``sum(map) ~= score(x) - score(baseline)`` up to the
    trapezoid error, which falls as ``1 / steps**2`` for smooth models and is
    zero when the gradient is linear along the path.
    """

    name = "integrated_gradients"
    defaults = {"steps": 64, "baseline": None, "steps_per_pass": 1}

    def __init__(self, **options):
        super().__init__(**options)
        steps = self.options["steps"]
        self.options["steps"] = _checks.positive_int(steps, "integrated_gradients steps")
        self.options["steps_per_pass"] = min(
            _checks.positive_int(self.options["steps_per_pass"], "integrated_gradients steps_per_pass"), steps + 1
        )
        baseline = self.options["baseline"]
        if baseline is not None and not isinstance(baseline, (dict, tuple, list)):
            self.options["baseline"] = np.asarray(baseline, dtype="float32")

    def config(self) -> dict:
        config = super().config()
        del config["steps_per_pass"]  # how, not what: a resume may change it
        return config

    def for_tensors(self, names):
        baseline = self.options["baseline"]
        bound = copy.copy(self)
        if baseline is None or isinstance(baseline, np.ndarray):
            if baseline is not None and len(names) > 1:
                raise ValueError(
                    f"integrated_gradients baseline: the model has several differentiated inputs ({', '.join(names)}); "
                    "pass a dict {name: array} (or a tuple, one per input; None for zeros)."
                )
            bound.baselines = [baseline] * len(names)
            return bound
        if isinstance(baseline, dict):
            unknown = sorted(set(map(str, baseline)) - set(names))
            if unknown:
                raise ValueError(
                    f"integrated_gradients baseline names {unknown}, which are not differentiated inputs "
                    f"({', '.join(names)}); give a baseline per input name (missing ones are zeros)."
                )
            values = [baseline.get(n) for n in names]
        else:
            if len(baseline) != len(names):
                raise ValueError(
                    f"integrated_gradients baseline has {len(baseline)} entries but {len(names)} inputs are "
                    f"differentiated ({', '.join(names)}); give one per differentiated input (None for zeros)."
                )
            values = list(baseline)
        bound.baselines = [None if b is None else np.asarray(b, "float32") for b in values]
        return bound

    def attribute(self, score_fn, xs, row_offset):
        steps = self.options["steps"]
        baselines = getattr(self, "baselines", [self.options["baseline"]] * len(xs))
        starts = [
            tf.zeros_like(x) if b is None else tf.broadcast_to(tf.cast(b, x.dtype), tf.shape(x))
            for x, b in zip(xs, baselines)
        ]
        deltas = [x - x0 for x, x0 in zip(xs, starts)]

        def point(ks):
            points = []
            for x, x0, delta in zip(xs, starts, deltas):
                alpha = tf.reshape(tf.cast(ks, x.dtype) / steps, [-1] + [1] * x.shape.rank)
                points.append(x0[None] + alpha * delta[None])
            return points

        def weight(ks):
            return tf.where((ks == 0) | (ks == steps), 0.5, 1.0)  # trapezoid rule

        total = weighted_gradient_sum(score_fn, xs, steps + 1, self.options["steps_per_pass"], point, weight)
        return [delta * t / steps for delta, t in zip(deltas, total)]


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
