"""Where a Keras functional model can be cut into checkpointed segments.

A checkpointed segment keeps only its inputs for the backward pass, so a good
boundary is a point of the layer graph where little is alive: ideally one
tensor through which every path from the inputs to the outputs passes (an
articulation point, Chen et al. 2016 "Training Deep Nets with Sublinear
Memory Cost"). Walking the layer calls in topological order, the tensors
alive after a call are those already produced and still needed later. A call
is a *cut* when exactly one of them carries learned computation; the others
are *side* tensors computed from the model inputs by weightless layers
(padding and attention masks, position ids, the inputs themselves), which the
caller holds anyway and which are simply passed on to the segments that
need them. Residual blocks, dense blocks and transformer layers each end on a
cut; nothing inside them is one.

The model's final projection (a ``Dense`` or keras_hub reversed embedding
making the logits) is left out of the segments: its output, the model's, is
kept anyway, and a fused loss (:mod:`effgrad.train.fused_loss`) can then
split it off the checkpointed model.

Segments are then chosen among the cuts so that each holds about the same
activation volume (estimated from the static output shapes).

A functional model called once inside another (a keras_hub backbone inside
its task model, a base model inside a fine-tuning head) is walked as its own
layer calls, so its transformer layers or residual blocks are cuts too.

Trap:
    Only recorded graphs are seen: a subclassed layer is one call, however
    much it computes, so a model made of one big subclassed layer has no cut.
    A sub-model called twice (a siamese tower) stays one call per use.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np

from effgrad import _compat

__all__ = ["Graph", "layer_graph", "choose_boundaries", "activation_bytes_per_row"]


@dataclasses.dataclass(frozen=True)
class Graph:
    """A functional model's layer calls in topological order.

    Attributes:
        nodes: Keras ``Node`` objects (layer calls), inputs excluded.
        inputs: The model's flat input tensors.
        outputs: The model's flat output tensors.
        cuts: Indices ``i`` of ``nodes`` after which exactly one non-side
            tensor is alive (and something is left to compute before the head).
        sizes: Estimated activation elements per example of each call.
        structure: The model's ``(inputs, outputs)`` with their nesting
            (dicts of named inputs, lists).
    """

    nodes: list
    inputs: list
    outputs: list
    cuts: list[int]
    sizes: list[int]
    structure: tuple
    aliases: dict = dataclasses.field(default_factory=dict)
    head: int = 0  # 1 if the last node is the final projection, which no segment holds

    def tensor(self, t):
        """The tensor of this graph that ``t`` stands for: an inlined sub-model's input is the
        tensor passed to it, and its call's output is the sub-model's own output."""
        while id(t) in self.aliases:
            t = self.aliases[id(t)]
        return t

    def inputs_of(self, node) -> list:
        """``node``'s input tensors, as tensors of this graph."""
        return [self.tensor(t) for t in node.inputs]

    def replay(self, nodes, values: dict) -> None:
        """Calls ``nodes``'s layers on ``values`` (``{id(tensor): value}``), adding their outputs."""
        for node in nodes:
            args, kwargs = node.fill_in({id(t): values[id(self.tensor(t))] for t in node.inputs})
            results = keras.tree.flatten(node.layer(*args, **kwargs))
            values.update((id(t), r) for t, r in zip(node.outputs, results))

    def segment_io(self, start: int, stop: int) -> tuple[list, list]:
        """Inputs (produced before ``start``) and outputs (needed after ``stop``) of ``nodes[start:stop]``."""
        before = {id(t) for t in self.inputs} | {id(t) for node in self.nodes[:start] for t in node.outputs}
        needed_later = {id(t) for node in self.nodes[stop:] for t in self.inputs_of(node)}
        needed_later |= {id(t) for t in self.outputs}
        inputs, outputs, seen = [], [], set()
        for node in self.nodes[start:stop]:
            for t in self.inputs_of(node):
                if id(t) in before and id(t) not in seen:
                    seen.add(id(t))
                    inputs.append(t)
            for t in node.outputs:
                if id(t) in needed_later and id(t) not in seen:
                    seen.add(id(t))
                    outputs.append(t)
        return inputs, outputs

    def segment(self, start: int, stop: int, name: str) -> tuple[keras.Model, list, list]:
        """``nodes[start:stop]`` as a functional model of the same layers, with its inputs and outputs.

        The calls are replayed on fresh ``keras.Input`` tensors.
        ``keras.Model(intermediate_inputs, outputs)`` would do it too, but it
        re-records the history of original input tensors passed next to
        intermediate ones (Keras 3.15 ``clone_graph_nodes``), which breaks
        serializing the original model.
        """
        inputs, outputs = self.segment_io(start, stop)

        def fresh(i, t):
            layer, _ = _compat.producer(t)
            label = layer.name if isinstance(layer, keras.layers.InputLayer) else f"{layer.name}_output_{i}"
            return keras.Input(batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse, name=label)

        values = {id(t): fresh(i, t) for i, t in enumerate(inputs)}
        block_inputs = [values[id(t)] for t in inputs]
        self.replay(self.nodes[start:stop], values)
        return keras.Model(block_inputs, [values[id(t)] for t in outputs], name=name), inputs, outputs


def _recorded_graph(model: keras.Model):
    parts = _compat.functional_graph(model)
    if parts is not None:
        return parts
    if isinstance(model, keras.Sequential):
        raise ValueError(
            f"checkpoint_model needs a built model, and {model.name} is not: give the Sequential model a "
            "keras.Input(...) first layer, or call model.build(input_shape) first."
        )
    raise TypeError(
        f"checkpoint_model needs a functional or Sequential keras.Model, got a {type(model).__name__} "
        "whose layer graph Keras does not record (a subclassed model). Wrap its blocks with "
        "effgrad.Checkpoint(block) in its __init__ instead."
    )


def _size(node, unknown: int = 1) -> int:
    """Estimated activation elements per example kept by one layer call.

    The output's size (unknown axes count as ``unknown``) times the number of
    layers the call runs: a transformer layer keeps far more than its output.
    """
    out = sum(math.prod(unknown if d is None else d for d in t.shape[1:]) for t in node.outputs)
    return out * max(1, len(_compat.flatten_layers(node.layer)) - 1)


def _ordered(nodes_by_depth) -> list:
    return [
        node for depth in sorted(nodes_by_depth, reverse=True) for node in nodes_by_depth[depth] if not node.is_input
    ]


def _inlined(node, uses: int, aliases: dict) -> list | None:
    """The layer calls of a functional sub-model called once by ``node`` (recording in ``aliases``
    what its inputs and outputs stand for), or None: then ``node`` stays one call."""
    parts = _compat.functional_graph(node.layer) if isinstance(node.layer, keras.Model) else None
    args, kwargs = node.args, node.kwargs
    if parts is None or uses != 1 or len(args) != 1 or any(v is not None for v in keras.tree.flatten(kwargs)):
        # Called twice its tensors would collide; a mask or training=False (a frozen base model's
        # BatchNorm) is an argument its layers would not get.
        return None
    nodes_by_depth, inner_inputs, inner_outputs = parts
    try:
        keras.tree.assert_same_structure(inner_inputs, args[0])
    except (TypeError, ValueError):
        return None  # inputs passed in another nesting than the sub-model's: Keras would restructure them
    for inner, outer in zip(keras.tree.flatten(inner_inputs), keras.tree.flatten(args[0])):
        if inner is not outer:  # a keras_hub task model passes its backbone's own inputs
            aliases[id(inner)] = outer
    for outer, inner in zip(node.outputs, keras.tree.flatten(inner_outputs)):
        aliases[id(outer)] = inner
    return _flat(_ordered(nodes_by_depth), aliases)


def _flat(nodes: list, aliases: dict) -> list:
    uses: dict[int, int] = {}
    for node in nodes:
        uses[id(node.layer)] = uses.get(id(node.layer), 0) + 1
    flat = []
    for node in nodes:
        inner = _inlined(node, uses[id(node.layer)], aliases)
        flat.extend([node] if inner is None else inner)
    return flat


def layer_graph(model: keras.Model) -> Graph:
    """The layer calls of ``model`` (functional or built Sequential) and its cuts."""
    nodes_by_depth, inputs_struct, outputs_struct = _recorded_graph(model)
    aliases: dict = {}
    nodes = _flat(_ordered(nodes_by_depth), aliases)
    g = Graph(nodes=nodes, inputs=[], outputs=[], cuts=[], sizes=[], structure=(), aliases=aliases)
    inputs, outputs = keras.tree.flatten(inputs_struct), [g.tensor(t) for t in keras.tree.flatten(outputs_struct)]
    last_use = {id(t): len(nodes) for t in outputs}
    for i, node in enumerate(nodes):
        for t in g.inputs_of(node):
            last_use[id(t)] = max(last_use.get(id(t), -1), i)

    # Side tensors: model inputs and what weightless calls compute from them.
    side = {id(t) for t in inputs}
    for node in nodes:
        if not getattr(node.layer, "weights", None) and all(id(t) in side for t in g.inputs_of(node)):
            side.update(id(t) for t in node.outputs)

    last = nodes[-1]
    head = int(len(nodes) > 1 and len(outputs) == 1 and outputs[0] is last.outputs[0] and _is_projection(last))
    cuts = []
    alive = {id(t) for t in inputs}
    for i, node in enumerate(nodes[: len(nodes) - 1 - head]):
        alive.update(id(t) for t in node.outputs)
        alive = {t for t in alive if last_use.get(t, -1) > i}
        if sum(t not in side for t in alive) == 1:
            cuts.append(i)
    return dataclasses.replace(
        g,
        inputs=inputs,
        outputs=outputs,
        cuts=cuts,
        sizes=[_size(node) for node in nodes],
        structure=(inputs_struct, outputs_struct),
        head=head,
    )


def _is_projection(node) -> bool:
    layer = node.layer
    if isinstance(layer, keras.layers.ReversibleEmbedding):  # keras_hub's subclasses it; tied or not
        return bool(node.kwargs.get("reverse"))
    return isinstance(layer, keras.layers.Dense)


def choose_boundaries(graph: Graph, segments: int) -> list[int]:
    """Up to ``segments - 1`` cuts splitting the activation volume before the head evenly.

    Returns the node indices after which a segment ends (strictly increasing);
    fewer than asked when the cuts are too few or too close together.
    """
    if segments <= 1 or not graph.cuts:
        return []
    cumulative = np.cumsum(graph.sizes[: len(graph.sizes) - graph.head], dtype=np.float64)
    total = cumulative[-1]
    at_cuts = cumulative[graph.cuts]
    chosen: list[int] = []
    for j in range(1, segments):
        candidates = [k for k, cut in enumerate(graph.cuts) if not chosen or cut > chosen[-1]]
        if not candidates:
            break
        # Leave room for the segments still to place after this one.
        remaining = segments - 1 - j
        usable = candidates[: len(candidates) - remaining] if remaining < len(candidates) else candidates[:1]
        best = min(usable, key=lambda k: abs(at_cuts[k] - total * j / segments))
        chosen.append(graph.cuts[best])
    return chosen


def activation_bytes_per_row(model, unknown: int = 1) -> int | None:
    """Rough bytes of activations one example keeps for backprop (float32), or None if unknown.

    From the static output shapes of the layer calls (see :func:`layer_graph`),
    an axis the model leaves unknown (a sequence length) counted as
    ``unknown``; None for models whose layer graph Keras does not record
    (subclassed).
    """
    try:
        return 4 * sum(_size(node, unknown) for node in layer_graph(model).nodes)
    except (TypeError, ValueError, AttributeError):
        return None
