"""What a map is taken with respect to: the model's float inputs, or one layer's output.

Both kinds answer the same three questions for the compiled job, so every
saliency method works on either:

``start(x)``
    The tensors differentiated at the batch ``x`` itself (``B`` rows each).
``forward(x, points)``
    The model's outputs with the differentiated tensors replaced by
    ``points``, which may hold ``k`` stacked copies of the batch (``k x B``
    rows: noise samples, path points); the other inputs are tiled to match.
``pack(maps)``
    The maps, one per differentiated tensor, in the caller's nest.

:class:`InputLeaves` differentiates every float input of a nest (integer
inputs such as token ids and padding masks are passed through unchanged).
:class:`LayerOutput` differentiates a layer's output (Captum's "layer"
attribution): the layer's ``call`` is intercepted while the job is traced,
first to read its output at ``x`` (the forward pass stops right there), then
to return ``points`` in its place. The layer must run once per forward pass.

Trap:
    The interception patches the layer *instance* while one job is traced
    (not while it runs). effgrad's own traces take turns (a lock), but a
    thread of yours calling the same model at that very moment would see it.
"""

from __future__ import annotations

import difflib

import tensorflow as tf

from effgrad import _compat
from effgrad.explain.inputs import Source, leaf_names

__all__ = ["InputLeaves", "LayerOutput", "find_layer"]


def _tile_rows(value: tf.Tensor, copies) -> tf.Tensor:
    """``copies`` copies of ``value`` stacked along the batch axis (copy-major)."""
    multiples = tf.concat([[copies], tf.ones([tf.rank(value) - 1], tf.int32)], 0)
    return tf.tile(value, multiples)


def _copies(x, points) -> tf.Tensor:
    return tf.shape(points[0])[0] // tf.shape(tf.nest.flatten(x)[0])[0]


class InputLeaves:
    """Differentiates the float leaves of the inputs; the others pass through.

    Attributes:
        names: Each differentiated leaf's name (``leaf_names``), ``""`` for a lone array.
        shapes: Each differentiated leaf's example shape.
    """

    def __init__(self, outputs_fn, source: Source):
        self.outputs_fn, self.spec = outputs_fn, source.spec
        leaves = source.leaves
        self.indices = [i for i, s in enumerate(leaves) if s.dtype.is_floating]
        names = leaf_names(source.spec)
        if not self.indices:
            kinds = ", ".join(f"{n or 'inputs'}: {s.dtype.name}" for n, s in zip(names, leaves))
            raise TypeError(
                f"Input gradients need float inputs, but every input is an integer ({kinds}). For token ids, "
                "pass layer= (the token embedding, e.g. layer='token_embedding') to explain that layer's "
                "output; for integer images, cast them (x.astype('float32'), or --cast float32 on the command line)."
            )
        self.names = [names[i] for i in self.indices]
        self.shapes = [tuple(leaves[i].shape[1:]) for i in self.indices]

    def start(self, x) -> list[tf.Tensor]:
        flat = tf.nest.flatten(x)
        return [flat[i] for i in self.indices]

    def forward(self, x, points):
        copies = _copies(x, points)
        replaced = dict(zip(self.indices, points))
        inputs = [replaced[i] if i in replaced else _tile_rows(v, copies) for i, v in enumerate(tf.nest.flatten(x))]
        return self.outputs_fn(tf.nest.pack_sequence_as(x, inputs))

    def pack(self, maps: list):
        """The maps in the inputs' nest (``None`` for a pass-through input); a lone map for one array."""
        if not tf.nest.is_nested(self.spec):
            return maps[0]
        flat = [None] * len(tf.nest.flatten(self.spec))
        for i, m in zip(self.indices, maps):
            flat[i] = m
        return tf.nest.pack_sequence_as(self.spec, flat)


class _Reached(Exception):
    """Raised by the intercepted layer to end a forward pass once its output is read."""


class LayerOutput:
    """Differentiates the output of one layer of the model.

    Attributes:
        names: ``[layer.name]``.
        shapes: ``[shape of one example's layer output]``.
    """

    def __init__(self, outputs_fn, layer, source: Source):
        self.outputs_fn, self.layer = outputs_fn, layer
        sample = tf.nest.map_structure(tf.convert_to_tensor, source.sample)
        start = self.start(sample)[0]  # checks the layer runs and has one float output
        calls = []

        def count(original, *args, **kwargs):
            calls.append(1)
            return start

        with _compat.intercepted_call(layer, count):
            outputs_fn(sample)
        if len(calls) != 1:
            raise ValueError(
                f"layer {layer.name!r} runs {len(calls)} times in one forward pass (a shared layer); layer= "
                "needs a layer that runs once, so that its output is one tensor per example."
            )
        self.names = [layer.name]
        self.shapes = [tuple(start.shape[1:])]

    def start(self, x) -> list[tf.Tensor]:
        seen = []

        def read(original, *args, **kwargs):
            seen.append(original(*args, **kwargs))
            raise _Reached  # the rest of the forward pass is not needed

        with _compat.intercepted_call(self.layer, read):
            try:
                self.outputs_fn(x)
            except _Reached:
                pass
        if not seen:
            raise ValueError(
                f"layer {self.layer.name!r} did not run when the model ran on the inputs; pass a layer of the "
                "model's forward pass."
            )
        output = seen[0]
        if not (tf.is_tensor(output) and output.dtype.is_floating):
            kind = type(output).__name__ if not tf.is_tensor(output) else output.dtype.name
            raise TypeError(
                f"layer {self.layer.name!r} must output one float tensor to be differentiated; it outputs {kind}."
            )
        return [output]

    def forward(self, x, points):
        copies = _copies(x, points)
        inputs = tf.nest.map_structure(lambda v: _tile_rows(v, copies), x)
        with _compat.intercepted_call(self.layer, lambda original, *args, **kwargs: points[0]):
            return self.outputs_fn(inputs)

    def pack(self, maps: list):
        return maps[0]


def find_layer(model, layer):
    """The layer ``layer`` names (or is), searched in nested models too; a clear error if none or several."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"layer= needs a Keras model, got {type(model).__name__}.")
    layers = _compat.flatten_layers(model)[1:]
    if isinstance(layer, keras.layers.Layer):
        if not any(candidate is layer for candidate in layers):
            raise ValueError(f"layer {layer.name!r} is not a layer of this model.")
        found = layer
    elif isinstance(layer, str):
        matches = [candidate for candidate in layers if candidate.name == layer]
        if not matches:
            names = list(dict.fromkeys(c.name for c in layers if not isinstance(c, keras.layers.InputLayer)))
            close = difflib.get_close_matches(layer, names, n=3)
            embeddings = [c.name for c in layers if isinstance(c, keras.layers.Embedding)]
            raise ValueError(
                f"The model has no layer named {layer!r}."
                + (f" Did you mean {' or '.join(map(repr, close))}?" if close else "")
                + (f" Its embedding layers (token attribution): {', '.join(embeddings)}." if embeddings else "")
                + f" Its layers: {', '.join(names[:40])}{', ...' if len(names) > 40 else ''}."
            )
        if len(matches) > 1:
            raise ValueError(f"Several layers are named {layer!r} (in nested models); pass the layer object itself.")
        found = matches[0]
    else:
        raise TypeError(f"layer must be a Keras layer or a layer name, got {type(layer).__name__}.")
    if isinstance(found, keras.layers.InputLayer):
        raise ValueError(f"{found.name!r} is an input: leave layer= out to differentiate the inputs themselves.")
    return found
