"""``effgrad.saliency``: check everything, open the output, stream."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from effgrad.explain.engine import stream
from effgrad.explain.plan import SaliencyPlan, prepare, weights_checksum
from effgrad.explain.sinks import ArraySink, GrowingArraySink, NpyFileSink, Sink

__all__ = ["saliency", "open_sink"]


def open_sink(out, plan: SaliencyPlan, resume: bool = False) -> Sink:
    """The sink for ``out``; raises before touching anything if it cannot hold the maps."""
    n, map_shape, dtype = plan.num_examples, plan.map_shape, plan.dtype
    is_path = isinstance(out, (str, bytes)) or hasattr(out, "__fspath__")
    if resume and not is_path:
        raise ValueError("resume=True continues a file: pass out='maps.npy' (the file the interrupted run wrote).")
    if out is None:
        return ArraySink(np.empty((n, *map_shape), dtype)) if n is not None else GrowingArraySink(map_shape, dtype)
    if isinstance(out, np.ndarray):
        needed = (n if n is not None else len(out), *map_shape)
        if out.shape != needed or out.dtype != dtype:
            rows = "N" if n is None else n
            raise ValueError(
                f"The output buffer has shape {out.shape} and dtype {out.dtype}; this run needs shape "
                f"({rows}, {', '.join(map(str, map_shape))}) and dtype {dtype}. Allocate "
                f"np.empty({needed}, dtype='{dtype}')."
            )
        if not out.flags.writeable:
            raise ValueError("The output buffer is read-only (a memmap opened with mode 'r'?); pass a writable one.")
        return ArraySink(out)
    if is_path:
        # Reading every weight is for the journal only: in-memory runs skip it.
        config = {**plan.config, "model": weights_checksum(plan.job.model)}
        return NpyFileSink.open(out, map_shape, n, dtype, config, resume)
    raise TypeError(f"out must be None, a path to a .npy file or a NumPy array/memmap, got {type(out).__name__}.")


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

    Algorithm: each batch's maps are computed by one compiled function
    (reduced and cast on the device), copied to the host while the next batch
    computes, and written into ``out`` at their rows; a ``.npy`` ``out`` is
    journaled so that a killed run resumes where it stopped.

    Example:
        >>> maps = effgrad.saliency(model, images, method="smoothgrad", reduce="abs_sum",
        ...                         out="maps.npy", samples=25, noise=0.15)
        >>> np.load("maps.npy", mmap_mode="r").shape   # (N, H, W)

    Args:
        model: A Keras model (or callable) from inputs to outputs.
        inputs: A NumPy array or memmap, a ``tf.Tensor``, a batched
            ``tf.data.Dataset`` (elements ``x`` or ``(x, ...)``) or an
            iterable of batches. Rows are explained in the order they come.
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
        resume: With a path ``out``: continue an interrupted run. Refused
            unless the model weights, the settings, the target and the
            committed input rows are those of the interrupted run.
        progress: Show a ``keras.utils.Progbar``.
        num_examples: Optional: the number of examples of a dataset or
            generator, when known (the output is then allocated, and its
            disk space reserved, up front).
        strategy: A ``tf.distribute.Strategy``: each batch is sharded across
            its replicas; rows still land in order.
        **method_options: ``samples``, ``noise``, ``seed``,
            ``samples_per_pass`` (smoothgrad); ``steps``, ``baseline``,
            ``steps_per_pass`` (integrated_gradients).

    Returns:
        The filled array (``np.memmap`` for a path).

    Raises:
        ValueError, TypeError: Bad arguments, before any work.
        FileExistsError: ``out`` exists and ``resume`` is False.
        BlockingIOError: another process is writing ``out``.
        OSError: not enough disk space for ``out`` (before any work).

    Trap:
        Collecting ``tape.gradient`` results of every batch in a Python list
        keeps them all on the device until it runs out of memory; this
        function copies each batch's maps to the host as soon as it is done.
        And a ``tf.data`` pipeline that shuffles gives rows in another order
        on every pass: pass ``shuffle=False`` to know (and resume) which map
        is which example.
    """
    plan = prepare(
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
    sink = open_sink(out, plan, resume)
    failed = True
    try:
        if not sink.complete:
            stream(plan, sink, progress)
        failed = False
    finally:
        sink.close(failed)  # a file run that committed nothing leaves no file
    return sink.result
