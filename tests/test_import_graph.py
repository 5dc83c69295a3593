"""The package's import graph: no cycles between its parts, and `parallel/` never imports `attention/` or `cp/` code.

A part is a subpackage (`attention`, `cp`, `parallel`, ...) or a top-level module (`module`, `loss`, ...).
Every `import lightning_ffpa...` statement counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_ffpa"
# The old import path `lightning_ffpa.parallel.context_parallel` re-exports `lightning_ffpa.cp` (docs used it).
REEXPORTS = {("parallel/context_parallel.py", "cp")}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def part_graph() -> dict[str, set[str]]:
    """{part: parts it imports}, re-export modules left out."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src, rel = _part(path), str(path.relative_to(PACKAGE))
        graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != "lightning_ffpa" or len(parts) < 2:
                    continue
                dst = parts[1]
                if (PACKAGE / dst).is_dir() or (PACKAGE / f"{dst}.py").exists():
                    if dst != src and (rel, dst) not in REEXPORTS:
                        graph[src].add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_parts_import_each_other_without_cycles():
    graph = part_graph()
    assert {"attention", "cp", "parallel", "_compat", "module"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_parallel_imports_no_attention_code():
    graph = part_graph()
    assert not graph["parallel"] & {"attention", "cp", "callbacks", "module"}, graph["parallel"]
    assert not graph["attention"] & {"cp", "parallel", "callbacks"}, graph["attention"]
    assert graph["_compat"] == set(), graph["_compat"]  # the ground floor


def test_a_planted_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
