"""The update policy: how summed gradients become one optimizer update, or none.

Given the raw gradient sums of a step (scaled by the loss scale ``S``, not
yet normalized) the final gradient of each variable is formed in one pass,
as the optimizer is about to use it::

    g = raw * factor              # factor = unscale (1/S) x normalization, one multiply
      + noise * noise_factor      # DP-SGD: N(0, (sigma C)^2), once per batch, same on every replica
      + d(regularization)/dθ
    g = g * min(1, clip_norm / |g|)   # the global norm of the FINAL gradient

and the step is applied only when every raw sum is finite (checked after the
cross-replica sum, so every replica decides alike) and the batch has weight.
The optimizer's inputs are the raw sums only: no second gradient-sized copy
exists before the update (each final gradient is formed as it is consumed).

Trap:
    Clipping before unscaling clips ``S`` times too hard; clipping before the
    cross-replica sum clips each replica's share (what Keras 3's
    ``LossScaleOptimizer`` does): both give another update than the
    full-batch one. Here the norm is taken of the final gradient only.
"""

from __future__ import annotations

import dataclasses
import warnings

import tensorflow as tf

from effgrad import _compat, distribute
from effgrad.train import accumulate, inplace

__all__ = ["Update", "Noise", "squared_norm", "regularization", "apply_gradients", "apply_or_skip", "warn_unconnected"]


def squared_norm(tensors) -> tf.Tensor:
    """``sum |t|^2`` over a list of tensors (None skipped), float32, with no squared copy of any tensor.

    An ``IndexedSlices`` counts as the dense gradient it stands for: its
    duplicate rows summed first. ``tf.nn.l2_loss`` is one fused reduction
    kernel, several times faster than a ``tensordot`` of a tensor with itself.
    """
    terms = [2.0 * tf.nn.l2_loss(tf.cast(_summed_rows(t), tf.float32)) for t in tensors if t is not None]
    return tf.add_n(terms) if terms else tf.zeros([], tf.float32)


def _summed_rows(g):
    """The rows of an ``IndexedSlices`` with its duplicate indices summed (a dense tensor as it is)."""
    if not isinstance(g, tf.IndexedSlices):
        return g
    unique, position = tf.unique(g.indices)
    return tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])


def _scaled(g, factor):
    """``g * factor``; an ``IndexedSlices`` stays one (its rows scaled)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * factor


def apply_gradients(optimizer, grads, variables) -> None:
    """``optimizer.apply(grads, variables)`` with ``grads`` in the units Keras's ``apply`` expects.

    With ``loss_scale_factor`` set, Keras's train step multiplies the loss by it and ``apply``
    divides the gradients by it; effgrad's gradients are the loss's own (its loss scaling is undone
    before here), so they are handed over multiplied by it: the same update as Keras's.
    """
    factor = getattr(optimizer, "loss_scale_factor", None)
    if factor is not None:
        grads = [None if g is None else _scaled(g, factor) for g in grads]
    optimizer.apply(grads, variables)


def regularization(variables) -> tuple[tf.Tensor, dict[int, tf.Tensor]]:
    """``(sum of the weight regularizers, {index: its gradient})`` for the variables that have one."""
    regularized = [(i, v) for i, v in enumerate(variables) if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return tf.zeros([], tf.float32), {}
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for _, v in regularized])
    grads = tape.gradient(loss, [v for _, v in regularized])
    return loss, {i: g for (i, _), g in zip(regularized, grads)}


@dataclasses.dataclass(frozen=True)
class Noise:
    """DP-SGD's Gaussian noise: ``stddev = sigma * C`` per coordinate, drawn from ``(seed, step, variable)``.

    Stateless draws: every replica draws the same numbers (so the noise is
    added once per batch, not once per replica) and a draw can be repeated
    (the clip norm sees the noise the update gets) without storing it.
    """

    stddev: float
    seed: tf.Tensor  # [2] int64: (the step's seed, the optimizer's iteration)

    def sample(self, index: int, shape) -> tf.Tensor:
        seed = tf.random.experimental.stateless_fold_in(self.seed, index)
        return tf.random.stateless_normal(shape, seed=seed, stddev=self.stddev, dtype=tf.float32)


@dataclasses.dataclass(frozen=True)
class Update:
    """One step's final gradients, formed lazily from the raw sums (see the module docstring).

    Attributes:
        raw: Raw gradient sums, one per trained variable (scaled, unnormalized).
        reg: ``{position in raw: regularization gradient}``.
        factor: Multiplier of the raw sums (unscale x normalize), None for 1.
        noise: DP-SGD's noise, or None.
        noise_factor: Multiplier of the noise (1 / the examples in the batch).
        clip_norm: Clip the final gradient's global norm to this, or None.
    """

    raw: list
    reg: dict
    factor: tf.Tensor | None = None
    noise: Noise | None = None
    noise_factor: tf.Tensor | None = None
    clip_norm: float | None = None

    def finite(self) -> tf.Tensor:
        """Whether every raw sum (and the factor) is finite.

        A sum per variable reads each gradient once and writes nothing; it is
        inf/NaN when an element is, or when the gradient is too large to sum
        in float32, which no update should use either.
        """
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in [*self.raw, *self.reg.values()]]
        checks = [tf.math.is_finite(tf.reduce_sum(g)) for g in values]
        if self.factor is not None:
            checks.append(tf.math.is_finite(self.factor))
        return tf.reduce_all(checks)

    def _unclipped(self, j: int) -> tf.Tensor | tf.IndexedSlices:
        """An embedding's ``IndexedSlices`` (one micro-batch, one replica) stays one, as Keras hands it to
        the optimizer; noise or a regularizer's dense gradient added to it makes it dense, as in Keras."""
        g = self.raw[j]
        if self.factor is not None:
            g = _scaled(g, self.factor)
        if isinstance(g, tf.IndexedSlices) and (self.noise is not None or j in self.reg):
            g = tf.convert_to_tensor(g)
        if self.noise is not None:
            g = g + self.noise.sample(j, tf.shape(g)) * self.noise_factor
        if j in self.reg:
            g = g + self.reg[j]
        return g

    def clip(self) -> tf.Tensor | None:
        """``min(1, clip_norm / |g|)`` of the final gradient (None: no clipping)."""
        if self.clip_norm is None:
            return None
        squares = []
        for j, g in enumerate(self.raw):
            if j in self.reg or self.noise is not None:
                squares.append(squared_norm([self._unclipped(j)]))
            else:  # from the raw sum: a scalar, no scaled copy
                squares.append(squared_norm([g]) * (1.0 if self.factor is None else tf.square(self.factor)))
        norm = tf.sqrt(tf.add_n(squares))
        return self.clip_norm / tf.maximum(norm, self.clip_norm)

    def gradient(self, j: int, clip: tf.Tensor | None) -> tf.Tensor | tf.IndexedSlices:
        """The final gradient of variable ``j``, formed in one pass."""
        g = self._unclipped(j)
        return g if clip is None else _scaled(g, clip)

    def tensors(self) -> dict:
        """The tensors of this update as a nest ``merge_call`` can hand from replicas to the update."""
        fields = {"raw": self.raw, "reg": self.reg}
        for name in ("factor", "noise_factor"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.noise is not None:
            fields["noise_seed"] = self.noise.seed
        return fields

    def with_tensors(self, fields: dict) -> Update:
        """This update with its tensors replaced by ``fields`` (what :meth:`tensors` gave, per replica)."""
        noise = None if self.noise is None else Noise(self.noise.stddev, fields["noise_seed"])
        return dataclasses.replace(
            self,
            raw=fields["raw"],
            reg=fields["reg"],
            factor=fields.get("factor"),
            noise=noise,
            noise_factor=fields.get("noise_factor"),
        )


def apply_or_skip(
    strategy, optimizer, update: Update, tensors: dict, variables, commit, apply_flag, accumulators=None
) -> tf.Tensor:
    """Cross-replica: every replica applies ``update`` and commits held-back state, or none does.

    ``tensors`` are the update's tensors as ``merge_call`` regrouped them
    (:meth:`Update.tensors`); ``commit`` is ``[(variable, new value)]`` of the
    forward pass's state writes. With ``accumulators`` the final gradients are
    written back into them (each buffer replaced as its gradient is formed):
    no second gradient-sized buffer next to them.
    """

    def apply(tensors, commit_values):
        final = update.with_tensors(tensors)
        clip = final.clip()
        if accumulators is None:
            grads = [final.gradient(j, clip) for j in range(len(final.raw))]
        else:  # one at a time: each final gradient is a buffer until it replaces its accumulator's
            writes = []
            for j, acc in enumerate(accumulators):
                with tf.control_dependencies(writes[-1:]):
                    writes.append(acc.assign(final.gradient(j, clip), read_value=False))
            with tf.control_dependencies(writes):
                grads = [accumulate.read(acc, v.shape) for acc, v in zip(accumulators, variables)]
        apply_gradients(optimizer, grads, variables)
        for (variable, _), value in zip(commit, commit_values):
            variable.assign(value)

    # Entered here, in the one cross-replica thread, not in each replica's.
    with _compat.gradients_already_reduced(optimizer), inplace.compiled(optimizer):
        return distribute.apply_or_skip(strategy, apply_flag, apply, args=(tensors, [v for _, v in commit]))


def warn_unconnected(variables, connected) -> None:
    """Warns (as Keras's own fit does) about trainable variables the loss does not reach."""
    if len(connected) < len(variables):
        idle = [variables[i].path for i in range(len(variables)) if i not in set(connected)]
        warnings.warn(
            f"Gradients do not exist for variables {idle} when minimizing the loss: they do not reach "
            "it, so they are not updated (as in Keras's own fit). If that is unexpected, check the "
            "model's outputs and loss.",
            UserWarning,
            stacklevel=3,
        )
