"""Input adapters: every kind of ``inputs`` as one :class:`Source` of batches.

An input is one array or a *nest* of them (a dict, or a tuple/list for a
model with several inputs), one example per row of each. Arrays and tensors
are cut into ``batch_size`` rows (a memmap reads only the rows of the batch
at hand); datasets and iterables are taken batch by batch as they come. Their
elements follow Keras's convention: ``x`` or ``(x, y, ...)``, where ``x`` may
itself be a nest (a dict of token ids and padding mask, say). The number of
examples is known up front for arrays, tensors and lists, and is ``None`` for
datasets and generators unless the caller says it (``num_examples``).

Trap:
    Rows come in the order the source yields them. A ``tf.data`` pipeline that
    shuffles (``image_dataset_from_directory`` does by default) yields another
    order on every pass: build it with ``shuffle=False`` (``ds.file_paths``
    then names the rows) to know which map is which file, and to resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from effgrad import _checks
from effgrad.explain.sinks import release_rows

__all__ = ["Source", "as_source", "spec_of", "leaf_names"]


@dataclass(frozen=True)
class Source:
    """Batches of the inputs, with what is known about them before the first batch.

    Attributes:
        num_examples: Rows in all, or ``None`` when only the end tells.
        spec: Nest of ``tf.TensorSpec`` (batch axis ``None``), one per input.
        batches: ``batches()`` -> iterator of nests of arrays/tensors, from the first row.
        sample: One example of each input, with its batch axis, to probe the model.
    """

    num_examples: int | None
    spec: Any
    batches: Callable[[], Iterator]
    sample: Any

    @property
    def leaves(self) -> list[tf.TensorSpec]:
        return tf.nest.flatten(self.spec)


def leaf_names(structure) -> list[str]:
    """A name per leaf of a nest, in ``tf.nest.flatten`` order: dict keys and
    sequence positions joined by dots (``"image"``, ``"0"``, ``"text.ids"``);
    ``""`` for a lone array."""
    if isinstance(structure, dict):  # tf.nest's order: sorted keys
        items = [(str(k), structure[k]) for k in sorted(structure)]
    elif isinstance(structure, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(structure)]
    else:
        return [""]
    return [f"{key}.{name}" if name else key for key, value in items for name in leaf_names(value)]


def _is_array(value) -> bool:
    return isinstance(value, (np.ndarray, tf.Tensor))


def _x_of(element):
    """Dataset/iterable elements are ``x`` or ``(x, y, ...)`` (Keras's convention): take ``x``."""
    return element[0] if isinstance(element, (tuple, list)) else element


def _spec(structure, what: str):
    """The nest of batch-axis-free ``TensorSpec`` of a nest of arrays, tensors or specs."""

    def one(leaf):
        if isinstance(leaf, tf.TensorSpec):
            shape, dtype = leaf.shape, leaf.dtype
        elif _is_array(leaf) or hasattr(leaf, "shape"):
            shape, dtype = tf.TensorShape(leaf.shape), tf.as_dtype(leaf.dtype)
        else:
            raise TypeError(f"{what} must be arrays or tensors (or dicts/tuples of them), found {type(leaf).__name__}.")
        if shape.rank == 0:
            raise ValueError(f"{what} must have a leading batch dimension; got a scalar.")
        return tf.TensorSpec([None, *shape[1:]], dtype)

    return tf.nest.map_structure(one, structure)


def _rows(structure, what: str) -> int:
    """The common number of rows of a nest of arrays; raises if they differ."""
    counts = {
        name or "inputs": int(leaf.shape[0]) for name, leaf in zip(leaf_names(structure), tf.nest.flatten(structure))
    }
    if len(set(counts.values())) > 1:
        raise ValueError(f"{what} must have the same number of rows (examples) in every input; got {counts}.")
    return next(iter(counts.values()))


def _with_known_shapes(spec, sample):
    """Fills dimensions a dataset leaves unknown (``None``) from its first batch."""
    return tf.nest.map_structure(
        lambda s, v: s if None not in s.shape[1:].as_list() else tf.TensorSpec([None, *v.shape[1:]], s.dtype),
        spec,
        sample,
    )


def _is_nest_of_arrays(inputs, several_inputs: bool) -> bool:
    """A dict of arrays, or (for a model with several inputs) a tuple/list of arrays: one nest of inputs.
    A list of tuples is a list of batches."""
    if isinstance(inputs, dict):
        return True
    return (
        several_inputs
        and isinstance(inputs, (tuple, list))
        and len(inputs) > 0
        and all(_is_array(e) or (isinstance(e, dict) and all(map(_is_array, tf.nest.flatten(e)))) for e in inputs)
    )


def spec_of(inputs, several_inputs: bool = False):
    """The nest of ``TensorSpec`` of arrays or a dataset, read without taking a batch; ``None`` for iterables."""
    if _is_array(inputs) or _is_nest_of_arrays(inputs, several_inputs):
        return _spec(inputs, "inputs")
    if isinstance(inputs, tf.data.Dataset):
        return _spec(_x_of(inputs.element_spec), "The dataset's elements (batches)")
    return None


def as_source(inputs, batch_size: int, num_examples: int | None = None, *, several_inputs: bool = False) -> Source:
    """The :class:`Source` of ``inputs``; raises ``TypeError``/``ValueError`` for what cannot work.

    ``several_inputs`` (the model takes more than one input) makes a
    tuple/list of arrays the model's inputs, as in ``model.predict([a, b])``;
    otherwise a list is a list of batches.
    """
    if num_examples is not None:
        num_examples = _checks.positive_int(num_examples, "num_examples")
    is_nest = isinstance(inputs, dict) or (
        several_inputs
        and isinstance(inputs, (tuple, list))
        and len(inputs) > 0
        and all(map(_is_array, tf.nest.flatten(inputs)))
    )
    if _is_array(inputs) or is_nest:
        return _array_source(inputs, batch_size, num_examples)
    if isinstance(inputs, tf.data.Dataset):
        x_spec = _x_of(inputs.element_spec)
        spec = _spec(x_spec, "The dataset's elements (batches)")
        first = next(iter(inputs.take(1)), None)
        if first is None:
            raise ValueError("inputs is an empty tf.data.Dataset: there is nothing to explain.")
        sample = _slice(_x_of(first), 0, 1)
        if num_examples is None and getattr(inputs, "file_paths", None) is not None:
            # keras.utils.image/text_dataset_from_directory: one example per file, known up front.
            num_examples = len(inputs.file_paths)
        return Source(num_examples, _with_known_shapes(spec, sample), lambda: (_x_of(e) for e in inputs), sample)
    if isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes)):
        if isinstance(inputs, (list, tuple)):  # re-iterable and sized: the length is known
            elements = [_x_of(e) for e in inputs]
            if not elements:
                raise ValueError("inputs is an empty list of batches.")
            spec = _spec(elements[0], "Each batch")
            for e in elements:
                _spec(e, "Each batch")
            n = sum(_rows(e, "Each batch") for e in elements)
            sample = _slice(elements[0], 0, 1)
            return Source(n, spec, lambda: iter(elements), sample)
        iterator = iter(inputs)
        try:
            first = _x_of(next(iterator))
        except StopIteration:
            raise ValueError("inputs is an empty iterator: there is nothing to explain.") from None
        spec = _spec(first, "Each batch")
        chained = itertools.chain([first], (_x_of(e) for e in iterator))
        return Source(num_examples, spec, lambda: chained, _slice(first, 0, 1))
    raise TypeError(
        f"inputs must be a NumPy array/memmap, a tf.Tensor, a dict (or, for a model with several inputs, a "
        f"tuple) of them, a batched tf.data.Dataset or an iterable of batches, got {type(inputs).__name__}."
    )


def _array_source(inputs, batch_size: int, num_examples: int | None) -> Source:
    spec = _spec(inputs, "inputs")
    n = _rows(inputs, "inputs")
    if n == 0:
        raise ValueError("inputs hold no examples (0 rows): there is nothing to explain.")
    if num_examples is not None and num_examples != n:
        raise ValueError(
            f"num_examples={num_examples} but the inputs hold {n} examples; num_examples is only for "
            "datasets and generators of unknown length: leave it out."
        )
    leaves = tf.nest.flatten(inputs)

    def batches():
        for start in range(0, n, batch_size):
            yield _slice(inputs, start, start + batch_size)  # a memmap reads just these rows
            for leaf in leaves:
                release_rows(leaf, start)  # the rows before this batch were copied to the device

    return Source(n, spec, batches, _slice(inputs, 0, 1))


def _slice(inputs, start: int, stop: int):
    return tf.nest.map_structure(lambda a: a[start:stop], inputs)
