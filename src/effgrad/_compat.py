"""Every TensorFlow/Keras internal effgrad borrows, in one place, checked at import.

effgrad needs a handful of non-public hooks (listed below, each with why). A
TensorFlow or Keras release may rename any of them; effgrad must then fail
loudly at import, naming the versions, instead of silently falling back to a
path that computes something else (e.g. a second all-reduce that multiplies
every multi-replica update by the number of replicas).

Tested with TensorFlow 2.21 and Keras 3.15 (pinned in pyproject.toml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import threading

import keras
import tensorflow as tf

__all__ = [
    "TESTED",
    "add_control_input",
    "BaseConv",
    "BaseDepthwiseConv",
    "apply_mask",
    "attention_classes",
    "attention_internals",
    "call_context_training",
    "build_compiled_metrics",
    "compiled_metric_objects",
    "compile_state",
    "compiled_loss",
    "context_started",
    "functional_graph",
    "get_keras_mask",
    "gradient_function",
    "get_stateless_scope",
    "gradients_already_reduced",
    "built_for",
    "SlotsOfStandIns",
    "variable_key",
    "optimizer_strategy",
    "LayerCall",
    "show_built_for",
    "collective_arguments",
    "collective_launchers",
    "current_device",
    "dynamic_update_slice",
    "exclude_from_weight_decay_as",
    "flatten_layers",
    "hook_method",
    "in_xla_context",
    "inbound_nodes",
    "intercepted_call",
    "learning_rate",
    "loss_function_arguments",
    "loss_tracker",
    "mmap_of",
    "model_state",
    "own_variables",
    "plain_convolution",
    "producer",
    "set_learning_rate",
    "optimization_barrier",
    "override_method",
    "restore_method",
    "recording_compiled_loss",
    "replaced",
    "rnn_loop",
    "seed_states",
    "SavedAsVariable",
    "set_compiled_optimizer",
    "set_keras_mask",
    "squeeze_or_expand_to_same_rank",
    "stop_recording",
    "track_variable",
]

TESTED = "TensorFlow 2.21 / Keras 3.15"


def _missing(what: str, err: Exception) -> ImportError:
    return ImportError(
        f"effgrad relies on {what}, which TensorFlow {tf.__version__} / Keras {keras.__version__} "
        f"does not provide ({type(err).__name__}: {err}). effgrad is tested with {TESTED}: install "
        "those versions (pip install 'tensorflow>=2.21,<2.22' 'keras>=3.15,<3.16') or an effgrad "
        "release made for your versions."
    )


try:
    # Runs a checkpointed forward pass without recording it on any tape.
    # Keeps grappler from merging a recompute back into the forward pass; writes a block at a
    # traced offset in place under XLA (the fused loss's kernel gradient).
    from tensorflow.compiler.tf2xla.python.xla import dynamic_update_slice, optimization_barrier
    from tensorflow.python.eager.record import stop_recording

    # Tells whether a graph is being compiled by XLA (the recompute guard differs).
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except (ImportError, AttributeError) as _err:  # pragma: no cover - only on an untested TF
    raise _missing("tensorflow.python.eager.record / control_flow_util / tf2xla xla ops", _err) from _err

try:
    # The registered gradient function of a graph op: fused_update makes a weight's gradient from the
    # gradient of one use's output, as backprop would.
    from tensorflow.python.framework.ops import get_gradient_function as gradient_function
except ImportError as _err:  # pragma: no cover
    raise _missing("tensorflow.python.framework.ops.get_gradient_function", _err) from _err
if not callable(getattr(tf.Operation, "_add_control_input", None)):  # pragma: no cover
    raise _missing("tf.Operation._add_control_input", AttributeError("not found"))


def add_control_input(op, control) -> None:
    """Makes graph op ``op`` (already made) wait for ``control``: backprop paced by the updates it feeds."""
    op._add_control_input(control)


try:
    # The enclosing StatelessScope: nested checkpoints see pending state writes.
    from keras.src.backend import get_keras_mask, get_stateless_scope, set_keras_mask
    from keras.src.backend.tensorflow.optimizer import TFOptimizer as _TFOptimizer

    # Keras's own rank alignment of sample weights and masks against losses, and a metric's
    # combination of a mask with the sample weights.
    from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank
except (ImportError, AttributeError) as _err:  # pragma: no cover
    raise _missing("keras.src backend / losses internals", _err) from _err

try:
    # Per-example norms mirror the convolution layers' calls (their shared bases), and run a
    # recurrent layer's cell arithmetic through Keras's own loop (masks, go_backwards, unroll)
    # as the layer's inner_loop does.
    from keras.src.backend import rnn as rnn_loop
    from keras.src.layers.convolutional.base_conv import BaseConv as _BaseConv
    from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.layers.convolutional BaseConv / BaseDepthwiseConv, keras.src.backend.rnn", _err) from _err
BaseConv = _BaseConv
_tracker = getattr(keras.layers.Layer, "_initialize_tracker", None)
if _tracker is None or "_seed_generators" not in inspect.unwrap(_tracker).__code__.co_names:
    raise _missing("keras Layer._seed_generators", AttributeError("not found"))  # pragma: no cover
if not hasattr(keras.layers.Layer, "_flatten_layers"):  # pragma: no cover
    raise _missing("keras Layer._flatten_layers", AttributeError("not found"))
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

try:
    from keras.src.ops.node import Node as _Node
    from keras.src.ops.symbolic_arguments import SymbolicArguments as _SymbolicArguments
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.ops Node / SymbolicArguments (the functional layer graph)", _err) from _err
_NODE_READS = ("operation", "input_tensors", "output_tensors", "arguments", "is_input")
if not all(hasattr(_Node, a) or a in _Node.__init__.__code__.co_names for a in _NODE_READS) or not all(
    hasattr(_SymbolicArguments, a) or a in _SymbolicArguments.__init__.__code__.co_names for a in ("fill_in", "args")
):  # pragma: no cover
    raise _missing("keras Node.operation/input_tensors/output_tensors/arguments/is_input", AttributeError("not found"))

if not callable(getattr(_TFOptimizer, "_all_reduce_sum_gradients", None)):  # pragma: no cover
    raise _missing("keras TFOptimizer._all_reduce_sum_gradients", AttributeError("not found"))


def context_started() -> bool:
    """Whether TensorFlow's eager context (devices, allocators) has started.

    TensorFlow reads ``TF_CPU_ALLOCATOR_USE_BFC`` when its context starts (the
    first op or device query), not at ``import tensorflow`` (measured on
    2.21): until then effgrad can still turn CPU allocator statistics on.
    """
    from tensorflow.python.eager import context

    return bool(getattr(context.context(), "_initialized", True))


def in_xla_context() -> bool:
    """True while tracing inside a function compiled with XLA."""
    return bool(_in_xla(tf.compat.v1.get_default_graph()))


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

    def swap():
        loss._flat_losses = [
            type(entry)(entry.path, recorder(entry.loss, entry.loss_weights), entry.loss_weights, entry.name)
            for entry in loss._flat_losses
        ]

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


def set_compiled_optimizer(model, optimizer) -> None:
    """Makes ``optimizer`` the model's optimizer, also in the compile config ``model.save`` writes."""
    model.optimizer = optimizer
    config = getattr(compile_state(model), "config", None)
    if not isinstance(config, dict) or "optimizer" not in config:
        raise _missing("keras SerializableDict.config['optimizer'] in the compile config", KeyError("optimizer"))
    config["optimizer"] = optimizer


def functional_graph(model):
    """``(nodes_by_depth, inputs, outputs)`` of a functional model's recorded layer graph, or None.

    Keras records the graph of a functional model (and of a built Sequential
    model, which holds one) but exposes no public walk over its layer calls;
    ``effgrad.checkpoint_model`` needs one to find where to cut. ``inputs`` and
    ``outputs`` keep the model's nesting (dicts of named inputs, lists). Each
    layer call is a :class:`LayerCall` (Keras's ``Node`` read once, here).
    """
    if isinstance(model, keras.Sequential):
        model = getattr(model, "_functional", None)
    if model is None or not isinstance(model, keras.Model) or not hasattr(model, "_nodes_by_depth"):
        return None
    try:
        nodes = {depth: [_layer_call(n) for n in at] for depth, at in model._nodes_by_depth.items()}
        return nodes, model._inputs_struct, model._outputs_struct
    except AttributeError as err:  # pragma: no cover
        raise _missing("keras Functional._inputs_struct/_outputs_struct", err) from err


def flatten_layers(model) -> list:
    """``model`` and every layer nested in it, each once (Keras's own walk over sublayers); ``[op]`` for an op."""
    walk = getattr(model, "_flatten_layers", None)
    return [model] if walk is None else list(walk(include_self=True, recursive=True))


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
        return super()._get_variable_index(getattr(variable, "stands_for", variable))


if not all(hasattr(keras.optimizers.Optimizer, a) for a in ("_var_key", "_get_variable_index")):  # pragma: no cover
    raise _missing("keras Optimizer._var_key / _get_variable_index", AttributeError("not found"))


def built_for(optimizer) -> list:
    """The variables a built Keras optimizer keeps state for, in its order."""
    return list(optimizer._trainable_variables)


def show_built_for(optimizer, variables) -> None:
    """Makes ``variables`` the ones a built optimizer lists (and its checkpoint saves, as
    ``optimizer/_trainable_variables/i``); the update still finds its state by the variables it was built on."""
    with _keras_tracking.DotNotTrackScope():  # not into optimizer.variables (TensorFlow's tracking still sees it)
        optimizer._trainable_variables = list(variables)


def own_variables(layer) -> list:
    """The variables ``layer`` created itself (``add_weight``), not those of its sublayers."""
    seen, own = set(), []
    for v in [*layer._trainable_variables, *layer._non_trainable_variables]:
        if id(v) not in seen:
            seen.add(id(v))
            own.append(v)
    return own


def seed_states(layer) -> list:
    """The state variables of the seed generators of ``layer`` and its sublayers (Keras random ops advance them)."""
    return [g.state for sub in flatten_layers(layer) for g in getattr(sub, "_seed_generators", ())]


def plain_convolution(layer) -> bool:
    """``layer`` is a Keras convolution whose ``call`` and ``convolution_op`` are the base class's."""
    return (
        isinstance(layer, _BaseConv)
        and type(layer).call is _BaseConv.call
        and type(layer).convolution_op is _BaseConv.convolution_op
    )


# Two traces in two threads on the same model must not see each other's hooks.
_INTERCEPTING = threading.RLock()


@contextlib.contextmanager
def replaced(obj, name: str, value):
    """``obj.<name>`` is ``value`` inside the block (an instance attribute, outside Keras's tracking), as it
    was after: the one way effgrad swaps a method of a Keras object for the length of a call."""
    own = obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if own is None:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, own)


@contextlib.contextmanager
def intercepted_call(layer, replacement):
    """``layer.call`` is ``replacement(original_call, *args, **kwargs)`` inside the block.

    effgrad's one mechanism for hooks on a model: saliency's ``layer=`` reads
    a layer's output with it, per-example norms tap every weighted layer.
    Keras's ``Layer.__call__`` looks ``self.call`` up on every call and keeps
    its own work around it (casting, autocast, masks), so an instance
    attribute seen only while a function is TRACED is enough: the traced graph
    keeps what the hook added, and the model object is left as it was.
    ``object.__setattr__`` keeps Keras's attribute tracking out of it; hooks
    nest (the inner one sees the outer one's call as the original), and
    traces in two threads take turns (a lock).
    """
    with _INTERCEPTING:
        original = layer.call
        with replaced(layer, "call", lambda *args, **kwargs: replacement(original, *args, **kwargs)):
            yield


@dataclasses.dataclass(frozen=True, eq=False)
class LayerCall:
    """One recorded call of a layer in a functional model: Keras's ``Node``, read here only.

    Attributes:
        layer: The layer (or operation) called.
        inputs: The symbolic tensors it was called on.
        outputs: The symbolic tensors it made.
        args: Its positional arguments as recorded (symbolic tensors and constants).
        kwargs: Its keyword arguments as recorded.
        is_input: Whether it is a model input's placeholder, not a call.
    """

    layer: object
    inputs: list
    outputs: list
    args: tuple
    kwargs: dict
    is_input: bool
    _node: object = dataclasses.field(repr=False)

    def fill_in(self, values: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with each symbolic input replaced by ``values[id(tensor)]``."""
        return self._node.arguments.fill_in(values)


def _layer_call(node) -> LayerCall:
    arguments = node.arguments
    return LayerCall(
        node.operation, list(node.input_tensors), list(node.output_tensors), tuple(arguments.args),
        dict(arguments.kwargs), bool(node.is_input), node,
    )  # fmt: skip


def producer(tensor) -> tuple[object, LayerCall]:
    """``(layer, its call)`` that produced a symbolic Keras tensor of a functional model."""
    layer, node_index, _ = tensor._keras_history
    return layer, _layer_call(layer._inbound_nodes[node_index])


def inbound_nodes(layer) -> list[LayerCall]:
    """Every call of ``layer`` recorded in functional models (one per graph it is used in)."""
    return [_layer_call(node) for node in getattr(layer, "_inbound_nodes", [])]


def loss_function_arguments(loss) -> dict:
    """The keyword arguments a ``keras.losses.LossFunctionWrapper`` passes its function (``from_logits``, ...)."""
    return dict(getattr(loss, "_fn_kwargs", {}))


def loss_tracker(model):
    """Keras's metric of the epoch-mean ``loss`` in ``fit``'s logs, or None."""
    return getattr(model, "_loss_tracker", None)


def learning_rate(optimizer):
    """The optimizer's learning rate as given: a number, a variable, a schedule or a callable."""
    return optimizer._learning_rate


def set_learning_rate(optimizer, rate) -> None:
    """Gives ``optimizer`` the very object ``rate`` (a schedule or callable is kept, not copied)."""
    optimizer._learning_rate = rate


def mmap_of(array):
    """The ``mmap`` under a ``np.memmap`` (to release its pages), or None: then nothing is released.

    An instance attribute (no class-level check at import): a NumPy without it
    only stops effgrad from handing read pages back to the OS early.
    """
    return getattr(array, "_mmap", None)


# ------------------------------------------------- effgrad's state on a model
_STATE = "_effgrad"  # the one attribute effgrad sets on a user's model


def model_state(model) -> dict:
    """effgrad's record on ``model`` (method hooks, saliency job caches), made on first use.

    One instance attribute, set with ``object.__setattr__`` so Keras neither
    tracks nor saves it; it lives and dies with the model (effgrad keeps no
    reference to a model anywhere else).
    """
    state = model.__dict__.get(_STATE)
    if state is None:
        state = {}
        object.__setattr__(model, _STATE, state)
    return state


def hook_method(model, name: str, key: str, wrap, order: int) -> None:
    """Makes ``model.<name>`` the class's method wrapped by every effgrad hook on it.

    ``wrap(inner) -> method`` receives the method below it; hooks apply in
    ``order`` (lower first, nearest the class's method), whatever order they
    were installed in; installing again under the same ``key`` replaces that
    hook. So ``attach`` (which replaces ``train_step``: order 0) and
    ``MemoryMonitor`` (which counts the traces of whatever ``train_step``
    is: order 10) compose in either order, and a re-``attach`` keeps the
    monitor. ``wrap=None`` removes the hook.
    """
    hooks = model_state(model).setdefault("hooks", {}).setdefault(name, {})
    if wrap is None:
        hooks.pop(key, None)
    else:
        hooks[key] = (order, wrap)
    method = getattr(type(model), name).__get__(model)
    for _, hook in sorted(hooks.values(), key=lambda entry: entry[0]):
        method = hook(method)
    if hooks:
        object.__setattr__(model, name, method)
    else:
        model.__dict__.pop(name, None)


# ------------------------------------------------- attention layers (effgrad.attention.layers)
try:
    # The Keras call context: the `training` of the layer call running in this thread.
    from keras.src.backend.common import global_state as _global_state
except ImportError as _err:  # pragma: no cover
    raise _missing("keras.src.backend.common.global_state", _err) from _err

_MHA = keras.layers.MultiHeadAttention
if not {"_inverse_sqrt_key_dim", "_dropout", "_flash_attention"} <= set(_MHA.__init__.__code__.co_names) or not {
    "_softmax",
    "_dropout_layer",
    "_attention_axes",
} <= set(_MHA._build_attention.__code__.co_names):  # pragma: no cover
    raise _missing(
        "keras MultiHeadAttention._inverse_sqrt_key_dim/_dropout/_flash_attention/_softmax/_dropout_layer",
        AttributeError("not found"),
    )

_ABSENT = object()


def override_method(obj, name: str, fn):
    """Makes ``obj.<name>`` the callable ``fn`` (an instance attribute Keras neither tracks nor saves).

    Returns what :func:`restore_method` puts back. Unlike
    :func:`intercepted_call` it holds no lock while installed: effgrad's
    attention routing stays installed while MirroredStrategy's replica
    threads trace (they wait for each other inside the step).
    """
    previous = obj.__dict__.get(name, _ABSENT)
    object.__setattr__(obj, name, fn)
    return previous


def restore_method(obj, name: str, previous) -> None:
    if previous is _ABSENT:
        obj.__dict__.pop(name, None)
    else:
        object.__setattr__(obj, name, previous)


def call_context_training():
    """``training`` of the Keras layer call running in this thread (None outside any call)."""
    context = _global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


_HUB_CLASSES: dict | None = None
_HUB_LLAMA = (
    ("llama.llama_attention", "LlamaAttention"),
    ("mistral.mistral_attention", "CachedMistralAttention"),
    ("qwen.qwen_attention", "QwenAttention"),
)


def attention_classes() -> dict[str, tuple]:
    """The attention implementations effgrad reproduces, by family.

    ``"keras"``: ``keras.layers.MultiHeadAttention``; ``"llama"``: keras_hub's
    Llama, Mistral and Qwen attention (einsum, scale, masked float32 softmax);
    ``"gemma"``: keras_hub's Gemma attention (grouped heads, soft cap,
    dropout on the probabilities). keras_hub's are looked up only once
    keras_hub is imported (a model holding them has imported it).
    """
    global _HUB_CLASSES
    if _HUB_CLASSES is None and "keras_hub" in sys.modules:
        import importlib

        try:
            llama = tuple(getattr(importlib.import_module(f"keras_hub.src.models.{m}"), c) for m, c in _HUB_LLAMA)
            gemma = (importlib.import_module("keras_hub.src.models.gemma.gemma_attention").CachedGemmaAttention,)
            from keras_hub.src.utils.keras_utils import fused_attention_op_available  # noqa: F401
        except (ImportError, AttributeError) as err:  # pragma: no cover
            raise _missing("keras_hub's Llama/Mistral/Qwen/Gemma attention layers (keras_hub 0.32)", err) from err
        for cls in llama:
            if not {"_inv_norm_factor", "_softmax"} <= set(cls.build.__code__.co_names):  # pragma: no cover
                raise _missing(f"keras_hub {cls.__name__}._inv_norm_factor/_softmax", AttributeError("not found"))
        if not {"softmax", "dropout_layer"} <= set(gemma[0].build.__code__.co_names):  # pragma: no cover
            raise _missing("keras_hub CachedGemmaAttention.softmax/dropout_layer", AttributeError("not found"))
        _HUB_CLASSES = {"llama": llama, "gemma": gemma}
    return {"keras": (_MHA,), **(_HUB_CLASSES or {})}


def attention_internals(layer, family: str) -> dict:
    """What a known attention layer's ``_compute_attention`` reads besides its arguments.

    ``scale`` (keras, llama), ``rate`` and ``seeds`` (the dropout on the
    probabilities and its ``SeedGenerator``: keras, gemma), ``softmax`` (the
    Keras ``Softmax`` it masks with), ``flash`` (keras: refused on
    TensorFlow), ``axes`` (keras), ``fused`` (llama, gemma: keras_hub
    would call a fused op instead), ``sliding`` (the layer's own
    sliding-window mask method, or None).
    """
    if family == "keras":
        return {
            "scale": layer._inverse_sqrt_key_dim,
            "rate": float(layer._dropout),
            "seeds": getattr(layer._dropout_layer, "seed_generator", None),  # made only when rate > 0
            "softmax": layer._softmax,
            "flash": bool(layer._flash_attention),
            "axes": tuple(layer._attention_axes),
        }
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    sliding = layer._mask_sliding_window if getattr(layer, "use_sliding_window_attention", False) else None
    if family == "llama":
        return {"scale": layer._inv_norm_factor, "softmax": layer._softmax, "fused": fused_attention_op_available(),
                "sliding": sliding}  # fmt: skip
    return {"softmax": layer.softmax, "seeds": getattr(layer.dropout_layer, "seed_generator", None),
            "fused": layer._use_fused_attention_op(), "sliding": sliding}  # fmt: skip


# ------------------------------------------------- sharded optimizer state (effgrad.train.shard)
try:
    # The collective ops MirroredStrategy and MultiWorkerMirroredStrategy synchronize replicas with:
    # one launcher per local device (its group, instance keys and ordering token). effgrad issues
    # its reduce-scatter (an all-to-all: the CPU has no reduce-scatter kernel) and all-gather on them.
    from tensorflow.python.distribute import device_util as _device_util
    from tensorflow.python.distribute.cross_device_ops import CollectiveAllReduce as _CollectiveAllReduce
    from tensorflow.python.distribute.cross_device_utils import CollectiveReplicaLauncher as _Launcher
except ImportError as _err:  # pragma: no cover
    raise _missing("tensorflow.python.distribute CollectiveAllReduce / CollectiveReplicaLauncher", _err) from _err
if (
    "_launchers" not in _CollectiveAllReduce.__init__.__code__.co_names
    or not {"_group_key", "_group_size", "_device", "_options"} <= set(_Launcher.__init__.__code__.co_names)
    or not all(callable(getattr(_Launcher, a, None)) for a in ("_next_instance_key", "_get_ordering_token"))
):  # pragma: no cover
    raise _missing("CollectiveAllReduce._launchers / CollectiveReplicaLauncher keys", AttributeError("not found"))
if not any(
    "_serialize_to_tensors" in vars(c) for c in keras.Variable.__mro__ if c.__module__.startswith("keras")
) or not any("_track_variable" in vars(c) for c in keras.optimizers.Optimizer.__mro__):  # pragma: no cover
    raise _missing("keras Variable._serialize_to_tensors / Optimizer._track_variable", AttributeError("not found"))


def collective_launchers(strategy) -> dict | None:
    """``{device: launcher}`` of the collective ops ``strategy``'s replicas run on, or None (no collectives).

    MirroredStrategy keeps them even when its all-reduce is NCCL's (``_collective_ops``);
    MultiWorkerMirroredStrategy's all-reduce is them (``_cross_device_ops``).
    """
    extended = strategy.extended
    for name in ("_collective_ops", "_cross_device_ops"):
        ops = getattr(extended, name, None)
        if isinstance(ops, _CollectiveAllReduce):
            return {_device_util.canonicalize(launcher._device): launcher for launcher in ops._launchers}
    return None


def current_device() -> str:
    """The canonical device ops are placed on here (a replica's, in replica or update context)."""
    return _device_util.canonicalize(_device_util.current() or "/device:CPU:0")


def collective_arguments(launcher) -> dict:
    """Keyword arguments of a ``tf.raw_ops.Collective*V2`` op on the launcher's group and device.

    Each call takes the next instance key (assigned when the function runs, as tf.distribute's own
    collectives are): every replica must issue the same collectives in the same order.
    """
    token = launcher._get_ordering_token()
    options = launcher._options
    return {
        "group_size": launcher._group_size,
        "group_key": launcher._group_key,
        "instance_key": launcher._next_instance_key(),
        "ordering_token": [] if token is None else [token],
        "communication_hint": options.implementation.value,
        "timeout_seconds": float(options.timeout_seconds or 0),
    }


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
