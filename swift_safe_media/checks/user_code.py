"""Never silent about user code: the media openers a training script's DataLoader reaches
and ``enable()`` does not bound (:mod:`.openers`), found mechanically in its source.

What is read, as the ms-swift template scan reads templates (``ast``, never running
anything): the script, and the modules of its own it imports (files beside the script,
or in a folder on ``sys.path`` that holds no installed package: :mod:`.source_files`).
The entry points are the methods a DataLoader calls on a dataset (``__getitem__``,
``__getitems__``, ``__iter__``, ``__next__``, ``__len__``) and its ``__init__`` (where a
video dataset often opens every clip to index it), of every class there deriving from torch's ``Dataset`` or
``IterableDataset``, or handed to a ``DataLoader(...)`` call, and every function passed as
``collate_fn=`` or ``worker_init_fn=`` (a name, ``functools.partial(f, ...)``, a lambda,
an instance of a class with ``__call__``). From each, calls are followed into
the functions and methods those files define (``self.load(...)``, a helper imported
from a module beside the script, an import inside the function) up to ``MAX_DEPTH``
calls deep; a function decorated with ``@swift_safe_media.isolated`` runs in a sandbox
already and is not entered.

``enable()`` runs it once, in the process that starts the run (rank 0's in a distributed
run; never in a DataLoader worker), and logs one warning per call site (:func:`warn_unbounded_openers`);
``swift-safe-media doctor --script train.py`` prints the same list before a run. It fails
open: a file that cannot be read or parsed is skipped, and any error ends the scan with a
debug line.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import time

from .. import process
from .openers import ISOLATED, Finding, opener
from .source_files import LIBRARY_FOLDERS, Module, imported_names, own_folders, walk_skipping_isolated

log = logging.getLogger("swift_safe_media")

MAX_DEPTH = 6  # calls followed from an entry point
MAX_FILES = 50  # of the user's own modules read per scan
DATASET_BASES = ("Dataset", "IterableDataset")
# What a DataLoader calls on a dataset, and what builds it (a video dataset often opens
# every clip to index its frames): a hang in either stalls the run.
DATASET_METHODS = ("__getitem__", "__getitems__", "__iter__", "__next__", "__len__", "__init__")
LOADER_FUNCTIONS = ("collate_fn", "worker_init_fn")


class Scan:
    """One scan from one script: the files read, what has been followed, what was found."""

    def __init__(self, script: str, root: str | None = None, extra_roots=(), name: str = ""):
        self.script, self.name = os.path.abspath(script), name  # name: "pkg.train" under python -m
        self.root = os.path.abspath(root or os.path.dirname(self.script))
        # Where the user's own modules are: the script's folder first, then (enable()) the
        # folders on sys.path that hold no installed package (PYTHONPATH, an editable src/).
        self.roots = list(dict.fromkeys([self.root, *map(os.path.abspath, extra_roots)]))
        self._local: dict[str, Module | None] = {}  # dotted name -> its file, once
        self._looking: set[str] = set()  # names being looked up (modules that import each other)
        self._modules: dict[str, Module | None] = {}
        self._followed: dict[tuple[str, int], int] = {}  # function -> the least depth it was followed at
        self.findings: list[Finding] = []
        self._seen_sites: set[tuple[str, int, str]] = set()

    # -- files ---------------------------------------------------------------------------
    def _read(self, name: str, path: str, is_package: bool = False, strict: bool = False) -> Module | None:
        """The file parsed (None if it cannot be: ``strict`` raises instead)."""
        if path in self._modules:
            return self._modules[path]
        self._modules[path] = None
        if len(self._modules) > MAX_FILES:
            return None
        try:
            with open(path, encoding="utf-8") as source:
                self._modules[path] = Module(name, path, source.read(), is_package)
        except (OSError, SyntaxError, ValueError):  # UnicodeDecodeError is a ValueError
            if strict:
                raise
            log.debug("swift_safe_media: cannot read %s for the user-code scan", path, exc_info=True)
        return self._modules[path]

    def local_module(self, dotted: str) -> Module | None:
        """The user's own module ``dotted`` (a file beneath the script's folder), if any."""
        if not dotted or dotted.split(".")[0] == "swift_safe_media":
            return None  # this package bounds what it opens
        if dotted not in self._local:
            self._local[dotted] = None
            for root in self.roots:
                base = os.path.join(root, *dotted.split("."))
                for path, is_package in ((base + ".py", False), (os.path.join(base, "__init__.py"), True)):
                    if os.path.isfile(path):
                        self._local[dotted] = self._read(dotted, path, is_package)
                        return self._local[dotted]
        return self._local[dotted]

    def lookup(self, dotted: str):
        """(module, definition) for a full name that one of the user's files defines:
        ``pkg.mod.function``, ``pkg.mod.Class``, ``pkg.mod.Class.method``."""
        if dotted in self._looking:
            return None
        self._looking.add(dotted)
        try:
            parts = dotted.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                module = self.local_module(".".join(parts[:cut]))
                if module is not None:
                    return self.definition(module, parts[cut:])
            return None
        finally:
            self._looking.discard(dotted)

    def definition(self, module: Module, names: list[str]):
        if not names:
            return None
        if names[0] in module.functions and len(names) == 1:
            return module, module.functions[names[0]], None
        if names[0] in module.classes:
            cls = module.classes[names[0]]
            if len(names) == 1:
                return module, cls, None
            found = self.method(module, cls, names[1])
            return found if len(names) == 2 else None
        if names[0] in module.imports and module.imports[names[0]] != names[0]:
            return self.lookup(".".join([module.imports[names[0]], *names[1:]]))
        return None

    def method(self, module: Module, cls: ast.ClassDef, name: str, depth: int = 0):
        """(module, function, class) of ``cls.name``, from the class or its bases in the user's files."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node, cls
        if depth > 8:
            return None
        for base in cls.bases:
            found = self.resolve(module, base, {})
            if found is not None and isinstance(found[1], ast.ClassDef):
                inherited = self.method(found[0], found[1], name, depth + 1)
                if inherited is not None:
                    return inherited
        return None

    # -- names ---------------------------------------------------------------------------
    def full_name(self, module: Module, node, aliases: dict[str, str]) -> str | None:
        """``decord.VideoReader`` for ``de.VideoReader`` after ``import decord as de``."""
        if isinstance(node, ast.Name):
            if node.id in aliases:
                return aliases[node.id]
            if node.id in module.imports:
                return module.imports[node.id]
            if node.id in module.functions or node.id in module.classes:
                return f"{module.name}.{node.id}" if module.name else node.id
            return None
        if isinstance(node, ast.Attribute):
            base = self.full_name(module, node.value, aliases)
            return f"{base}.{node.attr}" if base else None
        return None

    def resolve(self, module: Module, node, aliases: dict[str, str], cls: ast.ClassDef | None = None):
        """(module, definition, owning class) that a callee expression names in the user's files."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            return self.method(module, cls, node.attr) if cls is not None else None
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "super" and cls is not None):
            for base in cls.bases:
                found = self.resolve(module, base, aliases)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    return self.method(found[0], found[1], node.attr)
            return None
        if isinstance(node, ast.Name) and node.id not in aliases:
            if node.id in module.functions:
                return module, module.functions[node.id], None
            if node.id in module.classes:
                return module, module.classes[node.id], None
        dotted = self.full_name(module, node, aliases)
        if dotted is None:
            return None
        if not module.name and "." in dotted and dotted.split(".")[0] in module.classes:
            return self.definition(module, dotted.split("."))
        return self.lookup(dotted)

    # -- following calls -----------------------------------------------------------------
    def follow(self, module: Module, function, cls, entry: str, depth: int = 0) -> None:
        key = (module.path, function.lineno, function.col_offset)
        if self._followed.get(key, MAX_DEPTH + 1) <= depth or depth > MAX_DEPTH or self._isolated(module, function):
            return
        self._followed[key] = depth  # followed again only from nearer an entry point (deeper calls were cut)
        aliases: dict[str, str] = {}  # what imports inside the function bind
        calls = []
        body = function.body if isinstance(function.body, list) else [function.body]  # a lambda's is one node
        for node in walk_skipping_isolated(body, lambda inner: self._isolated(module, inner)):
            if isinstance(node, ast.Call):
                calls.append(node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                aliases.update(imported_names(node, module))
        name = _qualified(function, cls)
        for call in sorted(calls, key=lambda call: (call.lineno, call.col_offset)):
            self._call(module, call, aliases, cls, name, entry, depth)

    def _call(self, module, call: ast.Call, aliases, cls, name: str, entry: str, depth: int) -> None:
        dotted = self.full_name(module, call.func, aliases)
        # A dataset's __init__ and __len__ run in the training process, where no decode is bounded.
        in_worker = not entry.endswith((".__init__", ".__len__"))
        found = opener(dotted, call, in_worker) if dotted else None
        if found is not None:
            site = (module.path, call.lineno, found)
            if site not in self._seen_sites:
                self._seen_sites.add(site)
                self.findings.append(Finding(module.path, call.lineno, name, found, entry))
            return
        target = self.resolve(module, call.func, aliases, cls)
        if target is None:
            return
        target_module, definition, owner = target
        if isinstance(definition, ast.ClassDef):  # an instance made: its __init__ runs now
            for method in ("__init__", "__post_init__"):
                found_method = self.method(target_module, definition, method)
                if found_method is not None:
                    self.follow(*found_method, entry, depth + 1)
            return
        self.follow(target_module, definition, owner, entry, depth + 1)

    def _isolated(self, module: Module, function) -> bool:
        for decorator in getattr(function, "decorator_list", ()):
            called = decorator.func if isinstance(decorator, ast.Call) else decorator
            if self.full_name(module, called, {}) in ISOLATED:
                return True
        return False

    # -- entry points --------------------------------------------------------------------
    def is_dataset(self, module: Module, cls: ast.ClassDef, depth: int = 0) -> bool:
        for base in cls.bases:
            dotted = self.full_name(module, base, {}) or ""
            if dotted.split(".")[-1] in DATASET_BASES and dotted.split(".")[0] == "torch":
                return True
            found = self.resolve(module, base, {})
            if (depth < 8 and found is not None and isinstance(found[1], ast.ClassDef)
                    and self.is_dataset(found[0], found[1], depth + 1)):
                return True
        return False

    def run(self, strict: bool = False) -> list[Finding]:
        """The findings, the script's first; ``strict``: a script that cannot be read or
        parsed raises (OSError, SyntaxError, ValueError) instead of giving none."""
        script = self._read(self.name, self.script, strict=strict)
        if script is None:
            return []
        modules = [script]
        for full in set(script.imports.values()):  # the user's own modules the script imports
            parts = full.split(".")
            for cut in range(len(parts), 0, -1):
                found = self.local_module(".".join(parts[:cut]))
                if found is not None:
                    modules.append(found)
                    break
        for module in modules:
            for cls in module.classes.values():
                if self.is_dataset(module, cls):
                    self._dataset(module, cls)
            if not any(word in module.source for word in (*LOADER_FUNCTIONS, "DataLoader")):
                continue  # the walk of the whole file, only where a DataLoader may be made
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Call):
                    self._loader_call(module, node)
        self.findings.sort(key=lambda finding: (finding.path != self.script, finding.path, finding.line))
        return self.findings

    def _dataset(self, module: Module, cls: ast.ClassDef) -> None:
        for method in DATASET_METHODS:
            found = self.method(module, cls, method)
            if found is not None:
                self.follow(*found, f"{cls.name}.{method}")

    def _loader_call(self, module: Module, call: ast.Call) -> None:
        """The functions a call hands a DataLoader, and the dataset a ``DataLoader(...)`` gets
        (a class of the user's deriving from another library's dataset, say)."""
        for keyword in call.keywords:
            if keyword.arg in LOADER_FUNCTIONS:
                self._loader_function(module, keyword.arg, keyword.value)
        if not (self.full_name(module, call.func, {}) or "").endswith("DataLoader"):
            return
        given = [keyword.value for keyword in call.keywords if keyword.arg == "dataset"] + call.args[:1]
        if given and isinstance(given[0], ast.Call):
            found = self.resolve(module, given[0].func, {})
            if found is not None and isinstance(found[1], ast.ClassDef):
                self._dataset(found[0], found[1])

    def _loader_function(self, module: Module, role: str, value) -> None:
        if isinstance(value, ast.Lambda):
            self.follow(module, value, None, f"{role} <lambda>")
            return
        if isinstance(value, ast.Call):
            dotted = self.full_name(module, value.func, {}) or ""
            if dotted.split(".")[-1] == "partial" and value.args:
                self._loader_function(module, role, value.args[0])
                return
            value = value.func  # Collator(...): the instance's __call__
        found = self.resolve(module, value, {})
        if found is None:
            return
        target_module, definition, owner = found
        if isinstance(definition, ast.ClassDef):
            found = self.method(target_module, definition, "__call__")
            if found is None:
                return
            target_module, definition, owner = found
        self.follow(target_module, definition, owner, f"{role} {_qualified(definition, owner)}")


def _qualified(function, cls) -> str:
    name = getattr(function, "name", "<lambda>")
    return f"{cls.name}.{name}" if cls is not None else name


def scan_script(path: str, root: str | None = None) -> list[Finding]:
    """The unbounded openers the DataLoader of the script at ``path`` reaches, its own
    modules looked for beside it and in the current folder (raises OSError, SyntaxError or
    ValueError when the script itself cannot be read)."""
    name, top = package_of(path)
    return Scan(path, root or top, own_folders([os.curdir]), name).run(strict=True)


def package_of(path: str) -> tuple[str, str]:
    """The module name of a script inside a package (``pkg.train`` for ``pkg/train.py``
    beside ``pkg/__init__.py``, "" elsewhere) and the folder its imports start from."""
    folder = os.path.dirname(os.path.abspath(path))
    parts = [os.path.splitext(os.path.basename(path))[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")) and len(parts) < 20:
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    return (".".join(parts) if len(parts) > 1 else ""), folder


_warned = False


def warn_unbounded_openers(in_trainer: bool = True) -> None:
    """Once per process, in the process that starts the run (``in_trainer``; of rank 0 in a
    distributed run, as the other start-up warnings: every rank runs the same script): scan
    the main script and log one warning per unbounded opener its DataLoader reaches. Never
    raises."""
    global _warned
    if _warned or not in_trainer or process.rank() != 0:
        return
    _warned = True
    try:
        script, root, name = main_script()
        if script is None:
            return
        started = time.perf_counter()
        findings = Scan(script, root, own_folders(sys.path[1:]), name).run()
        log.debug("swift_safe_media: user-code scan of %s: %d finding(s) in %.1f ms", script, len(findings),
                  1000 * (time.perf_counter() - started))
        for finding in findings:
            log.warning("%s", finding.message())
    except Exception:  # fail open: a scan that cannot finish says nothing
        log.debug("swift_safe_media: the user-code scan failed", exc_info=True)


def main_script() -> tuple[str | None, str | None, str]:
    """The file ``__main__`` runs, the folder its imports start from and its module name
    under ``python -m`` (None, None, "" for ``python -c``, an interactive session, or a
    script run from an installed package)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return None, None, ""
    path = os.path.abspath(path)
    if any(folder in path for folder in LIBRARY_FOLDERS):
        return None, None, ""  # a console script of an installed package: not the user's code
    root = os.path.dirname(path)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    for _ in range(spec_name.count(".")):  # python -m pkg.train: imports start above the package
        root = os.path.dirname(root)
    return path, root, spec_name
