"""Loss scaling for float16 training: one interface, a no-op default.

float16 has ~3 decimal digits and a smallest normal of 6e-5, so small
gradients of a float16 forward pass underflow to zero. Multiplying the loss by
a scale ``S`` before differentiation shifts every gradient up by ``S``; the
gradient is divided by ``S`` again (in float32) before it is used. Too large a
``S`` overflows to inf, so :class:`DynamicLossScale` adapts it.

Every class here has the same four members, so the train step never asks
"is there a loss scale?":

* ``scale(loss)``: ``loss * S`` in the loss's dtype.
* ``unscale(grads, multiplier=1)``: ``grads * multiplier / S`` (float32);
  ``unscale_factor(multiplier)`` is that factor alone (``None`` where it is
  1), for a step that folds it into another pass over the gradients.
* ``update(grads_finite)``: advance the state after one step.
* ``value``: the current ``S`` as a float32 tensor (read-only).

State lives in ``tf.Variable``\\ s of a ``tf.Module``, so
``tf.train.Checkpoint(loss_scale=ls)`` saves and restores all of it. Create a
loss scale under ``strategy.scope()`` when training with a
``tf.distribute`` strategy (``build_train_step`` does this for you).
"""

from __future__ import annotations

import math
import warnings

import tensorflow as tf

from effgrad import _checks

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "get"]


def _state_variable(value, dtype, name: str) -> tf.Variable:
    # ONLY_FIRST_REPLICA lets every replica assign the (identical, already
    # agreed) new value from replica context under MirroredStrategy.
    return tf.Variable(
        value,
        dtype=dtype,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _positive_number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


class LossScale(tf.Module):
    """Interface shared by all loss scales (see the module docstring)."""

    @property
    def value(self) -> tf.Tensor:
        raise NotImplementedError

    def scale(self, loss: tf.Tensor) -> tf.Tensor:
        """Returns ``loss * value`` in ``loss.dtype``."""
        return loss * tf.cast(self.value, loss.dtype)

    def unscale_factor(self, multiplier=None) -> tf.Tensor | None:
        """``multiplier / value`` as a float32 scalar: what turns scaled gradient sums into unscaled ones.

        ``None`` when that is 1 (no scale and no multiplier): the caller skips the multiply.
        """
        multiplier = tf.ones([], tf.float32) if multiplier is None else tf.cast(multiplier, tf.float32)
        return multiplier / self.value

    def unscale(self, grads, multiplier=None):
        """Returns float32 ``grads * multiplier / value`` (``None`` kept), in one pass."""
        factor = self.unscale_factor(multiplier)
        return [None if g is None else tf.cast(g, tf.float32) * (1.0 if factor is None else factor) for g in grads]

    def update(self, grads_finite) -> tf.Operation | None:
        """Advances the state after a step; ``grads_finite`` is a bool scalar."""
        del grads_finite
        return None

    @property
    def overflow_streak(self) -> tf.Tensor:
        """Consecutive non-finite steps taken at the minimum scale."""
        return tf.constant(0, tf.int64)


class NoLossScale(LossScale):
    """The identity: ``scale`` and ``unscale`` return their input unchanged."""

    @property
    def value(self) -> tf.Tensor:
        return tf.constant(1.0, tf.float32)

    def scale(self, loss):
        return loss

    def unscale_factor(self, multiplier=None):
        return None if multiplier is None else tf.cast(multiplier, tf.float32)

    def __repr__(self) -> str:
        return "NoLossScale()"


class StaticLossScale(LossScale):
    """A fixed scale ``S``: ``scale(l) = l * S``, ``unscale(g) = g / S``.

    Example:
        >>> ls = StaticLossScale(2.0**10)
        >>> float(ls.value)
        1024.0

    Note:
        A non-finite step is still skipped by the train step, but a static
        scale never backs off: use :class:`DynamicLossScale` unless you know
        the gradient range.
    """

    def __init__(self, scale: float):
        super().__init__(name="static_loss_scale")
        self._scale = _state_variable(_positive_number(scale, "scale"), tf.float32, "scale")

    @property
    def value(self) -> tf.Tensor:
        return tf.convert_to_tensor(self._scale)

    def __repr__(self) -> str:
        return f"StaticLossScale({float(self._scale.numpy())!r})"


class DynamicLossScale(LossScale):
    """A scale that halves on overflow and doubles after a run of good steps.

    Algorithm (one call of ``update`` per train step)::

        if grads_finite:
            counter += 1
            if counter == growth_interval:
                scale = min(scale * growth_factor, max_scale); counter = 0
            overflow_streak = 0
        else:
            if scale == min_scale: overflow_streak += 1
            scale = max(scale * backoff_factor, min_scale); counter = 0

    The train step skips the update of a non-finite step entirely, so a
    backed-off step costs one batch, never a corrupted weight.

    Example:
        >>> ls = DynamicLossScale(initial_scale=2.0**15, growth_interval=2000)
        >>> ckpt = tf.train.Checkpoint(loss_scale=ls)  # saves scale and counter

    Trap:
        A scale stuck at ``min_scale`` with steps still overflowing means the
        loss itself is inf/NaN (bad data, log(0)) or training diverged; the
        train step warns once (``overflow_streak``) instead of failing silently.

    Args:
        initial_scale: Starting scale ``S``.
        growth_interval: Finite steps in a row before the scale grows.
        growth_factor: Multiplier on growth (> 1).
        backoff_factor: Multiplier on overflow (in (0, 1)).
        min_scale: Lower bound of the scale.
        max_scale: Upper bound of the scale.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        *,
        _state: tuple[tf.Variable, tf.Variable] | None = None,
    ):
        super().__init__(name="dynamic_loss_scale")
        initial_scale = _positive_number(initial_scale, "initial_scale")
        self.growth_factor = _positive_number(growth_factor, "growth_factor")
        self.backoff_factor = _positive_number(backoff_factor, "backoff_factor")
        self.min_scale = _positive_number(min_scale, "min_scale")
        self.max_scale = _positive_number(max_scale, "max_scale")
        self.growth_interval = _checks.positive_int(growth_interval, "growth_interval")
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be > 1 so the scale can grow, got {growth_factor!r}.")
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be < 1 so the scale shrinks on overflow, got {backoff_factor!r}.")
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({min_scale!r}) must be <= max_scale ({max_scale!r}).")
        if not self.min_scale <= initial_scale <= self.max_scale:
            raise ValueError(
                f"initial_scale ({initial_scale!r}) must lie in [min_scale, max_scale] = "
                f"[{min_scale!r}, {max_scale!r}]."
            )
        if _state is None:
            _state = (_state_variable(initial_scale, tf.float32, "scale"), _state_variable(0, tf.int64, "counter"))
        self._scale, self._counter = _state
        self._overflow_streak = _state_variable(0, tf.int64, "overflow_streak")

    @classmethod
    def sharing_state_of(cls, keras_optimizer) -> DynamicLossScale:
        """A dynamic scale whose scale and counter ARE the variables of a Keras ``LossScaleOptimizer``.

        ``model.compile`` under ``mixed_float16`` wraps the optimizer in one;
        its ``dynamic_scale`` and ``step_counter`` are optimizer variables, so
        ``model.save`` / ``ModelCheckpoint`` store them and ``load_model``
        restores them. Keeping effgrad's state there makes it survive a
        ``.keras`` round trip with no file format of its own. The wrapper must
        be built.
        """
        scale = keras_optimizer.dynamic_scale.value  # the backing tf.Variable
        counter = keras_optimizer.step_counter.value
        return cls(
            initial_scale=float(scale.numpy()),
            growth_interval=int(keras_optimizer.dynamic_growth_steps),
            _state=(scale, counter),
        )

    @property
    def value(self) -> tf.Tensor:
        return tf.convert_to_tensor(self._scale)

    @property
    def counter(self) -> tf.Tensor:
        """Finite steps since the last change of scale."""
        return tf.convert_to_tensor(self._counter)

    @property
    def overflow_streak(self) -> tf.Tensor:
        return tf.convert_to_tensor(self._overflow_streak)

    def update(self, grads_finite) -> tf.Operation:
        # Branch-free (tf.where), so it runs unchanged under XLA and in replica
        # context, where a tf.cond around variable writes would need merge_call.
        finite = tf.convert_to_tensor(grads_finite, tf.bool)
        scale = tf.convert_to_tensor(self._scale)
        counter = tf.cast(self._counter, tf.int64) + 1
        grow = counter >= self.growth_interval
        grown = tf.minimum(scale * self.growth_factor, self.max_scale)
        shrunk = tf.maximum(scale * self.backoff_factor, self.min_scale)
        new_scale = tf.where(finite, tf.where(grow, grown, scale), shrunk)
        new_counter = tf.cast(tf.where(finite & ~grow, counter, tf.zeros_like(counter)), self._counter.dtype)
        at_min = scale <= self.min_scale
        new_streak = tf.where(
            finite,
            tf.zeros_like(self._overflow_streak),
            self._overflow_streak + tf.cast(at_min, tf.int64),
        )
        return tf.group(
            self._scale.assign(new_scale),
            self._counter.assign(new_counter),
            self._overflow_streak.assign(new_streak),
        )

    def get_config(self) -> dict:
        return {
            "initial_scale": float(self._scale.numpy()),
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def __repr__(self) -> str:
        return f"DynamicLossScale(scale={float(self._scale.numpy())!r}, growth_interval={self.growth_interval})"


class CollapseWatch:
    """Warns once when a dynamic scale sits at its floor and the last steps were all skipped.

    Call :meth:`after_step` on the host after each step. It reads the scale's
    state only every ``every``-th call (each read waits for the device).
    """

    def __init__(self, every: int = 10, streak: int = 10):
        self.every, self.streak = every, streak
        self.calls = 0
        self.warned = False

    def after_step(self, loss_scale: LossScale | None) -> None:
        self.calls += 1
        if self.warned or not isinstance(loss_scale, DynamicLossScale) or self.calls % self.every:
            return
        if int(loss_scale.overflow_streak) >= self.streak:
            self.warned = True
            warnings.warn(
                f"effgrad: the loss scale sits at min_scale={loss_scale.min_scale} and the last "
                f"{int(loss_scale.overflow_streak)} steps all had inf/NaN gradients, so every one "
                "was skipped. Likely causes: the loss itself is inf/NaN (bad data, log(0), a division "
                "by zero) or training diverged (learning rate too high). Loss scaling cannot fix either.",
                RuntimeWarning,
                stacklevel=4,
            )


def computes_in_float16(model) -> bool:
    """True when any layer of ``model`` computes in float16 (``mixed_float16``)."""
    from effgrad import _compat

    return any(getattr(layer, "compute_dtype", None) == "float16" for layer in _compat.flatten_layers(model))


def is_dynamic(loss_scale, model=None) -> bool:
    """Whether the ``loss_scale`` option means dynamic scaling for ``model`` ("auto": iff float16)."""
    return loss_scale == "dynamic" or (loss_scale == "auto" and model is not None and computes_in_float16(model))


def get(loss_scale, model=None, keras_optimizer=None) -> LossScale:
    """Resolves the ``loss_scale`` argument of ``build_train_step``.

    ``"auto"`` means dynamic scaling exactly when the model computes in
    float16; ``None`` means none; a number means a static scale. A dynamic
    scale keeps its state in ``keras_optimizer`` (a built Keras
    ``LossScaleOptimizer``) when one is given.
    """
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if loss_scale is None:
        return NoLossScale()
    if isinstance(loss_scale, str):
        if loss_scale == "auto" and not is_dynamic(loss_scale, model):
            return NoLossScale()
        if loss_scale in ("auto", "dynamic"):
            if keras_optimizer is not None:
                return DynamicLossScale.sharing_state_of(keras_optimizer)
            return DynamicLossScale()
        raise ValueError(
            f"Unknown loss_scale {loss_scale!r}: use 'auto', 'dynamic', None, a number "
            "or an effgrad.LossScale instance."
        )
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return StaticLossScale(loss_scale)
    raise TypeError(
        f"loss_scale must be 'auto', 'dynamic', None, a number or an effgrad.LossScale, "
        f"got {type(loss_scale).__name__}."
    )
