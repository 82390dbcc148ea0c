"""The streaming loop: batches in, maps out, three stages overlapped.

Algorithm::

    stager thread:  read the next rows (a memmap reads them from disk), checksum them,
                    make the input tensor                  -> at most 2 batches ahead
    main thread:    maps = job.maps(x, targets, row)      -> at most 2 batches behind
                    (x: the batch's nest of inputs; maps: one per differentiated tensor)
    writer thread:  maps.numpy() -> sink rows [row, row + B); commit every ~0.5 s

So reading and checksumming the next batch and copying the last one to the
host overlap the device's work on the current one, and the device never holds
more than a few batches, whatever the number of examples.

Ctrl-C stops the run at the next batch boundary (a second Ctrl-C at once):
a ``KeyboardInterrupt`` raised at an arbitrary point can be lost (raised
inside an object's ``__del__``, of which TensorFlow runs many, Python only
prints it), and the run would go on.

A running CRC-32 of the input rows is stored with every commit. A resumed run
re-reads (does not recompute) the committed rows and refuses, before writing
anything, inputs that are not the same rows in the same order (another file,
a shuffling ``tf.data`` pipeline).
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
import time
import zlib

import numpy as np
import tensorflow as tf

from effgrad.explain.plan import SaliencyPlan
from effgrad.explain.sinks import Sink

__all__ = ["stream", "check_inputs"]

_COMMIT_EVERY_SECONDS = 0.5
_AHEAD = 2  # batches staged ahead of, and pending behind, the device


class _End:
    def __init__(self, rows: int, crc: int):
        self.rows, self.crc = rows, crc


def _staged(source, start_row: int, expected_crc: int | None, total: int | None):
    """Yields ``(row, x, n, crc)`` for the rows not yet committed, then an ``_End``.

    ``x`` is the batch's nest of tensors. The committed rows are read and
    checksummed, not yielded: a resume sees the same rows again before
    anything new is computed.
    """
    row, crcs = 0, None
    for batch in source.batches():
        leaves = tf.nest.flatten(batch)
        values = [v.numpy() if tf.is_tensor(v) else np.asarray(v) for v in leaves]
        n = len(values[0])
        if any(len(v) != n for v in values):
            raise ValueError(f"A batch has inputs with different numbers of rows: {[len(v) for v in values]}.")
        crcs = crcs or [0] * len(values)
        if row < start_row:  # already committed: only checked, not computed
            seen = min(n, start_row - row)
            crcs, row = [_checksum(v[:seen], c) for v, c in zip(values, crcs)], row + seen
            if row == start_row:
                _check_same_rows(_combined(crcs), expected_crc, start_row)
            if seen == n:
                continue
            leaves, values, n = [v[seen:] for v in leaves], [v[seen:] for v in values], n - seen
        if total is not None and row + n > total:
            raise ValueError(f"The inputs hold more than num_examples={total} examples.")
        crcs = [_checksum(v, c) for v, c in zip(values, crcs)]
        tensors = [leaf if tf.is_tensor(leaf) else tf.convert_to_tensor(v) for leaf, v in zip(leaves, values)]
        yield row, tf.nest.pack_sequence_as(batch, tensors), n, _combined(crcs)
        row += n
    if row < start_row:
        raise ValueError(f"Cannot resume: the inputs end after {row} rows, before the {start_row} committed ones.")
    yield _End(row, _combined(crcs or [0]))


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """``q.put(item)`` unless ``stop`` is set first (a consumer that gave up)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _ahead(items, stop: threading.Event):
    """``items``, produced by a background thread up to ``_AHEAD`` items ahead."""
    q: queue.Queue = queue.Queue(maxsize=_AHEAD)

    def produce():
        try:
            for item in items:
                if not _put(q, item, stop):
                    return
        except BaseException as err:  # surfaced in the consumer
            _put(q, err, stop)

    threading.Thread(target=produce, name="effgrad-saliency-stager", daemon=True).start()
    while True:
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if isinstance(item, _End):
            return


class _Writer:
    """Copies maps to the host and into the sink, committing every ~0.5 s.

    With ``background=True`` it works on its own thread behind a queue of at
    most ``_AHEAD`` batches; its first error is raised by :meth:`close`.
    """

    def __init__(self, sink: Sink, bar, background: bool):
        self.sink, self.bar = sink, bar
        self.failure: BaseException | None = None
        # (rows, input checksum) the sink holds: what a commit after an interruption may claim. Not
        # what was submitted: a Ctrl-C inside queue.put can land after the batch was enqueued.
        self.written = (sink.committed, sink.input_crc)
        self.last_commit = time.perf_counter()
        self.queue: queue.Queue | None = queue.Queue(maxsize=_AHEAD) if background else None
        if background:
            self.thread = threading.Thread(target=self._drain, name="effgrad-saliency-writer", daemon=True)
            self.thread.start()

    def submit(self, start: int, maps: tuple, targets, crc: int) -> None:
        if self.queue is not None:
            self.queue.put((start, maps, targets, crc))
        else:
            self._write(start, maps, targets, crc)

    def _write(self, start, maps, targets, crc) -> None:
        self.sink.write(start, maps, targets)
        done = start + int(maps[0].shape[0])
        self.written = (done, crc)
        self.bar.update(done)
        if time.perf_counter() - self.last_commit > _COMMIT_EVERY_SECONDS:
            self.sink.commit(done, crc)
            self.last_commit = time.perf_counter()

    def _drain(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.failure is None:  # after an error: drain, write nothing more
                try:
                    self._write(*item)
                except BaseException as err:
                    self.failure = err

    def close(self) -> None:
        """Waits for every submitted batch; raises the writer's error, if any."""
        if self.queue is not None:
            self.queue.put(None)
            self.thread.join()
        if self.failure is not None:
            raise self.failure


@contextlib.contextmanager
def _interrupts_between_batches():
    """Yields ``check()``, which raises ``KeyboardInterrupt`` if Ctrl-C was pressed since the last check.

    Only where Python's own handler is in place, in the main thread; a second Ctrl-C interrupts at once.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: None
        return
    pressed = threading.Event()

    def handler(signum, frame):
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    def check():
        if pressed.is_set():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def stream(plan: SaliencyPlan, sink: Sink, progress: bool = True, overlap: bool = True) -> None:
    """Streams every batch of ``plan`` through its job into ``sink``.

    Rows ``[0, sink.committed)`` are skipped (after checking they are the same
    input rows). ``sink.finish`` is called when the inputs are exhausted;
    after an error, what was written is committed and the error is raised.
    ``overlap=False`` runs the three stages one after another (what the
    benchmark compares with).
    """
    import keras  # Progbar: the progress bar Keras users know

    job, total, indices = plan.job, plan.num_examples, plan.target.indices
    start_row = sink.committed
    # A live bar on a terminal; in a log (stdout piped) one plain line at the end, no ANSI codes.
    verbose = (1 if sys.stdout.isatty() else 2) if progress else 0
    bar = keras.utils.Progbar(total, unit_name="example", verbose=verbose)
    if start_row:
        bar.update(start_row)
    stop = threading.Event()
    batches = _staged(plan.source, start_row, sink.input_crc, total)
    writer = _Writer(sink, bar, background=overlap)
    end = None
    try:
        with _interrupts_between_batches() as check_interrupt:
            for item in _ahead(batches, stop) if overlap else batches:
                if isinstance(item, _End):
                    end = item
                    break
                if writer.failure is not None:
                    break
                row, x, n, crc = item
                rows = indices[row : row + n] if indices is not None else np.zeros(n, "int32")
                maps, targets = job.maps(x, tf.constant(rows, tf.int32), tf.constant(row, tf.int64))
                writer.submit(row, maps, targets, crc)
                check_interrupt()
    finally:
        stop.set()
        writer.close()  # raises the writer's error first: nothing below then runs
        if end is None and writer.written[0] > start_row:
            sink.commit(*writer.written)  # an exception above: keep what was written
    if end is not None:
        if total is not None and end.rows != total:
            raise ValueError(f"The inputs held {end.rows} examples but num_examples={total}.")
        sink.finish(end.rows, end.crc)
        if total is None:  # a known total was finalized by the writer's last update
            bar.update(end.rows, finalize=True)


def check_inputs(plan: SaliencyPlan, sink: Sink) -> None:
    """For a run that was already complete: the inputs must be the rows it explained, no more, no fewer.

    Reads and checksums the inputs (no model call); without this a resume
    with other inputs would return the old maps as theirs.
    """
    for item in _staged(plan.source, sink.committed, sink.input_crc, None):
        if not isinstance(item, _End):
            raise ValueError(
                f"Cannot resume: the run into this output is complete with {sink.committed} rows, but the inputs "
                "hold more. Resume with the same inputs, or write to another file."
            )


def _combined(crcs: list[int]) -> int:
    """One checksum of several inputs' running CRCs (each input's own: independent of batch boundaries)."""
    return crcs[0] if len(crcs) == 1 else zlib.crc32(np.asarray(crcs, "uint32").tobytes())


def _checksum(values: np.ndarray, crc: int) -> int:
    """CRC-32 of rows' bytes, continuing ``crc`` (GB/s; no copy of contiguous rows)."""
    return zlib.crc32(np.ascontiguousarray(values), crc)


def _check_same_rows(crc: int, expected: int | None, rows: int) -> None:
    if expected is not None and crc != expected:
        raise ValueError(
            f"Cannot resume: the first {rows} input rows are not the ones the interrupted run explained "
            f"(checksum {crc:08x}, journal {expected:08x}). Resume with the same inputs in the same order. "
            "A tf.data pipeline that shuffles gives another order on every pass (image_dataset_from_directory "
            "shuffles by default: pass shuffle=False; then ds.file_paths names the rows). Nothing was written."
        )
