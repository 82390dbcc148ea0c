"""The benchmark suite runs end to end (``--quick``), so it never rots."""

import importlib
import json
import math
from pathlib import Path

import pytest

from benchmarks.__main__ import SUITES
from helpers import png_pixels, run_forked

ROOT = Path(__file__).resolve().parent.parent

# Three groups of suites with their plots, of about equal time, so parallel test workers share them.
# "distributed" and "shard" come first in theirs: their processes are then forks of one whose TensorFlow
# has not started (benchmarks.common.run_children), without a TensorFlow import each.
GROUPS = {
    "step": (
        ["accumulation", "step_floor", "fused_loss", "attention", "compact_state", "loss_scaling", "diagnostics"]
        + ["checkpointing", "segments"],
        [
            "accumulation_memory.png",
            "fused_loss_vocabulary.png",
            "attention_scaling.png",
            "compact_state_convergence.png",
            "noise_scale.png",
            "memory_monitor.png",
            "checkpointing_tradeoff.png",
            "checkpointing_segments.png",
        ],
    ),
    "distributed": (["distributed", "shard", "checkpoint_model", "privacy"], []),
    "saliency": (
        ["saliency", "saliency_methods", "token_attribution", "token_methods", "planning"],
        ["saliency_scaling.png"],
    ),
}


def test_the_groups_cover_every_suite():
    assert sorted(s for suites, _ in GROUPS.values() for s in suites) == sorted(SUITES)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_quick_benchmarks_write_results_tables_and_plots(tmp_path, group):
    suites, plots = GROUPS[group]
    # `python -m benchmarks run --quick ...` in a fresh process, on one thread per op as in the test
    # workers (conftest): the other worker has the other core.
    code = (
        f"import os, runpy, sys; os.chdir({str(ROOT)!r}); sys.path.insert(0, {str(ROOT)!r}); "
        "os.environ['TF_NUM_INTRAOP_THREADS'] = '1'; sys.argv = ['benchmarks', *sys.argv[1:]]; "
        "runpy.run_module('benchmarks', run_name='__main__')"
    )
    status, _, err = run_forked(code, {group: ["run", "--quick", "--results", tmp_path, *suites]}, timeout=900)[group]
    assert status == 0, err[-3000:]
    tables = [t for suite in suites for t in getattr(importlib.import_module(f"benchmarks.{suite}"), "TABLES", [suite])]
    for suite in tables:
        payload = json.loads((tmp_path / f"{suite}.json").read_text())
        assert payload["environment"]["tensorflow"] and payload["environment"]["cpu"]
        assert payload["rows"], suite
        for row in payload["rows"]:
            assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert (tmp_path / f"{suite}.md").read_text().count("|") > 10
    if "checkpoint_model" in suites:
        rows = json.loads((tmp_path / "checkpoint_model.json").read_text())["rows"]
        remat = [r for r in rows if "Remat" in r["method"]]
        assert "keyword" in remat[0]["error"]  # Keras's RematScope fails in a tf.function (keras #21207)
    if "saliency" in suites:
        rows = json.loads((tmp_path / "saliency.json").read_text())["rows"]
        assert [r for r in rows if "effgrad" in r["method"]]  # effgrad itself never depends on the optional peers
    for png in plots:
        png_pixels(tmp_path / png)  # a real, non-blank picture
