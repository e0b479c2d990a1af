"""The package's modules import each other without cycles, and none outgrows one
concern (at most ``MAX_MODULE_LINES`` lines).

The graph is read from the source (the AST), imports inside functions included: a
lazy import that only hides a cycle from the interpreter is still a cycle for the
reader. ``from . import name`` counts as an import of the submodule ``name`` when
there is one, else of the package itself. Run as a script to print the graph.
"""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "swift_safe_media"


def module_names(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its source)."""
    modules = module_names(package)
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(target for target in targets if target in modules and target != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_imports_without_cycles():
    graph = import_graph()
    assert "swift_safe_media.engine" in graph and graph["swift_safe_media"], graph
    assert cycles(graph) == []


MAX_MODULE_LINES = 400


def test_no_module_is_over_the_line_limit():
    long = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    long = {name: lines for name, lines in long.items() if lines > MAX_MODULE_LINES}
    assert not long, f"split these by concern (at most {MAX_MODULE_LINES} lines): {long}"


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


if __name__ == "__main__":
    graph = import_graph(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE)
    for module in sorted(graph):
        print(module, "->", ", ".join(sorted(graph[module])))
    print("cycles:", cycles(graph) or "none")
