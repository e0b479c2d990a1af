"""Post-import hooks: run a callback right after a module is executed, before the
importer continues, so names copied with ``from x import y`` are already patched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading

from ..errors import ProtectionUnavailable

log = logging.getLogger("swift_safe_media")

_callbacks: dict[str, list] = {}
_lock = threading.RLock()
_executed: set[str] = set()  # hooked modules whose body has run (their hooks run before the import ends)


def when_imported(module_name: str, callback) -> None:
    """Call ``callback(module)`` after ``module_name`` is imported (now, if it already is)."""
    with _lock:
        _callbacks.setdefault(module_name, []).append(callback)
        _install_finder()
    module = sys.modules.get(module_name)
    if module is not None:
        _run(callback, module)
        _again_when_executed(module)


def done_executing(module_name: str) -> bool:
    """Whether ``module_name`` is loaded and its body has run: a module still executing (it
    imported, say, what triggered a hook) may not have defined everything yet. Its own hooks
    run once its body is done, while the import system still marks it as initializing."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    return module_name in _executed or not getattr(getattr(module, "__spec__", None), "_initializing", False)


def clear(module_name: str | None = None) -> None:
    with _lock:
        if module_name is None:
            _callbacks.clear()
        else:
            _callbacks.pop(module_name, None)


def _run(callback, module) -> None:
    try:
        callback(module)
    except ProtectionUnavailable:
        raise  # protection asked for on the command line, and it cannot work: stop the run
    except Exception:  # otherwise a hook must never break the host's import
        log.exception("swift_safe_media: post-import hook for %s failed; host left as it was",
                      module.__name__)


def _fire(module) -> None:
    with _lock:
        callbacks = list(_callbacks.get(module.__name__, ()))
    for callback in callbacks:
        _run(callback, module)


class _SpecNoticingTheEnd(importlib.machinery.ModuleSpec):
    """The spec of a module that was still executing when a hook was added for it (it
    imported, say, what turned protection on): the import system marks its end by
    setting ``_initializing`` to False, and the hooks run again then, on the whole module."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "_initializing" and not value:
            self.__class__ = importlib.machinery.ModuleSpec
            module = sys.modules.get(self.name)
            if module is not None:
                _fire(module)


def _again_when_executed(module) -> None:
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "_initializing", False) and type(spec) is importlib.machinery.ModuleSpec:
        spec.__class__ = _SpecNoticingTheEnd


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _executed.add(module.__name__)
        _fire(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._resolving = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks or getattr(self._resolving, "name", None) == fullname:
            return None
        self._resolving.name = fullname
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._resolving.name = None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec


_finder: _PostImportFinder | None = None


def _install_finder() -> None:
    global _finder
    if _finder is None or _finder not in sys.meta_path:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
