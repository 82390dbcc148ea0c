"""Whether the step fuses its loss with the model's projection: one decision, :func:`decide`."""

from __future__ import annotations

import warnings

import keras

from effgrad import _compat, _proof
from effgrad.train.fused_loss import kernel
from effgrad.train.fused_loss.head import Head, find_head

__all__ = ["decide", "not_the_loss", "readers_of_logits"]


def readers_of_logits(on_micro_batch, y=None, logits=None) -> list[str]:
    """What in ``on_micro_batch`` needs the logits themselves: ``[]`` when nothing does.

    A callback computable from each position's rank (compiled accuracy and
    top-k metrics: ``attach``'s ``CompiledMetrics``) has
    ``readers_of_logits(y, logits)`` (``logits``: a ``keras.KerasTensor``
    with their shape, to resolve metrics such as ``"accuracy"``) and
    ``update_from_ranks(y, ranks, sample_weight, mask)``; any other callback
    reads ``y_pred``.
    """
    if on_micro_batch is None:
        return []
    readers = getattr(on_micro_batch, "readers_of_logits", None)
    return ["given to on_micro_batch"] if readers is None else readers(y, logits)


LOSS_CODE = ("call", "__call__")


def not_the_loss(loss) -> str | None:
    """``None`` when ``loss`` is Keras's ``SparseCategoricalCrossentropy(from_logits=True)`` over the last
    axis, running its own code (what the chunks compute); else why not, a sentence."""
    if loss is None:
        return "the loss has several terms or loss weights"
    described = repr(loss) if isinstance(loss, str) else type(loss).__name__
    if isinstance(loss, str):
        loss = keras.losses.get(loss)  # a name: Keras's default arguments (from_logits=False)
    sparse = keras.losses.SparseCategoricalCrossentropy
    if not isinstance(loss, sparse):
        return f"the loss {described} is not SparseCategoricalCrossentropy(from_logits=True)"
    if why := _proof.stands_in_for(loss, sparse, LOSS_CODE):
        return f"the loss is not Keras's own SparseCategoricalCrossentropy: {why}"
    if loss.fn is not keras.losses.sparse_categorical_crossentropy:
        return f"the loss computes {getattr(loss.fn, '__name__', loss.fn)!r}, not the sparse cross-entropy"
    arguments = _compat.loss_function_arguments(loss)
    if not arguments.get("from_logits") or arguments.get("axis", -1) != -1:
        return f"the loss is {described}({arguments}), not from_logits=True over the last axis"
    return None


def decide(
    options, objective, model, hint: tuple[int, int] | None, *, private: bool = False, y=None
) -> tuple[Head | None, str]:
    """``(head to fuse the loss with, or None; one sentence saying why or why not)``.

    Chunks hold one kernel-sized buffer (the kernel's gradient) and one chunk's logits where the
    plain loss holds two or three logits-sized ones, for a third more of the head's matmuls: "auto"
    fuses when a batch (``hint``: a replica's) has more than ``4 d`` positions (``d`` = the projection's input size) and
    its logits do not fit in one chunk (below ``4 d`` positions the kernel-sized buffer is most of what
    chunks would save). ``fused_loss=True`` raises where it cannot apply.
    """
    option, why_not, head = options.fused_loss, None, None
    loss = objective.single
    if option is False:
        why_not = "fused_loss=False"
    elif private:
        why_not = "per_example_clip needs the gradient of the logits to take each example's norm"
    elif why := not_the_loss(loss):
        why_not = why
    else:
        head = find_head(model)
        if isinstance(head, str):
            head, why_not = None, head
        elif option == "auto" and hint is not None:
            depth, classes = head.sizes
            positions = head.positions(hint)
            if positions * classes <= kernel.CHUNK_ELEMENTS:
                why_not = (
                    f"the batch's logits ({positions:,} x {classes:,}) fit in one chunk: nothing to save; "
                    "fused_loss=True forces it"
                )
            elif positions <= 4 * depth:
                why_not = (
                    f"a batch of {positions:,} positions is too few next to the projection's "
                    f"{depth:,} inputs for chunks to save memory (from {4 * depth + 1:,}); "
                    "fused_loss=True forces it"
                )
    readers = []
    if why_not is None:
        logits = keras.KerasTensor((*head.trunk.output.shape[:-1], head.sizes[1]), dtype=head.layer.compute_dtype)
        readers = readers_of_logits(options.on_micro_batch, y, logits)
    if readers:
        why_not = (
            f"the metrics {', '.join(readers)} read the logits of every micro-batch (accuracy and top-k "
            "metrics are computed from the chunks; compile without the others to fuse)"
        )
        if option == "auto":  # the memory the user expected is not saved: say so where it will be seen
            warnings.warn(
                f"effgrad: the loss is not fused with {head.layer.name!r}, so every batch's logits are made: "
                f"{why_not}.",
                UserWarning,
                stacklevel=4,
            )
    if why_not is not None:
        if option is True:
            raise ValueError(f"fused_loss=True cannot apply: {why_not}.")
        return None, f"fused loss not used: {why_not}."
    return head, (
        f"fused loss: {head.layer.name} ({head.sizes[1]:,} classes) and the cross-entropy computed in "
        "chunks of rows; the logits are never made."
    )
