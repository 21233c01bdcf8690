"""The map of lab/: imports point one way (README "Layout"), and there are no import cycles."""

import ast
from pathlib import Path

import pytest

from lab.paths import REPO_ROOT

LAB = REPO_ROOT / "lab"
LEAVES = {"lab.cli", "lab.dtypes", "lab.paths", "lab.units"}
# subpackage -> the other parts of lab it may import (besides itself and the leaf modules)
ALLOWED = {
    "kernels": set(),
    "accounting": set(),
    "model": {"kernels"},
    "measure": set(),
    "parallel": {"measure", "accounting"},
    "recipes": {"kernels", "model", "measure", "parallel", "accounting"},
    "bench": {"kernels", "model", "measure", "parallel", "accounting", "recipes"},
    "book": {"kernels", "model", "measure", "parallel", "accounting", "recipes", "bench"},
}


def _lab_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lab"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("lab"))
    return names


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_subpackage_imports_point_down(package):
    bad = []
    for path in sorted((LAB / package).rglob("*.py")):
        for name in _lab_imports(path):
            part = _part(name)
            if part is None or part == package:
                if part is None and name not in LEAVES and name != "lab" and not name.startswith(tuple(LEAVES)):
                    bad.append((path.name, name))
                continue
            if part not in ALLOWED[package]:
                bad.append((path.name, name))
    assert not bad, f"lab.{package} may import only {sorted(ALLOWED[package]) or 'nothing else in lab'}: {bad}"


def test_leaf_modules_import_nothing_from_lab():
    for leaf in LEAVES:
        path = LAB / (leaf.split(".")[1] + ".py")
        assert not _lab_imports(path), leaf


def test_every_subpackage_says_what_it_owns_and_may_import():
    for package in ALLOWED:
        doc = ast.get_docstring(ast.parse((LAB / package / "__init__.py").read_text()))
        assert doc and "May import" in doc, package


def test_no_module_is_much_longer_than_one_concept():
    long = [(str(p.relative_to(LAB)), n) for p in LAB.rglob("*.py") if (n := len(p.read_text().splitlines())) > 460]
    assert not long, f"modules over ~450 lines (split them by concept): {long}"
