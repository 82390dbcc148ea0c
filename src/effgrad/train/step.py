"""The train-step builder: micro-batches, loss scaling and clipping in one step.

This is the one module that composes the others. One call of the step is one
optimizer update of the loss (``w`` = sample weights times any Keras mask,
``l`` = unreduced losses, normalization from ``reduction``)::

    L = sum(w * l) / sum(w)  over the WHOLE batch and all replicas   +   weight regularization

Per replica, inside one ``tf.function``::

    S = loss_scale.value                          # constant within the step
    acc = sum over micro-batches i of d(S * sum(w_i * l_i) / B_local) / dθ   # float32, in place
    state writes of the forward passes (BatchNorm statistics, seeds): held back
    acc, sum(w*l), sum(w) = all_reduce(SUM, ...)  # the step's ONE cross-replica reduction
    finite = all(isfinite(acc))                   # identical on every replica (after the sum)
    g = acc * B_local / (S * sum(w)) + d(regularization) / dθ     # ONE pass: unscale + normalize
    g = g * min(1, clip_norm / |g|)                               #   + clip, folded into it
    if finite and sum(w) > 0: optimizer.apply(g); commit state writes   # else: nothing changes
    loss_scale.update(finite)

Dividing each micro-batch by the local batch size keeps the scaled objective
at the magnitude of a mean loss (what float16 loss scaling is tuned for), and
multiplying back makes the result exact whatever the micro-batch and replica
sizes are. With several replicas the ``B_local`` factor is applied before the
reduction (it differs per replica), the rest after it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from effgrad import _checks, _compat, diagnostics, distribute, state
from effgrad.remat import graph
from effgrad.train import accumulate
from effgrad.train import loss_scale as loss_scale_lib
from effgrad.train import objective as objective_lib

__all__ = ["StepOptions", "TrainStep", "build_train_step"]

_log = logging.getLogger("effgrad")

# How often (in calls) the step reads the loss-scale state to warn about a
# collapsed scale; reading it every call would force a device sync.
_COLLAPSE_CHECK_EVERY = 10
_COLLAPSE_STREAK = 10


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The keyword options of :func:`build_train_step` (and :func:`effgrad.attach`), validated once."""

    micro_batches: int = 1
    loss_scale: Any = "auto"
    clip_norm: float | None = None
    jit_compile: bool = False
    strategy: tf.distribute.Strategy | None = None
    reduction: str = "mean_with_sample_weight"
    noise_scale: bool = False
    on_micro_batch: Callable | None = None
    # False: a batch whose weights sum to 0 is still applied (regularizers, optimizer
    # moments, statistics), as stock Keras fit applies it; attach sets this.
    skip_zero_weight_batches: bool = True
    # True: with one micro-batch, each variable's update runs as backprop makes its
    # gradient (two backward passes when a global quantity gates the step).
    fused_update: bool | str = "auto"
    # "auto"/True: a sparse cross-entropy on a final projection is computed in chunks (effgrad.fused_loss).
    fused_loss: bool | str = "auto"

    def __post_init__(self):
        hint = " (1 = no accumulation)"
        for name in ("fused_update", "fused_loss"):
            value = getattr(self, name)
            if value not in (True, False, "auto") or not isinstance(value, (bool, str)):
                raise ValueError(f'{name} must be True, False or "auto", got {value!r}.')
        object.__setattr__(self, "micro_batches", _checks.positive_int(self.micro_batches, "micro_batches", hint))
        if self.clip_norm is not None:
            if (
                isinstance(self.clip_norm, bool)
                or not isinstance(self.clip_norm, (int, float))
                or not self.clip_norm > 0
            ):
                raise ValueError(f"clip_norm must be a number > 0 or None, got {self.clip_norm!r}.")
            object.__setattr__(self, "clip_norm", float(self.clip_norm))
        object.__setattr__(self, "reduction", objective_lib.check_reduction(self.reduction))
        if self.noise_scale and self.reduction == "sum":
            raise ValueError(
                'noise_scale=True estimates the noise of a MEAN loss gradient; use reduction="sum_over_batch_size" '
                'or "mean_with_sample_weight".'
            )
        if self.strategy is not None and not isinstance(self.strategy, tf.distribute.Strategy):
            raise TypeError(f"strategy must be a tf.distribute.Strategy, got {type(self.strategy).__name__}.")


def _leading_dims(nest) -> list[int]:
    return [int(t.shape[0]) for t in tf.nest.flatten(nest) if t is not None and t.shape.rank and t.shape[0] is not None]


def _check_batch_sizes(x, y, sample_weight) -> None:
    sizes = {name: set(_leading_dims(t)) for name, t in (("x", x), ("y", y), ("sample_weight", sample_weight))}
    if len(sizes["x"]) > 1:
        raise ValueError(f"The tensors of x have different batch sizes {sorted(sizes['x'])}; they must share dim 0.")
    every = set().union(*sizes.values())
    if len(every) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in sizes.items() if v)
        raise ValueError(f"x, y and sample_weight must have the same batch size (dim 0), got {detail}.")


def batch_shape(x) -> tuple[int, int] | None:
    """``(rows, largest other axis)`` of a batch's static shapes (e.g. ``(8, 256)`` for ``[8, 256]`` token ids)."""
    leaves = [t for t in tf.nest.flatten(x) if t is not None and len(getattr(t, "shape", ())) > 0]
    if not leaves or leaves[0].shape[0] is None:
        return None
    extent = max([int(d) for t in leaves for d in t.shape[1:] if d is not None] or [1])
    return int(leaves[0].shape[0]), extent


def _as_tensors(nest):
    return tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), nest)


def _relaxed_spec(t):
    if t is None:
        return None
    shape = t.shape.as_list()
    if not shape:
        raise ValueError("Inputs need a leading batch dimension; got a scalar.")
    return tf.TensorSpec([None] + shape[1:], t.dtype)


def _regularized(variables):
    return [(i, v) for i, v in enumerate(variables) if getattr(v, "regularizer", None) is not None]


def _unwrap_optimizer(optimizer):
    """``(optimizer that applies updates, Keras LossScaleOptimizer or None)``.

    ``model.compile`` under ``mixed_float16`` wraps the optimizer in Keras's
    ``LossScaleOptimizer``, whose ``apply`` divides by its own scale. effgrad
    scales and unscales itself, so it applies through the inner optimizer and
    keeps its scale state in the wrapper's variables (saved with the model):
    one loss scale, not two.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer, optimizer
    return optimizer, None


class TrainStep:
    """A compiled train step; build it with :func:`build_train_step`.

    Attributes:
        micro_batches: Micro-batches every batch is split into.
        loss_scale: The :class:`effgrad.LossScale` in use.
        reduction: The loss normalization (a Keras reduction name).
        strategy: The ``tf.distribute.Strategy`` the step runs under.
        trace_count: How often the step function has been traced (a step
            traces once per input structure/dtype; batch size never retraces).
        fused: Whether updates run inside backward (``fused_update``); None
            until the first call decides.
    """

    def __init__(self, model, loss, optimizer, **options):
        self.options = StepOptions(**options)
        if not callable(model) or not hasattr(model, "trainable_variables"):
            raise TypeError(f"model must be a keras.Model or keras.Layer, got {type(model).__name__}.")
        self.model = model
        self.optimizer, self._keras_loss_scale = _unwrap_optimizer(optimizer)
        self.micro_batches = self.options.micro_batches
        self.reduction = self.options.reduction
        self.strategy = self.options.strategy or tf.distribute.get_strategy()
        if isinstance(loss, objective_lib.Objective):
            self._objective = loss
            self.reduction = loss.reduction
        else:
            self._objective = objective_lib.Objective.of_loss(loss, self.reduction)
        self._forward = model  # the model, or its trunk when the loss is fused with its last layer
        self.fused_loss: bool | None = None  # decided at the first trace (see _fuse_loss)
        self.fused_loss_reason = ""
        self.loss_scale: loss_scale_lib.LossScale | None = None
        self.trace_count = 0
        self._calls = 0
        self._warned_collapse = False
        self._ready = False
        self._signatures: set[str] = set()
        self._accumulators: list[tf.Variable] | None = None
        self._state_variables: list = []
        self._written: list = []  # state variables the forward pass writes (seen at trace)
        self._normalize_in_objective = self.micro_batches == 1 and self.strategy.num_replicas_in_sync == 1
        if self.options.noise_scale and self._normalize_in_objective:
            raise ValueError(
                "noise_scale=True compares the gradients of smaller batches with the whole batch's: it needs "
                "micro_batches >= 2 or several replicas (a tf.distribute strategy with 2+ devices)."
            )
        self.noise_scale: diagnostics.GradientNoiseScale | None = None
        # No AutoGraph: effgrad's step has no Python control flow on tensors,
        # and converting Keras's code costs seconds per trace (measured 6.0 s
        # -> 1.8 s for the first call of a 16-layer MLP step).
        self._compute = tf.function(self._compute_gradients, jit_compile=self.options.jit_compile, autograph=False)
        self._step = tf.function(self._distributed_step, autograph=False)
        self._fused_fn = tf.function(self._fused_step, jit_compile=self.options.jit_compile, autograph=False)
        self.fused: bool | None = None  # decided at the first trace (see _decide_fused)
        # (rows, largest other axis) of the first batch, for fused_update="auto"
        self.batch_hint: tuple[int, int] | None = None
        if getattr(model, "built", False):
            self._prepare()

    # ------------------------------------------------------------------ edges
    def _prepare(self, x=None) -> None:
        """Creates every variable the step needs, outside any tf.function."""
        if not getattr(self.model, "built", False) and x is not None:
            # Variables cannot be created inside the compiled step; one
            # inference call on a single row builds them without touching
            # any state (no BatchNorm update, no dropout draw).
            with self.strategy.scope():
                self.model(tf.nest.map_structure(lambda t: t[:1], x), training=False)
        variables = self.model.trainable_variables
        if not variables:
            raise ValueError(
                f"{type(self.model).__name__} has no trainable variables, so the step would train "
                "nothing; build the model first or unfreeze layers (layer.trainable = True)."
            )
        with self.strategy.scope():
            if self._keras_loss_scale is not None and not self._keras_loss_scale.built:
                self._keras_loss_scale.build(variables)  # builds the inner optimizer too
            if not self.optimizer.built:
                self.optimizer.build(variables)
            self.loss_scale = loss_scale_lib.get(self.options.loss_scale, self.model, self._keras_loss_scale)
            if self.micro_batches > 1:
                self._accumulators = accumulate.make_accumulators(variables)
            if self.options.noise_scale and self.noise_scale is None:
                self.noise_scale = diagnostics.GradientNoiseScale()
        self._state_variables = list(self.model.non_trainable_variables)
        self._ready = True

    def _fuse_loss(self, hint: tuple[int, int] | None) -> None:
        """Computes a sparse cross-entropy on the model's final projection in chunks, if it applies.

        Chunks hold about two kernel-sized buffers (the kernel's gradient, summed per vocabulary
        chunk, then joined) where the plain loss holds two or three logits-sized ones: "auto" fuses
        when a batch has more than ``4 d`` positions (``d`` = the projection's input size) and its
        logits do not fit in one chunk. Measured at 512 rows, d = 256: equal peaks; GPT-2 at 2,048
        positions: 0.55x.
        """
        option, why_not = self.options.fused_loss, None
        loss = self._objective.single
        if isinstance(loss, str):
            loss = keras.losses.get(loss)
        if option is False:
            why_not = "fused_loss=False"
        elif not (isinstance(loss, keras.losses.SparseCategoricalCrossentropy) and loss.from_logits):
            why_not = f"the loss is {type(loss).__name__}, not SparseCategoricalCrossentropy(from_logits=True)"
        elif self.options.on_micro_batch is not None:
            why_not = "metrics read the logits of every micro-batch (compile without metrics to fuse)"
        else:
            from effgrad.train import fused_loss

            head = fused_loss.find_head(self.model)
            if isinstance(head, str):
                why_not = head
            elif option == "auto" and hint is not None:
                depth, classes = head.kernel().shape[::-1] if head.transposed else head.kernel().shape
                positions = hint[0] * math.prod(hint[1] if d is None else d for d in head.trunk.output.shape[1:-1])
                if positions * classes <= fused_loss.CHUNK_ELEMENTS:
                    why_not = (
                        f"the batch's logits ({positions:,} x {classes:,}) fit in one chunk: nothing to save; "
                        "fused_loss=True forces it"
                    )
                elif positions <= 4 * depth:
                    why_not = (
                        f"a batch of {positions:,} positions is too few next to the projection's "
                        f"{depth:,} inputs for chunks to save memory (from {4 * depth + 1:,}); "
                        "fused_loss=True forces it"
                    )
        self.fused_loss = why_not is None
        if why_not is not None:
            self.fused_loss_reason = f"fused loss not used: {why_not}."
            if option is True:
                raise ValueError(f"fused_loss=True cannot apply: {why_not}.")
        else:
            self._objective = objective_lib.Objective.of_head(head, loss, self.reduction)
            self._forward = head.trunk
            vocabulary = head.kernel().shape[0 if head.transposed else 1]
            self.fused_loss_reason = (
                f"fused loss: {head.layer.name} ({vocabulary:,} classes) and the cross-entropy computed in "
                "chunks of rows; the logits are never made."
            )
        _log.info("effgrad: %s", self.fused_loss_reason)

    def __call__(self, x, y, sample_weight=None) -> dict:
        """Runs one optimizer update on the batch ``(x, y, sample_weight)``.

        Returns:
            ``{"loss", "loss_scale", "grads_finite"}`` as scalar tensors.
        """
        distributed = isinstance(x, tf.distribute.DistributedValues)
        if not distributed:
            x, y, sample_weight = _as_tensors((x, y, sample_weight))
            _check_batch_sizes(x, y, sample_weight)
        if not self._ready:
            self._prepare(x)
        if not distributed:
            if self.batch_hint is None:
                self.batch_hint = batch_shape(x)
            specs = tf.nest.map_structure(_relaxed_spec, (x, y, sample_weight))
            key = repr(specs)
            if key not in self._signatures:
                # Tracing with a None batch dimension up front means later
                # batch sizes reuse this graph instead of retracing.
                self._step.get_concrete_function(*specs)
                self._signatures.add(key)
        logs = self._step(x, y, sample_weight)
        self.watch_loss_scale()
        return logs

    def watch_loss_scale(self) -> None:
        """Warns once when the dynamic scale has collapsed (called between steps, on the host)."""
        self._calls += 1
        if self._warned_collapse or not isinstance(self.loss_scale, loss_scale_lib.DynamicLossScale):
            return
        if self._calls % _COLLAPSE_CHECK_EVERY:
            return
        if int(self.loss_scale.overflow_streak) >= _COLLAPSE_STREAK:
            self._warned_collapse = True
            warnings.warn(
                f"effgrad: the loss scale sits at min_scale={self.loss_scale.min_scale} and the last "
                f"{int(self.loss_scale.overflow_streak)} steps all had inf/NaN gradients, so every one "
                "was skipped. Likely causes: the loss itself is inf/NaN (bad data, log(0), a division "
                "by zero) or training diverged (learning rate too high). Loss scaling cannot fix either.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------- compiled pieces
    def _distributed_step(self, x, y, sample_weight):
        self.trace_count += 1
        shard = not isinstance(x, tf.distribute.DistributedValues) and self.strategy.num_replicas_in_sync > 1
        logs = self.strategy.run(self.replica_step, args=(x, y, sample_weight), kwargs={"shard": shard})
        # Every log value is computed from all-reduced sums: replica 0's copy is the value.
        return {k: distribute.first_replica(self.strategy, v) for k, v in logs.items()}

    def _micro_step(self, local_rows, written: set, stray: list):
        state_variables = self._state_variables

        def micro_step(batch, carry):
            x, y, sample_weight = batch
            total, normalizer, pending, noise = carry
            with state.StateScope(zip(state_variables, pending), collect_losses=True) as scope:
                y_pred = self._forward(x, training=True)
            indices, others = state.written_in(scope, state_variables)
            written.update(indices)
            pending = [scope.get_current_value(v) for v in state_variables]
            if others and self.micro_batches > 1:
                raise ValueError(
                    f"The forward pass writes state outside the model's weights: {[v.path for v in others]} "
                    "(a stateful RNN's rnn_state: row i of a batch continues row i of the previous batch). "
                    "Micro-batches would split those rows; use micro_batches=1 for such a model."
                )
            stray.extend((v, scope.get_current_value(v)) for v in others)  # one micro-batch: commit as usual
            if scope.losses:
                raise NotImplementedError(
                    "The model adds losses in its forward pass (add_loss / activity_regularizer). They are "
                    "batch statistics that effgrad cannot renormalize over the whole batch; move the term "
                    "into the loss function or use a kernel regularizer instead."
                )
            micro_total, micro_normalizer = self._objective.sums(
                y, y_pred, sample_weight, exact=self._normalize_in_objective
            )
            if self.options.on_micro_batch is not None:
                self.options.on_micro_batch(x, y, y_pred, sample_weight)
            # One micro-batch on one replica: its normalizer is the global one,
            # known before backprop, so the gradient needs no rescaling pass.
            divisor = local_rows
            if self._normalize_in_objective:
                divisor = 1.0 if self.reduction == "sum" else micro_normalizer
            objective = self.loss_scale.scale(tf.math.divide_no_nan(micro_total, divisor))
            if noise:  # this micro-batch's size, for the gradient-norm hook that follows it
                noise = {**noise, "size": micro_normalizer}
            return objective, (total + micro_total, normalizer + micro_normalizer, pending, noise)

        return micro_step

    def _noise_hook(self, local_rows):
        """Adds ``|g_i|^2`` of each micro-batch's MEAN-loss gradient (scale and local rows undone)."""

        def on_gradients(grads, carry):
            total, normalizer, pending, noise = carry
            size = noise["size"]
            factor = tf.math.divide_no_nan(local_rows, self.loss_scale.value * size)
            has_rows = tf.cast(size > 0, tf.float32)
            noise = {
                "size": size,
                "small_sq": noise["small_sq"] + diagnostics.squared_norm(grads) * factor**2,
                "inverse_size": noise["inverse_size"] + tf.math.divide_no_nan(1.0, size),
                "count": noise["count"] + has_rows,
            }
            return total, normalizer, pending, noise

        return on_gradients

    def _compute_gradients(self, x, y, sample_weight):
        """Replica-local and XLA-compilable: raw (scaled, unnormalized) gradient sums and loss sums."""
        variables = self.model.trainable_variables
        local_rows = tf.cast(tf.maximum(accumulate.batch_size(x), 1), tf.float32)
        written: set[int] = set()
        stray: list = []  # (variable, new value) of state outside the model's variables
        zero = tf.zeros([], tf.float32)
        noise = {}
        if self.noise_scale is not None:
            noise = {"size": zero, "small_sq": zero, "inverse_size": zero, "count": zero}
        carry = (zero, zero, [tf.convert_to_tensor(v) for v in self._state_variables], noise)
        grads, (total, normalizer, pending, noise) = accumulate.accumulate_gradients(
            self._micro_step(local_rows, written, stray),
            variables,
            (x, y, sample_weight),
            self.micro_batches,
            carry,
            accumulators=self._accumulators,
            static_shapes=self.options.jit_compile,
            on_gradients=self._noise_hook(local_rows) if noise else None,
        )
        noise.pop("size", None)
        self._written = [self._state_variables[i] for i in sorted(written)] + [v for v, _ in stray]
        regularized = _regularized(variables)
        reg_loss, reg_grads = tf.zeros([], tf.float32), {}
        if regularized:
            with tf.GradientTape() as tape:
                reg_loss = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for _, v in regularized])
            reg_grads = dict(zip((i for i, _ in regularized), tape.gradient(reg_loss, [v for _, v in regularized])))
        pending = [pending[i] for i in sorted(written)] + [value for _, value in stray]
        return grads, total, normalizer, pending, noise, local_rows, reg_loss, reg_grads

    def replica_step(self, x, y, sample_weight=None, shard: bool = False) -> dict:
        """One step in replica context (what ``model.fit`` calls via :func:`effgrad.attach`)."""
        ctx = tf.distribute.get_replica_context()
        if shard:
            x, y, sample_weight = distribute.shard((x, y, sample_weight), accumulate.batch_size(x), ctx)
        if self.fused_loss is None:
            self._fuse_loss(self.batch_hint or batch_shape(x))
        if self.fused is None:
            self.fused = self._decide_fused(self.batch_hint or batch_shape(x))
        if self.fused:
            return self._fused_fn(x, y, sample_weight)
        grads, total, normalizer, pending, noise, local_rows, reg_loss, reg_grads = self._compute(x, y, sample_weight)
        variables = self.model.trainable_variables
        connected = [i for i, g in enumerate(grads) if g is not None or i in reg_grads]
        self._warn_unconnected(variables, connected)
        # A variable reached only by its regularizer: its loss gradient is 0.
        summed = [tf.zeros(variables[i].shape, tf.float32) if grads[i] is None else grads[i] for i in connected]
        # B_local differs per replica, so with several replicas it is applied
        # before the sum; with one, it joins the single pass below.
        several = ctx.num_replicas_in_sync > 1
        if several:
            summed = [g * local_rows for g in summed]
        summed, total, normalizer, noise = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM, (summed, total, normalizer, noise)
        )

        unscale = None if isinstance(self.loss_scale, loss_scale_lib.NoLossScale) else 1.0 / self.loss_scale.value
        if self._normalize_in_objective:
            per_loss = unscale  # None: the gradients are final as they are
        else:
            per_loss = (1.0 if several else local_rows) * (1.0 if unscale is None else unscale)
            if self.reduction != "sum":
                per_loss = tf.math.divide_no_nan(per_loss, normalizer)
        # A sum per variable reads each gradient once and writes nothing; it
        # is inf/NaN when an element is, or when the gradient is too large to
        # sum in float32, which no update should use either.
        finite = tf.reduce_all(
            [tf.math.is_finite(tf.reduce_sum(g)) for g in summed + list(reg_grads.values())]
            + ([] if per_loss is None else [tf.math.is_finite(per_loss)])
        )
        # The final gradient (unscale, normalize, regularize, clip) is formed
        # inside the apply branch, as Keras's LossScaleOptimizer does: the
        # branch's inputs are the raw sums only, never a second full copy.
        update = {"summed": summed, "reg": {j: reg_grads[i] for j, i in enumerate(connected) if i in reg_grads}}
        if per_loss is not None:
            update["per_loss"] = per_loss
        clip = self._clip_factor(summed, update["reg"], per_loss)
        if clip is not None:
            update["clip"] = clip
        loss = objective_lib.normalize(total, normalizer, self.reduction) + reg_loss
        has_weight = tf.constant(True)
        if self.reduction == "mean_with_sample_weight" and self.options.skip_zero_weight_batches:
            has_weight = normalizer > 0
        apply = functools.partial(self._apply_or_skip, connected=connected)
        done = ctx.merge_call(apply, args=(update, pending, finite & has_weight, finite, has_weight))
        with tf.control_dependencies([done]):
            loss = tf.identity(loss)
        logs = {"loss": loss, "loss_scale": self.loss_scale.value, "grads_finite": finite}
        if self.noise_scale is not None:
            logs.update(self._update_noise_scale(noise, summed, per_loss, normalizer, finite & has_weight))
        return logs

    def _decide_fused(self, hint: tuple[int, int] | None) -> bool:
        """Whether one micro-batch applies each update as backprop makes its gradient (two passes).

        Gathering every gradient before the one update costs a gradient-sized
        buffer more than Keras's step when the gradients outweigh the
        activations freed while they are made (fine-tuning: weights >>
        activations); the fused step avoids it for a second backward pass.
        """
        option = self.options.fused_update
        if option is False or self.micro_batches > 1:
            # With micro-batches the accumulators hold the one gradient-sized buffer anyway.
            return False
        why_not = None
        if self.strategy.num_replicas_in_sync > 1:
            why_not = (
                "with several replicas the gradients are all-reduced before any update, which gathers them; "
                "use micro_batches >= 2 (the accumulators are the floor) or fused_update=False"
            )
        elif getattr(self.optimizer, "global_clipnorm", None):
            why_not = (
                "the optimizer's global_clipnorm needs every gradient before any update; use "
                "build_train_step(clip_norm=...) instead (computed in the first backward pass)"
            )
        if why_not is not None:
            if option is True:
                raise ValueError(f"fused_update=True cannot apply updates inside backward here: {why_not}.")
            return False
        if option is True:
            return True
        if hint is None or getattr(self.optimizer, "compact_dtype", None):
            # Compact state: the updates run one after another (each expands its slots), and
            # backprop runs ahead of them holding the gradients: measured, the fused step then
            # keeps as much as the gathered one, for a second backward pass
            # (benchmarks/compact_state.py).
            return False
        rows, extent = hint
        per_row = graph.activation_bytes_per_row(self.model, unknown=extent)  # a sequence: T per unknown axis
        if per_row is None:
            return False
        gradient_bytes = 4 * sum(int(math.prod(v.shape)) for v in self.model.trainable_variables)
        # Layer outputs understate what backprop keeps (inputs, pre-activations, attention
        # probabilities), and the second pass keeps it all alive once more. Measured: a 16x1024
        # GELU MLP at batch 1024 (weights = outputs) and GPT2Backbone 12x768 at T=128, batch 2
        # (weights = 3.6x outputs; fused 1,084 vs gathered 995 MiB) are better gathered; 8 Dense
        # 2048x2048 at batch 64 (weights = 32x outputs) fused: 165-180 vs 258 MiB.
        return gradient_bytes > 4 * per_row * rows

    def _fused_step(self, x, y, sample_weight):
        """One micro-batch on one replica, each variable updated as backprop makes its gradient.

        Algorithm (LOMO's two passes, Lv et al. 2024)::

            forward once, keeping the tape
            pass 1: backprop; each gradient is reduced at once to a finiteness
                    flag (and a squared norm for clip_norm), then freed
            if every flag is finite (and the batch has weight):
                pass 2: backprop again; each variable's final gradient
                        (unscaled, regularized, clipped) goes to the optimizer
                        the moment it exists, so only a few are ever alive
                commit the forward pass's state (BatchNorm statistics)
            loss_scale.update(finite)

        Same update as the gathered step, and a skipped step still changes
        nothing; the price is one more backward pass. Pass 2 runs inside a
        ``tf.cond`` on the flags, so neither Grappler nor XLA merges it with
        pass 1 (which would gather the gradients again).
        """
        variables = self.model.trainable_variables
        local_rows = tf.cast(tf.maximum(accumulate.batch_size(x), 1), tf.float32)
        written: set[int] = set()
        stray: list = []
        zero = tf.zeros([], tf.float32)
        carry = (zero, zero, [tf.convert_to_tensor(v) for v in self._state_variables], {})
        with tf.GradientTape(persistent=True) as tape:
            objective, (total, normalizer, pending, _) = self._micro_step(local_rows, written, stray)(
                (x, y, sample_weight), carry
            )
        self._written = [self._state_variables[i] for i in sorted(written)] + [v for v, _ in stray]
        pending = [pending[i] for i in sorted(written)] + [value for _, value in stray]
        first = accumulate.dense(tape.gradient(objective, variables))
        regularized = dict(_regularized(variables))
        connected = [i for i, g in enumerate(first) if g is not None or i in regularized]
        self._warn_unconnected(variables, connected)
        trained = [variables[i] for i in connected]

        def loss_grads(grads):
            return [tf.zeros(v.shape, tf.float32) if g is None else g for v, g in zip(trained, grads)]

        def regularizer_grads(grads):
            # Each after its variable's loss gradient: computed up front they would all be alive at once.
            reg = {}
            for j, (i, g) in enumerate(zip(connected, grads)):
                if i in regularized:
                    with tf.control_dependencies([g]), tf.GradientTape() as t:
                        value = tf.cast(regularized[i].regularizer(regularized[i]), tf.float32)
                    reg[j] = t.gradient(value, regularized[i])
            return reg

        per_loss = None if isinstance(self.loss_scale, loss_scale_lib.NoLossScale) else 1.0 / self.loss_scale.value
        summed = loss_grads([first[i] for i in connected])
        reg = regularizer_grads(summed)
        finite = tf.reduce_all(
            [tf.math.is_finite(tf.reduce_sum(g)) for g in summed + list(reg.values())]
            + ([] if per_loss is None else [tf.math.is_finite(per_loss)])
        )
        clip = self._clip_factor(summed, reg, per_loss)
        reg_loss = tf.zeros([], tf.float32)
        if regularized:
            reg_loss = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized.values()])
        has_weight = tf.constant(True)
        if self.reduction == "mean_with_sample_weight" and self.options.skip_zero_weight_batches:
            has_weight = normalizer > 0

        def apply():
            second = loss_grads(accumulate.dense(tape.gradient(objective, trained)))
            again = regularizer_grads(second)
            grads = [self._combine(g, again.get(j), per_loss, clip) for j, g in enumerate(second)]
            with _compat.gradients_already_reduced(self.optimizer):
                self.optimizer.apply(grads, trained)
            for variable, value in zip(self._written, pending):
                variable.assign(value)
            return tf.constant(True)

        applied = tf.cond(finite & has_weight, apply, lambda: tf.constant(False))
        with tf.control_dependencies([applied]):
            updated = tf.cond(has_weight, lambda: self._update_loss_scale(finite), lambda: tf.constant(False))
        with tf.control_dependencies([updated]):
            loss = tf.identity(objective_lib.normalize(total, normalizer, self.reduction) + reg_loss)
            return {"loss": loss, "loss_scale": tf.identity(self.loss_scale.value), "grads_finite": finite}

    def _update_noise_scale(self, noise, summed, per_loss, normalizer, applied) -> dict:
        """Folds this step's estimate into the moving averages (skipped steps do not count)."""
        big_sq = diagnostics.squared_norm(summed) * per_loss**2  # |g_B|^2 of the reduced mean-loss gradient
        grad_sq, trace, valid = diagnostics.noise_scale_terms(
            noise["small_sq"], noise["inverse_size"], noise["count"], big_sq, normalizer
        )
        with tf.control_dependencies([self.noise_scale.update(grad_sq, trace, applied & valid)]):
            return {k: tf.identity(v) for k, v in self.noise_scale.logs().items()}

    def _clip_factor(self, summed, reg, per_loss):
        """``min(1, clip_norm / |g|)`` of the final gradient ``g = summed * per_loss + reg`` (None: no clipping)."""
        clip_norm = self.options.clip_norm
        if clip_norm is None:
            return None
        # |g|^2 from dot products of the summed gradients: scalars, no scaled copy.
        squares = [
            diagnostics.squared_norm([g]) * (1.0 if per_loss is None else per_loss**2)
            if j not in reg
            else diagnostics.squared_norm([self._combine(g, reg[j], per_loss, None)])
            for j, g in enumerate(summed)
        ]
        norm = tf.sqrt(tf.add_n(squares))
        return clip_norm / tf.maximum(norm, clip_norm)

    @staticmethod
    def _combine(g, r, per_loss, clip):
        """``(g * per_loss + r) * clip`` in one pass; a None factor is 1 and costs nothing."""
        factor = per_loss if clip is None else clip if per_loss is None else per_loss * clip
        if factor is not None:
            g = g * factor
        if r is not None:
            g = g + (r if clip is None else r * clip)
        return g

    def _warn_unconnected(self, variables, connected) -> None:
        if len(connected) < len(variables):
            idle = [variables[i].path for i in range(len(variables)) if i not in set(connected)]
            warnings.warn(
                f"Gradients do not exist for variables {idle} when minimizing the loss: they do not reach "
                "it, so they are not updated (as in Keras's own fit). If that is unexpected, check the "
                "model's outputs and loss.",
                UserWarning,
                stacklevel=2,
            )

    def _apply_or_skip(self, strategy, update, pending, apply_flag, finite, has_weight, *, connected):
        """Cross-replica: apply the agreed update and commit forward-pass state, or change nothing."""
        variables = [self.model.trainable_variables[i] for i in connected]
        state_variables = self._written

        def apply(update, pending):
            per_loss, clip = update.get("per_loss"), update.get("clip")
            grads = [self._combine(g, update["reg"].get(j), per_loss, clip) for j, g in enumerate(update["summed"])]
            if self._accumulators is not None:
                # Written back into the accumulators (each variable's buffer
                # replaced as its final gradient is formed): no second
                # gradient-sized buffer next to them.
                accumulators = [self._accumulators[i] for i in connected]
                writes = [acc.assign(g, read_value=False) for acc, g in zip(accumulators, grads)]
                with tf.control_dependencies(writes):
                    grads = [acc.read_value() for acc in accumulators]
            self.optimizer.apply(grads, variables)
            for variable, value in zip(state_variables, pending):
                variable.assign(value)

        # Entered here, in the one cross-replica thread, not in each replica's.
        with _compat.gradients_already_reduced(self.optimizer):
            applied = distribute.apply_or_skip(strategy, apply_flag, apply, args=(update, pending))
        with tf.control_dependencies([applied]):
            # An empty batch (no weight) is not evidence about the scale.
            return tf.cond(
                distribute.first_replica(strategy, has_weight),
                lambda: self._update_loss_scale(distribute.first_replica(strategy, finite)),
                lambda: tf.constant(False),
            )

    def _update_loss_scale(self, finite):
        op = self.loss_scale.update(finite)
        with tf.control_dependencies([op] if op is not None else []):
            return tf.constant(True)


def build_train_step(model, loss, optimizer, **options) -> TrainStep:
    """Builds a compiled step that applies one exact update per batch.

    The update equals the plain full-batch update of
    ``L = sum(w * l) / sum(w) + regularization`` for any batch size and any
    ``micro_batches``; only one micro-batch's activations and one
    gradient-sized float32 accumulator are in memory at a time (with one
    micro-batch, where weights dominate, not even that: ``fused_update``).

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> step = effgrad.build_train_step(model, keras.losses.MeanSquaredError(),
        ...                                 keras.optimizers.SGD(0.1), micro_batches=4)
        >>> logs = step(np.ones((10, 4), "float32"), np.zeros((10, 2), "float32"))
        >>> sorted(logs)
        ['grads_finite', 'loss', 'loss_scale']

    Args:
        model: A built or buildable ``keras.Model``/``keras.Layer``.
        loss: A ``keras.losses.Loss``, a Keras loss name, or a callable
            ``(y_true, y_pred) -> losses`` with a leading batch dimension
            (NOT reduced: effgrad normalizes once over the whole batch).
        optimizer: A ``keras.optimizers.Optimizer``. A Keras
            ``LossScaleOptimizer`` (what ``compile`` makes under
            ``mixed_float16``) is unwrapped: effgrad's loss scale replaces
            it and keeps its state in the wrapper's variables.
        **options: Keyword options (:class:`StepOptions`):

            * ``micro_batches``: split every batch into this many micro-batches;
              ``"auto"`` with ``memory_budget=`` (bytes, ``"6GiB"`` or a
              fraction of the device): plan at the first call
              (:func:`effgrad.plan`) and train with the fastest configuration
              whose measured peak fits (a :class:`effgrad.train.planner.PlannedTrainStep`).
            * ``loss_scale``: ``"auto"`` (dynamic iff the model computes in
              float16), ``None``, ``"dynamic"``, a number (static) or a ``LossScale``.
            * ``clip_norm``: clip the global norm of the final (unscaled,
              reduced) gradient.
            * ``jit_compile``: compile the gradient computation with XLA.
            * ``strategy``: a ``tf.distribute.Strategy``; default: the current one.
            * ``reduction``: Keras's reduction name, computed over the whole
              batch and all replicas: ``"mean_with_sample_weight"`` (default,
              ``sum(w*l)/sum(w)``), ``"sum_over_batch_size"`` (``sum(w*l)`` / loss
              elements, Keras's default for its losses) or ``"sum"``.
            * ``noise_scale``: log the gradient noise scale ``B_simple``
              (``logs["noise_scale"]``, plus ``"noise_scale_trace"`` and
              ``"noise_scale_grad_sq"``) from the micro-batch gradients the
              step computes anyway; needs ``micro_batches >= 2`` or several
              replicas. See ``docs/diagnostics.md``.
            * ``on_micro_batch``: ``fn(x, y, y_pred, sample_weight)`` called
              inside the compiled step once per micro-batch (e.g. metrics).
            * ``fused_update``: with one micro-batch on one replica, apply each
              variable's update as backprop makes its gradient instead of
              gathering every gradient first (LOMO's two backward passes: the
              first only decides finiteness and the clip norm, so a skipped
              step still changes nothing). ``"auto"`` (default) fuses when the
              gradients outweigh the activations (fine-tuning: the peak drops
              to Keras's, for a second backward pass) and the optimizer's
              state is not compact (:func:`effgrad.compact_state`, whose
              updates backprop outruns); ``True`` always, ``False`` never.
              ``step.fused`` says what was chosen.
            * ``fused_loss``: when the model ends in a projection (a linear
              ``Dense``, keras_hub's reversed ``ReversibleEmbedding``) and the
              loss is ``SparseCategoricalCrossentropy(from_logits=True)``,
              compute it in chunks without ever making the logits
              (:func:`effgrad.fused_sparse_cross_entropy`). ``"auto"``
              (default): where it applies, with one line on the ``effgrad``
              logger saying whether it does and why not; ``True`` refuses
              with the reason where it cannot; ``False`` never.
              ``step.fused_loss`` / ``step.fused_loss_reason`` tell.

    Returns:
        A :class:`TrainStep`; call it as ``step(x, y, sample_weight=None)``.

    Trap:
        Keras losses reduce by default (``"sum_over_batch_size"``); effgrad
        calls ``loss.call`` to get the unreduced values, so a custom callable
        must not reduce over the batch either. ``effgrad.attach`` takes the
        compiled loss's reduction, so ``fit`` trains what stock Keras trains.
    """
    if options.get("micro_batches") == "auto" or "memory_budget" in options:
        from effgrad.train.planner import PlannedTrainStep

        return PlannedTrainStep(model, loss, optimizer, **options)
    return TrainStep(model, loss, optimizer, **options)
