"""``effgrad.attach``: Keras's ``model.fit`` trains with an effgrad step.

``attach`` replaces ``model.train_step`` with :meth:`TrainStep.replica_step`
built from what ``compile`` was given, so ``fit`` trains exactly what stock
``fit`` trains:

* the compiled loss with ITS reduction (Keras's default for its losses is
  ``"sum_over_batch_size"``), computed over the whole batch;
* sample weights and Keras masks on ``y_pred`` weighted as ``Loss.__call__``
  weights them;
* the compiled optimizer; under ``mixed_float16`` ``compile`` wraps it in a
  ``LossScaleOptimizer``: effgrad applies through the inner optimizer and
  keeps its dynamic scale in the wrapper's variables, so there is one loss
  scale and ``model.save`` / ``ModelCheckpoint`` store its state;
* the compiled metrics, updated once per micro-batch; ``jit_compile``.

Calling ``compile`` again after ``attach`` is followed: the next ``fit``
attaches again with the new loss, optimizer and metrics and the same options.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from effgrad import _compat, memory
from effgrad.train import accumulate
from effgrad.train import loss_scale as loss_scale_lib
from effgrad.train import objective as objective_lib
from effgrad.train.batches import shape_hint
from effgrad.train.builder import planned
from effgrad.train.options import PLANNER_OPTIONS, StepOptions
from effgrad.train.planning.plan import make_plan
from effgrad.train.step import TrainStep

__all__ = ["attach"]


def _keep_scale_state_in_optimizer(model) -> None:
    """Wraps the compiled optimizer in a Keras ``LossScaleOptimizer`` (as ``compile`` does for float16).

    Its variables then hold effgrad's dynamic scale, and ``model.save``
    stores them; the compile config names the wrapper so ``load_model``
    rebuilds the same optimizer and restores them.
    """
    _compat.set_compiled_optimizer(model, keras.optimizers.LossScaleOptimizer(model.optimizer))


# Keras's train-step code that effgrad's step replaces: a model class with its own is refused.
_KERAS_STEP = ("train_step", "compute_loss", "compute_metrics")


def attach(model: keras.Model, **step_options) -> keras.Model:
    """Makes ``model.fit`` train with an effgrad step (after ``model.compile``).

    Uses the compiled loss (and its reduction), optimizer and metrics; metrics
    are updated once per micro-batch, and ``loss_scale`` shows in the logs
    when scaling is on.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> model = effgrad.attach(model, micro_batches=4)
        >>> history = model.fit(np.ones((32, 4)), np.zeros((32, 1)), batch_size=16, verbose=0)
        >>> model.effgrad_step.micro_batches
        4

    Args:
        model: A compiled ``keras.Model`` whose class keeps Keras's own ``train_step``,
            ``compute_loss`` and ``compute_metrics`` (effgrad's step replaces them).
        **step_options: Keyword options of :func:`effgrad.build_train_step`;
            ``reduction`` defaults to the compiled loss's, ``strategy`` to
            the model's, ``jit_compile`` to ``compile``'s.
            ``micro_batches="auto", memory_budget=...``: the next ``fit``
            plans from its first batch (:func:`effgrad.plan`), then trains
            with the chosen micro-batches (and ``checkpoint_model`` segments);
            the plan is ``model.effgrad_plan``.

    Returns:
        ``model`` itself.

    Trap:
        Re-attach after loading a saved model (``keras.models.load_model``
        restores the weights, optimizer and loss-scale state, not the
        ``attach``).
    """
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError("attach() needs a compiled model: call model.compile(optimizer=..., loss=...) first.")
    if model.loss is None:
        raise ValueError("attach() needs a compiled loss: call model.compile(optimizer=..., loss=...) first.")
    own = [m for m in _KERAS_STEP if getattr(type(model), m, None) is not getattr(keras.Model, m)]
    if own:
        raise TypeError(
            f"attach() would replace {type(model).__name__}'s own {', '.join(own)} without running it: call an "
            "effgrad.build_train_step step from your train_step instead, or put that code in the loss or a metric."
        )
    if planned(step_options):
        return _attach_planned(model, step_options)
    return _attach(model, dict(step_options), forward=model)


def _attach(model, given: dict, forward, accumulators=None) -> keras.Model:
    """``attach`` with checked options; ``forward`` computes the predictions (``model``, or a
    ``checkpoint_model`` of it sharing its variables); ``accumulators``: the plan's, which the step
    takes as they were allocated (the plan's peaks were measured with them)."""
    StepOptions(**given)  # every bad option is refused before the model is touched
    if given.get("shard_state") and not model.built:  # fit would build the whole optimizer state first
        raise ValueError(
            "attach(shard_state=True) needs a built model: call model.build(input_shape) or model(x) first."
        )
    objective = objective_lib.Objective.of_compiled(model, given.get("reduction"))
    options = {
        "strategy": model.distribute_strategy,
        "jit_compile": bool(model.jit_compile),
        "skip_zero_weight_batches": False,  # stock fit applies such a batch (regularizers, moments)
        **given,
        "reduction": objective.reduction,
    }
    if loss_scale_lib.is_dynamic(options.get("loss_scale", "auto"), model) and not isinstance(
        model.optimizer, keras.optimizers.LossScaleOptimizer
    ):
        _keep_scale_state_in_optimizer(model)

    # Without compiled metrics nothing reads y_pred; with accuracy and top-k only, the loss may still be
    # fused with the last layer (they are computed from the chunks).
    on_micro_batch = CompiledMetrics(model) if _compat.has_compiled_metrics(model) else None
    step = TrainStep(
        forward, objective, model.optimizer, on_micro_batch=on_micro_batch, accumulators=accumulators, **options
    )
    compiled_with = _compat.compile_state(model)

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        logs = step.replica_step(x, y, sample_weight)
        tracker = _compat.loss_tracker(model)  # Keras's epoch-mean "loss"
        if tracker is not None:
            tracker.update_state(logs["loss"], sample_weight=accumulate.batch_size(x))
        _compat.build_empty_compiled_metrics(model, y)
        results = dict(model.get_metrics_result())
        results.setdefault("loss", logs["loss"])
        if not isinstance(step.loss_scale, loss_scale_lib.NoLossScale):
            results["loss_scale"] = logs["loss_scale"]
            results["grads_finite"] = tf.cast(logs["grads_finite"], tf.float32)
        results.update({k: v for k, v in logs.items() if k.startswith("noise_scale")})
        return results

    def make_train_function(inner, force=False):
        if _compat.compile_state(model) is not compiled_with:
            # compile() was called again: train the new configuration, never the old one.
            _attach(model, given, forward)
            return model.make_train_function(force=True)
        if model.train_function is not None and not force:
            return model.train_function
        inner(force=True)  # Keras's: sets model.train_function
        compiled = model.train_function

        def train_function(iterator):
            logs = compiled(iterator)
            step.watch_loss_scale()  # Python side, between fit's steps
            return logs

        model.train_function = train_function
        return train_function

    # effgrad's hooks on the instance (_compat.hook_method): the step replaces Keras's train_step
    # innermost, so a MemoryMonitor (or another wrapper) stays around it through a re-attach.
    _compat.hook_method(model, "train_step", "attach", lambda inner: train_step, order=0)
    _compat.hook_method(
        model, "make_train_function", "attach", lambda inner: functools.partial(make_train_function, inner), order=0
    )
    _compat.hook_method(model, "fit", "attach", _before_fit(model), order=0)
    model.effgrad_step = step
    model.train_function = None  # rebuilt by the next fit()
    return model


class CompiledMetrics:
    """``attach``'s ``on_micro_batch``: the compiled metrics, updated with each micro-batch's predictions.

    With the loss fused into the last layer there are no logits. Accuracy and
    top-k metrics are then updated from each position's rank among the
    classes, which the chunks compute from logits they make anyway (ties
    counted as Keras's ``argmax`` and ``in_top_k`` count them); any other
    metric needs the logits, and the step does not fuse.

    Trap:
        The chunks rank float32 logits. Under ``mixed_float16`` Keras ranks
        float16 ones (and compares labels cast to float16, which above 2,048
        classes rounds them), so the two can differ on near ties.
    """

    _RANKED = (keras.metrics.SparseCategoricalAccuracy, keras.metrics.SparseTopKCategoricalAccuracy)

    def __init__(self, model):
        self.model = model

    def __call__(self, x, y, y_pred, sample_weight) -> None:
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def readers_of_logits(self, y=None, logits=None) -> list[str]:
        """The metrics that need the logits themselves (``[]``: all computable from ranks).

        Builds the compiled metrics from ``y`` and ``logits`` (their shape) if Keras has not yet
        (it builds them at their first update, which the fused step never makes with logits).
        """
        if type(self.model).compute_metrics is not keras.Model.compute_metrics:
            return [f"of {type(self.model).__name__}.compute_metrics"]
        if y is not None and logits is not None:
            _compat.build_compiled_metrics(self.model, y, logits)
        objects = _compat.compiled_metric_objects(self.model)
        if objects is None:
            return ["compiled (on several outputs, or not built yet)"]
        return [repr(m.name) for m in objects[0] + objects[1] if not self._ranked(m)]

    def _ranked(self, metric) -> bool:
        return type(metric) in self._RANKED and not metric.get_config().get("from_sorted_ids", False)

    def update_from_ranks(self, y, ranks, sample_weight, mask) -> None:
        """Updates each metric from ``ranks`` (``[..., 2]``: classes beating the label, classes tying it
        with a smaller id), with the weights and mask Keras's ``MeanMetricWrapper`` would use."""
        plain, weighted = _compat.compiled_metric_objects(self.model)
        beaten, tied = ranks[..., 0], ranks[..., 1]
        for metric, weight in [(m, None) for m in plain] + [(m, sample_weight) for m in weighted]:
            if isinstance(metric, keras.metrics.SparseTopKCategoricalAccuracy):
                hits = beaten < metric.get_config()["k"]  # in_top_k: ties across the boundary are in
            else:
                hits = (beaten == 0) & (tied == 0)  # argmax: the first maximum wins
            values = tf.cast(hits, keras.backend.floatx())
            if values.shape.rank > 1 and values.shape[-1] == 1:  # labels [batch, 1]: Keras squeezes
                values = tf.squeeze(values, -1)
            weight = _compat.apply_mask(weight, mask, dtype=metric.dtype, reduction="sum")
            keras.metrics.Mean.update_state(metric, values, sample_weight=weight)


def _before_fit(model):
    """What the step needs before ``fit`` traces it, from fit's arguments, on the host.

    A model ``fit`` builds (a ``Sequential`` without ``keras.Input``, as stock
    Keras allows) is built from the first batch, and the step's variables
    (optimizer slots, loss scale) made, outside the traced function.
    ``fused_update="auto"`` weighs gradients against the activations of a
    batch, whose size the traced step does not know (its batch dimension is
    None): fit tells it.
    """

    def wrap(inner):
        def fit(x=None, y=None, batch_size=None, *args, **kwargs):
            step = model.effgrad_step
            if not step.ready:
                try:
                    first = _first_batch(x, y, None, batch_size)[0]
                except TypeError:  # a generator: prepare() then asks for a built model
                    first = None
                step.prepare(first)
            if step.fused_update is None and step.batch_hint is None:
                step.batch_hint = _first_batch_shape(x, batch_size)
            return inner(x, y, batch_size, *args, **kwargs)

        return fit

    return wrap


def _first_batch_shape(x, batch_size) -> tuple[int, int] | None:
    """``(rows, largest other axis)`` of fit's first batch (a dataset of unknown shape yields one batch)."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        spec = spec[0] if isinstance(spec, tuple) else spec  # (x, y[, sample_weight]): x alone
        if all(t.shape.is_fully_defined() for t in tf.nest.flatten(spec)):
            return shape_hint(spec)
        first = next(iter(x.take(1)), None)
        return None if first is None else shape_hint(keras.utils.unpack_x_y_sample_weight(first)[0])
    leaves = tf.nest.flatten(x)
    if leaves and all(getattr(leaf, "shape", None) for leaf in leaves):
        rows, extent = shape_hint(x) or (0, 1)
        return min(batch_size or 32, rows), extent
    return None


def _first_batch(x, y, sample_weight, batch_size):
    """The first batch ``fit`` will train on, from its arguments (arrays or a ``tf.data.Dataset``)."""
    if isinstance(x, tf.data.Dataset):
        return keras.utils.unpack_x_y_sample_weight(next(iter(x.take(1))))
    leaves = tf.nest.flatten(x)
    if not leaves or not all(hasattr(leaf, "shape") for leaf in leaves):
        raise TypeError(
            "attach(micro_batches='auto') plans from the first batch of fit's x: pass arrays/tensors or a "
            "tf.data.Dataset, or call effgrad.plan(...) yourself and attach(micro_batches=plan.micro_batches)."
        )
    rows = batch_size or 32
    first = lambda nest: None if nest is None else tf.nest.map_structure(lambda a: a[:rows], nest)  # noqa: E731
    return first(x), first(y), first(sample_weight)


def _attach_planned(model, step_options: dict) -> keras.Model:
    """``attach(micro_batches="auto", memory_budget=...)``: plan at the next ``fit`` from its first batch."""
    if step_options.get("micro_batches", "auto") != "auto" or step_options.get("memory_budget") is None:
        raise ValueError("attach plans with micro_batches='auto' and memory_budget=... together (bytes, '6GiB', 0.5).")
    budget = memory.parse_budget(step_options["memory_budget"])
    options = {k: v for k, v in step_options.items() if k not in PLANNER_OPTIONS}
    planning = StepOptions(**{"strategy": model.distribute_strategy, **options})  # every option checked now
    if _compat.has_compiled_metrics(model):
        # Whether they read the logits is known once fit builds them: plan the unfused step, the larger
        # of the two the attached step may run (accuracy and top-k alone let it fuse).
        planning = planning.replace(fused_loss=False)
    margin, verbose = step_options.get("margin", 0.1), step_options.get("verbose", True)

    def plan_at_fit(inner):
        def fit(x=None, y=None, batch_size=None, *args, sample_weight=None, **kwargs):
            objective = objective_lib.Objective.of_compiled(model, options.get("reduction"))  # what fit trains
            first = _first_batch(x, y, sample_weight, batch_size)
            plan = make_plan(model, objective, model.optimizer, first, budget, planning, margin, verbose, keep=True)
            _compat.hook_method(model, "fit", "plan", None, order=1)  # planned once: later fits train with it
            _attach(model, {**options, **plan.step_options}, plan.model, plan.accumulators)
            model.effgrad_plan = plan
            return model.fit(x, y, batch_size, *args, sample_weight=sample_weight, **kwargs)

        return fit

    _compat.hook_method(model, "fit", "plan", plan_at_fit, order=1)
    model.effgrad_plan = None
    return model
