"""The layout is what docs/architecture.md says: the import contracts of pyproject.toml hold (import-
linter), no module imports itself through others, the engines root keeps only what every room imports,
and product files stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("container", "handlers", "engines", "djl_python")
# what every room imports; a module more belongs in a room (docs/architecture.md)
ENGINES_ROOT = {"__init__.py", "config.py", "devices.py", "dist.py", "protocol.py", "sampling_params.py", "spec.py"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# a Triton kernel is one function: its body is what one program instance runs, split it and it is slower
LONG_FUNCTIONS_ALLOWED = {"engines/kernels/paged_attention.py:_paged_attention_kernel"}


def test_the_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)  # pyproject.toml's [tool.importlinter]
    configuration.configure()  # as the lint-imports command does
    assert lint_imports(cache_dir=None, no_logo=True), "an import contract is broken: run `lint-imports` for the chain"


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Groups of modules that import one another, directly or not (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def test_no_module_imports_itself_through_others(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert [g for g in strongly_connected(graph) if len(g) > 1] == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert [g for g in strongly_connected(graph) if len(g) > 1] == [["p.a", "p.b", "p.c"]]


def test_the_engines_root_keeps_only_what_every_room_imports():
    assert {p.name for p in (ROOT / "engines").glob("*.py")} == ENGINES_ROOT


def test_no_product_file_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT)): n for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_product_function_is_longer_than_the_limit():
    long = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.add(f"{path.relative_to(ROOT)}:{node.name}")
    assert long == LONG_FUNCTIONS_ALLOWED
