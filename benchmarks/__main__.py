"""`python -m benchmarks run [--quick] [SUITE ...]`: run suites, write benchmarks/results/."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

SUITES = [
    "accumulation",
    "step_floor",
    "fused_loss",
    "attention",
    "compact_state",
    "loss_scaling",
    "diagnostics",
    "checkpointing",
    "checkpoint_model",
    "segments",
    "distributed",
    "shard",
    "saliency",
    "saliency_methods",
    "token_attribution",
    "token_methods",
    "planning",
    "privacy",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run benchmark suites")
    run.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default: all)")
    run.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: minutes, for CI and smoke tests (results go to a new temporary directory unless --results)",
    )
    run.add_argument("--results", help="directory for the result files (default: benchmarks/results)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if args.quick:  # read by benchmarks.common: run configurations in this process
        os.environ["EFFGRAD_BENCHMARK_QUICK"] = "1"
    if args.quick and not args.results:  # quick numbers are not measurements: never over the published ones
        args.results = tempfile.mkdtemp(prefix="effgrad-quick-")
        print(f"quick: results in {args.results}", flush=True)
    if args.results:  # read by benchmarks.common, here and in every child process
        os.environ["EFFGRAD_BENCHMARK_RESULTS"] = os.path.abspath(args.results)
    from benchmarks import common, plots

    for name in args.suites or SUITES:
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        started = time.perf_counter()
        importlib.import_module(f"benchmarks.{name}").run(quick=args.quick)
        table = (common.RESULTS / f"{name}.md").read_text()
        print(f"{table}\n({name}: {time.perf_counter() - started:.0f} s)", flush=True)
    index = common.RESULTS / "README.md"
    # A suite's tables: its own, and any more it names in TABLES.
    tables = [t for name in SUITES for t in getattr(importlib.import_module(f"benchmarks.{name}"), "TABLES", [name])]
    index.write_text(
        "# Benchmark results\n\n"
        + "\n".join((common.RESULTS / f"{t}.md").read_text() for t in tables if (common.RESULTS / f"{t}.md").exists())
    )
    for path in plots.plot_all():
        print(f"wrote {path}")
    if not args.results:  # the published results: docs/benchmarks.md shows them
        _refresh_docs(index.read_text())
    return 0


def _refresh_docs(index: str) -> None:
    """Replaces the "Latest results" part of docs/benchmarks.md with the results' index."""
    docs = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    head = docs.read_text().split("# Latest results")[0]
    body = index.split("\n", 2)[2] if index.startswith("# Benchmark results") else index
    docs.write_text(f"{head}# Latest results\n\n{body.lstrip()}")


if __name__ == "__main__":
    sys.exit(main())
