"""The streaming loop: batches in, maps out, three stages overlapped.

Algorithm::

    stager thread:  read the next rows (a memmap reads them from disk), checksum them,
                    make the input tensor                       -> staged (at most 2 ahead)
    main thread:    maps = job.maps(x, targets, row)           -> pending (at most 2 behind)
    writer thread:  maps.numpy() -> sink rows [row, row + B); commit every ~0.5 s

So reading and checksumming the next batch and copying the last one to the
host overlap the device's work on the current one, and the device never holds
more than a few batches, whatever the number of examples.

A running CRC-32 of the input rows is stored with every commit. A resumed run
re-reads (does not recompute) the committed rows and refuses, before writing
anything, inputs that are not the same rows in the same order (another file,
a shuffling ``tf.data`` pipeline).
"""

from __future__ import annotations

import queue
import threading
import time
import zlib

import numpy as np
import tensorflow as tf

from effgrad.explain.plan import SaliencyPlan
from effgrad.explain.sinks import Sink

__all__ = ["stream"]

_COMMIT_EVERY_SECONDS = 0.5
_AHEAD = 2  # batches staged ahead of, and pending behind, the device


class _End:
    def __init__(self, rows: int, crc: int):
        self.rows, self.crc = rows, crc


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """``q.put(item)`` unless ``stop`` is set first (a consumer that gave up)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def stream(plan: SaliencyPlan, sink: Sink, progress: bool = True) -> None:
    """Streams every batch of ``plan`` through its job into ``sink``.

    Rows ``[0, sink.committed)`` are skipped (after checking they are the same
    input rows). ``sink.finish`` is called when the inputs are exhausted;
    after an error, what was written is committed and the error is raised.
    """
    import keras  # Progbar: the progress bar Keras users know

    source, job, total = plan.source, plan.job, plan.num_examples
    start_row = sink.committed
    bar = keras.utils.Progbar(total, unit_name="example", verbose=1 if progress else 0)
    if start_row:
        bar.update(start_row)
    stop = threading.Event()
    staged: queue.Queue = queue.Queue(maxsize=_AHEAD)
    pending: queue.Queue = queue.Queue(maxsize=_AHEAD)
    failure: list[BaseException] = []

    def stager():
        row, crc = 0, 0
        try:
            for batch in source.batches():
                values = batch.numpy() if tf.is_tensor(batch) else np.asarray(batch)
                n = len(values)
                if row < start_row:  # already committed: only checked, not computed
                    seen = min(n, start_row - row)
                    crc, row = _checksum(values[:seen], crc), row + seen
                    if row == start_row:
                        _check_same_rows(crc, sink.input_crc, start_row)
                    if seen == n:
                        continue
                    batch, values, n = batch[seen:], values[seen:], n - seen
                if total is not None and row + n > total:
                    raise ValueError(f"The inputs hold more than num_examples={total} examples.")
                crc = _checksum(values, crc)
                x = batch if tf.is_tensor(batch) else tf.convert_to_tensor(values)
                if not _put(staged, (row, x, n, crc), stop):
                    return
                row += n
            if row < start_row:
                raise ValueError(
                    f"Cannot resume: the inputs end after {row} rows, before the {start_row} committed ones."
                )
            _put(staged, _End(row, crc), stop)
        except BaseException as err:  # surfaced in the main thread
            _put(staged, err, stop)

    def writer():
        last_commit = time.perf_counter()
        while (item := pending.get()) is not None:
            if failure:
                continue  # drain after an error: nothing more is written
            start, maps, targets, crc = item
            try:
                sink.write(start, maps, targets)
                done = start + int(maps.shape[0])
                bar.update(done)
                if time.perf_counter() - last_commit > _COMMIT_EVERY_SECONDS:
                    sink.commit(done, crc)
                    last_commit = time.perf_counter()
            except BaseException as err:  # surfaced in the main thread
                failure.append(err)

    threads = [threading.Thread(target=stager, daemon=True), threading.Thread(target=writer, daemon=True)]
    for thread in threads:
        thread.start()
    indices = plan.target.indices
    written = (start_row, sink.input_crc)
    end = None
    try:
        while not failure:
            item = staged.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, _End):
                end = item
                break
            row, x, n, crc = item
            rows = indices[row : row + n] if indices is not None else np.zeros(n, "int32")
            maps, targets = job.maps(x, tf.constant(rows, tf.int32), tf.constant(row, tf.int64))
            pending.put((row, maps, targets, crc))
            written = (row + n, crc)
    finally:
        stop.set()
        pending.put(None)
        threads[1].join()
        if not failure:
            if end is not None:
                if total is not None and end.rows != total:
                    raise ValueError(f"The inputs held {end.rows} examples but num_examples={total}.")
                sink.finish(end.rows, end.crc)
                bar.update(end.rows, finalize=True)
            elif written[0] > start_row:
                sink.commit(*written)  # an exception above: keep what was written
    if failure:
        raise failure[0]


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
