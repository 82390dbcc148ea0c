"""The train-step builder: micro-batches, loss scaling and clipping in one step.

This is the one module that composes the others. One call of the step is one
optimizer update of the loss (``w`` = sample weights, ``l`` = unreduced losses)::

    L = sum(w * l) / sum(w)  over the WHOLE batch   +   weight regularization

Per replica, inside one ``tf.function``::

    S = loss_scale.value                         # constant within the step
    G = sum over micro-batches i of  d(S * sum(w_i * l_i) / B_local) / dθ   (float32)
    G = G * B_local / S                          # unscale once -> d sum(w*l) / dθ
    G, sum(w*l), sum(w) = all_reduce(SUM, ...)   # the step's ONE cross-replica reduction
    g = G / sum(w) + d(regularization) / dθ
    finite = all(isfinite(g))                    # identical on every replica (after the sum)
    g = clip_by_global_norm(g, clip_norm)        # unscaled and reduced
    if finite and sum(w) > 0: optimizer.apply(g) # else: nothing changes
    loss_scale.update(finite)

Dividing each micro-batch by the local batch size keeps the scaled objective
at the magnitude of a mean loss (what float16 loss scaling is tuned for), and
multiplying back before the reduction makes the result exact whatever the
micro-batch and replica sizes are.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from effgrad import accumulate
from effgrad import loss_scale as loss_scale_lib

__all__ = ["TrainStep", "build_train_step", "attach"]

# How often (in calls) the step reads the loss-scale state to warn about a
# collapsed scale; reading it every call would force a device sync.
_COLLAPSE_CHECK_EVERY = 10
_COLLAPSE_STREAK = 10


def _unreduced_loss(loss) -> Callable:
    """Returns ``fn(y_true, y_pred) -> per-example/element losses``."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        # `call` is the unreduced loss; `__call__` would reduce it.
        return loss.call
    if callable(loss):
        return loss
    raise TypeError(
        f"loss must be a keras.losses.Loss, a loss name or a callable(y_true, y_pred) "
        f"returning unreduced losses, got {type(loss).__name__}."
    )


def _to_float32(nest):
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, nest)


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


def _as_tensors(nest):
    return tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), nest)


def _relaxed_spec(t):
    if t is None:
        return None
    shape = t.shape.as_list()
    if not shape:
        raise ValueError("Inputs need a leading batch dimension; got a scalar.")
    return tf.TensorSpec([None] + shape[1:], t.dtype)


@contextlib.contextmanager
def _gradients_already_reduced(optimizer):
    """Stops Keras' TF optimizer from summing gradients across replicas again.

    Keras' ``apply()`` all-reduces the gradients it is given when it runs in
    replica context. effgrad's gradients are already the one cross-replica sum
    of the step (needed before the finiteness check and the clipping), so a
    second sum would multiply them by the number of replicas. The override is
    an instance attribute that exists only while ``apply()`` is traced.
    """
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        yield
        return
    # object.__setattr__: plain instance attribute, no Keras tracking.
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", list)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "_all_reduce_sum_gradients")


def _regularized(variables):
    return [(i, v) for i, v in enumerate(variables) if getattr(v, "regularizer", None) is not None]


class TrainStep:
    """A compiled train step; build it with :func:`build_train_step`.

    Attributes:
        micro_batches: Micro-batches every batch is split into.
        loss_scale: The :class:`effgrad.LossScale` in use.
        strategy: The ``tf.distribute.Strategy`` the step runs under.
        trace_count: How often the step function has been traced (a step
            traces once per input structure/dtype; batch size never retraces).
    """

    def __init__(
        self,
        model,
        loss,
        optimizer,
        *,
        micro_batches: int = 1,
        loss_scale="auto",
        clip_norm: float | None = None,
        jit_compile: bool = False,
        strategy: tf.distribute.Strategy | None = None,
        on_micro_batch: Callable | None = None,
    ):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int (1 = no accumulation), got {micro_batches!r}.")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not clip_norm > 0):
            raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}.")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}.")
        if not callable(model) or not hasattr(model, "trainable_variables"):
            raise TypeError(f"model must be a keras.Model or keras.Layer, got {type(model).__name__}.")
        self.model = model
        self.optimizer = optimizer
        self.micro_batches = int(micro_batches)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.jit_compile = bool(jit_compile)
        self.strategy = strategy or tf.distribute.get_strategy()
        self.on_micro_batch = on_micro_batch
        self._loss_fn = _unreduced_loss(loss)
        with self.strategy.scope():
            self.loss_scale = loss_scale_lib.get(loss_scale, model)
        self.trace_count = 0
        self._calls = 0
        self._warned_collapse = False
        self._ready = False
        self._signatures: set[str] = set()
        self._compute = tf.function(self._compute_gradients, jit_compile=self.jit_compile)
        self._step = tf.function(self._distributed_step)
        if getattr(model, "built", False):
            self._prepare()

    # ------------------------------------------------------------------ edges
    def _prepare(self, x=None) -> None:
        """Builds model and optimizer variables outside any tf.function."""
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
        if not self.optimizer.built:
            with self.strategy.scope():
                self.optimizer.build(variables)
        self._ready = True

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
        if distributed:
            logs = self._step(x, y, sample_weight)
        else:
            specs = tf.nest.map_structure(_relaxed_spec, (x, y, sample_weight))
            key = repr(specs)
            if key not in self._signatures:
                # Tracing with a None batch dimension up front means later
                # batch sizes reuse this graph instead of retracing.
                self._step.get_concrete_function(*specs)
                self._signatures.add(key)
            logs = self._step(x, y, sample_weight)
        self._watch_loss_scale()
        return logs

    def _watch_loss_scale(self) -> None:
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
        return {k: self.strategy.experimental_local_results(v)[0] for k, v in logs.items()}

    def _micro_step(self, local_rows):
        def micro_step(batch):
            x, y, sample_weight = batch
            y_pred = self.model(x, training=True)
            self._reject_call_losses()
            losses = tf.convert_to_tensor(self._loss_fn(y, _to_float32(y_pred)))
            if losses.shape.rank == 0:
                raise ValueError(
                    "The loss returned a scalar, i.e. it is already reduced over the batch; effgrad "
                    "needs unreduced losses (shape [batch] or [batch, ...]) to normalize once over the "
                    "whole batch. Pass a keras.losses.Loss instance or a function like "
                    "`lambda y, p: keras.losses.mean_squared_error(y, p)`."
                )
            weights = tf.ones_like(losses, tf.float32)
            if sample_weight is not None:
                weights = accumulate.broadcast_weights(sample_weight, losses)
            weighted_sum = tf.reduce_sum(weights * tf.cast(losses, tf.float32))
            if self.on_micro_batch is not None:
                self.on_micro_batch(x, y, y_pred, sample_weight)
            objective = self.loss_scale.scale(weighted_sum / local_rows)
            return objective, (weighted_sum, tf.reduce_sum(weights))

        return micro_step

    def _reject_call_losses(self) -> None:
        n_call_losses = len(self.model.losses) - len(_regularized(self.model.trainable_variables))
        if n_call_losses > 0:
            raise NotImplementedError(
                "The model adds losses in its forward pass (add_loss / activity_regularizer). They are "
                "batch statistics that effgrad cannot renormalize over the whole batch; move the term "
                "into the loss function or use a kernel regularizer instead."
            )

    def _compute_gradients(self, x, y, sample_weight):
        """Replica-local: raw (unscaled, unnormalized) gradient sums, XLA-compilable."""
        variables = self.model.trainable_variables
        local_rows = tf.cast(tf.maximum(accumulate.batch_size(x), 1), tf.float32)
        grads, (weighted_sum, weight_sum) = accumulate.accumulate_gradients(
            self._micro_step(local_rows), variables, (x, y, sample_weight), self.micro_batches, num_aux=2
        )
        grads = self.loss_scale.unscale(grads, multiplier=local_rows)  # one pass over the gradients

        regularized = _regularized(variables)
        reg_loss, reg_grads = tf.zeros([], tf.float32), {}
        if regularized:
            with tf.GradientTape() as tape:
                reg_loss = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for _, v in regularized])
            reg_grads = dict(zip((i for i, _ in regularized), tape.gradient(reg_loss, [v for _, v in regularized])))
        return grads, weighted_sum, weight_sum, reg_loss, reg_grads

    def replica_step(self, x, y, sample_weight=None, shard: bool = False) -> dict:
        """One step in replica context (what ``model.fit`` calls via :func:`attach`)."""
        ctx = tf.distribute.get_replica_context()
        if shard:
            x, y, sample_weight = self._shard((x, y, sample_weight), ctx)
        grads, weighted_sum, weight_sum, reg_loss, reg_grads = self._compute(x, y, sample_weight)

        grads, weighted_sum, weight_sum = ctx.all_reduce(tf.distribute.ReduceOp.SUM, (grads, weighted_sum, weight_sum))
        grads = [tf.math.divide_no_nan(g, weight_sum) for g in grads]
        for i, reg_grad in reg_grads.items():
            grads[i] += reg_grad
        loss = tf.math.divide_no_nan(weighted_sum, weight_sum) + reg_loss
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        if self.clip_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.clip_norm, use_norm=tf.linalg.global_norm(grads))
        has_weight = weight_sum > 0
        ctx.merge_call(self._apply, args=(grads, finite, has_weight))
        return {"loss": loss, "loss_scale": self.loss_scale.value, "grads_finite": finite}

    def _shard(self, batch, ctx):
        """This replica's contiguous rows of a global batch (balanced split)."""
        n = ctx.num_replicas_in_sync
        r = ctx.replica_id_in_sync_group
        rows = accumulate.batch_size(batch)
        start, stop = (rows * r) // n, (rows * (r + 1)) // n
        return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], batch)

    def _apply(self, strategy, grads, finite, has_weight):
        """Cross-replica: apply the agreed update or skip it entirely."""
        # The flags come from all-reduced sums, so every replica holds the
        # same value and the first one speaks for all. A tf.cond whose branch
        # synchronizes replicas must run in cross-replica context.
        finite = strategy.experimental_local_results(finite)[0]
        has_weight = strategy.experimental_local_results(has_weight)[0]

        def apply():
            # Entered here, in the one cross-replica thread, not per replica thread.
            with _gradients_already_reduced(self.optimizer):
                strategy.extended.call_for_each_replica(self._apply_in_replica, args=(grads,))
            return tf.constant(True)

        applied = tf.cond(finite & has_weight, apply, lambda: tf.constant(False))
        with tf.control_dependencies([applied]):
            # An empty batch (no weight) is not evidence about the scale.
            return tf.cond(has_weight, lambda: self._update_loss_scale(finite), lambda: tf.constant(False))

    def _apply_in_replica(self, grads):
        self.optimizer.apply(grads, self.model.trainable_variables)

    def _update_loss_scale(self, finite):
        op = self.loss_scale.update(finite)
        with tf.control_dependencies([op] if op is not None else []):
            return tf.constant(True)


def build_train_step(
    model,
    loss,
    optimizer,
    *,
    micro_batches: int = 1,
    loss_scale="auto",
    clip_norm: float | None = None,
    jit_compile: bool = False,
    strategy: tf.distribute.Strategy | None = None,
    on_micro_batch: Callable | None = None,
) -> TrainStep:
    """Builds a compiled step that applies one exact update per batch.

    The update equals the plain full-batch update of
    ``L = sum(w * l) / sum(w) + regularization`` for any batch size and any
    ``micro_batches``; only one micro-batch's activations are in memory at a
    time.

    Example:
        >>> step = effgrad.build_train_step(model, keras.losses.MeanSquaredError(),
        ...                                 keras.optimizers.Adam(1e-3), micro_batches=4)
        >>> logs = step(x, y)            # one optimizer update on the whole batch
        >>> float(logs["loss"])

    Args:
        model: A built or buildable ``keras.Model``/``keras.Layer``.
        loss: A ``keras.losses.Loss``, a Keras loss name, or a callable
            ``(y_true, y_pred) -> losses`` with a leading batch dimension
            (NOT reduced: effgrad normalizes once over the whole batch).
        optimizer: A ``keras.optimizers.Optimizer``.
        micro_batches: Split every batch into this many micro-batches.
        loss_scale: ``"auto"`` (dynamic iff the model computes in float16),
            ``None``, ``"dynamic"``, a number (static) or a ``LossScale``.
        clip_norm: Clip the global norm of the final (unscaled, reduced)
            gradient.
        jit_compile: Compile the gradient computation with XLA.
        strategy: A ``tf.distribute.Strategy``; default: the current one.
        on_micro_batch: Optional ``fn(x, y, y_pred, sample_weight)`` called
            inside the compiled step once per micro-batch (padded rows carry
            weight 0), e.g. to update metrics.

    Returns:
        A :class:`TrainStep`; call it as ``step(x, y, sample_weight=None)``.

    Trap:
        Keras losses reduce by default (``"sum_over_batch_size"``); effgrad
        calls ``loss.call`` to get the unreduced values, so a custom callable
        must not reduce over the batch either.
    """
    return TrainStep(
        model,
        loss,
        optimizer,
        micro_batches=micro_batches,
        loss_scale=loss_scale,
        clip_norm=clip_norm,
        jit_compile=jit_compile,
        strategy=strategy,
        on_micro_batch=on_micro_batch,
    )


def attach(model: keras.Model, **step_options) -> keras.Model:
    """Makes ``model.fit`` train with an effgrad step (after ``model.compile``).

    Uses the compiled loss, optimizer and metrics; metrics are updated once per
    micro-batch, and ``loss_scale`` shows in the logs when scaling is on.

    Example:
        >>> model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        >>> effgrad.attach(model, micro_batches=8)
        >>> model.fit(x, y, batch_size=256)

    Args:
        model: A compiled ``keras.Model`` with a single loss.
        **step_options: Keyword arguments of :func:`build_train_step`.

    Returns:
        ``model`` itself.
    """
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError("attach() needs a compiled model: call model.compile(optimizer=..., loss=...) first.")
    if model.loss is None or isinstance(model.loss, (dict, list, tuple)):
        raise NotImplementedError(
            "attach() supports one compiled loss; for several outputs pass one callable that "
            "combines them, or call effgrad.build_train_step directly."
        )
    step_options.setdefault("strategy", model.distribute_strategy)

    def update_metrics(x, y, y_pred, sample_weight):
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    step = build_train_step(model, model.loss, model.optimizer, on_micro_batch=update_metrics, **step_options)

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        logs = step.replica_step(x, y, sample_weight)
        tracker = getattr(model, "_loss_tracker", None)  # Keras' epoch-mean "loss"
        if tracker is not None:
            tracker.update_state(logs["loss"], sample_weight=accumulate.batch_size(x))
        results = dict(model.get_metrics_result())
        results.setdefault("loss", logs["loss"])
        if not isinstance(step.loss_scale, loss_scale_lib.NoLossScale):
            results["loss_scale"] = logs["loss_scale"]
            results["grads_finite"] = tf.cast(logs["grads_finite"], tf.float32)
        return results

    original_make_train_function = model.make_train_function

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        original_make_train_function(force=True)  # sets model.train_function
        compiled = model.train_function

        def train_function(iterator):
            logs = compiled(iterator)
            step._watch_loss_scale()  # Python side, between fit's steps
            return logs

        model.train_function = train_function
        return train_function

    model.train_step = train_step
    model.make_train_function = make_train_function
    model.effgrad_step = step
    model.train_function = None  # rebuilt by the next fit()
    return model
