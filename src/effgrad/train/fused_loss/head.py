"""The model's final projection, which the loss is fused with: :func:`find_head`."""

from __future__ import annotations

import dataclasses
import math

import keras

from effgrad import _compat, _proof
from effgrad.train.fused_loss.kernel import cross_entropy

__all__ = ["Head", "find_head", "LAYER_CODE"]


@dataclasses.dataclass(frozen=True)
class Head:
    """A model's final projection, found by :func:`find_head`: the step computes its loss fused.

    Attributes:
        trunk: A ``keras.Model`` from the model's inputs to the projection's
            input (the same layers and variables).
        layer: The projection layer.
        transposed: Its kernel is ``[V, d]`` (a tied embedding).
        soft_cap: Logit soft-capping, if the layer applies it.
    """

    trunk: keras.Model
    layer: keras.layers.Layer
    transposed: bool
    soft_cap: float | None

    @property
    def sizes(self) -> tuple[int, int]:
        """``(d, V)``: the projection's inputs and classes."""
        shape = self.kernel().shape
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    def positions(self, hint: tuple[int, int]) -> int:
        """Rows of the logits of a batch of ``batch_shape`` ``hint`` (``(rows, largest other axis)``)."""
        return hint[0] * math.prod(hint[1] if d is None else d for d in self.trunk.output.shape[1:-1])

    def kernel(self):
        layer = self.layer
        if isinstance(layer, keras.layers.Dense):
            return layer.kernel
        return layer.embeddings if layer.tie_weights else layer.reverse_embeddings

    def bias(self):
        return getattr(self.layer, "bias", None) if isinstance(self.layer, keras.layers.Dense) else None

    def losses(self, hidden, labels, ignore_class=None, ranks: bool = False):
        """``(per-position losses, ranks or None)`` of ``labels`` against the projection of ``hidden``.

        ``ranks``: each position's two counts for accuracy and top-k metrics (see ``_cross_entropy``).
        """
        return cross_entropy(
            hidden, self.kernel(), labels, self.bias(), self.transposed, self.soft_cap, ignore_class, None, ranks
        )


def find_head(model) -> Head | str:
    """The model's final projection as a :class:`Head`, or why there is none (a sentence).

    Applies to a functional model (keras_hub task models included) with one
    output made by a linear ``Dense`` or by keras_hub's ``ReversibleEmbedding``
    called with ``reverse=True``.
    """
    parts = _compat.functional_graph(model)
    if parts is None:
        return f"{type(model).__name__} is not a functional model, so its last layer cannot be split off"
    _, inputs_struct, outputs = parts
    outputs = keras.tree.flatten(outputs)
    if len(outputs) != 1:
        return f"the model has {len(outputs)} outputs"
    layer, node = _compat.producer(outputs[0])
    if isinstance(layer, keras.layers.Dense):
        if why := _proof.stands_in_for(layer, keras.layers.Dense, LAYER_CODE):
            return f"its last layer {layer.name!r} is not Keras's Dense as such: {why}"
        if layer.activation not in (None, keras.activations.linear) or getattr(layer, "lora_enabled", False):
            return f"its last layer {layer.name!r} applies an activation (the loss needs the logits)"
        if len(layer.kernel.shape) != 2:
            return f"its last layer {layer.name!r} has a kernel that is not 2-D"
        transposed, soft_cap = False, None
    elif isinstance(layer, keras.layers.ReversibleEmbedding) and node.kwargs.get("reverse"):
        # keras_hub's ReversibleEmbedding subclasses Keras's, inheriting its code.
        if why := _proof.stands_in_for(layer, keras.layers.ReversibleEmbedding, LAYER_CODE):
            return f"its last layer {layer.name!r} is not Keras's ReversibleEmbedding as such: {why}"
        if getattr(layer, "reverse_dtype", None):
            return f"its last layer {layer.name!r} projects in another dtype"
        transposed, soft_cap = bool(layer.tie_weights), layer.logit_soft_cap
    else:
        return f"its last layer {layer.name!r} is a {type(layer).__name__}, not a Dense or a reversed embedding"
    if getattr(layer, "quantization_mode", None) or layer.activity_regularizer is not None:
        return f"its last layer {layer.name!r} is quantized or adds an activity regularization loss"
    inputs = node.inputs
    if len(inputs) != 1:
        return f"its last layer {layer.name!r} takes {len(inputs)} inputs"
    trunk = keras.Model(inputs_struct, inputs[0], name=f"{model.name}_trunk")
    return Head(trunk=trunk, layer=layer, transposed=transposed, soft_cap=soft_cap)


# What the fused computation reimplements of the layer and the loss: a subclass must inherit these.


# What the fused computation reimplements of the layer: a subclass must inherit these.
LAYER_CODE = ("call", "__call__", "compute_output_spec", "quantized_call")
