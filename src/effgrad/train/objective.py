"""Unreduced losses and their global normalization, as Keras defines it.

The train step sums over micro-batches and replicas and divides ONCE, so a
loss is handled as two sums per micro-batch::

    weights    = sample_weight * keras_mask            (broadcast to the losses)
    total      = sum(weights * losses)
    normalizer = sum(weights)          for "mean_with_sample_weight"
               = valid loss elements   for "sum_over_batch_size" (mask sum, else their count)
               = 0 (unused)            for "sum"
    L = sum_i total_i / sum_i normalizer_i   (or sum_i total_i for "sum")

which is exactly Keras's ``Loss.__call__`` on the whole batch: its mask
rescaling ``total / valid`` for ``"sum_over_batch_size"`` divides by the valid
elements, and ``"mean_with_sample_weight"`` divides by the summed weights.

Trap:
    ``Loss.call`` alone never sees the Keras mask (``y_pred._keras_mask``,
    e.g. from ``Embedding(mask_zero=True)``): ``Loss.__call__`` reads it off
    ``y_pred``. Read it before casting ``y_pred``, which drops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import tensorflow as tf

from effgrad import _compat, _proof

__all__ = ["REDUCTIONS", "Objective", "reduction_of", "unreduced", "weighted_terms", "normalize"]

REDUCTIONS = ("mean_with_sample_weight", "sum_over_batch_size", "sum")
_ALIASES = {"mean": "sum_over_batch_size"}


def check_reduction(reduction: str) -> str:
    """A Keras reduction name, standardized; ``ValueError`` for the others."""
    reduction = _ALIASES.get(reduction, reduction)
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {REDUCTIONS} (Keras's names, computed over the whole batch), "
            f"got {reduction!r}. 'none' cannot train: a step needs one scalar loss."
        )
    return reduction


def reduction_for(loss, given: str | None = None) -> str:
    """The reduction ``build_train_step`` computes ``loss`` with.

    ``given`` (its ``reduction=``) wins; else a Keras loss object's own when it
    was set (``SparseCategoricalCrossentropy(reduction="sum")``); else the
    step's documented default ``"mean_with_sample_weight"``, ``L = sum(w l) /
    sum(w)``. Keras's own default (``"sum_over_batch_size"``) cannot be told
    from one set by hand, and keeps the step's default: it differs only with
    sample weights or masks (``sum(w l) / N``); pass it as ``reduction=``.
    """
    if given is not None:
        return check_reduction(given)
    own = loss.reduction if isinstance(loss, keras.losses.Loss) else None
    if own in (None, "none", "sum_over_batch_size"):
        return "mean_with_sample_weight"
    return check_reduction(own)


def reduction_of(loss) -> str:
    """The reduction Keras's ``compile`` uses for ``loss`` (its default for names and functions).

    For several losses (a list or dict, one per output) the label of their sum
    (:func:`combined_reduction`).
    """
    leaves = [leaf for leaf in keras.tree.flatten(loss) if leaf is not None]
    if len(leaves) != 1:
        return combined_reduction([reduction_of(leaf) for leaf in leaves])
    loss = leaves[0]
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    return check_reduction(getattr(loss, "reduction", None) or "sum_over_batch_size")


def combined_reduction(reductions) -> str:
    """The label of a sum of terms reduced by ``reductions`` (one name when they agree)."""
    kinds = set(reductions)
    return kinds.pop() if len(kinds) == 1 else "sum_over_batch_size"


def unreduced(loss) -> Callable:
    """``fn(y_true, y_pred) -> per-example/element losses`` for a Keras loss, name or callable."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        if _proof.stands_in_for(loss, keras.losses.Loss, ("__call__",), whole=False):
            raise ValueError(
                f"{type(loss).__name__} overrides Loss.__call__, which effgrad cannot use: it needs the unreduced "
                "values of call() to normalize once over the whole batch. Move that code into call()."
            )
        return loss.call  # `__call__` would reduce
    if callable(loss):
        return loss
    raise TypeError(
        f"loss must be a keras.losses.Loss, a loss name or a callable(y_true, y_pred) "
        f"returning unreduced losses, got {type(loss).__name__}."
    )


def _broadcast(weights: tf.Tensor, losses: tf.Tensor, name: str) -> tf.Tensor:
    """``weights`` ``[m, ...]`` broadcast to ``losses``; missing trailing axes added on the right."""
    weights = tf.cast(weights, tf.float32)
    # Keras's own alignment: [batch, 1] weights against [batch] losses lose their last axis.
    weights, _ = _compat.squeeze_or_expand_to_same_rank(weights, losses, expand_rank_1=False)
    if weights.shape.rank is not None and losses.shape.rank is not None:
        if weights.shape.rank > losses.shape.rank:
            raise ValueError(
                f"{name} of shape {weights.shape} has more axes than the unreduced loss "
                f"{losses.shape}; pass one weight per example ([batch]) or per loss element."
            )
        while weights.shape.rank < losses.shape.rank:
            weights = weights[..., tf.newaxis]
        for w_dim, l_dim in zip(weights.shape[1:], losses.shape[1:]):
            if w_dim is not None and l_dim is not None and w_dim not in (1, l_dim):
                raise ValueError(
                    f"{name} of shape {weights.shape} does not broadcast against the unreduced loss of "
                    f"shape {losses.shape}; give it shape [batch] or {[None] + losses.shape[1:].as_list()}."
                )
    return tf.broadcast_to(weights, tf.shape(losses))


def _weights(losses, sample_weight, mask):
    """``sample_weight * mask`` broadcast to ``losses`` (float32), or None when there is neither."""
    weights = None
    if sample_weight is not None:
        weights = _broadcast(sample_weight, losses, "sample_weight")
    if mask is not None:
        mask = _broadcast(mask, losses, "the Keras mask of y_pred")
        weights = mask if weights is None else weights * mask
    return weights


def _keras_weights(losses, sample_weight, mask):
    """The weights whose sum Keras's ``"mean_with_sample_weight"`` divides by: the sample weights times
    the mask at the shape their product has, NOT broadcast to the losses (``[batch, 1]`` weights of
    ``[batch, T]`` token losses sum over the batch only: ``Loss.__call__``'s ``reduce_values``)."""
    weights = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
    if mask is not None:
        mask = tf.cast(mask, tf.float32)
        if weights is None:
            weights = mask
        else:
            mask, weights = _compat.squeeze_or_expand_to_same_rank(mask, weights)
            weights = weights * mask
    return _compat.squeeze_or_expand_to_same_rank(losses, weights)[1]


def weighted_terms(losses, sample_weight, mask, reduction: str, keras_divisor: bool = False):
    """``(sum(w * l), normalizer)`` of one micro-batch (see the module docstring), float32.

    ``keras_divisor``: ``"mean_with_sample_weight"`` divides by what Keras's ``Loss.__call__`` divides
    by (:func:`_keras_weights`: ``compile``'s losses, for ``attach``); else by the weights broadcast
    to the losses (``build_train_step``'s documented ``L``).
    """
    losses = tf.cast(losses, tf.float32)
    weights = _weights(losses, sample_weight, mask)
    total = tf.reduce_sum(losses if weights is None else weights * losses)
    if reduction == "sum":
        normalizer = tf.zeros([], tf.float32)
    elif reduction == "sum_over_batch_size" and mask is not None:
        normalizer = tf.reduce_sum(_broadcast(mask, losses, "the Keras mask of y_pred"))
    elif reduction == "mean_with_sample_weight" and weights is not None:
        normalizer = tf.reduce_sum(_keras_weights(losses, sample_weight, mask) if keras_divisor else weights)
    else:
        # A count from the shape, not sum(ones_like(losses)): under XLA a
        # dynamically sliced tensor can be padded to its bound, and ones_like
        # then counts the padding (measured: 4x too many at k=4).
        normalizer = tf.cast(tf.size(losses), tf.float32)
    return total, normalizer


def normalize(total, normalizer, reduction: str):
    """The loss ``L`` from the global sums (0 when every weight is 0)."""
    if reduction == "sum":
        return total
    return tf.math.divide_no_nan(total, normalizer)


def keras_mask(y_pred, values=None):
    """The mask ``Loss.__call__`` applies: ``y_pred``'s Keras mask and the loss values' own.

    A loss marks the elements it ignores with a mask on its values (e.g.
    ``SparseCategoricalCrossentropy(ignore_class=...)``); Keras ANDs it with
    the mask of ``y_pred``.
    """
    masks = [m for m in (_compat.get_keras_mask(y_pred), _compat.get_keras_mask(values)) if m is not None]
    if len(masks) == 2:
        return tf.logical_and(tf.cast(masks[0], tf.bool), tf.cast(masks[1], tf.bool))
    return masks[0] if masks else None


def to_float32(nest):
    """Float tensors of ``nest`` in float32, each keeping its Keras mask (a cast drops it)."""

    def cast(t):
        if t is None or not t.dtype.is_floating or t.dtype == tf.float32:
            return t
        mask = _compat.get_keras_mask(t)
        t = tf.cast(t, tf.float32)
        if mask is not None:
            _compat.set_keras_mask(t, mask)
        return t

    return tf.nest.map_structure(cast, nest)


@dataclasses.dataclass(frozen=True)
class Term:
    """One loss term of one micro-batch, unreduced: what ``Loss.__call__`` would reduce."""

    values: tf.Tensor
    sample_weight: tf.Tensor | None
    mask: tf.Tensor | None
    reduction: str
    weight: float | None = None  # compile's loss_weights entry
    keras_divisor: bool = False  # normalized as Keras's Loss.__call__ normalizes (weighted_terms)


def _evaluate(fn, reduction, y_true, y_pred, sample_weight, weight=None, keras_divisor=False) -> Term:
    check_shapes(fn, y_true, y_pred)
    values = tf.convert_to_tensor(fn(y_true, y_pred))
    if values.shape.rank == 0:
        raise ValueError(
            "The loss returned a scalar, i.e. it is already reduced over the batch; effgrad "
            "needs unreduced losses (shape [batch] or [batch, ...]) to normalize once over the "
            "whole batch. Pass a keras.losses.Loss instance or a function like "
            "`lambda y, p: keras.losses.mean_squared_error(y, p)`."
        )
    return Term(values, sample_weight, keras_mask(y_pred, values), reduction, weight, keras_divisor)


def check_shapes(fn, y_true, y_pred) -> None:
    """Traces ``fn`` on a static batch so a ``y_true``/``y_pred`` shape mismatch fails now, clearly.

    The step is traced with an unknown batch size, and ``[None]`` labels
    broadcast against ``[None, 10]`` predictions until the batch sizes meet
    at run time (deep inside the accumulation loop). A batch size that no
    other axis has makes the mismatch a trace-time error, as in Keras.
    """
    leaves = [t for t in tf.nest.flatten((y_true, y_pred)) if t is not None]
    if not leaves or any(t.shape.rank is None or not t.shape[1:].is_fully_defined() for t in leaves):
        return
    taken = {d for t in leaves for d in t.shape[1:]}
    rows = next(n for n in (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37) if n not in taken)

    def spec(t):
        return None if t is None else tf.TensorSpec([rows] + t.shape[1:].as_list(), t.dtype)

    try:
        tf.function(fn, autograph=False).get_concrete_function(*tf.nest.map_structure(spec, (y_true, y_pred)))
    except (ValueError, tf.errors.InvalidArgumentError) as err:
        if not any(m in str(err) for m in ("must be equal", "Incompatible shapes", "not compatible")):
            return  # another failure: the real call reports it
        shapes = lambda nest: tf.nest.map_structure(lambda t: [None] + t.shape[1:].as_list(), nest)  # noqa: E731
        raise ValueError(
            f"The loss cannot compare y (shape {shapes(y_true)}) with the model's output (shape "
            f"{shapes(y_pred)}). Give y the output's shape (e.g. one-hot "
            "labels for a categorical loss), or use a loss that takes these labels (integer class "
            "ids: SparseCategoricalCrossentropy)."
        ) from None


class Objective:
    """The training loss of one micro-batch as sums the step can combine over the whole batch.

    One loss term: ``(sum(w * l), normalizer)`` as in the module docstring.
    Several (a model with several outputs compiled with one loss, a list or a
    dict of losses, ``loss_weights``) give Keras's ``L = sum_o lw_o * L_o``,
    each ``L_o`` normalized over the WHOLE batch. With one micro-batch on one
    replica that is computed as it stands. Otherwise every term's normalizer
    must be a fixed multiple ``c_o`` of one quantity ``R`` that sums over
    micro-batches (the rows, or the sum of per-example weights), and
    ``L = sum_i sum_o lw_o * T_o,i / c_o  /  sum_i R_i`` is exact; terms
    normalized by different quantities (a Keras mask on one output) are
    refused before any update, never combined approximately.

    Build it with :meth:`of_loss` (one loss, ``build_train_step``) or
    :meth:`of_compiled` (what ``model.compile`` was given, ``attach``).
    """

    def __init__(self, evaluate: Callable, reduction: str, single=None, keras_divisor: bool = False):
        self._evaluate = evaluate  # (y, y_pred, sample_weight) -> list[Term]
        self.reduction = reduction
        self.keras_divisor = keras_divisor  # compile's losses: normalized as Keras normalizes them
        # The one loss function (a Keras loss, a name or a callable) when there is one term
        # and no loss weight: what a fused loss can replace.
        self.single = single

    @classmethod
    def of_loss(cls, loss, reduction: str) -> Objective:
        """One loss (a ``keras.losses.Loss``, a name or an unreduced callable), reduced by ``reduction``."""
        fn = unreduced(loss)
        reduction = check_reduction(reduction)

        def evaluate(y, y_pred, sample_weight):
            return [_evaluate(fn, reduction, y, y_pred, sample_weight)]

        return cls(evaluate, reduction, single=loss)

    @classmethod
    def of_head(
        cls, head, loss, reduction: str, on_ranks: Callable | None = None, keras_divisor: bool = False
    ) -> Objective:
        """``loss`` (a ``SparseCategoricalCrossentropy(from_logits=True)``) fused with ``head``'s projection.

        The step then calls the model's trunk and passes its hidden states
        where ``y_pred`` would be: the logits are never made
        (:mod:`effgrad.train.fused_loss`). ``on_ranks(y, ranks, sample_weight,
        mask)`` gets each position's rank counts (accuracy and top-k metrics)
        from the chunks' logits, ``mask`` being the one Keras would put on them.
        """
        reduction = check_reduction(reduction)

        def evaluate(y, hidden, sample_weight):
            values, ranks = head.losses(hidden, y, ignore_class=loss.ignore_class, ranks=on_ranks is not None)
            if on_ranks is not None:
                on_ranks(y, ranks, sample_weight, _compat.get_keras_mask(hidden))
            return [Term(values, sample_weight, keras_mask(hidden, values), reduction, None, keras_divisor)]

        return cls(evaluate, reduction, single=loss, keras_divisor=keras_divisor)

    @classmethod
    def of_compiled(cls, model, reduction: str | None = None) -> Objective:
        """The loss ``model.compile`` was given: its structure, ``loss_weights`` and reductions.

        Keras's own ``CompileLoss`` matches ``y`` to the outputs (lists,
        dicts, output names) and hands each term its part of ``y``,
        ``y_pred`` and ``sample_weight``; effgrad takes the unreduced values
        there (its per-output loss metrics are updated as in Keras, per
        micro-batch). ``reduction`` overrides every term's own.
        """
        compiled = _compat.compiled_loss(model)
        reduction = None if reduction is None else check_reduction(reduction)

        def evaluate(y, y_pred, sample_weight):
            terms = []

            def recorder(loss, weight):
                red = reduction or reduction_of(loss)

                def record(y_true, y_pred_o, sample_weight_o=None):
                    term = _evaluate(unreduced(loss), red, y_true, y_pred_o, sample_weight_o, weight, True)
                    terms.append(term)
                    return normalize(*weighted_terms(term.values, term.sample_weight, term.mask, red, True), red)

                return record

            with _compat.recording_compiled_loss(compiled, recorder):
                compiled(y, y_pred, sample_weight)
            return terms

        one = not isinstance(model.loss, (list, tuple, dict)) and not _compat.loss_weights(model)
        single = model.loss if one else None
        return cls(evaluate, reduction or reduction_of(model.loss), single=single, keras_divisor=True)

    def sums(self, y, y_pred, sample_weight, *, exact: bool):
        """``(total, normalizer)`` of one micro-batch; ``L = normalize(sum total, sum normalizer)``.

        ``exact``: the whole batch is this one micro-batch (one micro-batch,
        one replica), so several terms are normalized as they stand.
        """
        terms = self._evaluate(y, to_float32(y_pred), sample_weight)
        parts = [weighted_terms(t.values, t.sample_weight, t.mask, t.reduction, t.keras_divisor) for t in terms]
        lw = [1.0 if t.weight is None else float(t.weight) for t in terms]
        if len(terms) == 1:
            return parts[0][0] * lw[0], parts[0][1]
        if exact:
            total = tf.add_n([w * normalize(s, n, t.reduction) for w, (s, n), t in zip(lw, parts, terms)])
            return total, tf.ones([], tf.float32)
        if self.reduction == "sum" and all(t.reduction == "sum" for t in terms):
            return tf.add_n([w * s for w, (s, _) in zip(lw, parts)]), tf.zeros([], tf.float32)
        rows = tf.cast(tf.shape(terms[0].values)[0], tf.float32)
        quantities = [self._row_quantity(t, rows) for t in terms]
        if len({kind for kind, _ in quantities}) != 1 or any(t.mask is not None or t.reduction == "sum" for t in terms):
            raise ValueError(
                f"The compiled loss has {len(terms)} terms normalized by different quantities (a Keras mask or "
                "per-element sample weights on an output, or mixed reductions), which can be combined exactly "
                "only when one micro-batch is the whole batch: use micro_batches=1 on one device, or give every "
                "output the same per-example sample weights and no mask."
            )
        r = quantities[0][1]
        total = tf.add_n([w * s * tf.math.divide_no_nan(r, n) for w, (s, n) in zip(lw, parts)])
        if quantities[0][0] == "weights" and not _compat.in_xla_context():
            # Keras hands each output its own copy of the sample weights; the
            # terms combine exactly only if they hold the same values.
            checks = [
                tf.debugging.assert_near(q, r, message="per-output sample weights differ: use micro_batches=1")
                for _, q in quantities[1:]
            ]
            with tf.control_dependencies(checks):
                total = tf.identity(total)
        return total, r

    def per_example(self, y, y_pred, sample_weight) -> tf.Tensor:
        """``[batch]`` float32: each example's loss summed over its elements, weighted (DP-SGD's ``l_i``).

        Sample weights and Keras masks weight each element as in :meth:`sums`;
        several terms add with their ``loss_weights``. No normalization: DP-SGD
        clips each example's gradient of this sum, then divides by the batch size.
        """
        per = []
        for term in self._evaluate(y, to_float32(y_pred), sample_weight):
            values = tf.cast(term.values, tf.float32)
            weights = _weights(values, term.sample_weight, term.mask)
            values = values if weights is None else weights * values
            if values.shape.rank > 1:
                values = tf.reduce_sum(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
            per.append(values * (1.0 if term.weight is None else float(term.weight)))
        return tf.add_n(per)

    @staticmethod
    def _row_quantity(term: Term, rows):
        """``(kind, R)``: the quantity this term's normalizer is a fixed multiple of."""
        w = term.sample_weight
        if w is None or term.reduction == "sum_over_batch_size":
            return "rows", rows
        w = tf.cast(w, tf.float32)
        if w.shape.rank == 2 and w.shape[-1] == 1:
            w = w[:, 0]
        if w.shape.rank != 1:
            return ("per-element", id(term)), None
        return "weights", tf.reduce_sum(w)
