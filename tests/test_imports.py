"""No import cycles in src/: the graph of module-level imports between treedraft modules is acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import treedraft

SRC = Path(treedraft.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run when the module is imported (not in functions, not under TYPE_CHECKING)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def import_graph() -> dict[str, set[str]]:
    """treedraft module -> the treedraft modules (and sub-packages) it imports at module level."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                base = ".".join(p for p in (base, node.module or "") if p)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in [t for t in targets if t in files]:
                # importing a.b.c runs the __init__ of a.b first (the root package excepted: it always
                # runs first, and a package's own modules do not re-enter their package's __init__)
                parts = t.split(".")
                for pkg in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):
                    if pkg in files and pkg != mod and not mod.startswith(pkg + "."):
                        deps.add(pkg)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (c := visit(d)) is not None:
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None


def test_module_level_imports_are_acyclic() -> None:
    graph = import_graph()
    assert {"treedraft.api", "treedraft.engine", "treedraft.drafters.registry"} <= set(graph)
    assert "treedraft.interfaces" in graph["treedraft.drafters.medusa"]  # the resolver sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_drafters_and_training_do_not_import_the_api_or_the_engine() -> None:
    graph = import_graph()

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            for d in graph[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    for mod in graph:
        if mod.startswith(("treedraft.drafters", "treedraft.training")) and mod != "treedraft.training.cli":
            assert "treedraft.api" not in reach(mod), mod
            assert "treedraft.engine" not in reach(mod), mod
