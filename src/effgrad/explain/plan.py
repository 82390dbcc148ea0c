"""Everything a saliency run is, checked before any work: :func:`prepare`.

``prepare`` validates the method, reduction, dtype, inputs and target, builds
(or reuses) the compiled job, and returns a :class:`SaliencyPlan`. Nothing is
computed and no output is touched: every user error surfaces here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import zlib

import keras
import numpy as np
import tensorflow as tf

from effgrad import _checks, _compat
from effgrad.explain import methods as methods_lib
from effgrad.explain import reductions, targets
from effgrad.explain import wrt as wrt_lib
from effgrad.explain.inputs import Source, as_source, leaf_names, spec_of
from effgrad.explain.job import SaliencyJob, cached_job

__all__ = ["SaliencyPlan", "prepare", "model_checksum"]


@dataclasses.dataclass(frozen=True)
class SaliencyPlan:
    """A checked saliency run.

    Attributes:
        job: The compiled batch function.
        source: The inputs, as batches.
        target: The resolved target (per-example indices included).
        names: The name of each differentiated tensor (``leaf_names``; the
            layer's name with ``layer=``; ``""`` for a lone input array).
        map_shapes: Shape of one example's (reduced) map, per differentiated tensor.
        dtype: The maps' NumPy dtype.
        config: JSON-able identity of the run (what a resume must match; the
            weights' checksum is added only for a file output, which needs it).
    """

    job: SaliencyJob
    source: Source
    target: targets.Target
    names: list
    map_shapes: list
    dtype: np.dtype
    config: dict

    @property
    def num_examples(self) -> int | None:
        return self.source.num_examples

    def pack(self, maps: list):
        """Per-tensor results in the caller's nest (a lone array for one input or a layer)."""
        return self.job.wrt.pack(maps)


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
    layer=None,
    output=None,
    **method_options,
) -> SaliencyPlan:
    """Validates a saliency run and builds its job (see :func:`effgrad.saliency` for the arguments)."""
    reductions.check(reduce)
    method = methods_lib.get(method, **method_options)
    batch_size = _checks.positive_int(batch_size, "batch_size")
    if np.dtype(dtype) not in (np.float32, np.float16):
        raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}.")
    model_inputs = list(getattr(model, "inputs", None) or [])
    several = len(model_inputs) > 1
    _check_batched(model, inputs, spec_of(inputs, several))
    source = as_source(inputs, batch_size, num_examples, several_inputs=several)
    outputs_fn = targets.outputs_function(model, output)
    with _model_errors(source):
        if layer is not None:
            layer = wrt_lib.find_layer(model, layer)
            wrt = wrt_lib.LayerOutput(outputs_fn, layer, source)
        else:
            wrt = wrt_lib.InputLeaves(outputs_fn, source)
        target = targets.resolve(target, outputs_fn, source.sample, source.num_examples)
    if source.num_examples is None and target.indices is not None:
        source = dataclasses.replace(source, num_examples=len(target.indices))  # the target array tells the length
    method = method.for_tensors(wrt.names)
    map_shapes = [reductions.reduced_shape(shape, reduce) for shape in wrt.shapes]
    method_config = method.config()
    per_pass = {k: v for k, v in method.options.items() if k.endswith("_per_pass")}  # not in config(): how, not what
    key = (
        json.dumps({**method_config, **per_pass}, sort_keys=True),
        reduce,
        target.job_key(),
        np.dtype(dtype).str,
        repr(source.spec),
        id(layer),
        output,
        id(strategy),
    )
    job = cached_job(
        model,
        key,
        lambda: SaliencyJob(model, wrt, method, reduce, target, dtype, source.spec, strategy),
    )
    config = {
        **method_config,
        "reduce": reduce,
        "dtype": np.dtype(dtype).name,
        "batch_size": batch_size,
        "shape": [source.num_examples, *map_shapes[0]]
        if len(map_shapes) == 1
        else {name: [source.num_examples, *shape] for name, shape in zip(wrt.names, map_shapes)},
        "target": target.identity(),
    }
    if layer is not None:
        config["layer"] = layer.name
    if output is not None:
        config["output"] = output
    return SaliencyPlan(job, source, target, wrt.names, map_shapes, np.dtype(dtype), config)


def _check_batched(model, inputs, spec) -> None:
    """A clear error for an unbatched dataset or a single example without its batch axis."""
    graph = _compat.functional_graph(model)
    if graph is None or spec is None:
        return  # a subclassed model: its input shapes are unknown before it runs
    expected = graph[1]
    if isinstance(expected, (list, tuple)) and len(expected) == 1:
        expected = expected[0]
    if isinstance(spec, dict) and isinstance(expected, (list, tuple)):
        expected = {t.name: t for t in expected}  # Keras matches a dict by input name
    try:
        pairs = list(zip(tf.nest.flatten(spec), tf.nest.flatten(expected)))
        tf.nest.assert_same_structure(spec, expected)
    except (ValueError, TypeError):
        return  # another nesting: the model's own error (made readable by _model_errors) will tell
    for got, want in pairs:
        want_shape = tuple(want.shape)
        if want_shape and got.shape.rank == len(want_shape) - 1:
            if isinstance(inputs, tf.data.Dataset):
                raise ValueError(
                    f"The dataset is not batched: its elements lack the batch axis of the model's inputs "
                    f"{want_shape}. Batch it first: dataset.batch(64)."
                )
            raise ValueError(
                f"The inputs have one axis too few: the model takes batches of shape {want_shape}. A single "
                "example without its batch axis? Add one: x[None] (or np.expand_dims(x, 0))."
            )


@contextlib.contextmanager
def _model_errors(source: Source):
    """The model's own errors on the probe example, readable (Keras colours them for a terminal)."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if not _from_model(err):
            raise
        shapes = {name or "inputs": tuple(s.shape) for name, s in zip(leaf_names(source.spec), source.leaves)}
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()
        raise ValueError(f"The model cannot run on the inputs (batches of {shapes}): {' '.join(message[:4])}") from None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _from_model(err: BaseException) -> bool:
    """Whether an exception was raised inside Keras or TensorFlow (not by effgrad's own checks)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def _unnamed(config):
    """``config`` without layer names and wrapped layers' configs, at any depth."""
    if isinstance(config, dict):
        return {k: _unnamed(v) for k, v in config.items() if k not in ("name", "layer", "layers")}
    if isinstance(config, (list, tuple)):
        return [_unnamed(v) for v in config]
    return config


def model_checksum(model) -> str:
    """CRC-32 of the model's layers (class and config) and every weight's values: a resume with another
    model, or the same weights in another architecture (another activation), is refused."""
    crc = 0
    for layer in _compat.flatten_layers(model):
        if isinstance(layer, keras.Model):  # its layers stand for it (its config names them)
            continue
        try:  # without names (a model built again in the same process has others) and wrapped layers
            # (flatten_layers visits them); an object JSON cannot hold by its type (a repr may hold an address)
            config = json.dumps(_unnamed(layer.get_config()), sort_keys=True, default=lambda v: type(v).__qualname__)
        except Exception:  # a layer without a serializable config: its class stands for it
            config = ""
        crc = zlib.crc32(f"{type(layer).__module__}.{type(layer).__qualname__}:{config}".encode(), crc)
    for weight in getattr(model, "weights", []):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(weight.numpy())), crc)
    return f"{crc:08x}"
