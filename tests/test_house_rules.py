"""Every private TensorFlow/Keras access lives in effgrad/_compat/; modules meet through seams, not privates.

A static read of the package's source (no import): outside ``_compat/`` no module imports
``tensorflow.python``, ``tensorflow.compiler`` or ``keras.src``, and none reads ``x._name`` unless
``_name`` is defined in that very module (its own classes' and functions' privates) or is one of
effgrad's own private helper modules (``_compat``, ``_checks``, ...).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "effgrad"
PRIVATE_IMPORTS = ("tensorflow.python", "tensorflow.compiler", "keras.src")
# Underscore names that are public API: namedtuple's methods.
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make"}


def violations(source: str, name: str = "<module>") -> list[str]:
    """What a module's source does that only _compat/ may: private imports and foreign ``._name`` reads."""
    tree = ast.parse(source)
    own_modules = {p.stem for p in PACKAGE.glob("_*")}
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.alias):
            defined.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.keyword) and node.arg:
            defined.add(node.arg)  # set by keyword: self.__dict__.update(_name=...)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            defined.add(node.value)  # set by name: object.__setattr__(self, "_name", ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        found += [f"{name}:{node.lineno} imports {m}" for m in modules if m.startswith(PRIVATE_IMPORTS)]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in PUBLIC_UNDERSCORE or node.attr in defined or node.attr.lstrip("_") in own_modules:
                continue
            if node.attr in own_modules:
                continue
            found.append(f"{name}:{node.lineno} reads .{node.attr}")
    return found


def test_the_check_catches_a_private_import_and_a_foreign_private():
    source = "from tensorflow.python.framework import ops\nimport keras\nkeras.optimizers.Adam()._var_key(v)\n"
    assert len(violations(source)) == 2
    own = "class A:\n    def _x(self):\n        return 1\n\ndef f(a):\n    return a._x()\n"
    assert violations(own) == []  # a private of this module's own class


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if "_compat" not in p.relative_to(PACKAGE).parts),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_private_access_outside_compat(path):
    assert violations(path.read_text(), str(path.relative_to(PACKAGE))) == []
