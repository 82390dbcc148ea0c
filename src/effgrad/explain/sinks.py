"""Where maps go: host arrays, preallocated buffers, resumable ``.npy`` files.

Every sink implements :class:`Sink`: it receives each batch's maps in row
order (``write``), is told when rows are safe to count as done (``commit``)
and when the last row is in (``finish``), and is always closed (``close``).

The ``.npy`` file sink keeps a small JSON journal next to the file, rewritten
atomically *after* the rows it names reached the disk, so a run killed at any
point (SIGKILL included) resumes from the last committed row and produces the
same file as an uninterrupted run. Order of creation, so that every crash
leaves a state a resume recognizes::

    lock   maps.npy.lock       flock: one writer per output, else a clear error
    1.     maps.npy.journal.json   committed 0: a file without journal is never ours
    2.     maps.npy                header, then the whole size reserved (posix_fallocate):
                                   a full disk is an error before any work, never SIGBUS
    3.     rows (pwrite), fdatasync, journal "committed": k     every ~0.5 s
           (with the CRC-32 of output rows [0, k): a resume re-reads them and
           refuses a file whose committed rows changed, naming the rows)
    4.     (unknown length) header rewritten with the final row count, file cut to it
    5.     journal "complete": true; lock file removed

Rows are written with ``pwrite`` rather than through a writable memmap: the
page cache then holds them (host RSS stays flat in N) and a failed write is
an ``OSError``, not a ``SIGBUS`` that kills the process without a message.
"""

from __future__ import annotations

import errno
import io
import json
import mmap
import os
import shutil
import zlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.lib import format as npy_format

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per output is then the caller's duty
    fcntl = None

_CHECKS = 64  # output checksums kept in a journal

__all__ = ["Sink", "ArraySink", "GrowingArraySink", "NpyFileSink", "SinkGroup", "journal_path", "release_rows"]


@runtime_checkable
class Sink(Protocol):
    """Where the streaming engine puts each batch's maps.

    Attributes:
        committed: Rows already done before this run (a resume skips them).
        input_crc: Checksum of those rows' inputs (``None``: nothing to check).
        complete: Whether a previous run already finished everything.
    """

    committed: int
    input_crc: int | None
    complete: bool

    def write(self, start: int, maps, targets) -> None:
        """Rows ``[start, start + B)`` of each map (the engine passes a tuple: one per
        differentiated tensor); ``maps``/``targets`` are device tensors."""

    def commit(self, rows: int, input_crc: int) -> None:
        """Rows ``[0, rows)`` are written: make them durable."""

    def finish(self, rows: int, input_crc: int) -> None:
        """All ``rows`` rows are written."""

    def close(self, failed: bool) -> None:
        """Always called last; ``failed`` when the run raised."""

    @property
    def result(self):
        """What ``saliency`` returns."""


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
    from effgrad._compat import mmap_of  # here, not at import: the sinks load without TensorFlow

    handle = mmap_of(array)
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


def _host(maps) -> np.ndarray:
    return maps.numpy() if hasattr(maps, "numpy") else np.asarray(maps)  # device -> host


class ArraySink:
    """Writes rows into an array of known length: a new one, or the caller's buffer/memmap."""

    input_crc = None
    complete = False

    def __init__(self, array: np.ndarray):
        self.array = array
        self.committed = 0

    def write(self, start: int, maps, targets=None) -> None:
        rows = _host(maps)
        if start + len(rows) > len(self.array):
            raise ValueError(
                f"The inputs hold more than the {len(self.array)} rows of the output buffer; "
                "allocate one row per example."
            )
        self.array[start : start + len(rows)] = rows

    def commit(self, rows: int, input_crc: int = 0) -> None:
        if isinstance(self.array, np.memmap):
            self.array.flush()
            release_rows(self.array, rows)
        self.committed = rows

    def finish(self, rows: int, input_crc: int = 0) -> None:
        if rows != len(self.array):
            raise ValueError(f"The inputs held {rows} examples but the output buffer has {len(self.array)} rows.")
        self.commit(rows, input_crc)

    def close(self, failed: bool) -> None:
        """A caller's buffer is theirs: nothing to undo."""

    @property
    def result(self) -> np.ndarray:
        return self.array


class GrowingArraySink(ArraySink):
    """A new in-memory array whose length only the end of the inputs tells."""

    def __init__(self, map_shape: tuple, dtype):
        super().__init__(np.empty((0, *map_shape), dtype))
        self.chunks: list[np.ndarray] = []

    def write(self, start: int, maps, targets=None) -> None:
        self.chunks.append(_host(maps))

    def finish(self, rows: int, input_crc: int = 0) -> None:
        if self.chunks:
            self.array = np.concatenate(self.chunks)
        self.chunks = []
        self.committed = rows


class NpyFileSink:
    """A standard ``.npy`` file (``np.load`` reads it) plus a resume journal.

    Open it with :meth:`open`; ``num_examples=None`` writes a file of unknown
    length whose header names 0 rows until :meth:`finish` writes the count.
    """

    def __init__(self, path: Path, lock: _OutputLock, config: dict, map_shape: tuple, dtype, num_examples):
        self.path, self.lock, self.config = path, lock, config
        self.map_shape, self.dtype, self.num_examples = tuple(map_shape), np.dtype(dtype), num_examples
        self.row_bytes = int(np.prod(map_shape, dtype=np.int64)) * self.dtype.itemsize
        self.committed, self.input_crc, self.complete = 0, None, False
        # Running CRC-32 of the output rows written so far (rows arrive in order), and
        # [rows, crc] at commits: at most _CHECKS of them, spread over the file.
        self.crc, self.crc_rows, self.checks = 0, 0, []
        self.created = False
        self.fd: int | None = None
        self.offset = len(self._header(0))

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path, map_shape: tuple, num_examples: int | None, dtype, config: dict, resume: bool) -> NpyFileSink:
        """Creates the file, or reopens it to resume. Raises before changing anything."""
        path = Path(path)
        lock = _OutputLock(path)
        sink = cls(path, lock, config, map_shape, dtype, num_examples)
        try:
            if sink._resume_point(resume):
                return sink
            sink._create()
            return sink
        except BaseException:
            sink.close(failed=True)
            raise

    def _resume_point(self, resume: bool) -> bool:
        """True when an interrupted run was reopened; False when a new file must be made."""
        path, journal = self.path, journal_path(self.path)
        if not (path.exists() or journal.exists()):
            return False
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
        try:
            state = json.loads(journal.read_text())
            committed, complete = int(state["committed"]), bool(state["complete"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"Cannot resume into {path}: its journal is damaged ({err}). Remove both to start over."
            ) from None
        if state["config"] != self.config:
            changed = sorted(
                k for k in set(self.config) | set(state["config"]) if self.config.get(k) != state["config"].get(k)
            )
            raise ValueError(
                f"Cannot resume into {path}: it was started with a different configuration "
                f"({', '.join(changed)} differ{'s' if len(changed) == 1 else ''}: 'model' is a checksum of "
                "the layers and weights, 'target' of the target). Use the original model and settings, or remove "
                "the file to start over."
            )
        if path.exists() and self._layout_is_whole(committed, complete):
            self.fd = os.open(path, os.O_RDWR)
            self.committed, self.complete, self.input_crc = committed, complete, state.get("input_crc")
            self._verify_rows(state.get("output_checks") or [])
            return True
        if committed:
            raise ValueError(
                f"Cannot resume into {path}: its journal names {committed} finished rows but the file is "
                "missing or damaged (wrong size or header). Remove it and its .journal.json to start over."
            )
        return False  # killed before the first commit: nothing to keep, start again

    def _layout_is_whole(self, committed: int, complete: bool) -> bool:
        """Whether the file's header and size are what this run and its journal say."""
        try:
            with open(self.path, "rb") as f:
                version = npy_format.read_magic(f)
                read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                offset = f.tell()
        except (ValueError, EOFError, OSError):
            return False  # killed between creating the file and writing its header, or not a .npy
        size = os.path.getsize(self.path)
        if fortran or dtype != self.dtype or tuple(shape[1:]) != self.map_shape or offset != self.offset:
            return False
        if self.num_examples is not None:
            return shape[0] == self.num_examples and size == offset + self.num_examples * self.row_bytes
        if complete:
            return shape[0] == committed and size == offset + committed * self.row_bytes
        return shape[0] == 0 and size >= offset + committed * self.row_bytes

    def _crcs_at(self, stops) -> dict[int, int]:
        """The CRC-32 of output rows ``[0, stop)`` for each stop, read back from the file."""
        crcs, crc, row = {}, 0, 0
        chunk_rows = max(1, (64 << 20) // max(self.row_bytes, 1))
        for stop in sorted(set(stops)):
            while row < stop:
                n = min(chunk_rows, stop - row)
                crc, row = (
                    zlib.crc32(os.pread(self.fd, n * self.row_bytes, self.offset + row * self.row_bytes), crc),
                    row + n,
                )
            crcs[stop] = crc
        return crcs

    def _verify_rows(self, checks: list) -> None:
        """Re-reads the committed rows: their CRC must be what was committed (else a clear error)."""
        checks = [[int(rows), int(crc)] for rows, crc in checks if int(rows) <= self.committed]
        found = self._crcs_at([rows for rows, _ in checks] + [self.committed])
        good_from = 0
        for rows, crc in checks:
            if found[rows] != crc:
                os.close(self.fd)
                self.fd = None
                raise ValueError(
                    f"Cannot resume into {self.path}: rows {good_from}-{rows - 1} changed after they were "
                    f"committed (checksum {found[rows]:08x}, journal {crc:08x}); the file is damaged or was "
                    "edited. Remove it and its .journal.json to start over."
                )
            good_from = rows
        self.crc, self.crc_rows, self.checks = found[self.committed], self.committed, checks

    def rewind(self, rows: int, input_crc: int | None) -> None:
        """Continue from ``rows`` (< committed; ``input_crc`` of those inputs): a group resumes all its
        files from the one behind."""
        self.crc, self.crc_rows, self.input_crc = self._crcs_at([rows])[rows], rows, input_crc
        self.committed, self.complete = rows, False
        self.checks = [c for c in self.checks if c[0] <= rows]

    def _create(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.num_examples is not None:
            needed = self.offset + self.num_examples * self.row_bytes
            free = shutil.disk_usage(path.parent).free
            if needed > free:
                raise OSError(errno.ENOSPC, _no_space(path, needed, free))
        self._write_journal(0)  # first: a file without journal is never ours
        self.created = True
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self.fd, self._header(self.num_examples or 0), 0)
        if self.num_examples is not None and hasattr(os, "posix_fallocate"):
            needed = self.offset + self.num_examples * self.row_bytes
            try:  # blocks on disk now: later writes cannot fail for space
                os.posix_fallocate(self.fd, 0, needed)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, _no_space(path, needed, shutil.disk_usage(path.parent).free)) from None
            os.ftruncate(self.fd, needed)  # a no-op where fallocate sized it; sizes a sparse file elsewhere

    def _header(self, rows: int) -> bytes:
        # numpy pads the header so the first axis can grow to 21 digits in place.
        header = io.BytesIO()
        descr = {
            "descr": npy_format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (rows, *self.map_shape),
        }
        npy_format.write_array_header_1_0(header, descr)
        return header.getvalue()

    # ------------------------------------------------------------ writing
    def write(self, start: int, maps, targets=None) -> None:
        rows = np.ascontiguousarray(_host(maps), dtype=self.dtype)
        if self.num_examples is not None and start + len(rows) > self.num_examples:
            raise ValueError(f"The inputs hold more than num_examples={self.num_examples} examples.")
        data = memoryview(rows).cast("B")
        if start != self.crc_rows:
            raise RuntimeError(f"effgrad: rows must be written in order (row {start} after {self.crc_rows}).")
        try:
            _pwrite_all(self.fd, data, self.offset + start * self.row_bytes)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.path.parent).free
                raise OSError(errno.ENOSPC, _no_space(self.path, len(rows) * self.row_bytes, free)) from None
            raise
        self.crc, self.crc_rows = zlib.crc32(data, self.crc), start + len(rows)

    def commit(self, rows: int, input_crc: int = 0) -> None:
        os.fdatasync(self.fd) if hasattr(os, "fdatasync") else os.fsync(self.fd)  # rows on disk, then the journal
        self._check_point(rows)
        self._write_journal(rows, input_crc=input_crc)
        self.committed = rows

    def _check_point(self, rows: int) -> None:
        """Records the output CRC at ``rows``; past _CHECKS points every other older one is dropped
        (each is a CRC from row 0, so any subset still checks, only with coarser row ranges)."""
        if rows != self.crc_rows:
            raise RuntimeError(f"effgrad: commit at row {rows} but rows were written up to {self.crc_rows}.")
        if not self.checks or self.checks[-1][0] != rows:
            self.checks.append([rows, self.crc])
        if len(self.checks) > _CHECKS:
            self.checks = self.checks[:-1][1::2] + self.checks[-1:]

    def finish(self, rows: int, input_crc: int = 0) -> None:
        if self.num_examples is None:
            header = self._header(rows)
            assert len(header) == self.offset, "the .npy header must keep its length"
            _pwrite_all(self.fd, header, 0)
            os.ftruncate(self.fd, self.offset + rows * self.row_bytes)
        elif rows != self.num_examples:
            raise ValueError(f"The inputs held {rows} examples but num_examples={self.num_examples}.")
        os.fsync(self.fd)
        self._check_point(rows)
        self._write_journal(rows, complete=True, input_crc=input_crc)
        self.committed, self.complete = rows, True

    def close(self, failed: bool) -> None:
        """Closes the file and the lock; a run that committed nothing leaves no file behind."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if failed and self.created and self.committed == 0:
            for leftover in (self.path, journal_path(self.path)):
                leftover.unlink(missing_ok=True)
        self.lock.release()

    @property
    def result(self) -> np.memmap:
        return np.load(self.path, mmap_mode="r+")

    def _write_journal(self, rows: int, complete: bool = False, input_crc: int = 0) -> None:
        journal = journal_path(self.path)
        tmp = journal.with_name(f"{journal.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            state = {
                "config": self.config,
                "committed": rows,
                "complete": complete,
                "input_crc": input_crc,
                "output_checks": self.checks,
            }
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, journal)  # atomic: the journal is always whole


class SinkGroup:
    """One sink per differentiated tensor (a model's several inputs), driven as one :class:`Sink`.

    Each member commits on its own (each ``.npy`` has its own journal), so a
    kill can leave them at different rows: the group resumes from the
    fewest, and the others rewrite rows they already hold (the same values:
    rows are a pure function of the inputs).
    """

    def __init__(self, sinks: list, pack):
        behind = min(sinks, key=lambda s: s.committed)
        for sink in sinks:
            if sink.committed > behind.committed:  # killed between two commits: all continue from the one behind
                sink.rewind(behind.committed, behind.input_crc)
        self.sinks, self.pack = sinks, pack

    @property
    def committed(self) -> int:
        return min(s.committed for s in self.sinks)

    @property
    def input_crc(self) -> int | None:
        return min(self.sinks, key=lambda s: s.committed).input_crc

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.sinks)

    def write(self, start: int, maps: tuple, targets) -> None:
        for sink, m in zip(self.sinks, maps):
            sink.write(start, m, targets)

    def commit(self, rows: int, input_crc: int = 0) -> None:
        for sink in self.sinks:
            sink.commit(rows, input_crc)

    def finish(self, rows: int, input_crc: int = 0) -> None:
        for sink in self.sinks:
            sink.finish(rows, input_crc)

    def close(self, failed: bool) -> None:
        errors = []
        for sink in self.sinks:  # every one, whatever the others do
            try:
                sink.close(failed)
            except BaseException as err:
                errors.append(err)
        if errors:
            raise errors[0]

    @property
    def result(self):
        return self.pack([s.result for s in self.sinks])


_LOCK_MARK = b"effgrad output lock\n"  # what effgrad's lock files hold: another file of that name is not one


class _OutputLock:
    """An exclusive ``flock`` on ``PATH.lock``: one writer per output file.

    The lock file holds ``_LOCK_MARK`` (a file of that name holding anything else is the user's, and
    refused) and is removed on release; a second process that opened it just
    before then would lock a deleted file, so each acquisition checks that the
    locked file is still the one at the path (the classic unlink race).
    """

    def __init__(self, path: Path):
        self.path, self.fd = path.with_name(path.name + ".lock"), None
        if fcntl is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise BlockingIOError(
                    errno.EWOULDBLOCK,
                    f"{path} is being written by another process (it holds {self.path.name}); wait for it to "
                    "finish, or write to another path.",
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                if os.pread(fd, 64, 0) not in (b"", _LOCK_MARK):  # someone's own file of that name
                    os.close(fd)
                    raise FileExistsError(
                        f"{self.path} exists and is not effgrad's lock file: move it, or write to another path."
                    )
                os.pwrite(fd, _LOCK_MARK, 0)
                self.fd = fd
                return
            os.close(fd)  # we locked a file its owner had just removed: try again

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _no_space(path: Path, needed: int, free: int) -> str:
    return (
        f"Not enough disk space for {path}: it needs {needed / 2**20:,.1f} MiB, {free / 2**20:,.1f} MiB are free. "
        "Free some space, write to another disk, or store smaller maps (reduce='abs_sum', dtype='float16')."
    )
