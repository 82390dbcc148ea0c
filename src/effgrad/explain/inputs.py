"""Input adapters: every kind of ``inputs`` as one :class:`Source` of batches.

Arrays and tensors are cut into ``batch_size`` rows (a memmap reads only the
rows of the batch at hand); datasets and iterables are taken batch by batch
as they come (their elements are ``x`` or ``(x, ...)``). The number of
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

__all__ = ["Source", "as_source"]


@dataclass(frozen=True)
class Source:
    """Batches of one input, with what is known about it before the first batch.

    Attributes:
        num_examples: Rows in all, or ``None`` when only the end tells.
        example_shape: Shape of one example (no batch axis).
        dtype: The inputs' dtype.
        batches: ``batches()`` -> iterator of arrays/tensors from the first row.
        sample: One example with its batch axis, to probe the model's outputs.
    """

    num_examples: int | None
    example_shape: tuple
    dtype: tf.DType
    batches: Callable[[], Iterator]
    sample: Any


def _first_tensor(element):
    """Dataset/iterable elements are ``x`` or ``(x, ...)``: take ``x``."""
    return element[0] if isinstance(element, (tuple, list)) else element


def _check_rank(shape, what: str) -> None:
    if len(shape) == 0:
        raise ValueError(f"{what} must have a leading batch dimension; got a scalar.")


def as_source(inputs, batch_size: int, num_examples: int | None = None) -> Source:
    """The :class:`Source` of ``inputs``; raises ``TypeError``/``ValueError`` for what cannot work."""
    if num_examples is not None:
        num_examples = _checks.positive_int(num_examples, "num_examples")
    if isinstance(inputs, (np.ndarray, tf.Tensor)):
        _check_rank(inputs.shape, "inputs")
        n = int(inputs.shape[0])
        if num_examples is not None and num_examples != n:
            raise ValueError(
                f"num_examples={num_examples} but the inputs hold {n} examples; num_examples is only for "
                "datasets and generators of unknown length: leave it out."
            )

        def batches():
            for start in range(0, n, batch_size):
                yield inputs[start : start + batch_size]  # a memmap reads just these rows
                release_rows(inputs, start)  # the rows before this batch were copied to the device

        return Source(n, tuple(inputs.shape[1:]), tf.as_dtype(inputs.dtype), batches, inputs[:1])
    if isinstance(inputs, tf.data.Dataset):
        spec = _first_tensor(inputs.element_spec)
        _check_rank(spec.shape, "The dataset's elements (batches)")
        first = next(iter(inputs.take(1)), None)
        if first is None:
            raise ValueError("inputs is an empty tf.data.Dataset: there is nothing to explain.")
        sample = _first_tensor(first)[:1]
        shape = tuple(spec.shape[1:].as_list())
        if None in shape:  # e.g. a ragged last axis: the first batch tells
            shape = tuple(sample.shape[1:])
        return Source(num_examples, shape, spec.dtype, lambda: (_first_tensor(e) for e in inputs), sample)
    if isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes, dict)):
        if isinstance(inputs, (list, tuple)):  # re-iterable and sized: the length is known
            elements = [_first_tensor(e) for e in inputs]
            if not elements:
                raise ValueError("inputs is an empty list of batches.")
            for e in elements:
                _check_rank(e.shape, "Each batch")
            n = sum(int(e.shape[0]) for e in elements)
            first = elements[0]
            return Source(n, tuple(first.shape[1:]), tf.as_dtype(first.dtype), lambda: iter(elements), first[:1])
        iterator = iter(inputs)
        try:
            first = _first_tensor(next(iterator))
        except StopIteration:
            raise ValueError("inputs is an empty iterator: there is nothing to explain.") from None
        _check_rank(first.shape, "Each batch")
        chained = itertools.chain([first], (_first_tensor(e) for e in iterator))
        return Source(num_examples, tuple(first.shape[1:]), tf.as_dtype(first.dtype), lambda: chained, first[:1])
    raise TypeError(
        f"inputs must be a NumPy array/memmap, a tf.Tensor, a batched tf.data.Dataset or an iterable of "
        f"batches, got {type(inputs).__name__}."
    )
