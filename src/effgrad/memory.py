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
import os
import re
import subprocess
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "MemoryReport",
    "measure",
    "default_device",
    "current_bytes",
    "device_memory_bytes",
    "parse_budget",
    "format_bytes",
]


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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def format_bytes(nbytes: float) -> str:
    """``"452.3 MiB"``, ``"1.5 GiB"``, ``"512 bytes"``: the largest binary unit that keeps a number >= 1."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{int(nbytes)} bytes"


def device_memory_bytes() -> int:
    """Total memory of the device effgrad measures: the first GPU's, else the machine's RAM."""
    if default_device().startswith("GPU"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            return int(out.stdout.split()[0]) * 2**20
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            raise ValueError(
                "A budget as a fraction needs the GPU's total memory, which nvidia-smi did not tell; "
                "pass bytes instead, e.g. memory_budget='6GiB'."
            ) from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_budget(budget) -> int:
    """Bytes of a memory budget: an int, a size string or a fraction of the device's memory.

    Sizes: ``"300MiB"``, ``"6GiB"``, ``"2.5GB"``, ``"1TiB"``, ``"1000000"`` (binary
    and decimal units up to tera). A number without a unit is bytes when it is
    whole (``1000000``, ``"1000000"``) and a fraction of the device's memory
    when it has a decimal point (``0.8``, ``"0.8"``, in (0, 1]). A budget
    above the device's memory is accepted with a warning (it cannot bind).

    Example:
        >>> parse_budget("300MiB"), parse_budget(4096)
        (314572800, 4096)
    """
    if isinstance(budget, bool):
        raise ValueError(f"memory_budget must be bytes, a size string or a fraction, got {budget!r}.")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"memory_budget must be > 0 bytes, got {budget}.")
        return _checked_against_device(int(budget))
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(
                f"A memory_budget without a unit and with a decimal point is a fraction of the device's memory, "
                f"in (0, 1]; got {budget}. For a size give bytes (a whole number) or a unit, e.g. '300MiB'."
            )
        return int(budget * device_memory_bytes())
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if match and not match.group(2) and "." in match.group(1):
            return parse_budget(float(match.group(1)))  # "0.5": a fraction, checked as one
        if match and match.group(2).lower() in _UNITS:
            value = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if value >= 1:
                return _checked_against_device(int(value))
    raise ValueError(
        f"memory_budget must be bytes (int), a size like '300MiB' or '6GiB', or a fraction in (0, 1]; got {budget!r}."
    )


def _checked_against_device(nbytes: int) -> int:
    try:
        total = device_memory_bytes()
    except ValueError:
        return nbytes
    if nbytes > total:
        warnings.warn(
            f"effgrad: the memory budget {format_bytes(nbytes)} is more than the device has "
            f"({format_bytes(total)}): it cannot bind (the device runs out first).",
            UserWarning,
            stacklevel=3,
        )
    return nbytes
