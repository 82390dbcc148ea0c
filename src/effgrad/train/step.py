"""The train step: one exact optimizer update per batch, composed of small pieces.

One call of the step is one optimizer update of the loss (``w`` = sample
weights times any Keras mask, ``l`` = unreduced losses, normalization from
``reduction``)::

    L = sum(w * l) / sum(w)  over the WHOLE batch and all replicas   +   weight regularization

Per replica, inside one ``tf.function``::

    S = loss_scale.value                                   # constant within the step
    for each micro-batch i (k of them; k may change between calls without a retrace):
        forward: y_pred, state writes held back               (flows.Forward)
        differentiate S * sum(w_i * l_i) / B_local             (flows: a tape; DP: one pass, clipped)
        add each gradient into its float32 accumulator as backprop makes it   (accumulate)
    raw, sum(w*l), sum(w) = sum across replicas                 # the step's ONE cross-replica reduction
    update: g = raw * B_local / (S * sum(w)) [+ noise] + d(regularization)/dθ, clipped   (update.Update)
    if every raw sum is finite and sum(w) > 0: optimizer.apply(g); commit the state writes
    loss_scale.update(finite)

Dividing each micro-batch by the local batch size keeps the scaled objective
at the magnitude of a mean loss (what float16 loss scaling is tuned for), and
multiplying back makes the result exact whatever the micro-batch and replica
sizes are. With one micro-batch on one replica the normalizer is known before
backprop and divides the objective directly. Where weights outweigh
activations, one micro-batch applies each variable's update inside backprop
instead (:mod:`effgrad.train.fused_update`).
"""

from __future__ import annotations

import functools
import logging
import secrets
from typing import NamedTuple

import keras
import tensorflow as tf

from effgrad import _checks, distribute
from effgrad.attention import routing as attention_routing
from effgrad.remat import activations
from effgrad.train import accumulate, batches, flows, fused_loss, fused_update, noise_scale, shard, update
from effgrad.train import loss_scale as loss_scale_lib
from effgrad.train import objective as objective_lib
from effgrad.train.options import OFF_UNDER_DP, StepOptions

__all__ = ["TrainStep"]

_log = logging.getLogger("effgrad")


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


class Gradients(NamedTuple):
    """What one replica's micro-batches produced (the XLA-compilable part of a step)."""

    grads: list  # per trainable variable: raw sum (scaled, unnormalized), None where not connected
    total: tf.Tensor  # sum(w * l)
    normalizer: tf.Tensor
    pending: dict  # {index of a state variable the forward pass wrote: its new value}
    stray: list  # new values of state outside the model's variables (Facts.stray's variables)
    noise: dict  # noise-scale sums
    local_rows: tf.Tensor
    reg_loss: tf.Tensor
    reg_grads: dict  # {variable index: regularization gradient}


class TrainStep:
    """A compiled train step; build it with :func:`effgrad.build_train_step`.

    Attributes:
        micro_batches: Micro-batches every batch is split into. Assign another
            value between calls: once the step has accumulators (any ``k >= 2``
            made them) every ``k``, 1 included, shares one trace (one new trace
            going from 1 to more, or per ``k`` under ``jit_compile``).
        accumulators: The :class:`effgrad.train.accumulate.Accumulators` the
            micro-batches are summed into (None until ``k >= 2`` needs them).
        loss_scale: The :class:`effgrad.LossScale` in use.
        reduction: The loss normalization (a Keras reduction name).
        strategy: The ``tf.distribute.Strategy`` the step runs under.
        trace_count: How often the step function has been traced (a step
            traces once per input structure/dtype; batch size never retraces).
        fused_update: Whether updates run inside backward; None
            until the first call decides.
        fused_loss: Whether the loss is fused with the model's last layer;
            ``fused_loss_reason`` says why (not). None until the first call.
        attention: Whether attention layers compute with :func:`effgrad.attention`
            (``attention=`` option); ``attention_reason`` says which and why. None until the first call.
        recompute_activations: Whether activation functions are recomputed in backprop
            (``recompute_activations=`` option); ``recompute_activations_reason`` says which and why.
        shard_state: Whether each replica keeps 1/N of the optimizer state and
            reduced gradients (``shard_state=True`` with several replicas);
            ``shard_state_reason`` says what was done and why.
    """

    def __init__(self, model, loss, optimizer, *, accumulators: accumulate.Accumulators | None = None, **options):
        # accumulators: buffers made for this model's variables to reuse (the planner's, as its measurements
        # placed them); new ones are made when micro-batches need them and these do not match.
        self.configure(model, loss, optimizer, StepOptions(**options), accumulators)

    @classmethod
    def with_options(cls, model, loss, optimizer, options: StepOptions, accumulators=None) -> TrainStep:
        """A step from validated :class:`StepOptions` (the planner's way in)."""
        step = cls.__new__(cls)
        step.configure(model, loss, optimizer, options, accumulators)
        return step

    def configure(self, model, loss, optimizer, options: StepOptions, accumulators=None) -> None:
        """Sets the step up for these arguments, as ``__init__`` does: a step planned at its first call
        (:class:`effgrad.train.planning.planned_step.PlannedTrainStep`) becomes the chosen step this way."""
        self.options = options
        if not callable(model) or not hasattr(model, "trainable_variables"):
            raise TypeError(f"model must be a keras.Model or keras.Layer, got {type(model).__name__}.")
        self.model = model
        self.optimizer, self._keras_loss_scale = _unwrap_optimizer(optimizer)
        self.strategy = self.options.strategy or tf.distribute.get_strategy()
        if isinstance(loss, objective_lib.Objective):
            self._objective = loss
        else:
            reduction = objective_lib.reduction_for(loss, self.options.reduction)
            self._objective = objective_lib.Objective.of_loss(loss, reduction)
        self.reduction = self._objective.reduction
        if self.options.noise_scale and self.reduction == "sum":
            raise ValueError(
                'noise_scale=True estimates the noise of a MEAN loss gradient; use reduction="sum_over_batch_size" '
                'or "mean_with_sample_weight".'
            )
        self._micro_batches = self.options.micro_batches
        self._check_noise_scale(self._micro_batches)
        self.shard_state, self.shard_state_reason = shard.decide(self.options, self.strategy, self.optimizer)
        self._shards: shard.Shards | None = None  # made with the variables (_prepare)
        if self.options.shard_state:
            _log.info("effgrad: %s", self.shard_state_reason)
        self._forward_model = model  # the model, or its trunk when the loss is fused with its last layer
        self.fused_loss: bool | None = None
        self.fused_loss_reason = ""
        self.fused_update: bool | None = None
        self.attention: bool | None = None
        self.attention_reason = ""
        self.recompute_activations: bool | None = None
        self.recompute_activations_reason = ""
        self.batch_hint: tuple[int, int] | None = None  # (rows, largest other axis) of the first batch
        self.loss_scale: loss_scale_lib.LossScale | None = None
        self.noise_scale: noise_scale.GradientNoiseScale | None = None
        self.trace_count = 0
        self._collapse = loss_scale_lib.CollapseWatch()
        self.ready = False
        self._signatures: set[str] = set()
        self.accumulators: accumulate.Accumulators | None = None
        self._given_accumulators = accumulators
        self._state_variables: list = []
        self._taps = None  # per-example norm taps (DP-SGD)
        self._seed = None
        # No AutoGraph: effgrad's step has no Python control flow on tensors,
        # and converting Keras's code costs seconds per trace (measured 6.0 s
        # -> 1.8 s for the first call of a 16-layer MLP step).
        self._step = tf.function(self._distributed_step, autograph=False)
        if getattr(model, "built", False):
            self.prepare()

    # ------------------------------------------------------------------ edges
    @property
    def micro_batches(self) -> int:
        return self._micro_batches

    @micro_batches.setter
    def micro_batches(self, value) -> None:
        value = _checks.positive_int(value, "micro_batches", " (1 = no accumulation)")
        self._check_noise_scale(value)
        self._micro_batches = value
        if self.ready and value > 1 and self.accumulators is None:
            self._make_accumulators()

    def _check_noise_scale(self, micro_batches: int) -> None:
        if self.options.noise_scale and micro_batches == 1 and self.strategy.num_replicas_in_sync == 1:
            raise ValueError(
                "noise_scale=True compares the gradients of smaller batches with the whole batch's: it needs "
                "micro_batches >= 2 or several replicas (a tf.distribute strategy with 2+ devices)."
            )

    def _make_accumulators(self) -> None:
        given, self._given_accumulators = self._given_accumulators, None
        variables = self.model.trainable_variables
        self.accumulators = given if given is not None and given.matches(variables) else None
        if self.accumulators is None:
            self.accumulators = accumulate.Accumulators(variables, self.strategy)

    def prepare(self, x=None) -> None:
        """Creates every variable the step needs, outside any tf.function (the first call does it).

        ``x``: a batch (any rows) that builds a model not built yet, as stock
        ``fit`` builds it from its first batch.
        """
        attention_routing.check_model(self.model, self.options.attention)  # attention=True: refused now
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
            if self.shard_state:  # the optimizer's state is built on this replica's shards
                self._shards = shard.Shards.of(self.strategy, self.optimizer, self._keras_loss_scale, variables)
                self.shard_state_reason = f"{self.shard_state_reason}: {self._shards.plan.summary}"
            if self._keras_loss_scale is not None and not self._keras_loss_scale.built:
                self._keras_loss_scale.build(variables)  # builds the inner optimizer too
            if not self.optimizer.built:
                self.optimizer.build(variables)
            self.loss_scale = loss_scale_lib.get(self.options.loss_scale, self.model, self._keras_loss_scale)
            if self.options.noise_scale and self.noise_scale is None:
                self.noise_scale = noise_scale.GradientNoiseScale()
        if self._micro_batches > 1 or self._given_accumulators is not None:
            self._make_accumulators()  # given ones: every k runs on the loop they were measured with
        if self.options.private:
            from effgrad.train.per_example import NormTaps

            self._taps = NormTaps(self.model, training=True)  # refusals and fallback warnings now, before any trace
            self._seed = self.options.seed if self.options.seed is not None else secrets.randbits(62)
        self._state_variables = list(self.model.non_trainable_variables)
        self._given_accumulators = None  # taken, or not needed
        self.ready = True

    @property
    def _on_micro_batch(self):
        """What Forward calls with each micro-batch's predictions: nothing when the loss is fused
        (there are no logits; the fused objective hands the metrics each position's rank)."""
        return None if self.fused_loss else self.options.on_micro_batch

    def forward(self, *, split: bool) -> flows.Forward:
        """What one micro-batch's forward pass runs (the model or its trunk, the objective, the state
        held back): the seam ``fused_update`` and the micro-batch loop share. ``split``: the batch is
        split into micro-batches."""
        return flows.Forward(
            self._forward_model,
            self._objective,
            self._state_variables,
            split=split,
            on_micro_batch=self._on_micro_batch,
        )

    def _decide(self, x, y=None) -> None:
        """At the first trace: whether the loss is fused with the last layer, and updates with backprop."""
        # Each replica makes the activations and logits of its own rows (batch_hint: the global batch).
        hint = batches.per_replica(self.batch_hint, self.strategy.num_replicas_in_sync) or batches.shape_hint(x)
        if self.fused_loss is None:
            head, self.fused_loss_reason = fused_loss.decide(
                self.options, self._objective, self.model, hint, private=self.options.private, y=y
            )
            self.fused_loss = head is not None
            if head is not None:
                metrics = self.options.on_micro_batch
                self._objective = objective_lib.Objective.of_head(
                    head,
                    self._objective.single,
                    self.reduction,
                    None if metrics is None else metrics.update_from_ranks,
                    keras_divisor=self._objective.keras_divisor,
                )
                self._forward_model = head.trunk
            _log.info("effgrad: %s", self.fused_loss_reason)
        if self.fused_update is None:
            self.fused_update = fused_update.decide(self, hint)

    def __call__(self, x, y, sample_weight=None) -> dict:
        """Runs one optimizer update on the batch ``(x, y, sample_weight)``.

        Returns:
            ``{"loss", "loss_scale", "grads_finite"}`` as scalar tensors.
        """
        distributed = isinstance(x, tf.distribute.DistributedValues)
        if not distributed:
            x, y, sample_weight = batches.as_tensors((x, y, sample_weight))
            batches.check_sizes(x, y, sample_weight)
        if not self.ready:
            self.prepare(x)
        # The number of micro-batches is a tensor, so every k shares one trace once the step has
        # accumulators (k = 1 then runs one micro-batch through them); before, 1 is the plain step
        # (no loop), and XLA (static micro-batch shapes) takes k as a Python int.
        k = self._micro_batches
        runtime_k = (k > 1 or self.accumulators is not None) and not self.options.jit_compile
        k_arg = tf.constant(k, tf.int32) if runtime_k else k
        if not distributed:
            if self.batch_hint is None:
                self.batch_hint = batches.shape_hint(x)
            specs = tf.nest.map_structure(batches.relaxed_spec, (x, y, sample_weight))
            k_spec = tf.TensorSpec([], tf.int32) if runtime_k else k
            key = repr((specs, runtime_k or k))
            if key not in self._signatures:
                # Tracing with a None batch dimension up front means later
                # batch sizes reuse this graph instead of retracing.
                self._step.get_concrete_function(*specs, k_spec)
                self._signatures.add(key)
        logs = self._step(x, y, sample_weight, k_arg)
        self.watch_loss_scale()
        return logs

    def watch_loss_scale(self) -> None:
        """Warns once when the dynamic scale has collapsed (called between steps, on the host)."""
        self._collapse.after_step(self.loss_scale)

    # ------------------------------------------------------- compiled pieces
    def _distributed_step(self, x, y, sample_weight, micro_batches):
        self.trace_count += 1
        shard = not isinstance(x, tf.distribute.DistributedValues) and self.strategy.num_replicas_in_sync > 1
        logs = self.strategy.run(
            self.replica_step, args=(x, y, sample_weight), kwargs={"shard": shard, "micro_batches": micro_batches}
        )
        # Every log value is computed from all-reduced sums: replica 0's copy is the value.
        return {k: distribute.first_replica(self.strategy, v) for k, v in logs.items()}

    def _exact(self, micro_batches) -> bool:
        """One micro-batch on one replica: its normalizer is the global one, known before backprop."""
        return isinstance(micro_batches, int) and micro_batches == 1 and self.strategy.num_replicas_in_sync == 1

    def _normalization(self) -> str:
        # DP-SGD divides the clipped, noised sum by the number of examples.
        return "sum_over_batch_size" if self.options.private else self.reduction

    def _gradients(self, x, y, sample_weight, micro_batches, *, facts: flows.Facts) -> Gradients:
        """Replica-local and XLA-compilable: raw (scaled, unnormalized) gradient sums and loss sums."""
        variables = self.model.trainable_variables
        local_rows = tf.cast(tf.maximum(accumulate.batch_size(x), 1), tf.float32)
        exact = self._exact(micro_batches)
        split = not (isinstance(micro_batches, int) and micro_batches == 1)
        forward = self.forward(split=split)
        normalization = self._normalization()

        def multiplier(normalizer):
            divisor = local_rows
            if exact:
                divisor = 1.0 if normalization == "sum" else normalizer
            return self.loss_scale.scale(tf.math.divide_no_nan(1.0, divisor))

        on_gradients = self._noise_hook(local_rows) if self.noise_scale is not None else None
        if self.options.private:
            differentiate = flows.clipped_gradients(
                forward,
                multiplier,
                self.loss_scale.value,
                self.options.per_example_clip,
                variables,
                facts,
                self._taps,
                on_gradients=on_gradients,
            )
        else:
            differentiate = flows.tape_gradients(
                forward, multiplier, variables, facts, exact=exact, on_gradients=on_gradients
            )
        grads, sums = accumulate.accumulate_gradients(
            differentiate,
            variables,
            (x, y, sample_weight),
            micro_batches,
            flows.Sums.start(self._state_variables, self.noise_scale is not None),
            accumulators=self.accumulators.buffers if split else None,
            static_shapes=self.options.jit_compile,
        )
        noise = {k: v for k, v in sums.noise.items() if k != "size"}
        reg_loss, reg_grads = update.regularization(variables)
        pending = {i: sums.pending[i] for i in sorted(facts.written)}
        stray = [value for _, value in facts.stray]
        return Gradients(grads, sums.total, sums.normalizer, pending, stray, noise, local_rows, reg_loss, reg_grads)

    def _noise_hook(self, local_rows):
        """Adds ``|g_i|^2`` of each micro-batch's MEAN-loss gradient (scale and local rows undone)."""

        def on_gradients(grads, sums: flows.Sums) -> flows.Sums:
            squared_norm = update.squared_norm(grads)
            noise = noise_scale.add_micro_batch(sums.noise, squared_norm, local_rows, self.loss_scale.value)
            return sums._replace(noise=noise)

        return on_gradients

    def replica_step(self, x, y, sample_weight=None, shard: bool = False, micro_batches=None) -> dict:
        """One step in replica context (what ``model.fit`` calls via :func:`effgrad.attach`)."""
        if not self.ready:
            raise ValueError(
                f"{type(self.model).__name__} is not built, so the step has no variables to train: build it (call it "
                "on a batch, or give it keras.Input) or call the step itself on a batch first."
            )
        recompute = False if self.options.private else self.options.recompute_activations
        with (
            attention_routing.efficient_attention(self.model, self.options.attention) as routing,
            activations.recompute_activations(self.model, recompute) as recomputed,
        ):
            logs = self._replica_step(x, y, sample_weight, shard, micro_batches)
        self.attention, self.attention_reason = routing.applied, routing.reason
        self.recompute_activations, self.recompute_activations_reason = recomputed.applied, recomputed.reason
        if self.options.private:
            self.recompute_activations_reason = f"off under DP-SGD: {OFF_UNDER_DP['recompute_activations']}"
        return logs

    def _replica_step(self, x, y, sample_weight, shard, micro_batches) -> dict:
        micro_batches = self._micro_batches if micro_batches is None else micro_batches
        ctx = tf.distribute.get_replica_context()
        if shard:
            x, y, sample_weight = distribute.shard((x, y, sample_weight), accumulate.batch_size(x), ctx)
        self._decide(x, y)
        if self.fused_update and isinstance(micro_batches, int) and micro_batches == 1:
            try:
                return fused_update.step(self, x, y, sample_weight)
            except fused_update.Unfusable as why:
                if self.options.fused_update is True:
                    raise ValueError(f"fused_update=True cannot apply updates inside backward here: {why}.") from None
                self.fused_update = False
                _log.info("effgrad: updates after backprop (fused_update=False): %s.", why)
        facts = flows.Facts()  # what this trace learns about the model, for this trace only

        def compute(x, y, sample_weight, micro_batches):
            return self._gradients(x, y, sample_weight, micro_batches, facts=facts)

        if self.options.jit_compile:
            compute = tf.function(compute, jit_compile=True, autograph=False)
        gradients = compute(x, y, sample_weight, micro_batches)
        variables = self.model.trainable_variables
        connected = [i for i, g in enumerate(gradients.grads) if g is not None or i in gradients.reg_grads]
        update.warn_unconnected(variables, connected)
        several = ctx.num_replicas_in_sync > 1
        local_rows = gradients.local_rows
        sums = (gradients.total, gradients.normalizer, gradients.noise)
        if self._shards is not None:  # each replica keeps its shard of the cut variables' sums
            raw, total, normalizer, noise = self._shards.reduce(
                ctx, [variables[i] for i in connected], [gradients.grads[i] for i in connected], local_rows, sums
            )  # fmt: skip
        else:
            # A variable reached only by its regularizer: its loss gradient is 0.
            raw = [tf.zeros(variables[i].shape, tf.float32) if gradients.grads[i] is None else gradients.grads[i]
                   for i in connected]  # fmt: skip
            # B_local differs per replica, so with several replicas it is applied
            # before the sum; with one, it joins the single pass of the update.
            if several:
                raw = [g * local_rows for g in raw]
            raw, total, normalizer, noise = distribute.sum_across_replicas(ctx, (raw, *sums))
        step_update = self._update(raw, gradients.reg_grads, connected, local_rows, normalizer, several, micro_batches)
        if self._shards is not None:  # one finiteness verdict and global norm from the shards
            step_update = self._shards.agree(ctx, step_update, [variables[i] for i in connected])
        finite = step_update.finite()
        normalization = self._normalization()
        loss = objective_lib.normalize(total, normalizer, normalization) + gradients.reg_loss
        has_weight = tf.constant(True)
        if normalization == "mean_with_sample_weight" and self.options.skip_zero_weight_batches:
            has_weight = normalizer > 0
        commit = [(self._state_variables[i], v) for i, v in gradients.pending.items()]
        commit += [(variable, value) for (variable, _), value in zip(facts.stray, gradients.stray)]
        apply = functools.partial(
            self._apply_or_skip,
            step_update=step_update,
            variables=[variables[i] for i in connected],
            state=[variable for variable, _ in commit],
            accumulators=None if self.accumulators is None else [self.accumulators.buffers[i] for i in connected],
        )
        done = ctx.merge_call(
            apply, args=(step_update.tensors(), [v for _, v in commit], finite & has_weight, finite, has_weight)
        )
        with tf.control_dependencies([done]):
            loss = tf.identity(loss)
        logs = {"loss": loss, "loss_scale": self.loss_scale.value, "grads_finite": finite}
        if self.noise_scale is not None:
            scale = 1.0 if step_update.factor is None else step_update.factor
            big_sq = update.squared_norm(step_update.raw) * scale**2  # |g_B|^2 of the reduced mean-loss gradient
            logs.update(self.noise_scale.fold(noise, big_sq, normalizer, finite & has_weight))
        return logs

    def _update(self, raw, reg_grads, connected, local_rows, normalizer, several, micro_batches) -> update.Update:
        """How this step's raw sums become the final gradients (see :mod:`effgrad.train.update`)."""
        if self._exact(micro_batches):
            factor = self.loss_scale.unscale_factor()  # None: the gradients are final as they are
        else:
            factor = self.loss_scale.unscale_factor(1.0 if several else local_rows)
            if self._normalization() != "sum":
                factor = tf.math.divide_no_nan(tf.convert_to_tensor(factor, tf.float32), normalizer)
        noise = None
        if self.options.private and self.options.noise_multiplier > 0:
            stddev = self.options.noise_multiplier * self.options.per_example_clip
            seed = tf.stack([tf.constant(self._seed, tf.int64), tf.cast(self.optimizer.iterations, tf.int64)])
            noise = update.Noise(stddev, seed)
        return update.Update(
            raw=raw,
            reg={j: reg_grads[i] for j, i in enumerate(connected) if i in reg_grads},
            factor=factor,
            noise=noise,
            noise_factor=tf.math.divide_no_nan(1.0, normalizer) if noise is not None else None,
            clip_norm=self.options.clip_norm,
        )

    def _apply_or_skip(
        self, strategy, tensors, commit_values, apply_flag, finite, has_weight, *, step_update, variables, state,
        accumulators,
    ):  # fmt: skip
        """Cross-replica: apply the agreed update and commit forward-pass state, or change nothing."""
        apply_or_skip = update.apply_or_skip if self._shards is None else self._shards.apply_or_skip
        applied = apply_or_skip(
            strategy,
            self.optimizer,
            step_update,
            tensors,
            variables,
            list(zip(state, commit_values)),
            apply_flag,
            accumulators=accumulators,
        )
        with tf.control_dependencies([applied]):
            # An empty batch (no weight) is not evidence about the scale.
            return tf.cond(
                distribute.first_replica(strategy, has_weight),
                lambda: self.update_loss_scale(distribute.first_replica(strategy, finite)),
                lambda: tf.constant(False),
            )

    def update_loss_scale(self, finite) -> tf.Tensor:
        """Advances the loss scale after a step; returns a tensor to depend on."""
        op = self.loss_scale.update(finite)
        with tf.control_dependencies([op] if op is not None else []):
            return tf.constant(True)
