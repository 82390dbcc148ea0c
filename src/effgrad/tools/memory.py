"""Peak device-allocator bytes of one call: how effgrad proves its savings.

``measure(fn, *args)`` resets the allocator's peak counter, runs ``fn`` once,
waits for its results and reads the peak back::

    pause Python's cyclic garbage collector (a collection during the call
        could free earlier tensors and hide what the call allocates)
    base = current bytes before the call
    reset peak; result = fn(*args); block until result is computed
    peak_bytes  = allocator peak during the call (absolute, includes `base`)
    extra_bytes = peak_bytes - base  (what the call itself added at its worst)

The device is the first GPU when there is one, else ``CPU:0``.

Trap:
    On CPU TensorFlow keeps allocator statistics only with its BFC allocator,
    chosen by ``TF_CPU_ALLOCATOR_USE_BFC=true`` when TensorFlow's context
    starts (its first op or device query, not ``import tensorflow``).
    ``import effgrad`` sets it while that has not happened (``import keras``
    first is fine); after it, ``measure`` says so instead of guessing.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["MemoryReport", "measure", "default_device", "current_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What :func:`measure` saw.

    Attributes:
        peak_bytes: Allocator peak during the call (bytes in use at the worst
            moment, including what was allocated before the call).
        extra_bytes: ``peak_bytes`` minus the bytes in use before the call.
        device: The measured device, e.g. ``"CPU:0"``.
        result: What ``fn`` returned.
    """

    peak_bytes: int
    extra_bytes: int
    device: str
    result: Any = dataclasses.field(repr=False)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def extra_mib(self) -> float:
        return self.extra_bytes / 2**20


def default_device() -> str:
    """``"GPU:0"`` when a GPU is visible, else ``"CPU:0"``."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _memory_info(device: str) -> dict:
    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as err:
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device}. On CPU they need "
            "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow runs its first op: import effgrad before "
            "creating any tensor or model (importing keras/tensorflow first is fine), or export the variable."
        ) from err


def current_bytes(device: str | None = None) -> int:
    """Bytes the device allocator holds now (raises if it keeps no statistics)."""
    return int(_memory_info(device or default_device())["current"])


def _block_until_ready(result) -> None:
    # Eager ops may still be running asynchronously (GPU); reading one value of
    # every tensor makes sure the work is done before the peak is read.
    for t in tf.nest.flatten(result):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.shape.num_elements() != 0:
            tf.reshape(t, [-1])[:1].numpy()


def measure(fn: Callable, *args, device: str | None = None, **kwargs) -> MemoryReport:
    """Runs ``fn(*args, **kwargs)`` once and reports the allocator peak.

    Example:
        >>> report = effgrad.memory.measure(step, x, y)
        >>> print(f"{report.peak_mib:.1f} MiB at peak")

    Args:
        fn: Any callable; compiled functions should be traced beforehand if
            the tracing itself is not what you want to measure.
        *args: Positional arguments of ``fn``.
        device: Device to read; default :func:`default_device`.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A :class:`MemoryReport`.
    """
    device = device or default_device()
    # Paused rather than run first: a full collection costs seconds in a process that has built
    # many models (a test worker, a planner measuring many configurations).
    collecting = gc.isenabled()
    gc.disable()
    try:
        base = _memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        result = fn(*args, **kwargs)
        _block_until_ready(result)
        peak = _memory_info(device)["peak"]
    finally:
        if collecting:
            gc.enable()
    if peak == 0:
        # A call that returns tensors allocated something: a zero peak means
        # the allocator keeps no statistics (on CPU: TensorFlow allocated its
        # first tensor before TF_CPU_ALLOCATOR_USE_BFC was set), not "free".
        raise RuntimeError(
            f"TensorFlow recorded no allocations on {device}, so there is no peak to report. On CPU "
            "allocator statistics need TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow runs its first op: "
            "import effgrad before creating any tensor or model (importing keras/tensorflow first is fine), or "
            "export the variable."
        )
    return MemoryReport(peak_bytes=int(peak), extra_bytes=int(peak - base), device=device, result=result)
