"""The user's own source files as the user-code scan (:mod:`.user_code`) reads them: each
parsed once, with what its imports bind, and which folders on ``sys.path`` hold the user's
code rather than the interpreter's or an installed package's.
"""

from __future__ import annotations

import ast
import os
import sys

LIBRARY_FOLDERS = ("site-packages", "dist-packages")


class Module:
    """One file of the user's: its imports (alias -> full name), functions and classes."""

    def __init__(self, name: str, path: str, source: str, is_package: bool):
        self.name, self.path, self.source, self.is_package = name, path, source, is_package
        self.tree = tree = ast.parse(source, path)
        self.imports: dict[str, str] = {}
        self.functions: dict[str, ast.AST] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
        pending = list(tree.body)  # imports at module level, in an if or a try included
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.update(imported_names(node, self))
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                pending.extend(ast.iter_child_nodes(node))


def imported_names(node, module: Module) -> dict[str, str]:
    """alias -> full dotted name of what an import statement binds."""
    names = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                names[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                names[top] = top
        return names
    base = node.module or ""
    if node.level:  # relative to the importing module's package
        anchor = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
        anchor = [part for part in anchor[:len(anchor) - (node.level - 1)] if part]
        base = ".".join(anchor + ([base] if base else []))
    for alias in node.names:
        if alias.name != "*":
            names[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return names


def walk_skipping_isolated(nodes, isolated):
    """``ast.walk`` of ``nodes``, without entering a nested function decorated with ``isolated``."""
    pending = list(nodes)
    while pending:
        current = pending.pop()
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)) and isolated(current):
            continue
        yield current
        pending.extend(ast.iter_child_nodes(current))


def own_folders(paths) -> list[str]:
    """The folders of ``paths`` that hold the user's code, not the interpreter's or an
    installed package's."""
    prefixes = {os.path.realpath(prefix) for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found = []
    for path in paths:
        real = os.path.realpath(path or os.curdir)
        if (os.path.isdir(real) and not any(folder in real for folder in LIBRARY_FOLDERS)
                and not any(real == prefix or real.startswith(prefix + os.sep) for prefix in prefixes)):
            found.append(real)
    return found
