"""Shared benchmark plumbing: isolated runs, timing, environment, result files.

Every configuration runs in a fresh Python process (`run_isolated`): the
device allocator's peak and the host RSS then belong to that configuration
alone, and one configuration's cached graphs cannot help another's timing.
A `--quick` run (the test suite's check that the benchmarks do not rot)
runs them in its own process instead: its numbers are not measurements, and
a TensorFlow import per configuration was most of its time. What needs a
process of its own (virtual devices, a cluster's workers) is then forked
from it while its TensorFlow has not started (`run_children`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

RESULTS = Path(os.environ.get("EFFGRAD_BENCHMARK_RESULTS", Path(__file__).parent / "results"))
_MARK = "@@RESULT@@"
# Set for a child of run_children: having reported, it waits for stdin to close before it exits.
_HOLD = "EFFGRAD_BENCHMARK_HOLD"


QUICK = os.environ.get("EFFGRAD_BENCHMARK_QUICK") == "1"
# Configures virtual devices, which TensorFlow allows only before it starts.
_OWN_PROCESS = {"benchmarks.distributed"}


def run_isolated(module: str, config: dict, timeout: float = 900) -> dict:
    """Runs ``python -m module --child CONFIG`` and returns the dict it reports."""
    if QUICK and module not in _OWN_PROCESS:
        import gc

        import keras

        # What exists now (the imports, earlier configurations' survivors) is left out of the collections:
        # a full collection of a process holding TensorFlow and Keras costs most of a second.
        gc.freeze()
        result = importlib.import_module(module).child(config)
        result["host_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        keras.backend.clear_session()  # the next configuration starts without this one's layers and graphs
        return result
    return run_children(module, [(config, {})], timeout)[0]


def run_children(module: str, runs: list[tuple[dict, dict]], timeout: float = 900) -> list[dict]:
    """``module.child(config)`` for each ``(config, environment variables)``, side by side, each in a
    process of its own (a cluster's workers, virtual devices): the dicts they report.

    New interpreters (``python -m module --child CONFIG``); in a ``--quick`` run whose TensorFlow has not
    started yet, forks of this process instead, without a TensorFlow import each (forking a process whose
    TensorFlow runs threads is not safe, so a started one takes new interpreters too; a fork has no timeout).
    Either way a child that has reported waits until every sibling has (see :func:`_fork`).
    """
    if QUICK and not _tensorflow_started():
        return _wait([_fork(module, config, env) for config, env in runs])
    base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true", **{_HOLD: "1"})
    with contextlib.ExitStack() as stack:
        errors = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in runs]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, "--child", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**base, **env},
                cwd=Path(__file__).parent.parent,
            )
            for (config, env), err in zip(runs, errors)
        ]
        timer = threading.Timer(timeout, lambda: [proc.kill() for proc in procs])
        timer.start()
        try:
            # Every child's report first; then they are released together (child_main), as forks are.
            reports = [next((line for line in proc.stdout if line.startswith(_MARK)), None) for proc in procs]
        finally:
            for proc in procs:
                proc.stdin.close()
            for proc in procs:
                proc.wait()
            timer.cancel()
        results = []
        for proc, (config, _), report, err in zip(procs, runs, reports, errors):
            if proc.returncode or not report:
                err.seek(0)
                raise RuntimeError(f"{module} {config} failed (exit {proc.returncode}):\n{err.read()[-4000:]}")
            results.append(json.loads(report[len(_MARK) :]))
    return results


def _tensorflow_started() -> bool:
    from effgrad import _compat

    return _compat.context_started()


def _fork(module: str, config: dict, env: dict) -> tuple[int, int, int, dict]:
    """A forked child running ``module.child(config)``: ``(pid, its result's pipe, its release pipe, config)``.

    Having reported, the child waits to be released (:func:`_wait`): a cluster's worker that exits
    closes its gRPC server while a sibling may still be reading its part of the last collective from
    it ("Collective ops is aborted by: Socket closed").
    """
    read, write = os.pipe()
    held, release = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        os.close(held)
        return pid, read, release, config
    status = 1
    try:
        os.close(read)
        os.close(release)
        os.environ.update(env)
        result = importlib.import_module(module).child(config)
        result["host_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(result))
        status = 0
        os.read(held, 1)  # until every sibling has reported (its end closed)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _wait(children: list) -> list[dict]:
    """The forked ``children``'s reports, once all have reported; then they are released together."""
    texts = []
    try:
        for _, read, _, _ in children:
            with os.fdopen(read) as reply:
                texts.append(reply.read())
    finally:
        for _, _, release, _ in children:
            os.close(release)
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, *_ in children]
    for (*_, config), status, text in zip(children, statuses, texts):
        if status or not text:
            raise RuntimeError(f"{config} failed in a forked process (its traceback is above)")
    return [json.loads(text) for text in texts]


def run_rounds(module: str, configs: list[dict], rounds: int) -> list[dict]:
    """Runs every config ``rounds`` times, interleaved; keeps each one's fastest run.

    Timings on a shared machine drift by tens of percent between processes;
    interleaving the configurations and keeping the best of each spreads a
    slow phase over all of them instead of penalizing one.
    """
    best: list[dict | None] = [None] * len(configs)
    for _ in range(rounds):
        for i, config in enumerate(configs):
            result = run_isolated(module, config)
            if best[i] is None or result["seconds"] < best[i]["seconds"]:
                best[i] = result
    return best


def child_main(run) -> None:
    """Entry point of a child process: ``run(config) -> dict``."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        result = run(json.loads(sys.argv[2]))
        result["host_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(_MARK + json.dumps(result), flush=True)
        if os.environ.get(_HOLD):  # until every sibling has reported (run_children closes stdin)
            sys.stdin.read()
        return
    raise SystemExit("run the benchmarks with: python -m benchmarks run [--quick] [SUITE ...]")


def median_time(fn, warmup: int = 1, repeats: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment() -> dict:
    import keras
    import tensorflow as tf

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": [d.name for d in tf.config.list_physical_devices("GPU")],
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format) triples."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt) if fmt else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(name: str, title: str, rows: list[dict], columns: list[tuple[str, str, str]], **config) -> dict:
    """Writes ``results/NAME.json`` (rows + environment) and ``results/NAME.md`` (the table)."""
    env = environment()
    line = f"{env['cpu']}, {env['cores']} cores, TF {env['tensorflow']}, Keras {env['keras']}, {env['date']}"
    payload = {"title": title, "config": config, "environment": env, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(f"## {title}\n\n{line}\n\n{markdown_table(rows, columns)}\n")
    return payload
