"""The loops of blocked exact attention: forward and backward, never the whole score matrix.

Pure tensor functions on a static :class:`Plan`. Layout inside: queries (and
everything per query row) as ``[query blocks, B, Hk, G * bq, D]`` (the ``G``
query heads that share one key/value head stacked as rows, so grouped-query
attention is one batched matmul per block), keys and values as
``[key blocks, B, Hk, bk, D]``.

Forward (FlashAttention-2; Rabe & Staats 2021), for each query block ``i``
(one ``tf.while_loop``) and each key block ``j`` it can see (a nested one)::

    s = (scale * q_i) k_j^T   (cap * tanh(s / cap) with a soft cap); masked -> -inf
    m' = max(m, rowmax s);  p = exp(s - m');  l = l * exp(m - m') + rowsum p     (l: `total`)
    acc = acc * exp(m - m') + (p * keep / (1 - rate)) v_j          (keep: dropout)
    o_i = acc / l;  lse_i = m + log l

Backward, for each key block ``j`` and each query block ``i`` that sees it,
the block's probabilities are recomputed from ``lse`` (``p = exp(s - lse)``)::

    dv_j += p'^T do_i;  dp = (do_i v_j^T) * keep / (1 - rate)
    ds = p * (dp - rowsum(do_i * o_i))   (* (1 - (s / cap)^2) with a soft cap)
    dk_j += ds^T (scale * q_i);  dq_i += scale * ds k_j

Causal: a key block entirely above the diagonal is never visited (the loop
bounds end before it). With a mask, a block whose mask is all False is
skipped at run time (``tf.cond``): a causal mask built by the model gets the
same saving. Dropout's keep mask of block ``(i, j)`` is a counter-based hash
of (seed, block, position), so the backward pass redraws exactly the
forward's, in eager, graph and XLA alike.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

__all__ = ["Plan", "auto_block", "backward", "forward", "keep_mask", "mask_blocks"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static shapes and options of one attention call (hashable: one trace per plan)."""

    t: int  # query length
    s: int  # key length
    heads: int  # query heads
    kv_heads: int
    depth: int  # query/key depth
    value_depth: int
    bq: int  # query block
    bk: int  # key block
    causal: bool
    scale: float
    rate: float  # dropout on the probabilities
    soft_cap: float | None
    empty: str  # a query row that sees no key: "mean" (of all values, as keras.ops) or "zero" (keras Softmax)
    masked: bool  # a boolean mask is given
    dtype: str = "float32"  # accumulation: float32, or float64 for float64 inputs

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def nq(self) -> int:
        return -(-self.t // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.s // self.bk)

    def last_key_block(self, i):
        """One past the last key block query block ``i`` sees (causal: top-left aligned, key <= query)."""
        if not self.causal:
            return tf.constant(self.nk)
        return tf.minimum(self.nk, ((i + 1) * self.bq - 1) // self.bk + 1)

    @property
    def seen_key_blocks(self) -> int:
        """Key blocks any query sees (causal with S > T: the last ones are seen by none)."""
        return min(self.nk, ((self.nq * self.bq - 1) // self.bk) + 1) if self.causal else self.nk

    def first_query_block(self, j):
        """The first query block that sees key block ``j``."""
        return (j * self.bk) // self.bq if self.causal else tf.constant(0)


def auto_block(t: int, s: int, depth: int) -> int:
    """The largest power of two whose square block of scores is no larger than ``max(t, s) * depth``.

    One block's scores then never outweigh the queries (or keys) themselves:
    the memory stays linear in the sequence length, and the blocks grow with
    it (fewer loop iterations, larger matmuls).
    """
    return max(16, 2 ** int(math.floor(math.log2(math.sqrt(max(t, s) * depth)))))


# ------------------------------------------------------------------ layout
def query_blocks(x, plan: Plan):
    """``[B, T, H, D]`` -> ``[nq, B, Hk, G * bq, D]`` (rows padded to whole blocks)."""
    b, d = tf.shape(x)[0], x.shape[-1]
    x = tf.pad(x, [[0, 0], [0, plan.nq * plan.bq - plan.t], [0, 0], [0, 0]])
    x = tf.reshape(x, [b, plan.nq, plan.bq, plan.kv_heads, plan.groups, d])
    x = tf.transpose(x, [1, 0, 3, 4, 2, 5])
    return tf.reshape(x, [plan.nq, b, plan.kv_heads, plan.groups * plan.bq, d])


def from_query_blocks(x, plan: Plan):
    """The inverse of :func:`query_blocks` (padding rows dropped)."""
    d = x.shape[-1]
    x = tf.reshape(x, [plan.nq, -1, plan.kv_heads, plan.groups, plan.bq, d])
    x = tf.transpose(x, [1, 0, 4, 2, 3, 5])
    x = tf.reshape(x, [-1, plan.nq * plan.bq, plan.heads, d])
    return x[:, : plan.t]


def key_blocks(x, plan: Plan):
    """``[B, S, Hk, D]`` -> ``[nk, B, Hk, bk, D]``."""
    b, d = tf.shape(x)[0], x.shape[-1]
    x = tf.pad(x, [[0, 0], [0, plan.nk * plan.bk - plan.s], [0, 0], [0, 0]])
    x = tf.reshape(x, [b, plan.nk, plan.bk, plan.kv_heads, d])
    return tf.transpose(x, [1, 0, 3, 2, 4])


def from_key_blocks(x, plan: Plan):
    d = x.shape[-1]
    x = tf.transpose(x, [1, 0, 3, 2, 4])
    return tf.reshape(x, [-1, plan.nk * plan.bk, plan.kv_heads, d])[:, : plan.s]


def mask_blocks(mask, plan: Plan):
    """A 4-D boolean mask -> ``[nq|1, nk|1, Bm, Hm, bq|1, bk|1]`` (padding: False); axes of size 1 stay 1."""
    rows, cols = mask.shape[2] != 1, mask.shape[3] != 1
    pad_t = plan.nq * plan.bq - plan.t if rows else 0
    pad_s = plan.nk * plan.bk - plan.s if cols else 0
    mask = tf.pad(mask, [[0, 0], [0, 0], [0, pad_t], [0, pad_s]], constant_values=False)
    shape = [-1, mask.shape[1], plan.nq if rows else 1, plan.bq if rows else 1]
    mask = tf.reshape(mask, shape + [plan.nk if cols else 1, plan.bk if cols else 1])
    return tf.transpose(mask, [2, 4, 0, 1, 3, 5])


# ------------------------------------------------------------------ one block
class _Block:
    """What block ``(i, j)`` needs: its allowed entries, dropout keep mask, and whether any entry is live."""

    def __init__(self, plan: Plan, mask, seed, positions, i, j):
        self.plan = plan
        rows = i * plan.bq + tf.range(plan.bq)
        cols = j * plan.bk + tf.range(plan.bk)
        allowed, edge = None, tf.constant(False)
        if plan.s % plan.bk:
            allowed = tf.broadcast_to(cols[None, :] < plan.s, [plan.bq, plan.bk])
            edge = tf.equal(j, plan.nk - 1)
        if plan.causal:
            below = cols[None, :] <= rows[:, None]
            allowed = below if allowed is None else allowed & below
            edge = edge | ((j + 1) * plan.bk - 1 > i * plan.bq)  # some key after some query: on the diagonal
        self.edge = edge if mask is None else None  # without a mask, only edge blocks need masking
        self.live = None
        if mask is not None:  # mask_blocks' layout
            m = tf.gather(mask, i if mask.shape[0] != 1 else 0)
            m = tf.gather(m, j if mask.shape[1] != 1 else 0)  # [Bm, Hm, bq|1, bk|1]
            if m.shape[1] == 1:
                m = tf.expand_dims(m, 2)
            else:
                m = tf.reshape(m, [-1, plan.kv_heads, plan.groups, m.shape[2], m.shape[3]])
            self.live = tf.reduce_any(m) if allowed is None else tf.reduce_any(m & allowed)
            allowed = m if allowed is None else m & allowed
        self.allowed = allowed
        self.keep = None
        if plan.rate > 0.0:
            self.keep = keep_block(plan, seed, positions, i, j)

    def scores(self, q, k):
        """``(s, t)``: masked scores (-inf where not allowed) and ``tanh`` of the soft cap (or None).

        ``q`` comes scaled: ``s = (scale * q) k^T``.
        """
        plan = self.plan
        s = tf.matmul(q, k, transpose_b=True)
        t = None
        if plan.soft_cap is not None:
            t = tf.tanh(s / plan.soft_cap)
            s = plan.soft_cap * t
        if self.allowed is not None:

            def masked():
                s5 = tf.reshape(s, [-1, plan.kv_heads, plan.groups, plan.bq, plan.bk])
                return tf.reshape(tf.where(self.allowed, s5, tf.constant(-math.inf, s5.dtype)), tf.shape(s))

            s = masked() if self.edge is None else tf.cond(self.edge, masked, lambda: s)
        return s, t

    def dropped(self, x):
        """``x * keep / (1 - rate)`` (no dropout: ``x``)."""
        if self.keep is None:
            return x
        return tf.where(self.keep, x / (1.0 - self.plan.rate), tf.zeros_like(x))


def _mix(x):
    """lowbias32 (C. Wellons): a 32-bit integer hash with full avalanche, in uint32 arithmetic."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))
    x = x * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(15, tf.uint32)))
    x = x * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def positions(plan: Plan, batch):
    """``[B, Hk, G * bq, bk]``: each entry's hashed index within a block (made once, outside the loops:
    inside them XLA needs every shape to be a compile-time constant)."""
    per_row = plan.kv_heads * plan.groups * plan.bq * plan.bk
    index = _mix(tf.cast(tf.range(batch * per_row), tf.uint32))
    return tf.reshape(index, tf.stack([batch, plan.kv_heads, plan.groups * plan.bq, plan.bk]))


def keep_block(plan: Plan, seed, positions, i, j):
    """Dropout's keep mask of block ``(i, j)``: ``[B, Hk, G * bq, bk]``, the same bits forward and backward.

    A counter-based hash of (seed, block, position), not ``tf.random.stateless_uniform``: TensorFlow's
    stateless Philox draws other bits under XLA than in a graph (measured on 2.21), and the mask must not
    depend on how the step is compiled.
    """
    seed = tf.cast(seed, tf.uint32)
    block = tf.cast(i * plan.nk + j, tf.uint32)
    key = _mix(tf.bitwise.bitwise_xor(seed[0], _mix(tf.bitwise.bitwise_xor(seed[1], _mix(block)))))
    bits = _mix(tf.bitwise.bitwise_xor(positions, key))
    uniform = tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) * 2.0**-24
    return uniform >= plan.rate


def keep_mask(plan: Plan, seed, batch):
    """The whole keep mask ``[B, H, T, S]`` the kernel draws (for tests and debugging: it is T x S)."""
    grid = positions(plan, batch)
    rows = []
    for i in range(plan.nq):
        blocks = [keep_block(plan, seed, grid, i, j) for j in range(plan.nk)]
        rows.append(tf.concat(blocks, axis=-1))
    keep = tf.stack(rows)  # [nq, B, Hk, G*bq, nk*bk]
    keep = tf.reshape(keep, [plan.nq, batch, plan.kv_heads, plan.groups, plan.bq, plan.nk * plan.bk])
    keep = tf.transpose(keep, [1, 2, 3, 0, 4, 5])
    keep = tf.reshape(keep, [batch, plan.heads, plan.nq * plan.bq, plan.nk * plan.bk])
    return keep[:, :, : plan.t, : plan.s]


def _gated(block: _Block, compute, carry):
    """``compute(*carry)``, skipped at run time when the block's mask is all False."""
    if block.live is None:
        return compute(*carry)
    return tf.cond(block.live, lambda: compute(*carry), lambda: carry)


# ------------------------------------------------------------------ forward
def forward(q, k, v, mask, seed, plan: Plan):
    """``(o [B, T, H, Dv] float32, lse [nq, B, Hk, G*bq], seen [nq, B, Hk, G*bq] bool)``.

    ``seen``: the row saw at least one key (else its output follows ``plan.empty``).
    """
    batch = tf.shape(q)[0]
    qb, kb, vb = query_blocks(tf.cast(q, plan.dtype) * plan.scale, plan), key_blocks(k, plan), key_blocks(v, plan)
    rows = plan.groups * plan.bq
    # Every shape is made here, outside the loops (inside them XLA needs compile-time constants).
    stats_shape = tf.stack([batch, plan.kv_heads, rows])
    start = (
        tf.constant(0),
        tf.fill(stats_shape, tf.constant(-math.inf, plan.dtype)),
        tf.zeros(stats_shape, plan.dtype),
        tf.zeros(tf.concat([stats_shape, [plan.value_depth]], 0), plan.dtype),
    )
    grid = positions(plan, batch) if plan.rate > 0.0 else None

    def query_block(i, out, lses, seens):
        qi = tf.gather(qb, i)

        def key_block(j, m, total, acc):
            block = _Block(plan, mask, seed, grid, i, j)

            def update(m, total, acc):
                s, _ = block.scores(qi, tf.cast(tf.gather(kb, j), plan.dtype))
                m_new = tf.maximum(m, tf.reduce_max(s, axis=-1))
                # no key seen yet: nothing to shift
                m_safe = tf.where(tf.math.is_inf(m_new), tf.zeros_like(m_new), m_new)
                p = tf.exp(s - m_safe[..., None])
                correction = tf.exp(m - m_safe)
                total = total * correction + tf.reduce_sum(p, axis=-1)
                pv = tf.matmul(block.dropped(p), tf.cast(tf.gather(vb, j), plan.dtype))
                return m_new, total, acc * correction[..., None] + pv

            return (j + 1, *_gated(block, update, (m, total, acc)))

        end = plan.last_key_block(i)
        _, m, total, acc = tf.while_loop(lambda j, *_: j < end, key_block, start, parallel_iterations=1)
        seen = total > 0.0
        ones = tf.ones_like(total)
        o = acc / tf.where(seen, total, ones)[..., None]
        lse = tf.where(seen, m + tf.math.log(tf.where(seen, total, ones)), tf.zeros_like(total))
        return i + 1, out.write(i, o), lses.write(i, lse), seens.write(i, seen)

    arrays = (
        tf.TensorArray(plan.dtype, size=plan.nq, element_shape=[None, plan.kv_heads, rows, plan.value_depth]),
        tf.TensorArray(plan.dtype, size=plan.nq, element_shape=[None, plan.kv_heads, rows]),
        tf.TensorArray(tf.bool, size=plan.nq, element_shape=[None, plan.kv_heads, rows]),
    )
    _, out, lses, seens = tf.while_loop(
        lambda i, *_: i < plan.nq, query_block, (tf.constant(0), *arrays), parallel_iterations=1
    )
    o, seen = out.stack(), seens.stack()
    if plan.masked and plan.empty == "mean":
        # keras.ops.dot_product_attention: a row with every key masked softmaxes equal scores.
        o = tf.where(seen[..., None], o, _value_mean(v, plan)[None, :, :, None, :])
    return from_query_blocks(o, plan), lses.stack(), seen


def _value_mean(v, plan: Plan):
    """``[B, Hk, Dv]``: the mean of the values over the ``S`` real keys."""
    return tf.reduce_mean(tf.cast(v, plan.dtype), axis=1)


# ------------------------------------------------------------------ backward
def backward(q, k, v, o, lse, seen, do, mask, seed, plan: Plan):
    """``(dq, dk, dv)`` in float32, from the saved ``o`` and ``lse``; the blocks' scores are recomputed."""
    batch = tf.shape(q)[0]
    qb, kb, vb = query_blocks(tf.cast(q, plan.dtype) * plan.scale, plan), key_blocks(k, plan), key_blocks(v, plan)
    dob = query_blocks(tf.cast(do, plan.dtype), plan)
    delta = tf.reduce_sum(dob * query_blocks(tf.cast(o, plan.dtype), plan), axis=-1)  # rowsum(do * o)
    rows = plan.groups * plan.bq
    row_shape = [q.shape[0], plan.kv_heads, rows, plan.depth]
    zeros_q = tf.zeros(tf.stack([batch, plan.kv_heads, rows, plan.depth]), plan.dtype)
    zeros_k = tf.zeros(tf.stack([batch, plan.kv_heads, plan.bk, plan.depth]), plan.dtype)
    zeros_v = tf.zeros(tf.stack([batch, plan.kv_heads, plan.bk, plan.value_depth]), plan.dtype)
    grid = positions(plan, batch) if plan.rate > 0.0 else None

    def key_block(j, dq, dks, dvs):
        kj = tf.cast(tf.gather(kb, j), plan.dtype)
        vj = tf.cast(tf.gather(vb, j), plan.dtype)

        def query_block(i, dk, dv, dqs):
            block = _Block(plan, mask, seed, grid, i, j)

            def update(dk, dv, dq_i):
                qi = tf.gather(qb, i)
                doi = tf.gather(dob, i)
                s, t = block.scores(qi, kj)
                p = tf.exp(s - tf.gather(lse, i)[..., None])
                dv = dv + tf.matmul(block.dropped(p), doi, transpose_a=True)
                dp = block.dropped(tf.matmul(doi, vj, transpose_b=True))
                ds = p * (dp - tf.gather(delta, i)[..., None])
                if t is not None:
                    ds = ds * (1.0 - t * t)
                return dk + tf.matmul(ds, qi, transpose_a=True), dv, tf.matmul(ds, kj)

            # (The TensorArray is written outside the cond: XLA cannot carry one through a conditional.)
            dk, dv, dq_i = _gated(block, update, (dk, dv, zeros_q))
            return i + 1, dk, dv, dqs.write(i, dq_i)

        dqs = tf.TensorArray(plan.dtype, size=plan.nq, element_shape=row_shape)  # unwritten blocks are zeros
        start = (plan.first_query_block(j), zeros_k, zeros_v, dqs)
        _, dk, dv, dqs = tf.while_loop(lambda i, *_: i < plan.nq, query_block, start, parallel_iterations=1)
        return j + 1, dq + tf.ensure_shape(dqs.stack(), dq.shape), dks.write(j, dk), dvs.write(j, dv)

    start = (
        tf.constant(0),
        tf.zeros(tf.stack([plan.nq, batch, plan.kv_heads, rows, plan.depth]), plan.dtype),
        tf.TensorArray(plan.dtype, size=plan.nk, element_shape=[None, plan.kv_heads, plan.bk, plan.depth]),
        tf.TensorArray(plan.dtype, size=plan.nk, element_shape=[None, plan.kv_heads, plan.bk, plan.value_depth]),
    )
    # (Key blocks no query sees stay unwritten: zeros.)
    _, dq, dks, dvs = tf.while_loop(lambda j, *_: j < plan.seen_key_blocks, key_block, start, parallel_iterations=1)
    # ds is the gradient of (scale * q) k^T: dk has the scale in it already, dq gets it here.
    dq = from_query_blocks(dq * plan.scale, plan)
    dk, dv = from_key_blocks(dks.stack(), plan), from_key_blocks(dvs.stack(), plan)
    if plan.masked and plan.empty == "mean":
        # Each row that saw no key took the mean of all values: 1/S of its output gradient reaches every value.
        unseen = tf.cast(tf.logical_not(seen), plan.dtype)[..., None] * dob  # [nq, B, Hk, G*bq, Dv]
        share = tf.reduce_sum(unseen, axis=[0, 3]) / plan.s  # [B, Hk, Dv]
        dv = dv + share[:, None, :, :]
    return dq, dk, dv
