"""Keras's compile(): its loss, metrics and config; loss internals (masks, rank alignment)."""

from __future__ import annotations

import contextlib

import keras  # noqa: F401
import tensorflow as tf

from effgrad._compat.versions import missing as _missing

__all__ = [
    "apply_mask",
    "build_compiled_metrics",
    "build_empty_compiled_metrics",
    "compile_state",
    "compiled_loss",
    "compiled_metric_objects",
    "get_keras_mask",
    "get_stateless_scope",
    "has_compiled_metrics",
    "loss_function_arguments",
    "loss_tracker",
    "loss_weights",
    "recording_compiled_loss",
    "set_compiled_optimizer",
    "set_keras_mask",
    "squeeze_or_expand_to_same_rank",
]


try:
    # The enclosing StatelessScope: nested checkpoints see pending state writes.
    from keras.src.backend import get_keras_mask, get_stateless_scope, set_keras_mask

    # Keras's own rank alignment of sample weights and masks against losses, and a metric's
    # combination of a mask with the sample weights.
    from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank
except (ImportError, AttributeError) as _err:  # pragma: no cover
    raise _missing("keras.src backend / losses internals", _err) from _err


try:
    # compile()'s loss: its per-output terms (path, loss, loss_weights, name).
    from keras.src.trainers.compile_utils import CompileLoss as _CompileLoss
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.trainers.compile_utils.CompileLoss", _err) from _err
if getattr(_CompileLoss, "Loss", None) is None or "_flat_losses" not in _CompileLoss.build.__code__.co_names:
    raise _missing("keras CompileLoss.Loss / CompileLoss._flat_losses", AttributeError("not found"))  # pragma: no cover

try:
    # compile()'s metrics: which were given (an empty list reads no predictions).
    from keras.src.trainers.compile_utils import CompileMetrics as _CompileMetrics
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.trainers.compile_utils.CompileMetrics", _err) from _err
if not {"_user_metrics", "_user_weighted_metrics", "_flat_metrics", "_flat_weighted_metrics"} <= set(
    _CompileMetrics.build.__code__.co_names
):
    raise _missing(
        "keras CompileMetrics._user_metrics / _user_weighted_metrics / _flat_metrics / _flat_weighted_metrics",
        AttributeError("not found"),
    )  # pragma: no cover


def compile_state(model):
    """What Keras's ``compile()`` creates anew on every call (the model's compile config).

    ``effgrad.attach`` compares it by identity to notice a recompile.
    """
    try:
        return model._compile_config
    except AttributeError as err:
        raise _missing("keras Model._compile_config (set by compile())", err) from err


def compiled_loss(model):
    """Keras's ``CompileLoss`` made by ``model.compile(loss=..., loss_weights=...)``."""
    loss = getattr(model, "_compile_loss", None)
    if not isinstance(loss, _CompileLoss):
        raise ValueError(f"{model.name} has no compiled loss: call model.compile(optimizer=..., loss=...) first.")
    return loss


def loss_weights(model):
    """``compile(loss_weights=...)``, or None."""
    return getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)


def has_compiled_metrics(model) -> bool:
    """Whether ``compile`` was given any metric or weighted metric (they read ``y_pred``).

    ``compile(..., weighted_metrics=[])`` (how a keras_hub task model is compiled without its
    default accuracy) keeps an empty ``CompileMetrics``: it reads nothing.
    """
    metrics = getattr(model, "_compile_metrics", None)
    return metrics is not None and bool(metrics._user_metrics or metrics._user_weighted_metrics)


def compiled_metric_objects(model) -> tuple[list, list] | None:
    """``(metrics, weighted_metrics)`` of a built single-output ``CompileMetrics``, or None.

    None when the model has several outputs or its compiled metrics are not
    built yet (Keras builds them symbolically before fit's first step).
    """
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is None or not metrics.built:
        return None
    plain, weighted = metrics._flat_metrics, metrics._flat_weighted_metrics
    if len(plain) != 1 or len(weighted) != 1:
        return None
    return (list(plain[0].metrics) if plain[0] else []), (list(weighted[0].metrics) if weighted[0] else [])


def build_compiled_metrics(model, y, y_pred) -> None:
    """Builds ``compile``'s metrics from ``y`` and the predictions' shape, as their first update would."""
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is not None and not metrics.built:
        metrics.build(y, y_pred)


def build_empty_compiled_metrics(model, y) -> None:
    """Builds an empty ``CompileMetrics`` that no step updates, so Keras's results can read it.

    Keras builds it at its first ``compute_metrics``; a step that computes no
    metric never calls that, and ``get_metrics_result`` refuses an unbuilt one.
    """
    if not has_compiled_metrics(model):
        build_compiled_metrics(model, y, y)  # no metric: only the structure's length is read


@contextlib.contextmanager
def recording_compiled_loss(loss, recorder):
    """Runs Keras's ``CompileLoss`` with each term's loss replaced by ``recorder(loss, loss_weight)``.

    Keras's ``CompileLoss.call`` matches ``y`` to the model's outputs (lists,
    dicts, output names, partial losses) and hands every term its ``y_true``,
    ``y_pred`` and ``sample_weight``; the recorders take the unreduced values
    there, so effgrad follows Keras's own structure rules instead of copying
    them.
    """
    original = loss._flat_losses
    rows = []  # the rows of the output the last term was given
    trackers = []

    def counted(fn):
        def term(y_true, y_pred, *args, **kwargs):
            rows[:] = [tf.shape(tf.nest.flatten(y_pred)[0])[0]]
            return fn(y_true, y_pred, *args, **kwargs)

        return term

    def by_rows(update):
        # Keras weights each output's loss tracker by the batch's static size: unknown in a micro-batch
        # (their number is a runtime value), so every micro-batch would weigh the same, uneven or not.
        def update_state(values, sample_weight=None):
            return update(values, sample_weight=rows[0] if sample_weight is None and rows else sample_weight)

        return update_state

    def swap():
        loss._flat_losses = [
            type(entry)(entry.path, counted(recorder(entry.loss, entry.loss_weights)), entry.loss_weights, entry.name)
            for entry in loss._flat_losses
        ]
        for metric in loss.metrics:
            object.__setattr__(metric, "update_state", by_rows(metric.update_state))
            trackers.append(metric)

    if loss.built:
        swap()
    else:
        # Keras builds it at its first call (matching y to the outputs first):
        # the recorders go in right after, for that same call.
        build = loss.build

        def build_then_record(y_true, y_pred):
            build(y_true, y_pred)
            nonlocal original
            original = loss._flat_losses
            swap()

        object.__setattr__(loss, "build", build_then_record)
    try:
        yield
    finally:
        loss.__dict__.pop("build", None)
        loss._flat_losses = original
        for metric in trackers:
            metric.__dict__.pop("update_state", None)


def set_compiled_optimizer(model, optimizer) -> None:
    """Makes ``optimizer`` the model's optimizer, also in the compile config ``model.save`` writes."""
    model.optimizer = optimizer
    config = getattr(compile_state(model), "config", None)
    if not isinstance(config, dict) or "optimizer" not in config:
        raise _missing("keras SerializableDict.config['optimizer'] in the compile config", KeyError("optimizer"))
    config["optimizer"] = optimizer


def loss_function_arguments(loss) -> dict:
    """The keyword arguments a ``keras.losses.LossFunctionWrapper`` passes its function (``from_logits``, ...)."""
    return dict(getattr(loss, "_fn_kwargs", {}))


def loss_tracker(model):
    """Keras's metric of the epoch-mean ``loss`` in ``fit``'s logs, or None."""
    return getattr(model, "_loss_tracker", None)
