"""A training batch's structure: its batch sizes checked, its tensors, its trace signature, its shape."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["as_tensors", "check_sizes", "relaxed_spec", "shape_hint"]


def leading_dims(nest) -> list[int]:
    """The static batch sizes of a nest's tensors."""
    return [int(t.shape[0]) for t in tf.nest.flatten(nest) if t is not None and t.shape.rank and t.shape[0] is not None]


def check_sizes(x, y, sample_weight) -> None:
    """Raises ``ValueError`` unless every tensor of ``x``, ``y`` and ``sample_weight`` has one batch size."""
    sizes = {name: set(leading_dims(t)) for name, t in (("x", x), ("y", y), ("sample_weight", sample_weight))}
    if len(sizes["x"]) > 1:
        raise ValueError(f"The tensors of x have different batch sizes {sorted(sizes['x'])}; they must share dim 0.")
    every = set().union(*sizes.values())
    if len(every) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in sizes.items() if v)
        raise ValueError(f"x, y and sample_weight must have the same batch size (dim 0), got {detail}.")


def shape_hint(x) -> tuple[int, int] | None:
    """``(rows, largest other axis)`` of a batch's static shapes (e.g. ``(8, 256)`` for ``[8, 256]`` token ids)."""
    leaves = [t for t in tf.nest.flatten(x) if t is not None and len(getattr(t, "shape", ())) > 0]
    if not leaves or leaves[0].shape[0] is None:
        return None
    extent = max([int(d) for t in leaves for d in t.shape[1:] if d is not None] or [1])
    return int(leaves[0].shape[0]), extent


def per_replica(hint: tuple[int, int] | None, replicas: int) -> tuple[int, int] | None:
    """A global batch's :func:`shape_hint` as each of ``replicas`` replicas sees it (the most rows one takes)."""
    return None if hint is None else (-(-hint[0] // replicas), hint[1])


def as_tensors(nest):
    """Every leaf a tensor (``None`` kept)."""
    return tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), nest)


def relaxed_spec(t):
    """``t``'s spec with any batch size (one trace for every batch size)."""
    if t is None:
        return None
    shape = t.shape.as_list()
    if not shape:
        raise ValueError("Inputs need a leading batch dimension; got a scalar.")
    return tf.TensorSpec([None] + shape[1:], t.dtype)
