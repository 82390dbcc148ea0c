"""What each known attention layer's ``_compute_attention`` computes, as one call of the kernel.

Known implementations (:func:`effgrad._compat.attention_classes`), each
reproduced line by line from its source (Keras 3.15, keras_hub 0.32):

* ``"keras"``: ``keras.layers.MultiHeadAttention`` (so keras_hub's
  ``CachedMultiHeadAttention``, ``TransformerEncoder``/``Decoder`` and the
  backbones built on them). Without dropout it calls ``keras.ops.dot_product_attention`` (a row
  with no visible key: the mean of the values); with dropout it masks with
  its ``Softmax`` layer (such a row: zeros) and drops probabilities.
* ``"llama"``: keras_hub's Llama, Mistral and Qwen attention: scaled einsum,
  masked float32 ``Softmax`` (zeros), Qwen's sliding window from the layer's
  own method. Their key/value heads arrive already repeated.
* ``"gemma"``: keras_hub's Gemma attention: grouped heads, ``query_head_dim_normalize``,
  sliding window, soft cap, dropout on the probabilities.

A layer qualifies only if its class is one of these or a subclass whose
attention methods (:data:`METHODS`) are the known class's own (compared by
identity), and its ``Softmax`` is Keras's over the last axis. A call becomes
a :class:`Job`, or gives the reason it keeps its own path.
"""

from __future__ import annotations

import dataclasses
import inspect

import keras
import numpy as np
import tensorflow as tf

from effgrad import _compat, _proof
from effgrad.attention import kernel

__all__ = ["METHODS", "Job", "family_of", "class_reason", "job", "in_training", "output"]

# The methods each family's computation runs; a subclass must inherit them unchanged.
METHODS = {
    "keras": ("_compute_attention", "_masked_softmax", "_build_attention", "_compute_causal_mask"),
    "llama": ("_compute_attention", "_masked_softmax", "_mask_sliding_window"),
    "gemma": ("_compute_attention", "_mask_sliding_window", "_use_fused_attention_op"),
}


@dataclasses.dataclass
class Job:
    """One attention computation in the kernel's terms (``seeds``: drawn only if it runs)."""

    q: tf.Tensor
    k: tf.Tensor
    v: tf.Tensor
    mask: tf.Tensor | None  # boolean, broadcastable to [B, H, T, S]
    causal: bool
    scale: float
    rate: float
    seeds: object  # the layer's keras.random.SeedGenerator (with dropout)
    soft_cap: float | None
    empty: str

    def bytes_per_example(self) -> tuple[int, int]:
        """``(scores, q + k + v + output)`` per example: what the plain computation keeps, what any keeps."""
        (_, t, h, d), (_, s, hk, _), dv = self.q.shape, self.k.shape, self.v.shape[-1]
        item = self.q.dtype.size
        return 4 * h * t * s, item * (t * h * d + s * hk * d + s * hk * dv + t * h * dv)

    def run(self, block_size="auto") -> tf.Tensor:
        q, k, v = self.q, self.k, self.v
        plan = kernel.make_plan(
            q, k, v, masked=self.mask is not None, causal=self.causal, scale=self.scale, dropout_rate=self.rate,
            soft_cap=self.soft_cap, block_size=block_size, empty=self.empty,
        )  # fmt: skip
        seed = kernel.prepare_seed(self.seeds.next(), self.rate) if self.rate > 0 else None
        return kernel.attend(q, k, v, kernel.prepare_mask(self.mask, q, plan), seed, plan)


def family_of(layer) -> tuple[str, type] | None:
    """``(family, known class)`` of an attention layer effgrad knows, else None."""
    for family, classes in _compat.attention_classes().items():
        for cls in classes:
            if isinstance(layer, cls):
                return family, cls
    return None


def class_reason(layer, family: str, known: type) -> str | None:
    """Why ``layer`` does not run ``known``'s own attention code (None: it does; see :mod:`effgrad._proof`)."""
    methods = tuple(name for name in METHODS[family] if hasattr(known, name))
    hook = _compat.model_state(layer).get("attention_hook")
    return _proof.stands_in_for(layer, known, methods, ours=(hook,), whole=False)  # whatever call does


def bind(layer, known: type, args, kwargs) -> dict:
    """The arguments of a ``_compute_attention`` call, by name, defaults filled in."""
    bound = inspect.signature(known._compute_attention).bind(layer, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def in_training(family: str, arguments: dict) -> bool:
    """Whether the call trains (Llama's family reads ``training`` from Keras's call context)."""
    training = arguments.get("training") if family != "llama" else _compat.call_context_training()
    return isinstance(training, (bool, np.bool_)) and bool(training)


def output(family: str, result):
    """What the layer's ``_compute_attention`` returns: Keras's also returns (no) scores."""
    return (result, None) if family == "keras" else result


def _softmax_reason(softmax, axes) -> str | None:
    if type(softmax) is not keras.layers.Softmax or softmax.axis not in axes:
        return f"its softmax is {type(softmax).__name__}(axis={getattr(softmax, 'axis', '?')}), not Keras's over keys"
    return None


def _softmax_mask(mask):
    """As Keras's ``Softmax`` reads a mask: boolean, or > 0.5."""
    mask = tf.convert_to_tensor(mask)
    return mask if mask.dtype == tf.bool else mask > tf.cast(0.5, mask.dtype)


def _expanded(mask, rank: int = 4):
    """A ``[B, T, S]`` (or lower-rank) attention mask with heads inserted as Keras's MultiHeadAttention does."""
    mask = tf.convert_to_tensor(mask)
    while mask.shape.rank < rank:
        mask = tf.expand_dims(mask, -3)
    return mask


def job(layer, family: str, arguments: dict) -> Job | str:
    """The call as a :class:`Job`, or why it keeps its own path."""
    internals = _compat.attention_internals(layer, family)
    reason = _softmax_reason(internals["softmax"], ((3,), 3, -1, (-1,)) if family == "keras" else (-1,))
    if reason:
        return reason
    if internals.get("fused"):
        return "keras_hub sends it to a fused attention op on this backend"
    return {"keras": _keras_job, "llama": _llama_job, "gemma": _gemma_job}[family](layer, arguments, internals)


def _keras_job(layer, a: dict, internals: dict) -> Job | str:
    q, k, v, mask = a["query"], a["key"], a["value"], a["attention_mask"]
    if a["return_attention_scores"]:
        return "it returns its attention scores (return_attention_scores=True)"
    if q.shape.rank != 4 or internals["axes"] != (1,):
        return f"it attends over axes {internals['axes']} of rank-{q.shape.rank} inputs (effgrad: one sequence axis)"
    if internals["flash"]:
        return "flash_attention=True, which Keras refuses on TensorFlow"
    if mask is not None and tf.convert_to_tensor(mask).shape.rank > 4:
        return f"its attention_mask has rank {mask.shape.rank}"
    rate = internals["rate"]
    if rate > 0:  # Keras's explicit path: masked Softmax (zeros for a row with no key), dropout on it
        mask = None if mask is None else _softmax_mask(_expanded(mask))
        empty = "zero"
    else:  # keras.ops.dot_product_attention (mean of the values for such a row)
        mask = None if mask is None else tf.cast(_expanded(mask), tf.bool)
        empty = "mean"
    return Job(q, k, v, mask, bool(a.get("use_causal_mask")), internals["scale"], rate, internals["seeds"], None, empty)


def _llama_job(layer, a: dict, internals: dict) -> Job | str:
    mask = a["attention_mask"]
    if internals["sliding"] is not None:  # Qwen, as its _compute_attention calls it
        index = a.get("cache_update_index")
        mask = internals["sliding"](mask, cache_update_index=index if index else 0)
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        if mask.shape.rank != 3:
            return f"its attention_mask has rank {mask.shape.rank}, not [batch, T, S]"
        mask = _softmax_mask(mask[:, None, :, :])
    return Job(a["query"], a["key"], a["value"], mask, False, internals["scale"], 0.0, None, None, "zero")


def _gemma_job(layer, a: dict, internals: dict) -> Job | str:
    depth = layer.head_dim if layer.query_head_dim_normalize else layer.hidden_dim // layer.num_query_heads
    scale = float(np.float32(1 / np.sqrt(depth)))  # the layer multiplies q by this, cast to float32
    mask = a["attention_mask"]
    if internals["sliding"] is not None and mask is not None:
        mask = internals["sliding"](mask, cache_update_index=a["cache_update_index"])
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        if mask.shape.rank != 3:
            return f"its attention_mask has rank {mask.shape.rank}, not [batch, T, S]"
        mask = _softmax_mask(mask[:, None, :, :])
    rate = float(layer.dropout or 0.0)
    cap = layer.logit_soft_cap
    return Job(a["q"], a["k"], a["v"], mask, False, scale, rate, internals["seeds"], cap, "zero")
