"""Writes docs/api.md from the docstrings: `python docs/build_api.py`.

tests/test_docs.py fails when docs/api.md is out of date.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import effgrad  # noqa: E402
from effgrad import memory  # noqa: E402
from effgrad.explain import visualize  # noqa: E402

API = Path(__file__).with_name("api.md")


def _entry(name: str, obj) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = ""
    kind = "class" if inspect.isclass(obj) else "def"
    doc = inspect.cleandoc(obj.__doc__ or "(no docstring)")
    text = f"### `{name}`\n\n```python\n{kind} {name}{signature}\n```\n\n{doc}\n"
    if inspect.isclass(obj):
        for attr, member in sorted(vars(obj).items()):
            if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            member_doc = inspect.cleandoc(member.__doc__ or "")
            if member_doc:
                text += f"\n- `{attr}`: {member_doc.splitlines()[0]}"
        text += "\n"
    return text


def render() -> str:
    parts = [
        "# API reference\n",
        "Generated from the docstrings by `python docs/build_api.py`.\n",
        "## effgrad\n",
    ]
    for name in sorted(effgrad.__all__, key=str.lower):
        obj = getattr(effgrad, name)
        if inspect.ismodule(obj):
            continue
        parts.append(_entry(f"effgrad.{name}", obj))
    parts.append("## effgrad.memory\n")
    parts += [_entry(f"effgrad.memory.{n}", getattr(memory, n)) for n in memory.__all__]
    parts.append("## effgrad.explain.visualize\n")
    parts += [_entry(f"effgrad.explain.visualize.{n}", getattr(visualize, n)) for n in visualize.__all__]
    return "\n".join(parts)


if __name__ == "__main__":
    API.write_text(render())
    print(f"wrote {API}", file=sys.stderr)
