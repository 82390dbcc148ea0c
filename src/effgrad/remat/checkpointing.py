"""Activation checkpointing that is right with Dropout, BatchNorm, kwargs and XLA.

A checkpointed call keeps only its inputs for the backward pass and runs the
forward computation a second time to get the gradients::

    forward:   with writes-to-state recorded, not applied:
                   y = f(x)                       # nothing kept for backprop
               snapshot = state before f          # seeds, moving stats: small
               state <- state written by f        # applied exactly once
    backward:  with state read from `snapshot`, writes discarded:
                   y' = f(x)                      # same dropout masks as y
               return d y'/d (x, weights) · dy

``tf.recompute_grad`` and ``keras.remat`` run ``f`` twice against the live
state, so on TF 2.21 a Keras Dropout draws a *new* mask in the recompute
(gradients of a different function), its seed generator advances twice, and
BatchNorm updates its moving statistics twice. effgrad runs both passes in a
``keras.StatelessScope``: the forward collects the state it writes and applies
it once; the recompute reads the pre-forward snapshot and its writes go
nowhere. Keyword arguments are bound in a closure (``tf.custom_gradient``
refuses them in graph mode). An identical recompute would be merged back into
the forward pass by common-subexpression elimination, silently keeping every
activation alive again (measured): in graphs its inputs pass through an
optimization barrier with the incoming gradient; under XLA, whose CPU backend
strips barriers before CSE, it runs inside a conditional instead.

Example:
    >>> block = effgrad.Checkpoint(keras.Sequential([Dense(1024, "relu"), Dropout(0.1)]))
    >>> deep = effgrad.checkpoint_sequential(model, segments="sqrt")

Trap:
    Only Keras variables are seen by the state capture: a function that
    mutates a raw ``tf.Variable`` in its forward pass would do so twice.
    Random numbers must come from Keras (``Dropout``, ``keras.random`` with a
    ``SeedGenerator``): a traced block that draws from TensorFlow's stateful
    random ops (``tf.random.uniform``) is not checkpointed, with a warning
    (its recompute would draw other numbers); run eagerly, it is not detected. Layers
    must be built before their first checkpointed call (effgrad raises if a
    variable is created inside one, since it would get no gradient). A tensor
    made outside the block that a tape differentiates must be an argument:
    one it reads otherwise (closed over) is refused, since it would get no
    gradient.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from effgrad import _compat
from effgrad import model_graph as graph
from effgrad.state import StateScope

__all__ = ["checkpoint", "Checkpoint", "CheckpointedModel", "checkpoint_model", "checkpoint_sequential"]


# TensorFlow's stateful random ops: each run draws new numbers from hidden state (an op seed, a global
# generator) that a recompute cannot replay. Keras's own random ops (Dropout, keras.random with a
# SeedGenerator) are stateless ops fed from Keras variables, which the recompute replays.
_STATEFUL_RANDOM = frozenset(
    {
        "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "RandomShuffle",
        "Multinomial", "RandomGamma", "RandomGammaGrad", "RandomPoisson", "RandomPoissonV2",
        "ParameterizedTruncatedNormal", "RandomCrop", "StatefulUniform", "StatefulUniformInt",
        "StatefulUniformFullInt", "StatefulStandardNormal", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
        "StatefulRandomBinomial",
    }
)  # fmt: skip


class _NotReplayable(Exception):
    """A block that draws from TensorFlow's stateful random ops: its recompute would draw other numbers."""


def _is_tensor(value) -> bool:
    return tf.is_tensor(value) or isinstance(value, tf.Variable)


def _random_ops(graph, ops) -> set[str]:
    """The stateful random op types among ``ops`` and inside the functions they call (a while loop's
    body, ``tf.map_fn``'s, a nested ``tf.function``), as ``graph`` holds them."""

    def called(nodes) -> set[str]:
        names = (f for node in nodes for a in node.attr.values() for f in [a.func.name, *(g.name for g in a.list.func)])
        return {name for name in names if name}

    found = {op.type for op in ops if op.type in _STATEFUL_RANDOM}
    pending, seen = called(op.node_def for op in ops), set()
    while pending:
        name = pending.pop()
        definition = None if name in seen else _compat.function_def(graph, name)
        seen.add(name)
        if definition is not None:
            found |= {node.op for node in definition.node_def if node.op in _STATEFUL_RANDOM}
            pending |= called(definition.node_def)
    return found


def _differentiable(t) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def _closed_over(fn, inputs, ops=None) -> list[str]:
    """The tensors a block reads besides its ``inputs`` that a tape differentiates through:
    ``tf.custom_gradient`` differentiates only the inputs and the variables read, so these would get no
    gradient, silently. In a graph, every tensor made outside the block that its ``ops`` read; eagerly
    (no ops to read), the tensors ``fn`` closes over, names as a global or a ``functools.partial`` binds."""
    given = {t.ref() for t in inputs}
    if ops is not None:
        made = {op.name for op in ops}
        read = [t for op in ops for t in op.inputs if t.op.name not in made]
    else:
        cells = [_contents(c) for c in getattr(fn, "__closure__", None) or ()]
        code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        cells += [names[n] for n in (code.co_names if code else ()) if n in names]
        bound = [*fn.args, *fn.keywords.values()] if isinstance(fn, functools.partial) else []
        read = [t for value in cells + bound for t in tf.nest.flatten(value) if tf.is_tensor(t)]
    outside = {t.ref(): t for t in read if t.ref() not in given and _differentiable(t)}
    closed = [t for t in outside.values() if _compat.tape_records([t])]
    return sorted(t.name if hasattr(t, "graph") else f"a tensor of shape {t.shape}" for t in closed)


def _name(fn) -> str:
    """What the messages call a checkpointed block: its layer name, its function name, or "the block"."""
    return getattr(fn, "name", getattr(fn, "__name__", "the block"))


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a variable of the enclosing function not assigned yet
        return None


def _refuse_closed_over(fn, closed: list[str]) -> None:
    if closed:
        raise ValueError(
            f"effgrad.checkpoint: {_name(fn)} reads {closed}, made "
            "outside it from what the tape differentiates, which a checkpointed block cannot give a gradient: "
            "pass them as arguments."
        )


def _call_with_recompute(fn: Callable, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` whose activations are recomputed in backprop."""
    structure = (args, kwargs)
    flat = tf.nest.flatten(structure)
    positions = [i for i, leaf in enumerate(flat) if _is_tensor(leaf)]
    if not positions:
        return fn(*args, **kwargs)

    def call(tensors):
        leaves = list(flat)
        for i, t in zip(positions, tensors):
            leaves[i] = t
        call_args, call_kwargs = tf.nest.pack_sequence_as(structure, leaves)
        if "mask" not in call_kwargs:
            return fn(*call_args, **call_kwargs)
        with warnings.catch_warnings():
            # The masks are handed over explicitly (a functional block takes
            # ``mask=``), so Keras's warning that a layer without masking
            # support "will destroy the mask" of its inputs does not apply.
            warnings.filterwarnings("ignore", "Layer .* does not support masking", UserWarning)
            return fn(*call_args, **call_kwargs)

    out_structure, out_masks = [], []

    @_compat.custom_gradient
    def forward(*tensors):
        scope = StateScope(collect_losses=True)
        created = []

        def creator(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            created.append(variable)
            return variable

        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        known = 0 if graph is None else len(graph.get_operations())
        if graph is None:
            _refuse_closed_over(fn, _closed_over(fn, tensors))
        # Outermost: Keras creates the variables of a layer built inside a
        # StatelessScope when that scope exits.
        with tf.variable_creator_scope(creator), scope, _compat.stop_recording():  # keep no activation
            outputs = call(tensors)
        if graph is not None:
            ops = graph.get_operations()[known:]
            drawn = sorted(_random_ops(graph, ops))
            if drawn:
                raise _NotReplayable(", ".join(drawn))
            _refuse_closed_over(fn, _closed_over(fn, tensors, ops))
        if scope.losses and not kwargs.get("training", _compat.call_context_training()):
            if isinstance(fn, keras.layers.Layer):  # inference: handed on as the plain call adds them
                fn.add_loss(scope.losses)
        elif scope.losses:
            # Computed with the tapes paused, they would reach Keras's loss with no gradient.
            raise ValueError(
                f"effgrad.checkpoint: {_name(fn)} adds losses in "
                "its call (an activity_regularizer or add_loss), which a checkpointed block cannot hand on with "
                "their gradients: checkpoint the layers around it, or make the term part of the loss."
            )
        # Keras's global SeedGenerator, made at its first unseeded keras.random draw, holds no weight: its
        # state's draw and advance are replayed like any other state's.
        created = [v for v in created if not _compat.is_global_seed_state(v)]
        if created:
            # Such a layer computed this call from one draw of its initializer
            # and stored another, and the variables were never watched: the
            # outputs and gradients would both be wrong.
            raise ValueError(
                f"effgrad.checkpoint: {_name(fn)} created variables inside a "
                f"checkpointed call ({sorted({v.name for v in created})}): a layer that was not built yet. "
                "Build the layers before checkpointing them (call the function once without effgrad.checkpoint, or "
                "layer.build(input_shape)), or wrap the layer itself: effgrad.Checkpoint(layer)."
            )
        written = list(scope.written.values())
        # The scope kept the writes off the variables: they still hold the
        # pre-forward state, which is what the recompute must replay.
        snapshot = [tf.identity(v.value) for v in written]
        with tf.control_dependencies(snapshot):
            for v in written:
                v.assign(scope.get_current_value(v))
        out_structure.append(outputs)
        # Keras masks computed inside (an Embedding's mask_zero, a Masking
        # layer) are not differentiated; they leave the block as they are.
        out_masks.extend(_compat.get_keras_mask(t) for t in tf.nest.flatten(outputs))
        flat_out = [tf.identity(t) for t in tf.nest.flatten(outputs)]

        def grad(*output_grads, variables=None):
            variables = list(variables or [])
            watched = [t for t in tensors if _differentiable(t)]

            def recompute_and_differentiate(replay=tensors):
                sources = [t for t in replay if _differentiable(t)]
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    with StateScope(zip(written, snapshot)):  # same seeds; writes discarded
                        recomputed = tf.nest.flatten(call(replay))
                pairs = [(o, g) for o, g in zip(recomputed, output_grads) if g is not None and _differentiable(o)]
                with _compat.loops_one_iteration_at_a_time():  # as in every training backprop (effgrad.train.flows)
                    grads = tape.gradient(
                        [o for o, _ in pairs],
                        sources + variables,
                        output_gradients=[g for _, g in pairs],
                        unconnected_gradients=tf.UnconnectedGradients.ZERO,
                    )
                return [tf.convert_to_tensor(g) for g in grads]

            if tf.executing_eagerly():
                grads = recompute_and_differentiate()
            elif _compat.in_xla_context():
                # XLA's CSE would merge the recompute back into the forward
                # pass (XLA:CPU strips optimization barriers before CSE), but
                # it does not look inside a conditional. The predicate on the
                # incoming gradients also keeps the recompute from running
                # early; the other branch only runs when they are inf/NaN and
                # returns NaN, so loss scaling still sees the overflow.
                floats = [g for g in output_grads if g is not None and _differentiable(g)]  # not a mask's
                incoming = [tf.reduce_all(tf.math.is_finite(g)) for g in floats]
                grads = tf.cond(
                    tf.reduce_all(incoming),
                    recompute_and_differentiate,
                    lambda: [tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype)) for t in watched + variables],
                )
            else:
                # Grappler would merge an identical recompute with the forward
                # pass; routing the inputs through a barrier together with the
                # incoming gradients makes them different tensors, available
                # only once backprop reaches this block.
                barrier = _compat.optimization_barrier(*tensors, *[g for g in output_grads if g is not None])
                grads = recompute_and_differentiate(list(barrier[: len(tensors)]))
            if not tf.executing_eagerly() and variables:
                # The inputs' gradients only once the weights' exist: they start the previous block's
                # recompute, and an executor that runs ready ops first in, first out (one inter-op
                # thread) would otherwise leave this block's weight gradients, and the recomputed
                # activations they read, for later: every block's alive at once, more than the plain
                # model holds (tests/test_checkpoint_model.py's "one thread" case).
                with tf.control_dependencies(grads[len(watched) :]):
                    grads = [tf.identity(g) for g in grads[: len(watched)]] + grads[len(watched) :]
            watched_grads = iter(grads[: len(watched)])
            input_grads = [next(watched_grads) if _differentiable(t) else None for t in tensors]
            return input_grads, grads[len(watched) :]

        return flat_out, grad

    try:
        flat_out = forward(*[tf.convert_to_tensor(flat[i]) for i in positions])
    except _NotReplayable as drawn:  # nothing was written: the block runs as it is, its activations kept
        warnings.warn(
            f"effgrad.checkpoint: {_name(fn)} draws random numbers "
            f"with TensorFlow's stateful ops ({drawn}), which a recompute cannot replay: it runs without "
            "checkpointing (its activations are kept). Draw them with keras.random and a "
            "keras.random.SeedGenerator to checkpoint it.",
            UserWarning,
            stacklevel=3,
        )
        return fn(*args, **kwargs)
    for t, mask in zip(flat_out, out_masks):
        if mask is not None:
            _compat.set_keras_mask(t, mask)
    return tf.nest.pack_sequence_as(out_structure[-1], flat_out)


@keras.saving.register_keras_serializable(package="effgrad")
class Checkpoint(keras.layers.Wrapper):
    """A Keras layer that recomputes ``layer``'s activations in backprop.

    Outputs, gradients, random values and state updates equal those of
    ``layer`` itself; only the memory differs. Saves and loads with
    ``model.save("m.keras")`` / ``keras.models.load_model`` (import effgrad
    before loading).

    Example:
        >>> inputs = keras.Input((1024,))
        >>> h = effgrad.Checkpoint(keras.layers.Dense(1024, activation="relu"))(inputs)

    Args:
        layer: The layer (or model) to checkpoint.
        **kwargs: Keras layer arguments (``name``, ...).
    """

    def __init__(self, layer: keras.layers.Layer, **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"effgrad.Checkpoint wraps a keras.Layer or keras.Model, got {type(layer).__name__}; "
                "for a plain function use effgrad.checkpoint(fn)."
            )
        # The inputs as they come: the wrapped layers cast what they read themselves (a float32 layer
        # under mixed_float16 reads float32; casting here to the global policy's float16 would lose it).
        kwargs.setdefault("autocast", False)
        super().__init__(layer, **kwargs)

    def build(self, input_shape=None):
        if not self.layer.built:
            # A symbolic call builds sublayers too (layer.build() alone does
            # not for subclassed layers); variables must exist before the
            # first checkpointed call, or they would get no gradient.
            self.layer(keras.tree.map_shape_structure(lambda shape: keras.KerasTensor(shape), input_shape))
        self.built = True

    def _inner_kwargs(self, kwargs, training, mask):
        # `training` is resolved now, while Keras's call context is alive. The
        # recompute runs later, outside that context, so it is always passed
        # explicitly (Layer.__call__ takes it even when `call` does not, and
        # hands it to sublayers such as Dropout through a new context).
        if training is not None:
            kwargs["training"] = training
        if mask is not None and "mask" in inspect.signature(self.layer.call).parameters:
            kwargs["mask"] = mask
        return kwargs

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._inner_kwargs(kwargs, training, mask)
        n_variables = len(self.layer.variables)
        outputs = _call_with_recompute(self.layer, (inputs, *args), kwargs)
        if len(self.layer.variables) != n_variables:
            raise ValueError(
                f"{self.layer.name} created variables inside a checkpointed call, which would get no "
                "gradient. Give it a build() method that creates them, or call it once before wrapping."
            )
        return outputs

    def compute_output_shape(self, *args, **kwargs):
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
        kwargs = self._inner_kwargs(kwargs, training, mask)
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs, mask=None):
        if _compat.functional_graph(self.layer) is not None:
            # A functional block's masks come out of its run (its layers set
            # them); the default would hand back the *input* masks.
            return None
        return self.layer.compute_mask(inputs, mask)


def checkpoint(f: Callable) -> Callable:
    """Returns ``f`` with its activations recomputed during backprop.

    Args:
        f: A ``keras.Layer``/``keras.Model`` (returns an
            :class:`effgrad.Checkpoint` layer) or any function of tensors
            (nested inputs/outputs and keyword arguments allowed).

    Returns:
        A callable with ``f``'s signature and results.

    Example:
        >>> f = effgrad.checkpoint(lambda x, *, training: block(x, training=training))
        >>> with tf.GradientTape() as tape:
        ...     y = f(x, training=True)
    """
    if isinstance(f, keras.layers.Layer):
        return Checkpoint(f)
    if not callable(f):
        raise TypeError(f"effgrad.checkpoint needs a function, keras.Layer or keras.Model, got {type(f).__name__}.")

    def checkpointed(*args, **kwargs):
        return _call_with_recompute(f, args, kwargs)

    checkpointed.__name__ = f"checkpointed_{getattr(f, '__name__', 'fn')}"
    checkpointed.__doc__ = getattr(f, "__doc__", None)
    checkpointed.__wrapped__ = f
    return checkpointed


def _check_chain(layers) -> None:
    """Refuses a layer list that was not called as a chain (``resnet.layers``, extra tensor inputs)."""
    previous = None
    for layer in layers:
        nodes = _compat.inbound_nodes(layer)
        if not nodes:
            return  # never called: nothing recorded to check
        inputs = nodes[0].inputs
        if len(inputs) > 1:
            names = [t.name for t in inputs[1:]]
            raise ValueError(
                f"Layer {layer.name!r} was called with more than one tensor ({names} besides its input), "
                "which a stack of layers cannot pass on (it would silently drop them). Checkpoint the whole "
                "model with effgrad.checkpoint_model(model), which carries every input a segment needs."
            )
        if previous is not None and (len(inputs) != 1 or inputs[0] is not previous):
            raise ValueError(
                f"The layers are not a chain: {layer.name!r} does not take the output of the layer before it "
                "(a graph with branches or skip connections, e.g. model.layers of a residual network). Use "
                "effgrad.checkpoint_model(model), which cuts the graph where every path passes."
            )
        previous = nodes[0].outputs[0] if len(nodes[0].outputs) == 1 else None


def _sequential_layers(layers_or_sequential):
    if isinstance(layers_or_sequential, keras.Sequential):
        return list(layers_or_sequential.layers), layers_or_sequential
    if isinstance(layers_or_sequential, (list, tuple)):
        layers = list(layers_or_sequential)
        bad = [type(layer).__name__ for layer in layers if not isinstance(layer, keras.layers.Layer)]
        if bad:
            raise TypeError(f"checkpoint_sequential needs keras layers, got {bad}.")
        _check_chain([layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)])
        return layers, None
    raise TypeError(
        "checkpoint_sequential needs a keras.Sequential, a functional model or a list of layers, "
        f"got {type(layers_or_sequential).__name__}."
    )


def _segment_count(segments, n: int, what: str, stacklevel: int = 3) -> int:
    """``segments`` of ``n`` possible; a warning, at the user's call ``stacklevel`` frames up, if more."""
    if segments == "sqrt":
        return math.ceil(math.sqrt(n))
    if isinstance(segments, bool) or not isinstance(segments, numbers.Integral):
        raise ValueError(f'segments must be "sqrt" or an int, got {segments!r}.')
    if segments < 1:
        raise ValueError(f"segments must be at least 1, got {segments}.")
    if segments > n:
        warnings.warn(
            f"{what} can be split into at most {n} segments; using {n} instead of {segments}.", stacklevel=stacklevel
        )
    return min(int(segments), n)


def checkpoint_sequential(layers_or_sequential, segments="sqrt") -> keras.Model:
    """Splits a stack of layers into segments and checkpoints each one.

    With ``n`` layers in ``s`` segments the backward pass keeps the ``s``
    segment inputs plus one segment's activations at a time: memory
    ``O(s + n/s)`` layers, smallest at ``s = sqrt(n)`` (``segments="sqrt"``,
    ``ceil(sqrt(n))`` segments), for one extra forward pass of compute.

    Example:
        >>> deep = keras.Sequential([keras.Input((1024,))] + [Dense(1024, "relu") for _ in range(64)])
        >>> light = effgrad.checkpoint_sequential(deep, segments="sqrt")  # 8 segments of 8 layers

    Args:
        layers_or_sequential: A ``keras.Sequential``, a list of layers
            applied one after the other, or a functional model (handed to
            :func:`checkpoint_model`). The layers (and weights) are shared,
            not copied.
        segments: ``"sqrt"`` or a positive int (more than the number of
            layers: a warning, one layer per segment).

    Returns:
        A ``keras.Sequential`` of :class:`effgrad.Checkpoint` segments (a
        functional model for a functional input).

    Raises:
        ValueError: a layer list that is not a chain (``resnet.layers``), or
            whose layers were called with extra tensors (a ``padding_mask=``
            keyword) that a stack cannot pass on: use :func:`checkpoint_model`.
    """
    if isinstance(layers_or_sequential, keras.Model) and not isinstance(layers_or_sequential, keras.Sequential):
        return checkpoint_model(layers_or_sequential, segments)
    layers, sequential = _sequential_layers(layers_or_sequential)
    n = len(layers)
    if n == 0:
        raise ValueError("checkpoint_sequential got no layers to checkpoint.")
    segments = _segment_count(segments, n, f"A stack of {n} layers")
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    blocks = [
        Checkpoint(keras.Sequential(layers[start:stop], name=f"segment_{i}"), name=f"checkpoint_{i}")
        for i, (start, stop) in enumerate(zip(bounds, bounds[1:]))
    ]
    stack = []
    if sequential is not None and sequential.built and sequential.inputs:
        stack.append(keras.Input(batch_shape=sequential.inputs[0].shape, dtype=sequential.inputs[0].dtype))
    return keras.Sequential(stack + blocks, name=f"checkpointed_{sequential.name if sequential else 'stack'}")


def checkpoint_model(model: keras.Model, segments: int | str = "sqrt") -> keras.Model:
    """Checkpoints any functional or Sequential Keras model, cut where every path passes.

    Algorithm: walk the model's layer calls in topological order and cut
    after each call where exactly one tensor with learned computation behind
    it is still needed (the end of a residual block, a dense block, a
    transformer layer; see :mod:`effgrad.model_graph`). Tensors computed from the
    inputs alone (padding masks, position ids) do not block a cut: they are
    passed to every segment that reads them. The cuts are grouped into
    ``segments`` segments of about equal activation volume, each a functional
    sub-model of the *same* layers wrapped in :class:`effgrad.Checkpoint`.
    The backward pass then keeps the segment boundaries plus one segment's
    activations at a time, for one extra forward pass.

    Example:
        >>> inputs = keras.Input((32,))
        >>> h = inputs
        >>> for _ in range(8):  # residual blocks: cut after each sum
        ...     h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
        >>> model = keras.Model(inputs, keras.layers.Dense(10)(h))
        >>> light = effgrad.checkpoint_model(model, segments="sqrt")
        >>> sum(isinstance(layer, effgrad.Checkpoint) for layer in light.layers)  # 8 cuts: ceil(sqrt(9))
        3
        >>> light.compile("adam", "mse")  # fit() trains model's weights

    Args:
        model: A built functional or Sequential ``keras.Model``
            (``keras.applications``, keras_hub backbones, your own).
        segments: ``"sqrt"`` (``ceil(sqrt(cuts + 1))``) or a positive int.

    Returns:
        A functional model with the same inputs and outputs (names and
        nesting), sharing ``model``'s layers and variables: training it trains
        ``model``. Outputs and gradients equal ``model``'s, with the
        guarantees of :class:`Checkpoint` (Dropout masks, BatchNorm
        statistics updated once, masks, XLA, MirroredStrategy). Saves and
        loads as a ``.keras`` file (import effgrad before loading).

    Raises:
        TypeError: a subclassed model (Keras records no graph for it) or not
            a model.
        ValueError: ``segments > 1`` but the graph has no cut at all, or a
            bad ``segments``. Fewer cuts than asked: a warning, and the
            segments that exist.

    Trap:
        The balance is estimated from static output shapes (unknown axes
        count as 1) and a subclassed layer is one indivisible call: a model
        built from one large custom layer cannot be cut; checkpoint inside it.
        ``trainable_variables`` of the result may list the shared variables
        in another order than ``model``'s.
    """
    g, bounds = segment_bounds(model, segments)
    inputs_struct, outputs_struct = g.structure

    def fresh_input(t):
        layer, _ = _compat.producer(t)
        return keras.Input(batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse, name=layer.name)

    new_inputs = keras.tree.map_structure(fresh_input, inputs_struct)
    tensors = {id(t): new for t, new in zip(g.inputs, keras.tree.flatten(new_inputs))}
    for k, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        block, seg_inputs, seg_outputs = g.segment(start, stop, name=f"{model.name}_segment_{k}")
        outputs = Checkpoint(block, name=f"checkpoint_{k}")([tensors[id(t)] for t in seg_inputs])
        tensors.update((id(t), out) for t, out in zip(seg_outputs, keras.tree.flatten(outputs)))
    g.replay(g.nodes[bounds[-1] :], tensors)  # the final projection, if any, is called as it is
    new_outputs = keras.tree.map_structure(lambda t: tensors[id(g.tensor(t))], outputs_struct)
    return CheckpointedModel(new_inputs, new_outputs, source=model, segments=segments)


def segment_bounds(model: keras.Model, segments: int | str = "sqrt") -> tuple[graph.Graph, list[int]]:
    """How :func:`checkpoint_model` cuts ``model``: its layer graph and the node index each segment starts
    at, the last bound being where the body ends (the final projection, if any, is not in a segment).

    Segment ``k`` calls ``graph.nodes[bounds[k]:bounds[k + 1]]``; its inputs and outputs are
    ``graph.segment_io(bounds[k], bounds[k + 1])``. Nothing is built. Raises and warns as
    :func:`checkpoint_model` does.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"checkpoint_model needs a keras.Model, got {type(model).__name__}.")
    g = graph.layer_graph(model)
    if segments != 1 and not g.cuts:
        raise ValueError(
            f"{model.name} cannot be cut into segments: no tensor of its graph is one that every path from "
            "the inputs to the outputs passes through (or it is one subclassed layer). Wrap its blocks with "
            "effgrad.Checkpoint(block) instead, or pass segments=1 to checkpoint it whole."
        )
    wanted = _segment_count(segments, len(g.cuts) + 1, f"{model.name} ({len(g.cuts)} cut points)", stacklevel=4)
    ends = graph.choose_boundaries(g, wanted)
    if len(ends) + 1 < wanted:
        warnings.warn(
            f"{model.name}: only {len(ends) + 1} segments of {wanted} could be placed between its cut points.",
            stacklevel=3,  # checkpoint_model's caller
        )
    return g, [0] + [end + 1 for end in ends] + [len(g.nodes) - g.head]


@keras.saving.register_keras_serializable(package="effgrad")
class CheckpointedModel(keras.Model):
    """What :func:`checkpoint_model` returns: a functional model saved as "``source``, cut into ``segments``".

    Its config is the source model's config plus ``segments``, and loading
    runs :func:`checkpoint_model` again on the rebuilt source. Serializing the
    segment sub-models one by one instead would write a layer that two
    segments share (a tied embedding, a shared block or sub-model) once per
    segment, and loading would give the copies separate weights (or none).
    Rebuilt from the source, the layers are shared exactly as before and the
    weights load in the same order they were saved.
    """

    def __init__(self, inputs, outputs, *, source: keras.Model, segments, name=None, **kwargs):
        super().__init__(inputs, outputs, name=name or f"{source.name}_checkpointed", **kwargs)
        object.__setattr__(self, "_effgrad_source", (source, segments))  # untracked: its layers are ours

    def get_config(self):
        source, segments = self._effgrad_source
        return {
            "name": self.name,
            "source": keras.saving.serialize_keras_object(source),
            "segments": segments,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        source = keras.saving.deserialize_keras_object(config["source"], custom_objects=custom_objects)
        if not source.built:
            raise ValueError(f"checkpoint_model: the saved source model {source.name} did not rebuild.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # any "fewer segments" warning was given when it was made
            model = checkpoint_model(source, config["segments"])
        model.name = config["name"]
        return model
