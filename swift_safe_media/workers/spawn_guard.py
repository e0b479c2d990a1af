"""Spawned workers re-run the main script: one without ``if __name__ == "__main__":``
around its DataLoader would start workers again in each worker, and the parent waits
for ever (CPython's spawn and forkserver both import the main module in the child).

Before a DataLoader starts workers by spawn or forkserver, the main thread's frame in
the main script's module code is looked up; if the statement it is running is not
inside a ``__name__ == "__main__"`` test, a child would run it again. That DataLoader
then forks its workers, as stock PyTorch does on Linux, and one warning names the
script and the line (chosen over an error: the script ran before protection was on,
and protection still bounds every decode; only the workers' start method changes).
The check is row 6 of the decision as each DataLoader starts its workers
(:mod:`.start_method`), with its twin, :func:`main_unreachable`: a child that cannot import
the main module at all (``python -`` names it ``<stdin>``, no file to run), or that needs
the dataset's class from a main module without a file (``python -c``, the interactive
interpreter, a notebook cell), or one a script defines only under ``if __name__ ==
"__main__":`` or by exec (a notebook cell exec'd into ``__main__``), would die as it
starts; such a DataLoader forks its workers too, as stock PyTorch does.
"""

from __future__ import annotations

import ast
import functools
import io
import logging
import multiprocessing
import os
import pickle
import pickletools
import sys
import threading
import types

log = logging.getLogger("swift_safe_media")

RERUN_BY_CHILDREN = ("spawn", "forkserver")


def unguarded_main_statement(imports_are_harmless: bool = False) -> tuple[str, int] | None:
    """(script, line) when the main script's module code is running a statement that a
    spawned child would run again; None when it is guarded, finished, or not a file (or,
    with ``imports_are_harmless``, an import: a child re-running it finds it done)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None  # python -c, the REPL: nothing is re-run (console scripts have no .py: still checked)
    frame = sys._current_frames().get(threading.main_thread().ident)
    # The script's own module code: not code exec'd in its namespace (a notebook cell run by
    # exec(compile(cell, "<ipython-input-1>", "exec"), vars(__main__))), whose lines are the cell's.
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
                                     and _same_file(frame.f_code.co_filename, path)):
        frame = frame.f_back
    if frame is None:
        return None  # its module code has finished: a child's re-run stops short of this
    line = frame.f_lineno
    if _is_guarded(path, line) or (imports_are_harmless and line in _import_lines(path)):
        return None
    return path, line


def main_unreachable(pickled, main_names=frozenset) -> str | None:
    """Why a spawned or forkserver child could not have what it needs of the main module,
    or None: the main module names a file that is not one (``python -`` names it
    ``<stdin>``: CPython's child tries to run it and dies); or it is a file (or a module
    run with ``-m``) whose top level, imported as ``__mp_main__``, does not define a class
    or function of ``__main__`` that ``main_names()`` (their qualified names, as
    :func:`pickle_noting_main` notes them) says the dataset needs: one defined under
    ``if __name__ == "__main__":``, or by code exec'd in its namespace (a notebook cell);
    or it has no file (``-c``, the REPL, a notebook) and ``pickled()`` (the dataset,
    collate_fn and worker_init_fn, as pickle writes them; None if they do not pickle)
    names something defined there, which a child cannot find. ``pickled`` is called only
    in that last case."""
    main = sys.modules.get("__main__")
    named = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if path and not named and not os.path.isfile(path):
        return f"the main script is {path}, which a child cannot run"
    if named or path:
        missing = sorted(_not_defined_on_import(path, main_names()))
        if missing:
            return (f"the DataLoader's dataset, collate_fn or worker_init_fn needs {', '.join(missing)} of the main "
                    f"module, which a child importing {path} does not get (defined under `if __name__ == "
                    f"\"__main__\":`, or by exec as a notebook cell is)")
        return None
    data = pickled()
    if data is not None and _names_main(data):
        return ("the DataLoader's dataset, collate_fn or worker_init_fn is defined in a main module without a "
                "file (python -c, stdin, the interactive interpreter, a notebook cell), which a child cannot import")
    return None


def main_as_told() -> str | None:
    """How CPython tells a child to import this process's main module (``path:FILE`` or
    ``module:NAME``), or None (it tells nothing: ``-c``, the interactive interpreter)."""
    from multiprocessing import spawn

    told = spawn.get_preparation_data("swift-safe-media-child")
    if "init_main_from_name" in told:
        return f"module:{told['init_main_from_name']}"
    if "init_main_from_path" in told:
        return f"path:{told['init_main_from_path']}"
    return None


def import_main(main: str | None) -> None:
    """In a child prepared without it: import the parent's main module (:func:`main_as_told`)
    as CPython's spawn does (as ``__mp_main__``, under ``__name__ != "__main__"``); a child
    forked from here then finds it imported and skips it. A failure is left to what needs it."""
    if not main:
        return
    from multiprocessing import spawn

    kind, _, name = main.partition(":")
    current = multiprocessing.current_process()
    current._inheriting = True  # as CPython marks a child preparing: it must not start processes
    try:
        if kind == "module":
            spawn._fixup_main_from_name(name)
        else:
            spawn.import_main_path(name)
    except (Exception, SystemExit) as exc:
        log.debug("swift_safe_media: %s could not import %s: %r", current.name, name, exc)
    finally:
        del current._inheriting


# Types whose pickle succeeds, names nothing of ``__main__``, and can be gigabytes: the check
# writes a stand-in for each (``_stands_in``) rather than a copy of its data. Plain pickle copies
# a tensor's whole storage (twice, through ``torch.save``), where the workers' own pickler
# shares it: a dataset of tensors, or LLaMA-Factory's collator holding the model, cost the
# trainer that much memory and time at every start of its workers. (Not tokenizers: one with a
# component written in Python cannot be pickled, which the check must see.)
PLAIN_DATA_TYPES = frozenset({
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("numpy", "ndarray"),  # without Python objects inside (dtype.hasobject)
})


def _stands_in(obj) -> bool:
    kind = type(obj)
    if (kind.__module__, kind.__qualname__) not in PLAIN_DATA_TYPES:
        return False
    if kind.__module__ == "numpy":
        return not obj.dtype.hasobject
    if kind.__qualname__ in ("Tensor", "Parameter"):
        return not vars(obj)  # attributes set on a tensor are pickled as before (its storage stands in)
    return True


def pickle_noting_main(value) -> tuple[bytes, frozenset[str]]:
    """``pickle.dumps(value)`` with a stand-in for each array and tensor
    (:data:`PLAIN_DATA_TYPES`), and the qualified names of the classes and functions of
    ``__main__`` it refers to (pickled by name: a child must find them in its main module).
    The bytes are for reading (:func:`_names_main`), not for loading."""
    names: set[str] = set()

    class Noting(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
                names.add(obj.__qualname__)
            elif _stands_in(obj):
                return bytes, ()
            return NotImplemented

    buffer = io.BytesIO()
    Noting(buffer, pickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue(), frozenset(names)


def _not_defined_on_import(path: str | None, qualnames) -> set[str]:
    """Of ``qualnames``, those whose top-level name the script at ``path`` does not bind
    when imported as ``__mp_main__`` (none when that cannot be told)."""
    bound = _bound_on_import(path) if path and qualnames else None
    return set() if bound is None else {name for name in qualnames if name.split(".")[0] not in bound}


def _same_file(code_file: str, path: str) -> bool:
    return code_file == path or os.path.realpath(code_file) == os.path.realpath(path)


@functools.lru_cache(maxsize=8)
def _bound_on_import(path: str) -> frozenset[str] | None:
    """The names the script's top level binds outside its ``__name__ == "__main__"``
    branches; None if unreadable, or if a star import leaves them unknown."""
    tree = _script_tree(path)
    if tree is None:
        return None
    names: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If):
            branch = _main_branch(node)  # a child runs the other branch of a main guard, or both of another test
            if branch is None:
                pending += node.body + node.orelse
            else:
                pending += node.orelse if branch is node.body else node.body
        elif isinstance(node, (ast.Try, ast.For, ast.While, ast.With)):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            pending += [statement for handler in getattr(node, "handlers", ()) for statement in handler.body]
            if isinstance(node, ast.For):
                names.update(_targets(node.target))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", None) or [node.target]:
                names.update(_targets(target))
    return frozenset(names)


def _targets(target) -> set[str]:
    return {node.id for node in ast.walk(target) if isinstance(node, ast.Name)}


def may_name_main(pickled: bytes) -> bool:
    """Whether a pickle may refer to a global of ``__main__``: one that does holds the string
    (a bytes search, no pass over its opcodes; :func:`_names_main` reads them)."""
    return b"__main__" in pickled


def _names_main(pickled: bytes) -> bool:
    """Whether a pickle refers to a global of ``__main__`` (GLOBAL ``__main__ name``, or the
    module string STACK_GLOBAL reads)."""
    try:
        return any(isinstance(argument, str) and (argument == "__main__" or argument.startswith("__main__ "))
                   for _, argument, _ in pickletools.genops(pickled))
    except Exception:  # unreadable: take it to name main (forking is stock's own way)
        return True


@functools.lru_cache(maxsize=8)
def _script_tree(path: str) -> ast.Module | None:
    """The script's syntax tree, read once for every question asked of it; None if unreadable."""
    try:
        with open(path, "rb") as source:
            return ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=8)
def _import_lines(path: str) -> frozenset[int]:
    """Lines of the script's top-level import statements (a hook such as ours may run
    inside one: the start-up hook enables protection as the host is imported)."""
    tree = _script_tree(path)
    if tree is None:
        return frozenset()
    return frozenset(line for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                     for line in range(node.lineno, node.end_lineno + 1))


@functools.lru_cache(maxsize=8)
def _main_guards(path: str) -> tuple[tuple[int, int], ...] | None:
    """Line ranges of the script that run only as ``__main__``; None if unreadable."""
    tree = _script_tree(path)
    if tree is None:
        return None
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            branch = _main_branch(node)
            if branch:
                ranges.append((branch[0].lineno, branch[-1].end_lineno))
    return tuple(ranges)


def _main_branch(node: ast.If) -> list | None:
    """The branch of ``if __name__ == "__main__"`` (or ``!=``'s else) that runs as main."""
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and len(test.comparators) == 1):
        return None
    sides = {_name_or_text(test.left), _name_or_text(test.comparators[0])}
    if sides != {"__name__", "'__main__'"}:
        return None
    if isinstance(test.ops[0], ast.Eq):
        return node.body
    if isinstance(test.ops[0], ast.NotEq):
        return node.orelse
    return None


def _name_or_text(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return repr(node.value)
    return None


def _is_guarded(path: str, line: int) -> bool:
    guards = _main_guards(path)
    if guards is None:
        return True  # cannot tell: leave the user's start method alone
    return any(first <= line <= last for first, last in guards)


# Calls a script may make at its top level and still count as only defining things: paths,
# the environment, loggers, warning filters, typing helpers, builtin conversions (by the
# name called).
_DEFINING_CALLS = frozenset({
    "Path", "resolve", "absolute", "join", "dirname", "abspath", "realpath", "basename", "expanduser",
    "getenv", "get", "setdefault", "insert", "append", "extend",
    "getLogger", "setLevel", "basicConfig", "filterwarnings", "simplefilter",
    "TypeVar", "NewType", "namedtuple", "compile",
    "str", "int", "float", "bool", "tuple", "list", "dict", "set", "frozenset",
})


@functools.lru_cache(maxsize=8)
def only_imports_and_defines(path: str) -> bool:
    """Whether importing the script runs nothing but imports and definitions: at its top
    level only imports, functions and classes (decorated or not), docstrings, assignments
    and calls that only make paths, read the environment, set up logging or warnings
    (``_DEFINING_CALLS``), ``try`` and plain ``if`` blocks of the same, and what runs under
    ``if __name__ == "__main__":``. Every spawned or forkserver child imports such a script
    anyway; anything else (another call, a loop, a ``with``) might be training code, and it
    is False. False too if unreadable."""
    tree = _script_tree(path)
    return tree is not None and _only_defines(tree.body)


def definitions_of(path: str) -> ast.Module | None:
    """The script's top level without what does work (see :func:`only_imports_and_defines`):
    what a process that needs only its functions and classes runs of it. None if unreadable."""
    tree = _script_tree(path)
    if tree is None:
        return None
    # A `__name__ == "__main__"` test stays: run as __mp_main__, its main branch does not run.
    return ast.Module(body=[node for node in tree.body if _only_defines([node])], type_ignores=[])


def _only_defines(statements) -> bool:
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Pass)):
            continue
        if isinstance(node, ast.Expr) and (isinstance(node.value, ast.Constant) or (
                isinstance(node.value, ast.Call) and _calls_only_defining(node.value))):
            continue  # a docstring, sys.path.insert(...), warnings.filterwarnings(...)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if node.value is None or _calls_only_defining(node.value):
                continue
            return False
        if isinstance(node, ast.If):
            branch = _main_branch(node)
            if branch is not None:  # runs as __main__ only; the other branch runs in children
                if _only_defines(node.orelse if branch is node.body else node.body):
                    continue
                return False
            if _calls_only_defining(node.test) and _only_defines(node.body) and _only_defines(node.orelse):
                continue
            return False
        if isinstance(node, ast.Try):
            if (_only_defines(node.body) and all(_only_defines(handler.body) for handler in node.handlers)
                    and _only_defines(node.orelse) and _only_defines(node.finalbody)):
                continue
            return False
        return False
    return True


def _calls_only_defining(expression) -> bool:
    for node in ast.walk(expression):
        if isinstance(node, ast.Call):
            callee = node.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", None)
            if name not in _DEFINING_CALLS:
                return False
        elif isinstance(node, (ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)):
            return False
    return True


def start_method(loader) -> str:
    context = loader.multiprocessing_context
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()
    return context if isinstance(context, str) else context.get_start_method()
