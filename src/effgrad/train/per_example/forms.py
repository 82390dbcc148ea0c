"""One weight's per-example gradients in the forms backprop already holds, their norms and their clipped sum.

A rule (:mod:`effgrad.train.per_example.rules`) describes each weight's
per-example gradient ``G_i`` in one of two forms:

* :class:`Outer`: ``G_i = view(sum_t left[i, t] (x) right[i, t])``, group by
  group (``left``: ``[B, T, G, m]`` or one-hot :class:`Ids`, ``right``:
  ``[B, T, G, n]``; ``T`` positions, e.g. tokens or pixels). A Dense kernel
  is ``left = x`` (its input), ``right = g`` (its output gradient).
* :class:`Direct`: ``G_i`` itself, ``[B, *shape]`` (biases, normalization
  scales, the fallback's per-example gradients).

For an ``Outer``, two ways to the norm (mixed ghost clipping, Bu et al. 2022)::

    ghost:        |G_i|^2 = sum_g sum_{t,s} (left_it . left_is)(right_it . right_is)   # [T, T] Gram matrices
    instantiated: G_i = einsum("tgm,tgn->gmn"), then its sum of squares

and one to the clipped sum (book-keeping, Bu et al. 2023)::

    sum_i c_i G_i = view(left^T (c * right))       # the plain gradient's own matmul, rows scaled

:class:`Book` keeps, per weight, whatever is smaller until the clipping
factors ``c`` exist: ``G_i`` when it is no larger than its factors
(``G m n <= T G (m + n)``), else the factors (then ``T^2 < m n``: the Gram
matrices are smaller than ``G_i`` too). A weight used by several calls (a
tied embedding) has ``|sum_u G_u,i|^2 != sum_u |G_u,i|^2``: its parts are
kept and combined after backprop, with cross Gram terms ``<G_u, G_v>``.

Example:
    >>> from effgrad.train.per_example.forms import Outer, View, ghost_sq
    >>> x, g = tf.ones([2, 3, 1, 4]), tf.ones([2, 3, 1, 5])
    >>> part = Outer(tf.Variable(tf.zeros([4, 5])), x, g, View((4, 5)))
    >>> [float(v) for v in ghost_sq([part])]  # |sum_t x_t g_t^T|^2 = (3 * 1 * 1)^2 * 20
    [180.0, 180.0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

__all__ = ["Ids", "View", "Outer", "Direct", "by_rows", "ghost_sq", "instantiate", "clipped", "Book"]


def _f32(t) -> tf.Tensor:
    return tf.cast(t, tf.float32)


def by_rows(t, *shape) -> tf.Tensor:
    """``t`` as ``[batch, *shape]`` (one entry may be -1), keeping every size known statically (a dynamic
    batch would otherwise hide the -1's size: the choice between the forms needs it)."""
    shape = list(shape)
    if -1 in shape and t.shape[1:].is_fully_defined():
        shape[shape.index(-1)] = t.shape[1:].num_elements() // math.prod(d for d in shape if d != -1)
    return tf.reshape(t, [tf.shape(t)[0], *shape])


def sum_sq(t) -> tf.Tensor:
    """``[batch]``: the squared norm of each row of ``t``."""
    return tf.reduce_sum(tf.square(by_rows(_f32(t), -1)), axis=1)


@dataclasses.dataclass(frozen=True)
class Ids:
    """One-hot rows: ``left[i, t] = e_{ids[i, t]}`` in a space of ``size`` (an embedding lookup); one group."""

    ids: tf.Tensor  # [B, T] integers
    size: int


@dataclasses.dataclass(frozen=True)
class View:
    """How ``[L, G, m, n]`` blocks become ``[L, *shape]``: reshape to ``dims``, permute, reshape to ``shape``."""

    dims: tuple
    perm: tuple | None = None
    shape: tuple | None = None

    def __call__(self, t: tf.Tensor) -> tf.Tensor:
        t = tf.reshape(t, [-1, *self.dims])
        if self.perm is not None:
            t = tf.transpose(t, [0, *(p + 1 for p in self.perm)])
        return t if self.shape is None else tf.reshape(t, [-1, *self.shape])


@dataclasses.dataclass(frozen=True)
class Outer:
    """``G_i = view(sum_t left[i, t] (x) right[i, t])`` per group: see the module docstring.

    ``left`` may be a zero-argument callable (made when needed: a convolution's patches).
    """

    variable: Any
    left: tf.Tensor | Ids | Callable
    right: tf.Tensor  # [B, T, G, n]
    view: View

    def left_value(self) -> tf.Tensor | Ids:
        return self.left() if callable(self.left) else self.left

    @property
    def sizes(self) -> tuple:
        """``(T, G, m, n)``, static (``T`` may be None)."""
        t, groups, n = self.right.shape[1], self.right.shape[2], self.right.shape[3]
        m = self.left.size if isinstance(self.left, Ids) else math.prod(self.view.dims) // (groups * n)
        return t, groups, m, n

    def smaller_instantiated(self) -> bool:
        """``G_i`` holds no more numbers than its two factors (so it is kept, not them)."""
        t, groups, m, n = self.sizes
        if t is None:
            return False
        left = 1 if isinstance(self.left, Ids) else m
        return groups * m * n <= t * groups * (left + n)


@dataclasses.dataclass(frozen=True)
class Direct:
    """``G_i`` as it is: ``[B, *variable.shape]``."""

    variable: Any
    per_example: tf.Tensor


def _gram(a, b) -> tf.Tensor:
    """``[B, G, T, S]``: ``a_t . b_s`` per group (``a``, ``b``: ``[B, T|S, G, k]`` or :class:`Ids`)."""
    if isinstance(a, Ids) and isinstance(b, Ids):
        return _f32(tf.equal(a.ids[:, :, None], b.ids[:, None, :]))[:, None]
    if isinstance(b, Ids):
        return tf.transpose(_gram(b, a), [0, 1, 3, 2])
    if isinstance(a, Ids):  # e_{a_t} . b_s = b_s[a_t]
        picked = tf.gather(_f32(b[:, :, 0, :]), tf.cast(a.ids, tf.int32), axis=2, batch_dims=1)  # [B, S, T]
        return tf.transpose(picked, [0, 2, 1])[:, None]
    if a.shape[1] == 1 and b.shape[1] == 1:  # one position each: a dot product per group
        return tf.reduce_sum(_f32(a[:, 0]) * _f32(b[:, 0]), axis=-1)[:, :, None, None]
    if a.shape[2] == 1:
        return tf.linalg.matmul(_f32(a[:, :, 0]), _f32(b[:, :, 0]), transpose_b=True)[:, None]
    return tf.einsum("btgk,bsgk->bgts", _f32(a), _f32(b))


def _inner(u: Outer, v: Outer, left_u, left_v) -> tf.Tensor:
    """``[B]``: ``<G_u,i, G_v,i>`` from Gram matrices (no per-example gradient)."""
    return tf.reduce_sum(_gram(left_u, left_v) * _gram(u.right, v.right), axis=[1, 2, 3])


def ghost_sq(parts: Sequence[Outer]) -> tf.Tensor:
    """``[B]``: ``|sum_u G_u,i|^2`` over parts of one weight with the same view, from Gram matrices.

    One part of unknown length ``T`` decides per batch between the Gram
    matrices and the per-example gradient, whichever is smaller.
    """
    lefts = [p.left_value() for p in parts]
    if len(parts) == 1 and parts[0].sizes[0] is None:
        part, (_, _, m, n) = parts[0], parts[0].sizes
        length = tf.shape(part.right)[1]
        return tf.cond(
            length * length <= m * n,
            lambda: _inner(part, part, lefts[0], lefts[0]),
            lambda: sum_sq(instantiate(part)),
        )
    total = None
    for i, u in enumerate(parts):
        for j in range(i, len(parts)):
            term = _inner(u, parts[j], lefts[i], lefts[j]) * (1.0 if i == j else 2.0)
            total = term if total is None else total + term
    return total


def instantiate(part: Outer) -> tf.Tensor:
    """``[B, *shape]`` float32: every example's gradient."""
    left, right = part.left_value(), _f32(part.right)
    if isinstance(left, Ids):
        rows, n = tf.shape(right)[0], right.shape[-1]
        segments = tf.cast(left.ids, tf.int32) + left.size * tf.range(rows)[:, None]
        summed = tf.math.unsorted_segment_sum(tf.reshape(right, [-1, n]), tf.reshape(segments, [-1]), rows * left.size)
        return part.view(tf.reshape(summed, [rows, 1, left.size, n]))
    if left.shape[2] == 1:  # one batched matmul, no transposed copy
        return part.view(tf.linalg.matmul(_f32(left[:, :, 0]), right[:, :, 0], transpose_a=True)[:, None])
    return part.view(tf.einsum("btgm,btgn->bgmn", _f32(left), right))


def clipped(part: Outer | Direct, weights: tf.Tensor) -> tf.Tensor:
    """``sum_i weights_i G_i`` (the variable's shape, float32): one matmul, no per-example gradient."""
    if isinstance(part, Direct):
        return tf.tensordot(weights, _f32(part.per_example), 1)
    left, right = part.left_value(), _f32(part.right) * weights[:, None, None, None]
    n = right.shape[-1]
    if isinstance(left, Ids):
        summed = tf.math.unsorted_segment_sum(
            tf.reshape(right, [-1, n]), tf.reshape(tf.cast(left.ids, tf.int32), [-1]), left.size
        )
        return part.view(summed[None])[0]
    groups, m = left.shape[2], left.shape[3]
    if groups == 1:
        block = tf.linalg.matmul(tf.reshape(_f32(left), [-1, m]), tf.reshape(right, [-1, n]), transpose_a=True)
        return part.view(block[None, None])[0]
    return part.view(tf.einsum("btgm,btgn->gmn", _f32(left), right)[None])[0]


class _Entry:
    """One weight during a backward pass: its parts (Gram form) or its per-example gradient (instantiated)."""

    def __init__(self, variable, uses: int):
        self.variable, self.uses = variable, uses
        self.parts: list = []
        self.total: tf.Tensor | None = None  # [B, *shape] when instantiated

    def add(self, part) -> None:
        if self.total is None and not self.parts:  # the first part decides the form
            ghost = isinstance(part, Outer) and not part.smaller_instantiated()
            if ghost:
                self.parts.append(part)
                return
        elif self.parts and isinstance(part, Outer) and part.view == self.parts[0].view:
            self.parts.append(part)
            return
        if self.parts:  # another kind of use: Gram terms would not combine; instantiate them all
            self.total = tf.add_n([instantiate(p) for p in self.parts])
            self.parts = []
        value = _f32(part.per_example) if isinstance(part, Direct) else instantiate(part)
        self.total = value if self.total is None else self.total + value

    def norm_sq(self) -> tf.Tensor:
        return ghost_sq(self.parts) if self.parts else sum_sq(self.total)

    def clipped(self, weights) -> tf.Tensor:
        if self.parts:
            return tf.add_n([clipped(p, weights) for p in self.parts])
        return tf.tensordot(weights, self.total, 1)


class Book:
    """What one backward pass keeps per weight, until the clipping factors exist.

    ``uses``: how many layer calls use each weight (``id(variable) -> count``),
    counted in the forward pass. A weight with one use gives its norm share as
    soon as its part arrives (:meth:`add` returns it); the others are combined
    in :meth:`shared_sq` after backprop.
    """

    def __init__(self, uses: dict[int, int]):
        self.uses = uses
        self.entries: dict[int, _Entry] = {}

    def add(self, parts: Sequence, rows) -> tf.Tensor:
        """Files one call's parts; returns ``[B]``: the squared norm share of its weights used once."""
        share = tf.zeros([rows], tf.float32)
        for part in parts:
            key = id(part.variable)
            if key not in self.uses:  # not trained
                continue
            entry = self.entries.setdefault(key, _Entry(part.variable, self.uses[key]))
            entry.add(part)
            if entry.uses == 1:
                share += entry.norm_sq()
        return share

    def shared_sq(self):
        """``[B]`` squared norms of the weights several calls use (summed over them), or None."""
        shared = [e.norm_sq() for e in self.entries.values() if e.uses > 1]
        return tf.add_n(shared) if shared else None

    def clipped(self, variables, weights: tf.Tensor) -> list:
        """``sum_i weights_i G_i`` per variable (float32), None for a variable no call reached."""
        weights = _f32(weights)
        out = []
        for v in variables:
            entry = self.entries.get(id(v))
            out.append(None if entry is None else tf.ensure_shape(entry.clipped(weights), v.shape))
        return out
