"""``effgrad.saliency``: check everything, open the output, stream."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from effgrad.explain.engine import check_inputs, stream
from effgrad.explain.inputs import leaf_names
from effgrad.explain.plan import SaliencyPlan, model_checksum, prepare
from effgrad.explain.sinks import ArraySink, GrowingArraySink, NpyFileSink, Sink, SinkGroup

__all__ = ["saliency", "open_sink", "tensor_outputs"]


def open_sink(out, plan: SaliencyPlan, resume: bool = False) -> Sink:
    """The sink for ``out``; raises before touching anything if it cannot hold the maps.

    One member sink per differentiated tensor (see :func:`tensor_outputs`),
    opened in order; if one cannot be opened, those already opened are
    closed again (files they created are removed).
    """
    outs = tensor_outputs(out, plan.names)
    if resume and not all(_is_path(o) for o in outs):
        raise ValueError("resume=True continues a file: pass out='maps.npy' (the file the interrupted run wrote).")
    checksum = model_checksum(plan.job.model) if any(_is_path(o) for o in outs) else None
    sinks = []
    try:
        for name, shape, o in zip(plan.names, plan.map_shapes, outs):
            sinks.append(_open_one(o, plan, name if len(outs) > 1 else None, shape, checksum, resume))
    except BaseException:
        for sink in sinks:
            sink.close(failed=True)
        raise
    return SinkGroup(sinks, plan.pack)


def tensor_outputs(out, names: list[str]) -> list:
    """Where each differentiated tensor's maps go, from ``out``.

    ``None``: new arrays. A path with one differentiated tensor: that file;
    with several, one file per tensor named after it: ``maps.npy`` ->
    ``maps.image.npy``, ``maps.tabular.npy`` (``maps.0.npy``... for a tuple
    of inputs). A dict (or tuple) shaped like the inputs: each input's own
    buffer or path (``None`` or absent for inputs that are not differentiated).
    """
    if out is None:
        return [None] * len(names)
    if isinstance(out, (dict, list, tuple)):
        given = dict(zip(leaf_names(out), tf.nest.flatten(out)))
        missing = [n for n in names if given.get(n) is None]
        extra = sorted(n for n, v in given.items() if v is not None and n not in names)
        if missing or extra:
            raise ValueError(
                f"out names {sorted(n for n, v in given.items() if v is not None)} but the differentiated inputs "
                f"are {names}: give each of them a buffer or path (and nothing for the others)."
            )
        return [given[n] for n in names]
    if len(names) == 1:
        return [out]
    if _is_path(out):
        path = Path(os.fsdecode(out))
        stem, suffix = (path.name[: -len(".npy")], ".npy") if path.suffix == ".npy" else (path.name, ".npy")
        return [path.with_name(f"{stem}.{name}{suffix}") for name in names]
    raise ValueError(
        f"The model has several differentiated inputs ({', '.join(names)}): pass out as a dict (or tuple) "
        "with one buffer per input, or a path ('maps.npy' writes maps.<input>.npy)."
    )


def _is_path(out) -> bool:
    return isinstance(out, (str, bytes)) or hasattr(out, "__fspath__")


def _open_one(out, plan: SaliencyPlan, name: str | None, map_shape: tuple, checksum: str | None, resume: bool):
    n, dtype = plan.num_examples, plan.dtype
    which = f" for {name!r}" if name else ""
    if out is None:
        return ArraySink(np.empty((n, *map_shape), dtype)) if n is not None else GrowingArraySink(map_shape, dtype)
    if isinstance(out, np.ndarray):
        needed = (n if n is not None else len(out), *map_shape)
        if out.shape != needed or out.dtype != dtype:
            rows = "N" if n is None else n
            raise ValueError(
                f"The output buffer{which} has shape {out.shape} and dtype {out.dtype}; this run needs shape "
                f"({rows}, {', '.join(map(str, map_shape))}) and dtype {dtype}. Allocate "
                f"np.empty({needed}, dtype='{dtype}')."
            )
        if not out.flags.writeable:
            raise ValueError(
                f"The output buffer{which} is read-only (a memmap opened with mode 'r'?); pass a writable one."
            )
        return ArraySink(out)
    if _is_path(out):
        # Reading every weight is for the journal only: in-memory runs skip it.
        config = {**plan.config, "model": checksum, **({"map": name} if name else {})}
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
    layer=None,
    output=None,
    **method_options,
):
    """Computes input-gradient maps for a whole dataset, streamed to a host buffer.

    Algorithm: each batch's maps are computed by one compiled function
    (reduced and cast on the device), copied to the host while the next batch
    computes, and written into ``out`` at their rows; a ``.npy`` ``out`` is
    journaled so that a killed run resumes where it stopped.

    Example:
        >>> maps = effgrad.saliency(model, images, method="smoothgrad", reduce="abs_sum",
        ...                         out="maps.npy", samples=25, noise=0.15)
        >>> np.load("maps.npy", mmap_mode="r").shape   # (N, H, W)

        Several inputs come back as the same nest; a text model is explained
        at its token embedding, one score per token:

        >>> maps = effgrad.saliency(two_input_model, {"image": images, "tabular": table})
        >>> maps["image"].shape, maps["tabular"].shape      # (N, H, W, C), (N, F)
        >>> scores = effgrad.saliency(bert_classifier, {"token_ids": ids, "segment_ids": seg,
        ...                           "padding_mask": mask}, layer="token_embedding", reduce="sum")
        >>> scores.shape                                    # (N, T)

    Args:
        model: A Keras model (or callable) from inputs to outputs.
        inputs: A NumPy array or memmap, a ``tf.Tensor``, a dict of them
            (or, for a model with several inputs, a tuple/list), a batched
            ``tf.data.Dataset`` (elements ``x`` or ``(x, y, ...)``, ``x``
            any such nest) or an iterable of batches. Rows are explained in
            the order they come. Float inputs are differentiated; integer
            ones (token ids, masks) are passed through unchanged.
        method: ``"gradient"``, ``"gradient_x_input"``, ``"smoothgrad"``,
            ``"integrated_gradients"``, or a method instance.
        target: ``None`` (each example's arg-max output), an int, an int
            array ``[N]``, or ``callable(outputs) -> [B]`` scores.
        reduce: ``None``, ``"abs"``, or over the last axis ``"abs_max"``,
            ``"abs_sum"``, ``"l2"``, ``"sum"``; applied on the device.
        batch_size: Rows per batch (array/tensor inputs).
        out: ``None`` (new array), a ``.npy`` path (a memmap is returned), or
            a preallocated array/memmap of the right shape and dtype. With
            several differentiated inputs, a path ``maps.npy`` writes
            ``maps.<input name>.npy`` per input (``maps.0.npy``... for a
            tuple), or pass a dict/tuple of buffers or paths like the inputs.
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
        layer: A layer of the model (or its name, searched in nested models
            too): differentiate that layer's output instead of the inputs,
            e.g. ``"token_embedding"`` of a keras_hub text model. Every
            method works there (IG's ``baseline`` is then in the layer's
            output space, zeros by default); maps have the layer output's
            shape (``reduce="sum"`` over the embedding axis: one score per token).
        output: For a model with several outputs: the name or index of the
            one to explain (``target`` then applies to it).
        **method_options: ``samples``, ``noise``, ``seed``,
            ``samples_per_pass`` (smoothgrad); ``steps``, ``baseline``,
            ``steps_per_pass`` (integrated_gradients).

    Returns:
        The filled array (``np.memmap`` for a path); for several inputs, the
        inputs' nest of them (``None`` for inputs not differentiated).

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
        layer=layer,
        output=output,
        **method_options,
    )
    sink = open_sink(out, plan, resume)
    failed = True
    try:
        if sink.complete:
            check_inputs(plan, sink)  # the same rows, or the old maps are not theirs
        else:
            stream(plan, sink, progress)
        failed = False
    finally:
        sink.close(failed)  # a file run that committed nothing leaves no file
    return sink.result
