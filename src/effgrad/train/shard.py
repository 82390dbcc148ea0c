"""``shard_state=True``: optimizer state and reduced gradients sharded across replicas (ZeRO stages 1 and 2).

Under ``tf.distribute`` every replica holds the whole model, the whole reduced gradient and the whole
optimizer state (Adam: twice the weights), whatever the number of replicas N. With ``shard_state``
each replica keeps 1/N of the state and of the reduced gradient, on tf.distribute's own collectives::

    plan: each variable (but the smallest, at most 1% of the numbers, replicated as before) is
          flattened and padded to N equal shards of s numbers; replica r owns [r*s, (r+1)*s)
    build: the optimizer is built on the shards (a variable of s numbers per replica), so each
           slot holds this replica's numbers only (shard_slots)
    step, on each replica:
        backprop (micro-batches: summed)  -> reduce-scatter each gradient: this replica's shard of the sum
        replicated gradients, loss sums -> one all-reduce, as without sharding
        finite?, |final shard|^2      -> one all-reduce of two numbers: one verdict, one global norm
        if finite: shard = this replica's numbers of each weight
                   optimizer.apply(final shard gradients, shards)      (Keras's own update)
                   weight = all-gather(shards)                          (into every replica's copy)
                   shard emptied: it holds numbers only during the update

The reduce-scatter is an all-to-all of the gradient's N parts and a local sum (the CPU has no
reduce-scatter kernel; the all-to-all moves the same bytes), in pieces (``Group.reduce_scatter``).
DP-SGD's noise is drawn by each shard's owner for its numbers only, the very numbers the unsharded
step draws there (Philox counters).

Whole variables dealt out round-robin would need no padding, but one large variable (an embedding)
then sits whole on one replica, over 1/N of the state; flat shards keep 1/N (+ a few numbers of
padding) on any model, and every collective moves equal parts.

Example:
    >>> from effgrad.train import shard
    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(1)])
    >>> [layout and layout.shard for layout in shard.plan(model.trainable_variables, replicas=4).layouts]
    [4096, 64, 64, None]
    >>> step = effgrad.build_train_step(model, "mse", keras.optimizers.Adam(), shard_state=True)
    >>> step.shard_state, step.shard_state_reason.split(":")[0]  # no strategy: one replica, a no-op
    (False, 'one replica')

Trap:
    The summed gradient of several micro-batches is reduce-scattered once, at the end of the step:
    each replica keeps a whole float32 accumulator, as without sharding (see :meth:`Shards.reduce`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import keras
import tensorflow as tf

from effgrad import _compat, distribute
from effgrad.train import compact, update
from effgrad.train.shard_slots import Group, Layout, ShardRef, shard_slots

__all__ = ["decide", "plan", "Shards", "ShardUpdate", "REPLICATED_SHARE"]

# The smallest variables (biases, norms) up to this share of the numbers keep whole, replicated state:
# a collective per bias would cost more time than its state saves memory.
REPLICATED_SHARE = 0.01
PHILOX_NUMBERS = 4  # float32 normals per Philox counter: shards start on a multiple (DP-SGD noise)


def decide(options, strategy, optimizer) -> tuple[bool, str]:
    """``(shard?, why)`` at build time; raises ``ValueError`` for what cannot be sharded."""
    if not options.shard_state:
        return False, "shard_state=False"
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return False, "one replica: nothing to shard, the unsharded step runs (shard_state is a no-op)"
    if _compat.collective_launchers(strategy) is None:
        raise ValueError(
            f"shard_state=True needs MirroredStrategy or MultiWorkerMirroredStrategy (tf.distribute's collective "
            f"ops); {type(strategy).__name__} has none (ParameterServer, CentralStorage and TPU strategies do not): "
            "drop shard_state or change the strategy."
        )
    refusals = [
        (options.noise_scale, "noise_scale=True (its estimate needs every replica's whole gradient)"),
        (not compact.elementwise(optimizer), f"{type(optimizer).__name__}, whose update of a number reads more "
         "than that number (Keras's Adam, AdamW, Adamax, Nadam, RMSprop, Lion, SGD, Adagrad, Adadelta, Ftrl and "
         "their compact_state versions update each number alone)"),
        (optimizer.clipnorm or optimizer.global_clipnorm, "the optimizer's clipnorm/global_clipnorm (it would see "
         "a shard's norm): use build_train_step(clip_norm=...)"),
        (optimizer.use_ema, "the optimizer's use_ema"),
        (optimizer.gradient_accumulation_steps, "the optimizer's gradient_accumulation_steps: use micro_batches"),
    ]  # fmt: skip
    for refused, what in refusals:
        if refused:
            raise ValueError(f"shard_state=True cannot be combined with {what}.")
    return True, f"optimizer state and reduced gradients sharded across {replicas} replicas"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which variables are cut (:func:`plan`)."""

    layouts: tuple  # per variable: its Layout, or None (replicated)
    sizes: tuple  # per variable: its numbers

    @property
    def summary(self) -> str:
        cut = [size for size, layout in zip(self.sizes, self.layouts) if layout is not None]
        share = sum(cut) / max(sum(self.sizes), 1)
        return f"{len(cut)} of {len(self.sizes)} variables ({share:.2%} of the numbers) cut into shards"


def plan(variables, replicas: int, align: int = PHILOX_NUMBERS) -> Plan:
    """Which variables are cut into ``replicas`` shards (of a multiple of ``align`` numbers each).

    The largest first, until what is left replicated is at most ``REPLICATED_SHARE`` of the numbers;
    a variable whose shard would be as large as itself is never cut.
    """
    sizes = [math.prod(v.shape) for v in variables]
    layouts, left = [None] * len(sizes), sum(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if left <= REPLICATED_SHARE * sum(sizes):
            break
        shard = -(-sizes[i] // (replicas * align)) * align
        variable = variables[i]
        floating = keras.backend.is_float_dtype(variable.dtype)
        if shard < sizes[i] and floating and not getattr(variable, "overwrite_with_gradient", False):
            layouts[i] = Layout(tuple(variable.shape), shard, replicas)
            left -= sizes[i]
    return Plan(tuple(layouts), tuple(sizes))


def _rank() -> tf.Tensor:
    return tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32)


def _noise(noise: update.Noise, index: int, layout: Layout, rank) -> tf.Tensor:
    """This shard's numbers of ``noise.sample(index, whole shape)``, drawn alone.

    Philox makes ``PHILOX_NUMBERS`` normals per counter value, in order: the draw of a shard starting at
    number ``r * s`` is the one whose counter starts ``r * s / PHILOX_NUMBERS`` further.
    """
    seed = tf.random.experimental.stateless_fold_in(noise.seed, index)
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    offset = tf.cast(rank * (layout.shard // PHILOX_NUMBERS), tf.uint64)
    low = counter[0] + offset
    counter = tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])  # 128-bit add
    alg = tf.raw_ops.StatelessRandomGetAlg()
    draw = tf.raw_ops.StatelessRandomNormalV2(shape=[layout.shard], key=key, counter=counter, alg=alg)
    return tf.where(layout.real(rank), draw * noise.stddev, 0.0)


@dataclasses.dataclass(frozen=True)
class ShardUpdate(update.Update):
    """:class:`update.Update` where ``raw[j]`` is this replica's shard when ``layouts[j]`` is a Layout.

    :meth:`agree` makes the finiteness verdict and the clip multiplier every replica shares (one
    all-reduce of two numbers); the shards' final gradients carry their part of the noise and the
    regularization gradient, and zeros in the padding.
    """

    layouts: tuple = ()
    verdict: tf.Tensor | None = None
    scale: tf.Tensor | None = None

    def _unclipped(self, j: int) -> tf.Tensor:
        layout = self.layouts[j]
        if layout is None:
            return super()._unclipped(j)
        rank, g = _rank(), self.raw[j]
        if self.factor is not None:
            g = g * self.factor
        if self.noise is not None:
            g = g + _noise(self.noise, j, layout, rank) * self.noise_factor
        if j in self.reg:
            g = g + layout.piece(self.reg[j], rank)
        return g

    def _squares(self, j: int) -> tf.Tensor:
        if j in self.reg or self.noise is not None:
            return update.squared_norm([self._unclipped(j)])
        return update.squared_norm([self.raw[j]]) * (1.0 if self.factor is None else tf.square(self.factor))

    def agree(self, ctx) -> ShardUpdate:
        """The update with the verdict and clip multiplier all replicas agree on (in replica context)."""
        sharded = [j for j, layout in enumerate(self.layouts) if layout is not None]
        whole = [j for j, layout in enumerate(self.layouts) if layout is None]

        def bad(tensors):
            return tf.add_n([tf.cast(~tf.math.is_finite(tf.reduce_sum(t)), tf.float32) for t in tensors] + [0.0])

        clip = self.clip_norm is not None
        local = tf.stack([bad([self.raw[j] for j in sharded]), tf.add_n([self._squares(j) for j in sharded] + [0.0])
                          if clip else 0.0])  # fmt: skip
        total = distribute.sum_across_replicas(ctx, local)
        rest = [self.raw[j] for j in whole] + list(self.reg.values())
        if self.factor is not None:
            rest.append(self.factor)
        verdict = (total[0] + bad(rest)) == 0.0
        scale = None
        if clip:
            norm = tf.sqrt(total[1] + tf.add_n([self._squares(j) for j in whole] + [0.0]))
            scale = self.clip_norm / tf.maximum(norm, self.clip_norm)
        return dataclasses.replace(self, verdict=verdict, scale=scale)

    def finite(self) -> tf.Tensor:
        return self.verdict

    def clip(self) -> tf.Tensor | None:
        return self.scale

    def tensors(self) -> dict:
        fields = {**super().tensors(), "verdict": self.verdict}
        return fields if self.scale is None else {**fields, "scale": self.scale}

    def with_tensors(self, fields: dict) -> ShardUpdate:
        return dataclasses.replace(super().with_tensors(fields), verdict=fields["verdict"], scale=fields.get("scale"))


class Shards:
    """A step's sharding: the plan, each cut variable's shard (what the optimizer updates), the collectives.

    Made once per optimizer (:meth:`of`, which builds the optimizer's state); a train step uses it at
    two more seams: the one reduction (:meth:`reduce`, then :meth:`agree`) and the update
    (:meth:`apply_or_skip`).
    """

    def __init__(self, group: Group, variables, layout_plan: Plan, targets):
        self.group, self.plan = group, layout_plan
        self._variables, self._targets = list(variables), list(targets)

    @classmethod
    def of(cls, strategy, optimizer, wrapper, variables) -> Shards:
        """The optimizer's shards, its state built on them (under ``strategy.scope()``, eagerly)."""
        state = _compat.model_state(optimizer)
        known = state.get("shards")
        if (
            known is not None
            and known.group.strategy is strategy
            and [id(v) for v in known._variables] == [id(v) for v in variables]
        ):
            return known
        if optimizer.built:
            raise ValueError(
                "shard_state=True needs an optimizer that has not built its state yet (built, it holds the whole "
                "state on every replica): give the step a new optimizer, then restore its state "
                "(tf.train.Checkpoint(...).restore or model.load_weights) after building the step."
            )
        block = optimizer.block_size if getattr(optimizer, "compact_dtype", None) == "int8" else 1
        layout_plan = plan(variables, strategy.num_replicas_in_sync, math.lcm(PHILOX_NUMBERS, block))
        group = Group(strategy)
        targets, layouts = [], {}
        for variable, layout in zip(variables, layout_plan.layouts):
            if layout is None:
                targets.append(variable)
                continue
            with contextlib.ExitStack() as scopes:  # the variable's path: slots are named as its own would be
                for scope in variable.path.split("/")[:-1]:
                    scopes.enter_context(keras.name_scope(scope))
                ref = ShardRef(layout, name=variable.name, dtype=variable.dtype)
            for copy in strategy.experimental_local_results(ref.value):  # no memory until the first update
                _compat.empty_variable(copy)
            _compat.exclude_from_weight_decay_as(optimizer, ref, variable)
            targets.append(ref)
            layouts[id(ref)] = layout
        with shard_slots(optimizer, group, layouts):
            optimizer.build(targets)
        if wrapper is not None and not wrapper.built:
            wrapper.build(targets)  # a LossScaleOptimizer: its own variables (the inner one is built)
        for built in (optimizer, wrapper):  # checkpoints list the model's variables, as without shards
            if built is not None:
                _compat.show_built_for(built, variables)
        state["shards"] = shards = cls(group, variables, layout_plan, targets)
        return shards

    def targets(self, variables) -> list:
        """What the optimizer updates for each of ``variables``: a shard, or the variable itself."""
        of = {id(v): t for v, t in zip(self._variables, self._targets)}
        return [of[id(v)] for v in variables]

    def _layouts(self, variables) -> list:
        of = {id(v): layout for v, layout in zip(self._variables, self.plan.layouts)}
        return [of[id(v)] for v in variables]

    def reduce(self, ctx, variables, grads, local_rows, sums):
        """``(raw, *sums)``: each cut gradient as this replica's shard of the sum over replicas, the others
        and ``sums`` summed (one all-reduce). ``grads`` are None where only a regularizer reaches.

        Each micro-batch's gradient is not reduce-scattered as it is made: a collective inside a
        replica's ``tf.while_loop`` is refused (``merge_call``) or never meets its peers (raw collective
        ops time out; TF 2.21), and it would send ``micro_batches`` times the bytes. The accumulated sum
        is, once per step (the accumulators stay whole: see docs/distributed.md's formula).
        """
        layouts = self._layouts(variables)
        raw = list(grads)
        for j in reversed(range(len(raw))):
            layout, g = layouts[j], raw[j]
            if layout is None:
                raw[j] = (tf.zeros(variables[j].shape, tf.float32) if g is None else g) * local_rows
            elif g is None:
                raw[j] = tf.zeros([layout.shard], tf.float32)
            else:
                raw[j] = self.group.reduce_scatter(layout.padded(g), scale=local_rows)
        whole = [j for j, layout in enumerate(layouts) if layout is None]
        summed, sums = distribute.sum_across_replicas(ctx, ([raw[j] for j in whole], sums))
        for j, g in zip(whole, summed):
            raw[j] = g
        return (raw, *sums)

    def agree(self, ctx, step_update: update.Update, variables) -> ShardUpdate:
        fields = {f.name: getattr(step_update, f.name) for f in dataclasses.fields(step_update)}
        return ShardUpdate(**fields, layouts=tuple(self._layouts(variables))).agree(ctx)

    def apply_or_skip(
        self, strategy, optimizer, step_update: ShardUpdate, tensors, variables, commit, apply_flag, accumulators=None
    ) -> tf.Tensor:
        """Cross-replica: every replica updates its shards and gathers the weights, or none does.

        The arguments are :func:`update.apply_or_skip`'s; ``accumulators`` are not reused here.
        """
        layouts, targets = self._layouts(variables), self.targets(variables)

        def per_replica(tensors, commit_values):
            final = step_update.with_tensors(tensors)
            clip, rank = final.clip(), _rank()
            # Each step starts from the weights themselves (they may have been set or restored since).
            fresh = [_compat.refill_variable(t.value, layout.piece(v, rank))
                     for v, t, layout in zip(variables, targets, layouts) if layout is not None]  # fmt: skip
            with tf.control_dependencies(fresh):
                grads = [final.gradient(j, clip) for j in range(len(final.raw))]
                update.apply_gradients(optimizer, grads, targets)
            for (variable, _), value in zip(commit, commit_values):
                variable.assign(value)

        def run():
            strategy.extended.call_for_each_replica(per_replica, args=(tensors, [v for _, v in commit]))
            for j in reversed(range(len(variables))):
                if layouts[j] is not None:
                    self._gather(strategy, variables[j], targets[j], layouts[j])
            return tf.constant(True)

        with _compat.gradients_already_reduced(optimizer):
            return tf.cond(distribute.first_replica(strategy, apply_flag), run, lambda: tf.constant(False))

    def _gather(self, strategy, variable, target, layout: Layout) -> None:
        """Every replica's copy of ``variable`` := all of its shards, then the shard emptied (cross-replica,
        one device at a time)."""

        def put(copy, shard):
            value = layout.whole(self.group.all_gather(tf.convert_to_tensor(shard)))
            if variable.constraint is not None:
                value = variable.constraint(value)
            return copy.assign(tf.cast(value, copy.dtype), read_value=False), _compat.empty_variable(shard)

        strategy.extended.update(variable.value, put, args=(target.value,), group=False)
