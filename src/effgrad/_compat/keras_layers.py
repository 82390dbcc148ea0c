"""Keras layers and functional graphs: the recorded layer calls, sublayers, method swaps, attention internals."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import threading

import keras

from effgrad._compat.versions import missing as _missing

__all__ = [
    "BaseConv",
    "BaseDepthwiseConv",
    "LayerCall",
    "attention_classes",
    "attention_internals",
    "call_context_training",
    "class_attention",
    "flatten_layers",
    "functional_graph",
    "hook_method",
    "inbound_nodes",
    "intercepted_call",
    "is_global_seed_state",
    "model_state",
    "override_method",
    "own_variables",
    "plain_convolution",
    "producer",
    "replaced",
    "restore_method",
    "rnn_loop",
    "seed_states",
]


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


def is_global_seed_state(variable) -> bool:
    """Whether ``variable`` backs the state of Keras's global ``SeedGenerator`` (what ``keras.random``
    draws with when given no seed; Keras makes it at the first such draw)."""
    generator = _global_state.get_global_attribute("global_seed_generator")
    return generator is not None and generator.state.value is variable


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


def class_attention(layer):
    """The layer's class's own ``_compute_attention``, bound to the layer (None if it has none): what
    runs when no instance hook is installed over it."""
    method = getattr(type(layer), "_compute_attention", None)
    return None if method is None else method.__get__(layer)


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
