"""Keras optimizers: cross-replica sums, slot keys, learning rates, tracked variables, checkpointed values."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from effgrad._compat.keras_layers import replaced
from effgrad._compat.versions import missing as _missing

__all__ = [
    "SavedAsVariable",
    "SlotsOfStandIns",
    "adam_slots",
    "built_for",
    "exclude_from_weight_decay_as",
    "gradients_already_reduced",
    "learning_rate",
    "optimizer_strategy",
    "set_learning_rate",
    "show_built_for",
    "slots_standing_in",
    "track_variable",
    "variable_key",
]


try:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer as _TFOptimizer
except (ImportError, AttributeError) as _err:  # pragma: no cover
    raise _missing("keras.src.backend.tensorflow.optimizer.TFOptimizer", _err) from _err

# (Checked on the class, not an instance: an optimizer would start TensorFlow's context at import.)
if not any(
    "_learning_rate" in getattr(getattr(cls, "__init__", None), "__code__", compile("", "", "exec")).co_names
    for cls in keras.optimizers.Optimizer.__mro__
):  # pragma: no cover
    raise _missing("keras Optimizer._learning_rate", AttributeError("not found"))


try:
    # Keras's own attribute tracking (what an optimizer adds to .variables), switched off around an assignment.
    from keras.src.utils import tracking as _keras_tracking
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.utils.tracking", _err) from _err
if not hasattr(_keras_tracking, "DotNotTrackScope"):  # pragma: no cover
    raise _missing("keras.src.utils.tracking.DotNotTrackScope", AttributeError("not found"))


if not callable(getattr(_TFOptimizer, "_all_reduce_sum_gradients", None)):  # pragma: no cover
    raise _missing("keras TFOptimizer._all_reduce_sum_gradients", AttributeError("not found"))


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops a Keras optimizer from summing gradients across replicas again.

    Keras's TF optimizer all-reduces the gradients given to ``apply()`` in
    replica context. effgrad's gradients are already the step's one
    cross-replica sum (needed before the finiteness check and the clipping),
    so a second sum would multiply them by the number of replicas. The
    override is an instance attribute that exists only while ``apply()`` runs.

    Raises:
        TypeError: the optimizer is not a Keras TensorFlow optimizer, so there
            is no known way to keep it from reducing a second time.
    """
    if not isinstance(optimizer, _TFOptimizer):
        raise TypeError(
            f"{type(optimizer).__name__} is not a Keras optimizer of the TensorFlow backend; effgrad "
            "cannot stop it from all-reducing gradients a second time. Use a keras.optimizers.Optimizer "
            "with KERAS_BACKEND=tensorflow."
        )
    # object.__setattr__: a plain instance attribute, no Keras tracking.
    object.__setattr__(optimizer, "_all_reduce_sum_gradients", list)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "_all_reduce_sum_gradients")


def variable_key(optimizer, variable):
    """The key a Keras optimizer files ``variable``'s slots under."""
    return optimizer._var_key(variable)


def optimizer_strategy(optimizer) -> tf.distribute.Strategy:
    """The ``tf.distribute`` strategy a Keras optimizer was built under."""
    return optimizer._distribution_strategy


class SlotsOfStandIns:
    """Mixed into a Keras optimizer: an object standing for a variable (with ``stands_for``, e.g. a part of it
    being updated) finds that variable's slots, which Keras looks up by ``_get_variable_index``."""

    def _get_variable_index(self, variable):
        return super()._get_variable_index(_standing_for(variable))


if not all(hasattr(keras.optimizers.Optimizer, a) for a in ("_var_key", "_get_variable_index")):  # pragma: no cover
    raise _missing("keras Optimizer._var_key / _get_variable_index", AttributeError("not found"))


# Where Keras's Adam and AdamW keep each variable's slots (``build``), in the order ``update_step`` reads them.
_ADAM_SLOTS = ("_momentums", "_velocities", "_velocity_hats")


def _adam_slot_lists(optimizer) -> list[str]:
    return [name for name in _ADAM_SLOTS if isinstance(vars(optimizer).get(name), list)]


def adam_slots(optimizer, variable) -> list | None:
    """The slot variables of ``variable`` in a built Keras Adam or AdamW (None where they are not found)."""
    names = _adam_slot_lists(optimizer)
    if len(names) < 2:
        return None
    index = optimizer._get_variable_index(variable)
    return [vars(optimizer)[name][index] for name in names]


@contextlib.contextmanager
def slots_standing_in(optimizer, variable, stand_ins: list):
    """Inside the block, Keras's Adam or AdamW finds ``stand_ins`` (in :func:`adam_slots`' order) as the
    slots of ``variable`` and of any object standing for it (``stands_for``): its ``update_step`` then
    updates a part of them."""
    index = optimizer._get_variable_index(variable)
    own_index = optimizer._get_variable_index

    def index_of(v):
        return own_index(_standing_for(v))

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(optimizer, "_get_variable_index", index_of))
        for name, stand_in in zip(_adam_slot_lists(optimizer), stand_ins):
            slots = list(vars(optimizer)[name])
            slots[index] = stand_in
            stack.enter_context(replaced(optimizer, name, slots))
        yield


def _standing_for(variable):
    """The variable an object stands for (``stands_for``: a part of it being updated), or itself."""
    return getattr(variable, "stands_for", variable)


def built_for(optimizer) -> list:
    """The variables a built Keras optimizer keeps state for, in its order."""
    return list(optimizer._trainable_variables)


def show_built_for(optimizer, variables) -> None:
    """Makes ``variables`` the ones a built optimizer lists (and its checkpoint saves, as
    ``optimizer/_trainable_variables/i``); the update still finds its state by the variables it was built on."""
    with _keras_tracking.DotNotTrackScope():  # not into optimizer.variables (TensorFlow's tracking still sees it)
        optimizer._trainable_variables = list(variables)


def learning_rate(optimizer):
    """The optimizer's learning rate as given: a number, a variable, a schedule or a callable."""
    return optimizer._learning_rate


def set_learning_rate(optimizer, rate) -> None:
    """Gives ``optimizer`` the very object ``rate`` (a schedule or callable is kept, not copied)."""
    optimizer._learning_rate = rate


def config_and_exclusions(optimizer) -> tuple[dict, dict]:
    """``optimizer``'s config, and what it holds outside it: the weight-decay exclusions.

    A learning rate that is not a variable (a schedule, a callable) is left out of the config (a number
    stands in): a callable has no config, nor a schedule without ``get_config``; the caller hands the
    object itself on (:func:`set_learning_rate`).
    """
    rate = optimizer._learning_rate
    if not isinstance(rate, keras.Variable):
        optimizer._learning_rate = 0.001
    try:
        config = optimizer.get_config()
    finally:
        optimizer._learning_rate = rate
    names = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")
    return config, {name: vars(optimizer)[name] for name in names if name in vars(optimizer)}


def set_exclusions(optimizer, exclusions: dict) -> None:
    """Gives ``optimizer`` the weight-decay exclusions :func:`config_and_exclusions` read from another."""
    for name, value in exclusions.items():
        setattr(optimizer, name, value)
    if exclusions:
        optimizer._exclude_from_weight_decay_cache = {}


if not any(
    "_serialize_to_tensors" in vars(c) for c in keras.Variable.__mro__ if c.__module__.startswith("keras")
) or not any("_track_variable" in vars(c) for c in keras.optimizers.Optimizer.__mro__):  # pragma: no cover
    raise _missing("keras Variable._serialize_to_tensors / Optimizer._track_variable", AttributeError("not found"))


class SavedAsVariable(keras.Variable):
    """A ``keras.Variable`` checkpointed as another tensor than the one it stores.

    TensorFlow's checkpoints (``tf.train.Checkpoint``) read a trackable's value through its
    ``_serialize_to_tensors`` and write it back through ``_restore_from_tensors``; these route both
    to :meth:`saved_value` and :meth:`restore_saved_value`, which subclasses define.
    """

    def saved_value(self) -> tf.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def restore_saved_value(self, value) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.saved_value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.restore_saved_value(restored_tensors["VARIABLE_VALUE"])


def track_variable(optimizer, variable) -> None:
    """Adds ``variable`` to ``optimizer.variables`` (saved with it), as its ``add_variable`` does."""
    optimizer._track_variable(variable)


def exclude_from_weight_decay_as(optimizer, variable, model_variable) -> None:
    """Excludes ``variable`` from weight decay if ``optimizer.exclude_from_weight_decay(var_list=...)``
    named ``model_variable`` (the public method replaces every exclusion at once). Before ``build``."""
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded and optimizer._var_key(model_variable) in excluded:
        excluded.add(optimizer._var_key(variable))
