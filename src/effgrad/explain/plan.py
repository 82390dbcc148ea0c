"""Everything a saliency run is, checked before any work: :func:`prepare`.

``prepare`` validates the method, reduction, dtype, inputs and target, builds
(or reuses) the compiled job, and returns a :class:`SaliencyPlan`. Nothing is
computed and no output is touched: every user error surfaces here.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import numpy as np
import tensorflow as tf

from effgrad import _checks
from effgrad.explain import methods as methods_lib
from effgrad.explain import reductions, targets
from effgrad.explain.inputs import Source, as_source
from effgrad.explain.job import SaliencyJob, cached_job

__all__ = ["SaliencyPlan", "prepare", "weights_checksum"]


@dataclasses.dataclass(frozen=True)
class SaliencyPlan:
    """A checked saliency run.

    Attributes:
        job: The compiled batch function.
        source: The inputs, as batches.
        target: The resolved target (per-example indices included).
        map_shape: Shape of one example's (reduced) map.
        dtype: The maps' NumPy dtype.
        config: JSON-able identity of the run (what a resume must match; the
            weights' checksum is added only for a file output, which needs it).
    """

    job: SaliencyJob
    source: Source
    target: targets.Target
    map_shape: tuple
    dtype: np.dtype
    config: dict

    @property
    def num_examples(self) -> int | None:
        return self.source.num_examples


def prepare(
    model,
    inputs,
    *,
    method="gradient",
    target=None,
    reduce=None,
    batch_size: int = 64,
    dtype="float32",
    num_examples: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    **method_options,
) -> SaliencyPlan:
    """Validates a saliency run and builds its job (see :func:`effgrad.saliency` for the arguments)."""
    reductions.check(reduce)
    method = methods_lib.get(method, **method_options)
    batch_size = _checks.positive_int(batch_size, "batch_size")
    if np.dtype(dtype) not in (np.float32, np.float16):
        raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}.")
    source = as_source(inputs, batch_size, num_examples)
    if not source.dtype.is_floating:
        raise TypeError(
            f"Input gradients need float inputs, but the inputs are {source.dtype.name}. For token ids or "
            "other integer inputs, explain the float embeddings instead (a model that takes embedding "
            "vectors as input), or cast the inputs if they are really continuous."
        )
    target = targets.resolve(target, model, source.sample, source.num_examples)
    if source.num_examples is None and target.indices is not None:
        source = dataclasses.replace(source, num_examples=len(target.indices))  # the target array tells the length
    map_shape = reductions.reduced_shape(source.example_shape, reduce)
    method_config = method.config()
    per_pass = {k: v for k, v in method.options.items() if k.endswith("_per_pass")}  # not in config(): how, not what
    key = (
        json.dumps({**method_config, **per_pass}, sort_keys=True),
        reduce,
        target.job_key(),
        np.dtype(dtype).str,
        source.example_shape,
        source.dtype.name,
        id(strategy),
    )
    job = cached_job(
        model,
        key,
        lambda: SaliencyJob(model, method, reduce, target, dtype, source.example_shape, source.dtype, strategy),
    )
    config = {
        **method_config,
        "reduce": reduce,
        "dtype": np.dtype(dtype).name,
        "batch_size": batch_size,
        "shape": [source.num_examples, *map_shape],
        "target": target.identity(),
    }
    return SaliencyPlan(job, source, target, map_shape, np.dtype(dtype), config)


def weights_checksum(model) -> str:
    """CRC-32 of every weight's values: a resume with other weights is refused."""
    crc = 0
    for weight in getattr(model, "weights", []):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(weight.numpy())), crc)
    return f"{crc:08x}"
