"""The map of lab/: imports point one way (README "Layout"), there are no import cycles, and lab's own
imports sit at the top of a module (a function-level import only for an optional dependency)."""

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
    """Leaves import nothing from lab but the root package, whose own imports are torch and the standard library."""
    for leaf in LEAVES:
        path = LAB / (leaf.split(".")[1] + ".py")
        assert _lab_imports(path) <= {"lab"}, leaf
    assert not _lab_imports(LAB / "__init__.py")


def test_every_subpackage_says_what_it_owns_and_may_import():
    for package in ALLOWED:
        doc = ast.get_docstring(ast.parse((LAB / package / "__init__.py").read_text()))
        assert doc and "May import" in doc, package


def test_no_module_is_much_longer_than_one_concept():
    long = [(str(p.relative_to(LAB)), n) for p in LAB.rglob("*.py") if (n := len(p.read_text().splitlines())) > 460]
    assert not long, f"modules over ~450 lines (split them by concept): {long}"


# --- the import graph, from the AST: top-level and function-level imports alike ---------------------------

#: The comment an allowed function-level import carries (on its line or the line above): it imports a module
#: that needs an optional dependency (Triton, Linux only), which ``import lab`` must work without.
OPTIONAL = "optional dependency"


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {_module_name(p): p for p in LAB.rglob("*.py")}


def _resolve(name: str) -> str:
    """The lab module an imported name lives in: ``lab.measure.step.MODES`` -> ``lab.measure.step``."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path):
    """Every import of a lab module in ``path``: (node, resolved modules, at module top)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lab":
            found = {_resolve(f"{node.module}.{a.name}") for a in node.names}
        elif isinstance(node, ast.Import):
            found = {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "lab"}
        else:
            continue
        if found:
            yield node, found, id(node) in top


def _graph() -> dict[str, set[str]]:
    return {name: {m for _, found, _ in _imports(path) for m in found} - {name} for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _triton_modules() -> set[str]:
    """lab modules that import Triton, directly or through the lab modules they import at their top."""
    direct = set()
    edges = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names):
                direct.add(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
                direct.add(name)
        edges[name] = {m for _, found, top in _imports(path) if top for m in found}
    needs, grew = set(direct), True
    while grew:
        grew = False
        for name, targets in edges.items():
            if name not in needs and targets & needs:
                needs.add(name)
                grew = True
    return needs


def test_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_lab_modules():
    cycles = _cycles(_graph())

    assert not cycles, f"import cycles in lab (move the shared code to the lower module): {cycles}"


def test_lab_imports_sit_at_the_top_of_a_module():
    optional = _triton_modules()
    assert {"lab.kernels.flash_triton", "lab.kernels.fused_cross_entropy"} <= optional
    found = set()
    for path in sorted(LAB.rglob("*.py")):
        lines = path.read_text().splitlines()
        rel = str(path.relative_to(LAB))
        for node, modules, top in _imports(path):
            if top:
                continue
            said = " ".join(lines[max(node.lineno - 2, 0):node.lineno])
            if modules <= optional and OPTIONAL in said:
                continue
            found.update((rel, module) for module in modules)
    late = sorted(found)
    assert not late, ("a lab import inside a function (move it to the top; if it hides a cycle, remove the "
                      f"cycle; for an optional dependency say '{OPTIONAL}' in a comment): {late}")


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path in sorted(LAB.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node, _, _ in _imports(path):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{path.relative_to(LAB)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
                aliases.update({a.asname or a.name: node.module for a in node.names})
            else:
                aliases.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(LAB)}: {node.value.id}.{node.attr}")
    assert not bad, f"imports of another module's private names (make them public with a docstring): {bad}"


# --- one place per chapter ----------------------------------------------------------------------------------

#: notebook -> the lab.book package that holds its experiments and presentation
CHAPTERS = {"01_profiling": "profiling", "02_mixed_precision": "precision", "03_memory": "memory",
            "04_attention": "attention", "05_flash": "flash", "06_communication": "communication", "07_ddp": "ddp",
            "08_sharding": "sharding", "09_accounting": "accounting", "10_fastest_step": "fastest"}


def test_every_notebook_has_one_chapter_package_and_its_tests():
    notebooks = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert notebooks == sorted(CHAPTERS)
    packages = sorted(p.name for p in (LAB / "book").iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(CHAPTERS.values())
    for notebook, chapter in CHAPTERS.items():
        assert (LAB / "book" / chapter / "present.py").exists(), chapter
        assert ast.get_docstring(ast.parse((LAB / "book" / chapter / "__init__.py").read_text())), chapter
        assert list((REPO_ROOT / "tests" / "book" / chapter).glob("test_*.py")), chapter
        used = {m.split(".")[2] for m in _lab_imports(REPO_ROOT / "notebooks" / f"{notebook}.py")
                if m.startswith("lab.book.") and m.split(".")[2] in CHAPTERS.values()}
        assert chapter in used, f"{notebook} does not use lab.book.{chapter}"


def test_only_the_book_and_its_command_lines_import_the_book():
    importers = {name for name, path in MODULES.items() if not name.startswith("lab.book")
                 for _, found, _ in _imports(path) if any(m.startswith("lab.book") for m in found)}
    assert importers <= {"lab.render", "lab.fastest"}, importers


def test_the_book_stays_smaller_than_the_engine_it_presents():
    """Chapters state claims as data and one module says them: the book's code stays within 6,000 lines."""
    lines = sum(len(p.read_text().splitlines()) for p in (LAB / "book").rglob("*.py"))
    assert lines <= 6000, f"lab/book has {lines:,} lines"


#: Chapters that still import another, until what they share moves into the engine (this set only shrinks).
NOT_YET_SIBLINGS: set[tuple[str, str]] = set()


def test_chapters_are_siblings():
    """No chapter imports another: what two chapters share lives in the engine or in the book's core."""
    chapters = set(CHAPTERS.values())
    bad = []
    for path in sorted((LAB / "book").rglob("*.py")):
        own = path.relative_to(LAB / "book").parts[0]
        if own not in chapters:
            continue
        for _, found, _ in _imports(path):
            bad += [(str(path.relative_to(LAB)), m) for m in found
                    if m.startswith("lab.book.") and m.split(".")[2] in chapters - {own}
                    and (own, m.split(".")[2]) not in NOT_YET_SIBLINGS]
    assert not bad, f"chapters import each other (move what they share into lab's engine): {bad}"
