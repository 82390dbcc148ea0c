"""Per-example gradients for DP-SGD without per-example gradients: rules, taps and the public API.

* :mod:`~effgrad.train.per_example.forms`: the maths of one weight (ghost
  norms, per-example instantiation, the clipped sum).
* :mod:`~effgrad.train.per_example.rules` (+ ``convolution``,
  ``recurrent``): one closed form per layer type, in a registry.
* :mod:`~effgrad.train.per_example.fallback`: the exact per-example
  gradients of any other layer.
* :mod:`~effgrad.train.per_example.taps`: the taps of one forward pass and
  the one backward pass after it (:class:`NormTaps`).
* :mod:`~effgrad.train.per_example.api`: :func:`per_example_norms`.
"""

from effgrad.train.per_example.api import per_example_norms
from effgrad.train.per_example.taps import NormTaps

__all__ = ["NormTaps", "per_example_norms"]
