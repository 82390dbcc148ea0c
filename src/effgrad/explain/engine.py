"""The streaming saliency engine.

Algorithm::

    check everything (method, reduce, dtype, target range, output buffer)  # before any work
    for each batch (skipping the rows a resumed file already holds):
        maps = reduce(method(model, x, target))   # one compiled function, on device
        queue.put(maps)                             # bounded: at most 2 batches in flight
    writer thread: maps.numpy() -> sink rows [start, start + B); commit every ~0.5 s

The compiled function has a fixed signature with a ``None`` batch dimension,
so a short last batch does not retrace it. Reduction and the optional float16
cast happen on the device, before anything crosses to the host; the copy to
the host and the file write overlap the next batch's compute. Device memory is
therefore bounded by a couple of batches, whatever the number of examples.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import queue
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from effgrad import _checks, distribute
from effgrad.explain import methods as methods_lib
from effgrad.explain import reductions
from effgrad.explain.sinks import ArraySink, NpyFileSink, release_rows

__all__ = ["saliency", "SaliencyJob"]

_COMMIT_EVERY_SECONDS = 0.5
# Compiled jobs live ON the model (a plain attribute, not tracked by Keras):
# effgrad itself keeps no reference, so a model and its jobs are freed
# together. A few per model, most recent first: a new lambda target per call
# must not grow memory without bound.
_JOBS_ATTRIBUTE = "_effgrad_saliency_jobs"
_JOBS_PER_MODEL = 4


def _cached_job(model, key, make) -> SaliencyJob:
    jobs = getattr(model, _JOBS_ATTRIBUTE, None)
    if jobs is None:
        jobs = collections.OrderedDict()
        object.__setattr__(model, _JOBS_ATTRIBUTE, jobs)
    if key in jobs:
        jobs.move_to_end(key)
    else:
        jobs[key] = make()
        while len(jobs) > _JOBS_PER_MODEL:
            jobs.popitem(last=False)
    return jobs[key]


# ---------------------------------------------------------------- inputs
@dataclass
class _Source:
    """Batches of one input, with what is known about it up front."""

    num_examples: int | None
    example_shape: tuple
    dtype: tf.DType
    batches: Callable[[], Iterator]  # -> iterator of arrays/tensors, from the first row
    sample: Any  # a small batch, to probe the model's outputs


def _first_tensor(element):
    """Dataset/iterable elements are ``x`` or ``(x, ...)``: take ``x``."""
    return element[0] if isinstance(element, (tuple, list)) else element


def _source(inputs, batch_size: int, num_examples: int | None) -> _Source:
    if isinstance(inputs, (np.ndarray, tf.Tensor)):
        if len(inputs.shape) == 0:
            raise ValueError("inputs must have a leading example dimension; got a scalar.")
        n = int(inputs.shape[0])
        if num_examples is not None and int(num_examples) != n:
            raise ValueError(
                f"num_examples={num_examples} but the inputs hold {n} examples; num_examples is only for "
                "datasets and generators of unknown length: leave it out."
            )

        def batches():
            for start in range(0, n, batch_size):
                yield inputs[start : start + batch_size]  # a memmap reads just these rows
                release_rows(inputs, start)  # the rows before this batch were copied to the device

        return _Source(n, tuple(inputs.shape[1:]), tf.as_dtype(inputs.dtype), batches, inputs[:1])
    if isinstance(inputs, tf.data.Dataset):
        spec = _first_tensor(inputs.element_spec)
        if num_examples is None:
            raise ValueError(
                "The number of examples in a tf.data.Dataset is not known up front; pass "
                "num_examples=N so the output buffer can be allocated."
            )
        shape = tuple(spec.shape[1:].as_list())
        sample = _first_tensor(next(iter(inputs.take(1))))[:1]
        return _Source(num_examples, shape, spec.dtype, lambda: (_first_tensor(e) for e in inputs), sample)
    if isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes, dict)):
        if isinstance(inputs, (list, tuple)):  # re-iterable, sized: length known
            elements = [_first_tensor(e) for e in inputs]
            if not elements:
                raise ValueError("inputs is an empty list of batches.")
            n = sum(int(e.shape[0]) for e in elements)
            first = elements[0]
            return _Source(n, tuple(first.shape[1:]), tf.as_dtype(first.dtype), lambda: iter(elements), first[:1])
        if num_examples is None:
            raise ValueError(
                "The number of examples of an iterator/generator is not known up front; pass "
                "num_examples=N so the output buffer can be allocated."
            )
        iterator = iter(inputs)
        first = _first_tensor(next(iterator))
        chained = itertools.chain([first], (_first_tensor(e) for e in iterator))
        return _Source(num_examples, tuple(first.shape[1:]), tf.as_dtype(first.dtype), lambda: chained, first[:1])
    raise TypeError(
        f"inputs must be a NumPy array/memmap, a tf.Tensor, a batched tf.data.Dataset or an iterable of "
        f"batches, got {type(inputs).__name__}."
    )


# ---------------------------------------------------------------- targets
def _output_units(model, sample) -> int:
    outputs = model(tf.convert_to_tensor(sample), training=False)
    if not tf.is_tensor(outputs):
        raise ValueError(
            "The model has several outputs; pass target=callable(outputs) -> [batch] scores to say "
            "which one to explain."
        )
    return int(np.prod(outputs.shape[1:])) if outputs.shape.rank > 1 else 1


def _check_target(target, units: int, num_examples: int | None):
    """Returns ``(mode, per-example indices or None)``; raises before any work."""
    if target is None:
        return "argmax", None
    if callable(target):
        return "callable", None
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if not 0 <= target < units:
            raise ValueError(f"target={target} is out of range: the model has {units} output unit(s) (0..{units - 1}).")
        return "fixed", None
    indices = np.asarray(target)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise TypeError("target must be None, an int, an int array [N] or a callable(outputs) -> [batch] scores.")
    if num_examples is not None and len(indices) != num_examples:
        raise ValueError(f"target has {len(indices)} entries but there are {num_examples} examples.")
    bad = (indices < 0) | (indices >= units)
    if bad.any():
        raise ValueError(
            f"target[{int(np.argmax(bad))}] = {indices[bad][0]} is out of range: the model has {units} output unit(s)."
        )
    return "per_example", indices.astype("int32")


# ---------------------------------------------------------------- the job
class SaliencyJob:
    """One compiled ``(method, reduce, target mode)`` batch function.

    ``maps(x, indices, row_offset)`` returns ``(reduced maps, target indices)``
    of a batch; it traces once (``trace_count``) whatever the batch sizes are.
    """

    def __init__(self, model, method, reduce, target_mode, target, dtype, example_shape, input_dtype, strategy=None):
        self.model, self.method, self.reduce = model, method, reduce
        self.target_mode, self.target, self.dtype = target_mode, target, tf.as_dtype(dtype)
        self.strategy = strategy
        self.trace_count = 0
        self.maps = tf.function(
            self._maps,
            input_signature=[
                tf.TensorSpec([None, *example_shape], input_dtype),
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([], tf.int64),
            ],
        )

    def _scores(self, indices, chosen: list | None = None):
        """``score_fn(x)``: each row's target output. With ``indices=None`` the target is the
        arg-max of the same (differentiated) forward pass, appended to ``chosen``."""

        def score_fn(x):
            outputs = self.model(x, training=False)
            if self.target_mode == "callable":
                return self.target(outputs)
            flat = tf.reshape(tf.cast(outputs, tf.float32), [tf.shape(x)[0], -1])
            targets = indices
            if targets is None:
                targets = tf.stop_gradient(tf.cast(tf.argmax(flat, axis=-1), tf.int32))  # 0 for one output unit
                chosen.append(targets)
            return tf.gather(flat, targets, batch_dims=1)

        return score_fn

    def _replica_maps(self, x, indices, row_offset):
        if self.target_mode == "argmax" and self.method.scores_at_input:
            chosen = []  # one forward pass per batch, not two
            maps = self.method.attribute(self._scores(None, chosen), x, row_offset)
            return tf.cast(reductions.reduce_map(maps, self.reduce), self.dtype), chosen[0]
        if self.target_mode == "fixed":
            indices = tf.fill([tf.shape(x)[0]], tf.constant(int(self.target), tf.int32))
        elif self.target_mode == "argmax":  # noisy/interpolated inputs: the target is the clean input's
            outputs = self.model(x, training=False)
            flat = tf.reshape(outputs, [tf.shape(x)[0], -1])
            indices = tf.cast(tf.argmax(flat, axis=-1), tf.int32)  # 0 for a single output unit
        maps = self.method.attribute(self._scores(indices), x, row_offset)
        return tf.cast(reductions.reduce_map(maps, self.reduce), self.dtype), indices

    def _maps(self, x, indices, row_offset):
        self.trace_count += 1
        if self.strategy is None or self.strategy.num_replicas_in_sync == 1:
            return self._replica_maps(x, indices, row_offset)

        def shard(x, indices, row_offset):
            start, stop = distribute.replica_rows(tf.shape(x)[0])
            return self._replica_maps(x[start:stop], indices[start:stop], row_offset + tf.cast(start, tf.int64))

        per_replica = self.strategy.run(shard, args=(x, indices, row_offset))
        return tuple(self.strategy.gather(t, axis=0) for t in per_replica)  # replica order = row order


class _Progress:
    """A one-line progress bar on stderr: rows, examples/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.enabled = total, done, enabled
        self.start, self.start_done, self.last = time.perf_counter(), done, 0.0

    def update(self, rows: int, force: bool = False) -> None:
        self.done += rows
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.2 and not force):
            return
        self.last = now
        rate = (self.done - self.start_done) / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta != float("inf") else "--:--:--"
        sys.stderr.write(
            f"\rsaliency [{'=' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{rate:,.0f} examples/s ETA {eta_text}"
        )
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _prepare_sink(out, shape, dtype, config, resume):
    if out is None:
        return ArraySink(np.zeros(shape, dtype=dtype))
    if isinstance(out, np.ndarray):
        if out.shape != shape or out.dtype != np.dtype(dtype):
            raise ValueError(
                f"The output buffer has shape {out.shape} and dtype {out.dtype}; this run needs shape {shape} "
                f"and dtype {np.dtype(dtype)}. Allocate np.empty({shape}, dtype='{np.dtype(dtype)}')."
            )
        return ArraySink(out)
    if isinstance(out, (str, bytes)) or hasattr(out, "__fspath__"):
        return NpyFileSink.open(out, shape, dtype, config, resume)
    raise TypeError(f"out must be None, a path to a .npy file or a NumPy array/memmap, got {type(out).__name__}.")


def _run(job: SaliencyJob, source: _Source, sink, indices, progress: bool) -> None:
    """Streams every batch through ``job`` into ``sink`` (the shared loop).

    ``sink.write(start, maps, targets)`` runs on a writer thread and receives
    device tensors; it copies them wherever they go.
    """
    start_row = sink.committed
    bar = _Progress(source.num_examples, start_row, progress)
    pending: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def writer():
        last_commit = time.perf_counter()
        while (item := pending.get()) is not None:
            if failure:
                continue  # drain after an error: nothing more is written
            start, maps, targets, crc = item
            try:
                sink.write(start, maps, targets)
                bar.update(int(maps.shape[0]))
                if time.perf_counter() - last_commit > _COMMIT_EVERY_SECONDS:
                    sink.commit(start + int(maps.shape[0]), crc)
                    last_commit = time.perf_counter()
            except BaseException as err:  # surfaced in the main thread
                failure.append(err)

    thread = threading.Thread(target=writer, name="effgrad-saliency-writer", daemon=True)
    thread.start()
    # A running checksum of the input rows, stored with each commit: a resume
    # must see the same rows again (another file, a shuffling dataset) before
    # anything new is written. Rows already done are read (not computed) for it.
    row, crc = 0, 0
    written = (start_row, sink.input_crc)
    try:
        for batch in source.batches():
            if failure:
                break
            n = int(batch.shape[0])
            if row < start_row:
                seen = min(n, start_row - row)
                crc = _checksum(batch[:seen], crc)
                row += seen
                if row == start_row:
                    _check_same_rows(crc, sink.input_crc, start_row)
                if seen == n:
                    continue
                batch, n = batch[seen:], n - seen
            if row + n > source.num_examples:
                raise ValueError(f"inputs hold more than num_examples={source.num_examples} examples.")
            crc = _checksum(batch, crc)
            x = tf.convert_to_tensor(batch)
            batch_indices = indices[row : row + n] if indices is not None else np.zeros(n, "int32")
            maps, targets = job.maps(x, tf.constant(batch_indices, tf.int32), tf.constant(row, tf.int64))
            pending.put((row, maps, targets, crc))
            row += n
            written = (row, crc)
    finally:
        pending.put(None)
        thread.join()
        if not failure and row == source.num_examples:
            sink.finish(row, crc)
            bar.update(0, force=True)
        elif not failure and written[0] > start_row:
            sink.commit(*written)  # an exception above: keep what was written
    if failure:
        raise failure[0]
    if row != source.num_examples:
        raise ValueError(f"inputs held {row} examples but num_examples={source.num_examples}.")


def _checksum(batch, crc: int) -> int:
    """CRC-32 of a batch's bytes, continuing ``crc`` (cheap: GB/s, no copy of a contiguous batch)."""
    values = batch.numpy() if tf.is_tensor(batch) else np.asarray(batch)
    return zlib.crc32(np.ascontiguousarray(values), crc)


def _check_same_rows(crc: int, expected: int | None, rows: int) -> None:
    if expected is not None and crc != expected:
        raise ValueError(
            f"Cannot resume: the first {rows} input rows are not the ones the interrupted run explained "
            f"(checksum {crc:08x}, journal {expected:08x}). Resume with the same inputs in the same order. "
            "A tf.data pipeline that shuffles gives another order on every pass (image_dataset_from_directory "
            "shuffles by default: pass shuffle=False; then ds.file_paths names the rows). Nothing was written."
        )


def _weights_checksum(model) -> str:
    """CRC-32 of every weight's values: a resume with other weights is refused."""
    crc = 0
    for weight in getattr(model, "weights", []):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(weight.numpy())), crc)
    return f"{crc:08x}"


def _callable_checksum(fn) -> str:
    """Name, bytecode and simple captured values of a callable target."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn).__qualname__
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    simple = [v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__ for v in cells]
    data = code.co_code + repr((code.co_consts, code.co_names, simple)).encode()
    return f"{fn.__qualname__}:{zlib.crc32(data):08x}"


def _plan(
    model,
    inputs,
    *,
    method="gradient",
    target=None,
    reduce=None,
    batch_size=64,
    dtype="float32",
    num_examples=None,
    strategy=None,
    **method_options,
):
    """Validates everything and builds the job; no output is touched."""
    reductions.check(reduce)
    method = methods_lib.get(method, **method_options)
    batch_size = _checks.positive_int(batch_size, "batch_size")
    if np.dtype(dtype) not in (np.float32, np.float16):
        raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}.")
    source = _source(inputs, int(batch_size), num_examples)
    if not source.dtype.is_floating:
        raise TypeError(
            f"Input gradients need float inputs, but the inputs are {source.dtype.name}. For token ids or "
            "other integer inputs, explain the float embeddings instead (a model that takes embedding "
            "vectors as input), or cast the inputs if they are really continuous."
        )
    units = _output_units(model, source.sample) if not callable(target) else 0
    target_mode, indices = _check_target(target, units, source.num_examples)
    map_shape = reductions.reduced_shape(source.example_shape, reduce)
    method_config = method.config()
    if target_mode == "fixed":
        target_config = int(target)
    elif target_mode == "per_example":
        target_config = {"per_example": hashlib.sha1(indices).hexdigest()}
    elif target_mode == "callable":
        target_config = {"callable": _callable_checksum(target)}
    else:
        target_config = target_mode
    # Compiled jobs are kept per model, so a second call (another dataset,
    # a summary after the maps) reuses the traced function. Per-example
    # indices are an input of the job; a callable target is part of it.
    key = (
        json.dumps(method_config, sort_keys=True),
        reduce,
        id(target)
        if target_mode == "callable"
        else json.dumps(target_config if target_mode == "fixed" else target_mode),
        np.dtype(dtype).str,
        source.example_shape,
        source.dtype.name,
        id(strategy),
    )
    job = _cached_job(
        model,
        key,
        lambda: SaliencyJob(
            model, method, reduce, target_mode, target, dtype, source.example_shape, source.dtype, strategy
        ),
    )
    config = {
        **method_config,
        "reduce": reduce,
        "dtype": np.dtype(dtype).name,
        "batch_size": int(batch_size),
        "shape": [source.num_examples, *map_shape],
        "target": target_config,
        "model": _weights_checksum(model),
    }
    return job, source, indices, (source.num_examples, *map_shape), config


def saliency(
    model,
    inputs,
    *,
    method: str = "gradient",
    target=None,
    reduce: str | None = None,
    batch_size: int = 64,
    out=None,
    dtype: str = "float32",
    resume: bool = False,
    progress: bool = True,
    num_examples: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    **method_options,
) -> np.ndarray:
    """Computes input-gradient maps for a whole dataset, streamed to a host buffer.

    Example:
        >>> maps = effgrad.saliency(model, images, method="smoothgrad", reduce="abs_sum",
        ...                         out="maps.npy", samples=25, noise=0.15)
        >>> np.load("maps.npy", mmap_mode="r").shape   # (N, H, W)

    Args:
        model: A Keras model (or callable) from inputs to outputs.
        inputs: A NumPy array or memmap, a ``tf.Tensor``, a batched
            ``tf.data.Dataset`` (elements ``x`` or ``(x, ...)``) or an
            iterable of batches.
        method: ``"gradient"``, ``"gradient_x_input"``, ``"smoothgrad"``,
            ``"integrated_gradients"``, or a method instance.
        target: ``None`` (each example's arg-max output), an int, an int
            array ``[N]``, or ``callable(outputs) -> [B]`` scores.
        reduce: ``None``, ``"abs"``, or over the last axis ``"abs_max"``,
            ``"abs_sum"``, ``"l2"``, ``"sum"``; applied on the device.
        batch_size: Rows per batch (array/tensor inputs).
        out: ``None`` (new array), a ``.npy`` path (a memmap is returned), or
            a preallocated array/memmap of the right shape and dtype.
        dtype: ``"float32"`` or ``"float16"`` (cast on the device).
        resume: With a path ``out``: continue an interrupted run.
        progress: Show a progress bar on stderr.
        num_examples: Required when the length of ``inputs`` is unknown.
        strategy: A ``tf.distribute.Strategy``: each batch is sharded across
            its replicas; rows still land in order.
        **method_options: ``samples``, ``noise``, ``seed`` (smoothgrad);
            ``steps``, ``baseline`` (integrated_gradients).

    Returns:
        The filled array (``np.memmap`` for a path).

    Trap:
        Collecting ``tape.gradient`` results of every batch in a Python list
        keeps them all on the device until it runs out of memory; this
        function copies each batch's maps to the host as soon as it is done.
    """
    job, source, indices, shape, config = _plan(
        model,
        inputs,
        method=method,
        target=target,
        reduce=reduce,
        batch_size=batch_size,
        dtype=dtype,
        num_examples=num_examples,
        strategy=strategy,
        **method_options,
    )
    sink = _prepare_sink(out, shape, dtype, config, resume)
    try:
        if sink.committed < shape[0]:
            _run(job, source, sink, indices, progress)
    except BaseException:
        sink.discard_if_empty()  # a run that computed nothing leaves no file
        raise
    return sink.array
