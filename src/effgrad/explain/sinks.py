"""Where maps go: host arrays, preallocated buffers, resumable ``.npy`` files.

A sink receives each batch's maps in order (``write``) and is told when rows
are safe to count as done (``commit``). The ``.npy`` file sink keeps a small
JSON journal next to the file, rewritten atomically *after* the rows it names
were flushed, so a run killed at any point (SIGKILL included) resumes from
the last committed row and produces the same file as an uninterrupted run.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

__all__ = ["ArraySink", "NpyFileSink", "journal_path", "release_rows"]


def release_rows(array: np.ndarray, stop_row: int) -> None:
    """Drops the resident pages of a file-backed memmap's rows ``[0, stop_row)``.

    Pages of a memory-mapped file that were read or flushed stay resident and
    count as the process's memory until the kernel needs them back; dropping
    the finished ones keeps host memory flat in N. The data is safe: read
    pages are re-read from the file if touched again, and written pages are
    released only after ``flush``. A no-op for anything but a whole memmap.

    Trap:
        Never on a copy-on-write memmap (``mode="c"``, also what
        ``np.load(path, mmap_mode="c")`` returns): its changed pages are
        private memory, not the file, and ``MADV_DONTNEED`` would silently
        revert them to the file's contents (the caller's edits to inputs,
        effgrad's maps in an output buffer).
    """
    handle = getattr(array, "_mmap", None)
    if handle is None or not hasattr(handle, "madvise") or not array.flags.c_contiguous or stop_row <= 0:
        return
    if getattr(array, "mode", "c") not in ("r", "r+", "w+"):  # shared mappings only
        return
    start_in_map = array.offset % mmap.ALLOCATIONGRANULARITY
    end = start_in_map + stop_row * array.strides[0]
    end -= end % mmap.PAGESIZE
    if end > 0:
        handle.madvise(mmap.MADV_DONTNEED, 0, end)


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal.json")


class ArraySink:
    """Writes rows into an in-memory array or a caller's buffer/memmap."""

    # Checksum of the input rows a resumed run must see again (file sinks).
    input_crc: int | None = None

    def __init__(self, array: np.ndarray):
        self.array = array
        self.committed = 0

    def write(self, start: int, maps, targets=None) -> None:
        rows = maps.numpy() if hasattr(maps, "numpy") else np.asarray(maps)  # device -> host
        self.array[start : start + len(rows)] = rows

    def commit(self, rows: int, input_crc: int = 0) -> None:
        if isinstance(self.array, np.memmap):
            self.array.flush()
            release_rows(self.array, rows)
        self.committed = rows

    def finish(self, rows: int, input_crc: int = 0) -> None:
        self.commit(rows, input_crc)

    def discard_if_empty(self) -> None:
        """Called when a run fails: a caller's buffer is theirs, nothing to undo."""


class NpyFileSink(ArraySink):
    """A standard ``.npy`` file (``np.load`` reads it) plus a resume journal."""

    def __init__(self, path: Path, array: np.memmap, config: dict, committed: int, input_crc=None):
        super().__init__(array)
        self.path, self.config, self.committed, self.input_crc = path, config, committed, input_crc
        self.created = False

    @classmethod
    def open(cls, path, shape: tuple, dtype, config: dict, resume: bool) -> NpyFileSink:
        """Creates the file, or reopens it to resume. Raises before touching anything."""
        path = Path(path)
        journal = journal_path(path)
        if path.exists() or journal.exists():
            if not resume:
                raise FileExistsError(
                    f"{path} already exists; effgrad never overwrites it. Pass resume=True to continue an "
                    "interrupted run into it, or remove it (and its .journal.json) to start over."
                )
            if not journal.exists():
                raise ValueError(
                    f"Cannot resume into {path}: it has no effgrad journal ({journal.name}), so it was not "
                    "written by an interrupted effgrad run. Remove it or choose another path."
                )
            state = json.loads(journal.read_text())
            if state["config"] != config:
                changed = sorted(
                    k for k in set(config) | set(state["config"]) if config.get(k) != state["config"].get(k)
                )
                raise ValueError(
                    f"Cannot resume into {path}: it was started with a different configuration "
                    f"({', '.join(changed)} differ{'s' if len(changed) == 1 else ''}: 'model' is a checksum of "
                    "the weights, 'target' of the target). Use the original model and settings, or remove "
                    "the file to start over."
                )
            committed = int(state["committed"])
            array = _reopen(path, shape, dtype) if path.exists() else None
            if array is not None:
                return cls(path, array, config, committed, state.get("input_crc"))
            if committed:
                raise ValueError(
                    f"Cannot resume into {path}: its journal names {committed} finished rows but the file is "
                    "missing or damaged (wrong size or header). Remove it and its .journal.json to start over."
                )
            # Killed before the first row was committed: nothing to keep, start again.
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = cls(path, None, config, 0)
        sink._write_journal(0)  # first: a file without journal is never ours
        sink.array = npy_format.open_memmap(path, mode="w+", dtype=np.dtype(dtype), shape=tuple(shape))
        sink.created = True
        return sink

    def discard_if_empty(self) -> None:
        """Removes the file and journal this run created if no row was committed."""
        if self.created and self.committed == 0:
            self.array = None
            for leftover in (self.path, journal_path(self.path)):
                leftover.unlink(missing_ok=True)

    def _write_journal(self, rows: int, complete: bool = False, input_crc: int = 0) -> None:
        journal = journal_path(self.path)
        # Unique per process: two runs on one output never share a temporary file.
        tmp = journal.with_name(f"{journal.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            state = {"config": self.config, "committed": rows, "complete": complete, "input_crc": input_crc}
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, journal)  # atomic: the journal is always whole

    def commit(self, rows: int, input_crc: int = 0) -> None:
        self.array.flush()  # rows reach the file before the journal names them
        self._write_journal(rows, input_crc=input_crc)
        release_rows(self.array, rows)
        self.committed = rows

    def finish(self, rows: int, input_crc: int = 0) -> None:
        self.array.flush()
        self._write_journal(rows, complete=True, input_crc=input_crc)
        self.committed = rows


def _reopen(path: Path, shape: tuple, dtype) -> np.memmap | None:
    """The ``.npy`` at ``path`` as a writable memmap, or None if its header or size is not this run's."""
    try:
        # Read-only first: numpy silently zero-extends a short file opened "r+".
        array = np.load(path, mmap_mode="r")
    except (ValueError, EOFError, OSError):
        return None  # killed between creating the file and writing its header, truncated, not a .npy
    if not isinstance(array, np.memmap) or array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
        return None
    if os.path.getsize(path) != array.offset + array.nbytes:
        return None  # a damaged file: committed rows would read back as zeros
    del array
    return np.load(path, mmap_mode="r+")
