"""The house reads at a glance: service/ by role with no import circle, short docs, a short README.

These hold what a restructuring set, so that later work cannot undo it silently:
- no import circle among service/'s modules, counting imports inside functions
  (only those under ``TYPE_CHECKING``, and reading the package's ``__version__``,
  are left out: neither runs an import at run time that could meet a half-built module);
- at most 8 loose modules at service/'s top besides ``__init__.py``, every other
  piece in a role's folder whose ``__init__`` docstring says what runs there;
- every page in docs/ at most 400 lines, and README.md at most 12,000 bytes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
MAX_LOOSE_MODULES = 8
MAX_DOC_LINES = 400
MAX_README_BYTES = 12_000


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(SERVICE.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _target(name: str) -> str | None:
    """The service module ``name`` loads: itself, or the nearest package above it that exists."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def imports_of(name: str) -> set[str]:
    """The service modules ``name`` imports anywhere in its body, outside ``if TYPE_CHECKING:``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(t for alias in child.names if (t := _target(alias.name)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                for alias in child.names:
                    if base == "service" and alias.name == "__version__":
                        continue
                    # ``from package import module`` imports the module; ``import name`` its package.
                    full = f"{base}.{alias.name}"
                    target = _target(full) if full in MODULES else _target(base)
                    if target is not None:
                        found.add(target)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, edges_of_root in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(edges_of_root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_one_through_an_import_inside_a_function() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_service() -> None:
    graph = {name: imports_of(name) for name in MODULES}
    found = circles(graph)
    detail = "; ".join(
        " / ".join(f"{m} -> {sorted(graph[m] & set(component))}" for m in component) for component in found
    )
    assert not found, f"import circles in service/: {detail}. Move the shared piece down a layer."


def test_service_keeps_few_loose_modules_and_each_role_folder_says_what_runs_there() -> None:
    loose = sorted(path.name for path in SERVICE.glob("*.py") if path.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, f"service/ has {len(loose)} loose modules: {loose}"
    for folder in sorted(p for p in SERVICE.iterdir() if p.is_dir() and not p.name.startswith("__")):
        init = folder / "__init__.py"
        assert init.is_file(), f"service/{folder.name} is a role without an __init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert docstring and len(docstring.split()) >= 8, (
            f"service/{folder.name}/__init__.py: say what runs there"
        )


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_is_short(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_DOC_LINES, f"docs/{page.name} has {lines} lines: split it by topic"


def test_the_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes: move detail to docs/"
