"""pyproject.toml declares what src/aiayn imports, and imports what it declares: a module that
is imported but not declared works here by accident (another package pulled it in) and fails
on a user's machine; one declared and never imported costs every install for nothing."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
# Declared, never imported, on purpose: what each is for instead.
NOT_IMPORTED = {
    "accelerate": "a launcher: `accelerate launch -m aiayn train` (docs/distributed.md)",
    "tensorboard": "imported through torch.utils.tensorboard",
}


def _name(requirement: str) -> str:
    """The distribution a requirement names, normalised (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for group in project["optional-dependencies"].values() for r in group}
    return required, extras


def _imported() -> dict[str, str]:
    """Top-level third-party modules src/aiayn imports, each with a file that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "aiayn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "aiayn" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared_and_every_dependency_imported():
    required, extras = _declared()
    dists = packages_distributions()
    imported = {}
    for module, where in _imported().items():
        assert module in dists, f"{module} (imported in {where}) is not installed"
        imported[_name(dists[module][0])] = where
    undeclared = {d: w for d, w in imported.items() if d not in required | extras}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"
    unused = required - set(imported) - set(NOT_IMPORTED)
    assert not unused, f"declared but never imported by src/aiayn: {unused}"
    assert set(NOT_IMPORTED) <= required
