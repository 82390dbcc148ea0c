"""The docs stay in step with the code."""

import importlib.util
from pathlib import Path

import effgrad

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_api_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("build_api", DOCS / "build_api.py")
    build_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_api)
    assert (DOCS / "api.md").read_text() == build_api.render(), "run: python docs/build_api.py"


def test_every_public_name_is_documented():
    for name in effgrad.__all__:
        obj = getattr(effgrad, name)
        assert (obj.__doc__ or "").strip(), f"effgrad.{name} has no docstring"
