"""Every module the package imports is the standard library's, ours, or a declared runtime
dependency (triton: the `cuda` extra), so `pip install specscope` without extras runs every
subcommand (.ci/wheel_smoke checks the same on a built wheel in a fresh venv)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in reqs}


def _imported_top_levels() -> dict[str, str]:
    """Top-level module -> the first file importing it (absolute imports only)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "specscope").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                found.setdefault(n.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = _requirement_names(meta["dependencies"])
    optional = {extra: _requirement_names(r) for extra, r in
                meta["optional-dependencies"].items() if extra != "test"}
    dists = packages_distributions()
    missing = []
    for module, where in _imported_top_levels().items():
        if module in sys.stdlib_module_names or module in ("specscope", "__future__"):
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if names & runtime or any(names & o for o in optional.values()):
            continue
        missing.append(f"{module} (imported in {where}; distribution {sorted(names)})")
    assert not missing, "undeclared runtime imports: " + "; ".join(missing)
    assert optional["cuda"] == {"triton"}
