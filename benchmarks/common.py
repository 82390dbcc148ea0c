"""Shared benchmark plumbing: isolated runs, timing, environment, result files.

Every configuration runs in a fresh Python process (`run_isolated`): the
device allocator's peak and the host RSS then belong to that configuration
alone, and one configuration's cached graphs cannot help another's timing.
A `--quick` run (the test suite's check that the benchmarks do not rot)
runs them in its own process instead: its numbers are not measurements, and
a TensorFlow import per configuration was most of its time.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(os.environ.get("EFFGRAD_BENCHMARK_RESULTS", Path(__file__).parent / "results"))
_MARK = "@@RESULT@@"


QUICK = os.environ.get("EFFGRAD_BENCHMARK_QUICK") == "1"
# Configures virtual devices, which TensorFlow allows only before it starts.
_OWN_PROCESS = {"benchmarks.distributed"}


def run_isolated(module: str, config: dict, timeout: float = 900) -> dict:
    """Runs ``python -m module --child CONFIG`` and returns the dict it reports."""
    if QUICK and module not in _OWN_PROCESS:
        import gc
        import importlib

        import keras

        # What exists now (the imports, earlier configurations' survivors) is left out of the collections:
        # a full collection of a process holding TensorFlow and Keras costs most of a second.
        gc.freeze()
        result = importlib.import_module(module).child(config)
        result["host_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        keras.backend.clear_session()  # the next configuration starts without this one's layers and graphs
        return result
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true")
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    raise RuntimeError(f"{module} {config} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


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
