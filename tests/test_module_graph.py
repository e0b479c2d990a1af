"""The package's modules import each other without cycles and in one direction (the core
never up into the host adapters), none outgrows one concern (at most ``MAX_MODULE_LINES``
lines), and no function is longer than ``MAX_FUNCTION_LINES``.

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
    assert "swift_safe_media.engine.calls" in graph and graph["swift_safe_media"], graph
    assert cycles(graph) == []


MAX_MODULE_LINES = 400


def test_no_module_is_over_the_line_limit():
    long = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    long = {name: lines for name, lines in long.items() if lines > MAX_MODULE_LINES}
    assert not long, f"split these by concern (at most {MAX_MODULE_LINES} lines): {long}"


# Imports flow one way (docs/how-it-works.md#layout): the core never imports a host
# adapter, the checks or the activation layer; adapters import the core, and the layer on
# top (activation, cli, demo, checks) imports both.
CORE = ("engine", "confinement", "workers", "records", "patching", "decoders",
        "config", "settings_registry", "errors", "process", "logs", "_moved")
ABOVE_THE_CORE = ("hosts", "checks", "activation", "cli", "demo")


def _in(module: str, parts) -> bool:
    return any(module == f"swift_safe_media.{part}" or module.startswith(f"swift_safe_media.{part}.")
               for part in parts)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """core module -> what it imports from above the core (the package's ``__init__`` included)."""
    found = {}
    for module, targets in graph.items():
        if _in(module, CORE):
            upward = {target for target in targets
                      if _in(target, ABOVE_THE_CORE) or target == "swift_safe_media"}
            if upward:
                found[module] = upward
    return found


def test_the_core_never_imports_up_into_the_adapters():
    graph = import_graph()
    assert {"swift_safe_media.engine.pool", "swift_safe_media.hosts.swift.adapter"} <= set(graph)
    assert upward_imports(graph) == {}


def test_an_upward_import_is_found():
    graph = {"swift_safe_media.workers.start": {"swift_safe_media.hosts.lerobot.adapter"},
             "swift_safe_media.hosts.lerobot.adapter": {"swift_safe_media.workers.start"}}
    assert upward_imports(graph) == {"swift_safe_media.workers.start": {"swift_safe_media.hosts.lerobot.adapter"}}


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in sorted(PACKAGE.glob("*/**/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(docstring.split()) >= 20, f"{init.relative_to(PACKAGE.parent)}: say what it owns"


MAX_FUNCTION_LINES = 60


def long_functions(package: pathlib.Path = PACKAGE) -> dict[str, int]:
    """'module:function' -> its lines (decorators, docstring and body), for every function
    or method over ``MAX_FUNCTION_LINES``."""
    long = {}
    for name, path in module_names(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    long[f"{name}:{node.name}"] = node.end_lineno - first + 1
    return long


def test_no_function_is_over_the_line_limit():
    long = long_functions()
    assert not long, f"split these (at most {MAX_FUNCTION_LINES} lines a function): {long}"


def test_a_long_function_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("def short():\n    return 1\n")
    (package / "long.py").write_text("def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(package) == {"pkg.long:long": MAX_FUNCTION_LINES + 1}


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


if __name__ == "__main__":
    graph = import_graph(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE)
    for module in sorted(graph):
        print(module, "->", ", ".join(sorted(graph[module])))
    print("cycles:", cycles(graph) or "none")
