"""The keyword options of :func:`effgrad.build_train_step` and :func:`effgrad.attach`, validated once."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from effgrad import _checks
from effgrad.train import objective

__all__ = ["StepOptions", "PLANNER_OPTIONS", "OFF_UNDER_DP"]

# Options of a planned step (micro_batches="auto"): effgrad.plan's, not the step's.
PLANNER_OPTIONS = ("micro_batches", "memory_budget", "margin", "verbose")


def _positive_number(value, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}.")
    return float(value)


# The automatic features DP-SGD turns off ("auto") or refuses (True), and why.
OFF_UNDER_DP = {
    "fused_update": "each example's gradient norm is needed before any update",
    "fused_loss": "the per-example norms need the gradient of the logits",
    "recompute_activations": "the per-example norms read each layer's own backprop",
}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The configuration of one train step; every field is checked when it is made.

    See :func:`effgrad.build_train_step` for what each option does.
    """

    micro_batches: int = 1
    loss_scale: Any = "auto"
    clip_norm: float | None = None
    jit_compile: bool = False
    strategy: tf.distribute.Strategy | None = None
    # None: the loss object's own reduction, else "mean_with_sample_weight" (objective.reduction_for).
    reduction: str | None = None
    noise_scale: bool = False
    on_micro_batch: Callable | None = None
    # False: a batch whose weights sum to 0 is still applied (regularizers, optimizer
    # moments, statistics), as stock Keras fit applies it; attach sets this.
    skip_zero_weight_batches: bool = True
    # With one micro-batch, each variable's update runs as backprop makes its gradient.
    fused_update: bool | str = "auto"
    # A sparse cross-entropy on a final projection computed in chunks (effgrad.train.fused_loss).
    fused_loss: bool | str = "auto"
    # Attention layers computed by effgrad.attention in training calls (effgrad.attention.routing).
    attention: bool | str = "auto"
    # Activation functions recomputed in backprop, their inputs kept (effgrad.remat.activations).
    recompute_activations: bool | str = "auto"
    # DP-SGD: each example's gradient clipped to this norm, Gaussian noise added once per batch.
    per_example_clip: float | None = None
    noise_multiplier: float | None = None
    seed: int | None = None
    # ZeRO stages 1 and 2: each replica keeps 1/N of the optimizer state and reduced gradients (train.shard).
    shard_state: bool = False

    def __post_init__(self):
        if not isinstance(self.shard_state, bool):
            raise ValueError(f"shard_state must be True or False, got {self.shard_state!r}.")
        for name in ("fused_update", "fused_loss", "attention", "recompute_activations"):
            value = getattr(self, name)
            if value not in (True, False, "auto") or not isinstance(value, (bool, str)):
                raise ValueError(f'{name} must be True, False or "auto", got {value!r}.')
        micro_batches = _checks.positive_int(self.micro_batches, "micro_batches", " (1 = no accumulation)")
        object.__setattr__(self, "micro_batches", micro_batches)
        if self.clip_norm is not None:
            object.__setattr__(self, "clip_norm", _positive_number(self.clip_norm, "clip_norm"))
        if self.reduction is not None:
            object.__setattr__(self, "reduction", objective.check_reduction(self.reduction))
        if self.strategy is not None and not isinstance(self.strategy, tf.distribute.Strategy):
            raise TypeError(f"strategy must be a tf.distribute.Strategy, got {type(self.strategy).__name__}.")
        self._check_privacy()

    def _check_privacy(self) -> None:
        if self.per_example_clip is None:
            if self.noise_multiplier is not None:
                raise ValueError(
                    "noise_multiplier adds DP-SGD's noise to clipped per-example gradients: give per_example_clip=C "
                    "too (the clipping norm, which also sets the noise's scale sigma * C)."
                )
            return
        object.__setattr__(self, "per_example_clip", _positive_number(self.per_example_clip, "per_example_clip"))
        if self.noise_multiplier is None:
            raise ValueError(
                "per_example_clip needs noise_multiplier=sigma as well (the Gaussian noise's standard deviation is "
                "sigma * per_example_clip; noise_multiplier=0 clips each example's gradient without noise, which "
                "gives no privacy)."
            )
        noise = _positive_number(self.noise_multiplier, "noise_multiplier", allow_zero=True)
        object.__setattr__(self, "noise_multiplier", noise)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        for name, why in OFF_UNDER_DP.items():
            if getattr(self, name) is True:
                raise ValueError(f"{name}=True cannot be combined with per_example_clip: {why}.")

    @property
    def private(self) -> bool:
        """Whether the step clips per-example gradients (DP-SGD)."""
        return self.per_example_clip is not None

    def replace(self, **changes) -> StepOptions:
        return dataclasses.replace(self, **changes)
