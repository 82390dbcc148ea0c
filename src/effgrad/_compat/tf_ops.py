"""TensorFlow internals: tape and XLA ops, gradient functions, control inputs, the eager context, collectives."""

from __future__ import annotations

import contextlib
import functools
import weakref

import keras  # noqa: F401
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from effgrad._compat.versions import missing as _missing

__all__ = [
    "add_control_input",
    "collective_arguments",
    "collective_launchers",
    "context_started",
    "current_device",
    "custom_gradient",
    "dynamic_update_slice",
    "empty_variable",
    "function_def",
    "gradient_function",
    "in_xla_context",
    "loops_one_iteration_at_a_time",
    "optimization_barrier",
    "refill_variable",
    "stop_recording",
    "tape_records",
]


try:
    # Runs a checkpointed forward pass without recording it on any tape.
    # Keeps grappler from merging a recompute back into the forward pass; writes a block at a
    # traced offset in place under XLA (the fused loss's kernel gradient).
    from tensorflow.compiler.tf2xla.python.xla import dynamic_update_slice, optimization_barrier
    from tensorflow.python.eager.record import should_record_backprop as _should_record_backprop
    from tensorflow.python.eager.record import stop_recording

    # Tells whether a graph is being compiled by XLA (the recompute guard differs).
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except (ImportError, AttributeError) as _err:  # pragma: no cover - only on an untested TF
    raise _missing("tensorflow.python.eager.record / control_flow_util / tf2xla xla ops", _err) from _err

try:
    # tf.custom_gradient's graph-mode gradient functions live in TensorFlow's global gradient registry.
    from tensorflow.python.framework import registry as _registry
    from tensorflow.python.framework.ops import gradient_registry as _gradient_registry

    _gradient_registry._registry, _registry._TYPE_TAG  # noqa: B018
except (ImportError, AttributeError) as _err:  # pragma: no cover
    raise _missing("tensorflow.python.framework.ops.gradient_registry", _err) from _err

try:
    # The registered gradient function of a graph op: fused_update makes a weight's gradient from the
    # gradient of one use's output, as backprop would.
    from tensorflow.python.framework.ops import get_gradient_function as gradient_function
except ImportError as _err:  # pragma: no cover
    raise _missing("tensorflow.python.framework.ops.get_gradient_function", _err) from _err
for _name in ("_add_control_input", "_set_attr"):
    if not callable(getattr(tf.Operation, _name, None)):  # pragma: no cover
        raise _missing(f"tf.Operation.{_name}", AttributeError("not found"))


def _barrier_gradient(op, *grads):
    """The barrier is the identity on each input: a second-order gradient (a gradient penalty through a
    checkpointed block, whose backprop holds one) passes straight through it."""
    return list(grads)


try:  # TensorFlow 2.21 registers none; a later one that does keeps its own
    tf.RegisterGradient("XlaOptimizationBarrier")(_barrier_gradient)
except KeyError:  # pragma: no cover
    pass


def tape_records(tensors) -> bool:
    """Whether an active ``tf.GradientTape`` differentiates through any of ``tensors`` (they depend on
    something it watches): a checkpointed block that closes over one would drop that gradient."""
    return bool(tensors) and bool(_should_record_backprop(list(tensors)))


def custom_gradient(f):
    """``tf.custom_gradient(f)`` whose gradient function, in graph mode, is held by the graph that made it.

    In graph mode ``tf.custom_gradient`` registers every call's gradient function under a new name in
    TensorFlow's global registry, which is never emptied: the function, and all it closes over (the
    block's tensors, its variables and so its weights), would outlive the model, the step and their
    graphs. Here the graph keeps the function and the registry a weak reference, dropped with it.
    """
    wrapped = tf.custom_gradient(f)

    @functools.wraps(f)
    def call(*args, **kwargs):
        out = wrapped(*args, **kwargs)
        if not tf.executing_eagerly():
            first = next((t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)), None)
            if first is not None:
                _owned_by_graph(first.op)
        return out

    return call


def _owned_by_graph(op) -> None:
    """Hands the gradient function registered for ``op`` (the IdentityN a custom gradient made) to its graph."""
    try:
        name = op.get_attr("_gradient_op_type").decode()
    except ValueError:  # not a custom gradient's op
        return
    entries = _gradient_registry._registry
    entry = entries.get(name)
    if entry is None or isinstance(entry[_registry._TYPE_TAG], _WeakGradient):
        return
    function = entry[_registry._TYPE_TAG]
    op.graph.add_to_collection("effgrad_gradient_functions", function)  # held by the graph, freed with it
    entry[_registry._TYPE_TAG] = _WeakGradient(function, lambda _: entries.pop(name, None))


class _WeakGradient:
    """A registered gradient function held weakly: alive while the graph that made it is."""

    def __init__(self, function, on_free):
        self.function = weakref.ref(function, on_free)

    def __call__(self, op, *grads):
        function = self.function()
        if function is None:  # pragma: no cover - asked only by the graph that owns it
            raise RuntimeError(f"the gradient function of {op.name} was freed with the graph that made it")
        return function(op, *grads)


def function_def(graph, name: str):
    """The ``FunctionDef`` of the function ``name`` that ``graph`` (or a graph enclosing it) holds, else
    None: what a while loop's body or a nested ``tf.function`` runs, without serializing the graph."""
    while graph is not None:
        function = graph._get_function(name)
        if function is not None:
            return function.definition
        graph = getattr(graph, "outer_graph", None)
    return None


def add_control_input(op, control) -> None:
    """Makes graph op ``op`` (already made) wait for ``control``: backprop paced by the updates it feeds."""
    op._add_control_input(control)


@contextlib.contextmanager
def loops_one_iteration_at_a_time():
    """Every while loop made in the current graph inside the block runs one iteration at a time.

    Sets the ``parallel_iterations`` attribute of each ``While`` op made in the block to 1 (op
    attributes have no public setter once the op exists). A no-op eagerly, and under XLA, which
    ignores the attribute.
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    yield
    one = attr_value_pb2.AttrValue(i=1)
    for op in graph.get_operations()[start:]:
        if op.type in ("While", "StatelessWhile"):
            op._set_attr("parallel_iterations", one)


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


def empty_variable(variable) -> tf.Operation | None:
    """Frees ``variable``'s buffer until :func:`refill_variable`: it holds zero numbers, its shape stays declared.

    ``tf.Variable.assign`` checks the value's shape against the variable's, in the graph and when it
    runs; the op can do neither: its value's length is hidden from graph construction
    (``PlaceholderWithDefault``) and its ``validate_shape`` is off. Reading the variable while empty
    gives zero numbers, not its declared shape.
    """
    return refill_variable(
        variable, tf.raw_ops.PlaceholderWithDefault(input=tf.zeros([0], variable.dtype), shape=[None])
    )


def refill_variable(variable, value) -> tf.Operation | None:
    """``variable.assign(value)`` that an emptied variable (:func:`empty_variable`) accepts."""
    value = tf.convert_to_tensor(value, variable.dtype)
    return tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value, validate_shape=False)


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
