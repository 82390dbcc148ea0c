"""The docs stay in step with the code."""

import json
import re
from pathlib import Path

import pytest

import effgrad
from helpers import run_forked

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_api_reference_builds_with_pdoc_without_warnings(tmp_path, monkeypatch):
    """The reference (`pdoc --docformat google -o docs/api effgrad`) builds cleanly and has every public name."""
    import warnings

    import pdoc
    import pdoc.render

    monkeypatch.setenv("PDOC_ALLOW_EXEC", "1")  # an import asks `uname -p`; pdoc would warn about it
    pdoc.render.configure(docformat="google")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc("effgrad", output_directory=tmp_path)
    from_pdoc = [str(w.message) for w in caught if "pdoc" in w.filename]
    assert not from_pdoc, from_pdoc
    page = (tmp_path / "effgrad.html").read_text()
    for name in effgrad.__all__:
        assert f'id="{name}"' in page or (tmp_path / "effgrad" / f"{name}.html").exists(), name


def test_every_public_name_is_documented():
    for name in effgrad.__all__:
        obj = getattr(effgrad, name)
        assert (obj.__doc__ or "").strip(), f"effgrad.{name} has no docstring"


# --------------------------------------------------------------------------- docs that run
ROOT = DOCS.parent
GUIDES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
BLOCKS = [
    pytest.param(path, i, code, id=f"{path.name}#{i}")
    for path in GUIDES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
]


@pytest.mark.parametrize("path, index, code", BLOCKS)
def test_every_python_block_of_the_docs_runs_as_written(path, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write their files (maps.npy, ...) here
    if "MirroredStrategy" in code:
        # A second MirroredStrategy over the devices the test session's own uses aborts the
        # process (TF 2.21, see conftest): this block runs in a process of its own.
        status, _, err = run_forked(code, {"block": []})["block"]
        assert status == 0, err[-3000:]
        return
    exec(compile(code, f"{path.name} block {index}", "exec"), {"__name__": "__docs__"})


def _quoted_ratios(text: str) -> list[str]:
    """Every ratio a text quotes: '0.35x', both ends of '0.97-0.99x'."""
    ratios = []
    for low, high in re.findall(r"(\d+\.\d+)(?:-(\d+\.\d+))?x\b", text):
        ratios += [r for r in (low, high) if r]
    return ratios


def test_every_ratio_quoted_in_the_docs_comes_from_a_benchmark_result():
    results = ROOT / "benchmarks" / "results"
    tables = " ".join(p.read_text() for p in results.glob("*.md"))
    numbers = set()

    def collect(value):
        if isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.add(float(value))

    for p in results.glob("*.json"):
        collect(json.loads(p.read_text()))
    missing = []
    for path in GUIDES:
        for ratio in _quoted_ratios(path.read_text()):
            decimals = len(ratio.split(".")[1])
            in_json = any(round(n, decimals) == float(ratio) for n in numbers)
            if ratio not in tables and not in_json:
                missing.append(f"{path.name}: {ratio}x")
    assert not missing, f"ratios quoted without a benchmark result behind them: {missing}"


def test_links_between_the_docs_resolve():
    broken = []
    for path in GUIDES:
        for target in re.findall(r"\]\(([^)#\s]+)\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.name} -> {target}")
    assert not broken, broken
