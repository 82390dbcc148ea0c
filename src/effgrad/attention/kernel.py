"""``effgrad.attention``: exact softmax attention whose scores ``[B, H, T, S]`` never exist.

Contract: the result (and every gradient) equals
``keras.ops.dot_product_attention(query, key, value, mask=mask, is_causal=causal,
scale=scale)`` on the TensorFlow backend, in the same layout (``[batch, length,
heads, depth]``), with three additions: a soft cap on the scores (Gemma's
``cap * tanh(s / cap)``), dropout on the probabilities, and grouped-query
attention (``key``/``value`` may have fewer heads; query head ``h`` reads
key/value head ``h // (H / Hk)``, as Keras's ``repeat`` does). A query row
whose keys are all masked gets the mean of the values, as Keras's does.

Algorithm: :mod:`effgrad.attention.blocks` (an online softmax over key blocks,
a custom gradient that recomputes each block's scores from the saved output
and log-sum-exp). What is kept for backprop is ``q, k, v, o`` and one float
per query row: memory linear in the length instead of quadratic.

Trap: dropout's keep mask depends on the seed AND the block size (it is drawn
per block); it is the same mask forward and backward, not the mask
``keras.layers.Dropout`` would draw.
"""

from __future__ import annotations

import functools
import math
import numbers

import tensorflow as tf

from effgrad import _compat
from effgrad.attention import blocks

__all__ = ["attention", "attend", "make_plan", "dropout_keep_mask", "prepare_mask", "prepare_seed"]


def _fail(message: str):
    raise ValueError(f"effgrad.attention: {message}")


def _tensors(query, key, value):
    q, k, v = (tf.convert_to_tensor(t) for t in (query, key, value))
    ranks = [t.shape.rank for t in (q, k, v)]
    if ranks != [4, 4, 4]:
        _fail(f"query, key and value must be [batch, length, heads, depth] (rank 4); got ranks {ranks}.")
    if not all(t.dtype.is_floating for t in (q, k, v)):
        _fail(f"query, key and value must be floating point; got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}.")
    wide = max((q, k, v), key=lambda t: t.dtype.size)
    if len({t.dtype for t in (q, k, v)}) > 1:  # keras.ops promotes to the common type
        q, k, v = (tf.cast(t, tf.float32 if wide.dtype.size < 4 else wide.dtype) for t in (q, k, v))
    return q, k, v


def make_plan(
    q, k, v, *, masked: bool, causal: bool = False, scale=None, dropout_rate=0.0, soft_cap=None,
    block_size="auto", empty: str = "mean",
) -> blocks.Plan:  # fmt: skip
    """The static plan of one call, after checking every argument (one-line ``ValueError`` otherwise)."""
    (b, t, h, d), (bk, s, hk, dk), (bv, sv, hv, dv) = (x.shape.as_list() for x in (q, k, v))
    if None in (t, h, d, s, hk, dk, sv, hv, dv):
        _fail(f"lengths, heads and depths must be static; got query {q.shape}, key {k.shape}, value {v.shape}.")
    if 0 in (t, s):
        _fail(f"the query and key lengths must be at least 1; got query {q.shape}, key {k.shape}.")
    if d != dk:
        _fail(f"query and key depths differ ({d} vs {dk}).")
    if (s, hk) != (sv, hv):
        _fail(f"key and value must have the same length and heads; got key {k.shape}, value {v.shape}.")
    if h % hk:
        _fail(f"query heads ({h}) must be a multiple of key/value heads ({hk}) (grouped-query attention).")
    if len({x for x in (b, bk, bv) if x is not None}) > 1:
        _fail(f"query, key and value batch sizes differ ({b}, {bk}, {bv}).")
    if not isinstance(causal, bool):
        _fail(f"causal must be True or False, got {causal!r}.")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail(f"scale must be a finite number or None, got {scale!r}.")
    rate = dropout_rate
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        _fail(f"dropout_rate must be a number in [0, 1), got {dropout_rate!r}.")
    if soft_cap is not None and (
        isinstance(soft_cap, bool) or not isinstance(soft_cap, numbers.Real) or not 0 < soft_cap < math.inf
    ):
        _fail(f"soft_cap must be a positive number or None, got {soft_cap!r}.")
    if block_size == "auto":
        block = blocks.auto_block(t, s, d)
    elif isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        _fail(f'block_size must be "auto" or a positive int, got {block_size!r}.')
    else:
        block = int(block_size)
    return blocks.Plan(
        t=t, s=s, heads=h, kv_heads=hk, depth=d, value_depth=dv, bq=min(block, t), bk=min(block, s),
        causal=causal, scale=float(scale), rate=float(rate), soft_cap=None if soft_cap is None else float(soft_cap),
        empty=empty, masked=masked, dtype="float64" if q.dtype == tf.float64 else "float32",
    )  # fmt: skip


def prepare_mask(mask, q, plan: blocks.Plan):
    """A boolean mask broadcastable to ``[B, H, T, S]``, in the blocks' layout (None stays None)."""
    if mask is None:
        return None
    mask = tf.convert_to_tensor(mask)
    if mask.dtype != tf.bool:
        _fail(f"mask must be boolean (True = attend), got {mask.dtype.name}.")
    rank = mask.shape.rank
    if rank is None or rank > 4:
        _fail(f"mask must have rank <= 4 (broadcastable to [batch, heads, T, S]), got shape {mask.shape}.")
    if rank < 4:
        mask = tf.reshape(mask, [1] * (4 - rank) + [-1 if n is None else n for n in mask.shape])
    full = (q.shape[0], plan.heads, plan.t, plan.s)
    for n, m, name in zip(mask.shape, full, ("batch", "heads", "T", "S")):
        if n is not None and n != 1 and m is not None and n != m:
            _fail(f"mask of shape {mask.shape} does not broadcast to [batch, heads, T, S] = {list(full)} ({name}).")
    if mask.shape[1] not in (1, plan.heads):
        _fail(f"mask's heads axis must be 1 or {plan.heads}, got {mask.shape[1]}.")
    return blocks.mask_blocks(mask, plan)


def prepare_seed(seed, rate: float):
    """``seed`` (an int, or a shape-[2] integer tensor such as ``SeedGenerator.next()``) as int64 [2]."""
    if rate == 0.0:
        return None
    if seed is None:
        _fail("dropout_rate > 0 needs seed= (an int, or a [2] integer tensor such as SeedGenerator.next()).")
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        seed = int(seed) % 2**64
        return tf.constant([seed & 0xFFFFFFFF, seed >> 32], tf.int64)
    seed = tf.convert_to_tensor(seed)
    if not seed.dtype.is_integer or seed.shape.as_list() != [2]:
        _fail(f"seed must be an int or a [2] integer tensor, got {seed.dtype.name} {seed.shape}.")
    return tf.cast(seed, tf.int64)


@functools.lru_cache(maxsize=256)
def _compiled(plan: blocks.Plan, dtype: tf.DType, mask_shape: tuple | None, seeded: bool):
    """The forward and backward loops as graph functions, traced once per plan for every layer and batch size.

    (Inlined where the caller is compiled with XLA; in eager mode they run as graphs, not Python loops.)
    """
    rows = [plan.nq, None, plan.kv_heads, plan.groups * plan.bq]
    extra = [tf.TensorSpec(mask_shape, tf.bool)] if mask_shape is not None else []
    extra += [tf.TensorSpec([2], tf.int64)] if seeded else []
    q = tf.TensorSpec([None, plan.t, plan.heads, plan.depth], dtype)
    k = tf.TensorSpec([None, plan.s, plan.kv_heads, plan.depth], dtype)
    v = tf.TensorSpec([None, plan.s, plan.kv_heads, plan.value_depth], dtype)
    o = tf.TensorSpec([None, plan.t, plan.heads, plan.value_depth], dtype)

    def split(extra):
        mask = extra[0] if mask_shape is not None else None
        return mask, (extra[-1] if seeded else None)

    def forward(q, k, v, *extra):
        o, lse, seen = blocks.forward(q, k, v, *split(extra), plan)
        return tf.cast(o, dtype), lse, seen

    def backward(q, k, v, o, lse, seen, do, *extra):
        grads = blocks.backward(q, k, v, o, lse, seen, do, *split(extra), plan)
        return tuple(tf.cast(g, dtype) for g in grads)

    stats = [tf.TensorSpec(rows, plan.dtype), tf.TensorSpec(rows, tf.bool)]
    functions = (
        tf.function(forward, input_signature=[q, k, v, *extra], autograph=False),
        tf.function(backward, input_signature=[q, k, v, o, *stats, o, *extra], autograph=False),
    )
    with tf.init_scope():  # traced here: a trace inside the caller's graph would keep it, and its weights, alive
        for function in functions:
            function.get_concrete_function()
    return functions


def attend(q, k, v, mask, seed, plan: blocks.Plan):
    """The kernel on prepared arguments (:func:`prepare_mask`, :func:`prepare_seed`): ``[B, T, H, Dv]``."""
    mask_shape = None
    if mask is not None:  # a batch axis of the mask's own stays unknown: no new trace per batch size
        mask_shape = tuple(None if i == 2 and n != 1 else n for i, n in enumerate(mask.shape))
    forward, backward = _compiled(plan, q.dtype, mask_shape, seed is not None)
    extra = [t for t in (mask, seed) if t is not None]

    @_compat.custom_gradient
    def run(q, k, v):
        # In a graph tf.custom_gradient still records f's ops on the tape; the loops must not be
        # differentiated (that would keep every block's intermediates).
        with _compat.stop_recording():
            o, lse, seen = forward(q, k, v, *extra)

        def grad(do):
            return backward(q, k, v, o, lse, seen, tf.cast(do, o.dtype), *extra)

        return o, grad

    return run(q, k, v)


# No AutoGraph: the kernel has no Python control flow on tensors, and converting it costs seconds per trace.
@tf.autograph.experimental.do_not_convert
def attention(
    query, key, value, *, mask=None, causal: bool = False, scale: float | None = None, dropout_rate: float = 0.0,
    seed=None, soft_cap: float | None = None, block_size: int | str = "auto",
) -> tf.Tensor:  # fmt: skip
    """Exact attention in blocks: the ``[B, H, T, S]`` scores never exist, forward or backward.

    ``softmax(scale * q k^T [soft-capped, masked]) v`` per head, computed over
    blocks of keys with a running max and sum (FlashAttention-2); backprop
    recomputes each block's scores from the output and the saved log-sum-exp.

    Example:
        >>> q = tf.random.normal([2, 100, 4, 16]); kv = tf.random.normal([2, 100, 2, 16])
        >>> out = effgrad.attention(q, kv, kv, causal=True, block_size=32)
        >>> ref = keras.ops.dot_product_attention(q, tf.repeat(kv, 2, axis=2), tf.repeat(kv, 2, axis=2), is_causal=True)
        >>> float(tf.reduce_max(tf.abs(out - ref))) < 1e-5
        True

    Args:
        query: ``[batch, T, heads, depth]``.
        key: ``[batch, S, kv_heads, depth]``; ``heads`` a multiple of ``kv_heads``.
        value: ``[batch, S, kv_heads, value_depth]``.
        mask: Boolean, True = attend, broadcastable to ``[batch, heads, T, S]``
            (e.g. ``[batch, 1, 1, S]`` for key padding). Blocks it masks
            entirely are skipped at run time.
        causal: Query ``i`` sees keys ``j <= i`` (top-left aligned, as Keras);
            key blocks above the diagonal are never computed.
        scale: Multiplies the scores; default ``1 / sqrt(depth)``.
        dropout_rate: Dropout on the probabilities (the normalizer is the
            undropped sum, as with a Dropout layer after the softmax).
        seed: With dropout: an int or a ``[2]`` integer tensor (e.g. a
            ``keras.random.SeedGenerator``'s ``next()``, new every step).
        soft_cap: ``cap * tanh(scores / cap)`` before masking (Gemma 2).
        block_size: Rows and keys per block; ``"auto"``: the largest power of
            two whose square is at most ``max(T, S) * depth`` (one block's
            scores no larger than the queries).

    Returns:
        ``[batch, T, heads, value_depth]`` in the inputs' dtype; float16 and
        bfloat16 inputs are accumulated in float32.

    Raises:
        ValueError: one line, before any work, for wrong ranks, unknown
            lengths, heads that do not group, or a mask that does not broadcast.

    Trap:
        Lengths, heads and depths must be static (the batch may be unknown);
        dropout's mask is drawn per block, so it changes with ``block_size``.
    """
    q, k, v = _tensors(query, key, value)
    plan = make_plan(
        q, k, v, masked=mask is not None, causal=causal, scale=scale, dropout_rate=dropout_rate, soft_cap=soft_cap,
        block_size=block_size,
    )  # fmt: skip
    return attend(q, k, v, prepare_mask(mask, q, plan), prepare_seed(seed, plan.rate), plan)


@tf.autograph.experimental.do_not_convert
def dropout_keep_mask(query, key, value, *, dropout_rate: float, seed, block_size: int | str = "auto") -> tf.Tensor:
    """The ``[B, H, T, S]`` boolean keep mask :func:`attention` draws for these shapes and seed.

    For tests and debugging only (it is the score-sized tensor the kernel
    never makes): ``attention(..., dropout_rate=r, seed=s)`` equals the plain
    computation ``(softmax(scores) * keep / (1 - r)) @ v`` with this mask.
    """
    q, k, v = _tensors(query, key, value)
    plan = make_plan(q, k, v, masked=False, dropout_rate=dropout_rate, block_size=block_size)
    return blocks.keep_mask(plan, prepare_seed(seed, plan.rate), tf.shape(q)[0])
