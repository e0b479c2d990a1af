"""Patch targets as data, and the patchers that apply them.

An adapter declares its targets in one table of :class:`Target` rows, functions and
methods alike, and hands it to a :class:`Patches`, which gives it ``patch`` /
``unpatch`` / ``is_patched``. A function is replaced by name in the defining module and
in every loaded module of the host that holds the same object (``from x import y``
copies the name: :class:`Patcher`); a method on its class (:class:`MethodPatcher`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from dataclasses import dataclass

from . import moved_targets

MARK = "__swift_safe_media_original__"


def original_of(function):
    return getattr(function, MARK, None)


def mark(replacement, original):
    setattr(replacement, MARK, original)
    return replacement


def _forwarder(safe_function):
    def replacement(*args, **kwargs):
        return safe_function(*args, **kwargs)
    return replacement


class Patcher:
    """Records every replacement so that ``restore`` puts the originals back exactly,
    including in modules that copied the replacement after it was made."""

    def __init__(self, scope: tuple[str, ...]):
        self.scope = scope  # module-name prefixes that may hold aliases
        self._originals: dict[int, tuple[object, object]] = {}  # id(replacement) -> pair

    def __bool__(self):
        return bool(self._originals)

    def replace(self, module_name: str, name: str, safe_function) -> None:
        """Make every reference to ``module_name.name`` call ``safe_function`` instead.

        The stand-in is a fresh wrapper carrying the original's name, signature and
        docstring, marked so that patching twice is a no-op; ``safe_function`` itself
        is never modified."""
        self.replace_all([(module_name, name, safe_function)])

    def replace_all(self, functions) -> None:
        """``replace`` for each ``(module_name, name, safe_function)``, in one pass over the
        loaded modules (a host's scope may hold hundreds)."""
        by_id = {}
        for module_name, name, safe_function in functions:
            current = getattr(sys.modules[module_name], name)
            if original_of(current) is not None or id(current) in by_id:
                continue  # patched already
            replacement = functools.update_wrapper(_forwarder(safe_function), current)
            mark(replacement, current)
            self._originals[id(replacement)] = (replacement, current)
            by_id[id(current)] = replacement
        if by_id:
            self._swap(by_id)

    def sites(self) -> list[tuple[str, str]]:
        """(module, attribute) pairs that currently hold one of our replacements."""
        ours = {id(replacement) for replacement, _ in self._originals.values()}
        return [(module.__name__, attribute) for module in self._modules()
                for attribute, value in list(vars(module).items()) if id(value) in ours]

    def restore(self) -> None:
        self._swap({key: original for key, (_, original) in self._originals.items()})
        self._originals.clear()

    def _swap(self, by_id: dict[int, object]) -> None:
        for module in self._modules():
            for attribute, value in list(vars(module).items()):
                if id(value) in by_id:
                    setattr(module, attribute, by_id[id(value)])

    def _modules(self):
        for module_name, module in list(sys.modules.items()):
            if module is not None and module_name.startswith(self.scope) and hasattr(module, "__dict__"):
                yield module


class MethodPatcher:
    """Replaces methods on host classes; ``restore`` puts the originals back."""

    def __init__(self):
        self._originals: list[tuple[type, str, object]] = []  # (class, name, original)

    def __bool__(self):
        return bool(self._originals)

    def replace(self, cls, name: str, stand_in) -> None:
        """Make ``cls.name(self, ...)`` call ``stand_in(original, self, ...)``; a classmethod
        stays one (``stand_in(original bound to the class, the class, ...)``), a
        staticmethod one (``stand_in(original, ...)``), and a coroutine function one (its
        stand-in is a coroutine function too)."""
        current = cls.__dict__[name]
        if original_of(current) is not None:
            return  # patched already

        if isinstance(current, classmethod):
            @functools.wraps(current.__func__)
            def for_class(owner, *args, **kwargs):
                return stand_in(current.__get__(None, owner), owner, *args, **kwargs)

            replacement = classmethod(for_class)
        elif isinstance(current, staticmethod):
            @functools.wraps(current.__func__)
            def static(*args, **kwargs):
                return stand_in(current.__func__, *args, **kwargs)

            replacement = staticmethod(static)
        elif inspect.iscoroutinefunction(current):  # stays a coroutine function (FastAPI asks)
            @functools.wraps(current)
            async def replacement(self, *args, **kwargs):
                return await stand_in(current, self, *args, **kwargs)
        else:
            @functools.wraps(current)
            def replacement(self, *args, **kwargs):
                return stand_in(current, self, *args, **kwargs)

        mark(replacement, current)
        setattr(cls, name, replacement)
        self._originals.append((cls, name, current))

    def add(self, cls, name: str, function) -> None:
        """Give ``cls`` the method ``name`` where it does not define one itself (a host
        version that lacks what a later one has); ``restore`` takes it away again."""
        if name in cls.__dict__:
            return  # defined by the host, or added already
        setattr(cls, name, function)
        self._originals.append((cls, name, None))

    def restore(self) -> None:
        while self._originals:
            cls, name, original = self._originals.pop()
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


@dataclass(frozen=True)
class Target:
    """One patch target. ``name`` is a function of ``module`` (replaced with every alias
    of it) or ``"Class.method"``. ``stand_in`` names the replacement: ``"pkg.mod:name"``,
    or a bare name looked up in the adapter's module. A function's stand-in is called
    like the function; a method's as ``stand_in(original, self, ...)``."""
    module: str
    name: str
    stand_in: str
    # A method the class gets only where it lacks one (an older host version missing what
    # a later one has); the stand-in is then the method itself, and unpatch removes it.
    only_if_missing: bool = False
    # Where the target must exist: a requirement on an installed distribution ("ms-swift>=4.3",
    # "datasets<4.8"). None: wherever its distribution is installed (within the host's
    # supported range). A target that should exist and does not is named at start-up
    # (moved_targets); one absent by design here is quiet.
    expected_in: str | None = None

    @property
    def is_method(self) -> bool:
        return "." in self.name


class Patches:
    """An adapter's target table and the state of its patch.

    ``patch()`` patches whatever of the targets is loaded now (a module may be loaded
    but still executing: what it has not defined yet is patched when called again, by
    a later trigger); ``wrap_functions`` wraps each function's stand-in (the adapter's
    logging, say)."""

    def __init__(self, scope: tuple[str, ...], targets, namespace: dict, wrap_functions=None, *,
                 label: str, decode_functions=()):
        self.targets = tuple(targets)
        self._namespace = namespace
        self._wrap = wrap_functions
        self.label = label  # what the rows protect, as the warnings name it ("ms-swift")
        # moved_targets.DecodeFunctions: the known modules' decode functions, each a target or inner
        self.decode_functions = tuple(decode_functions)
        self._functions = Patcher(scope)
        self._methods = MethodPatcher()

    @property
    def modules(self) -> tuple[str, ...]:
        """The host modules the targets live in: the triggers that (re)apply the patch."""
        return tuple(dict.fromkeys(target.module for target in self.targets))

    def stand_in(self, target: Target):
        module_name, _, name = target.stand_in.rpartition(":")
        if module_name:
            return getattr(importlib.import_module(module_name), name)
        return self._namespace[name]

    def patch(self) -> None:
        """Patch what is loaded of the table, except targets whose signature changed
        under a stand-in written for the old one; then warn once for each target that
        should exist and does not (moved_targets)."""
        try:
            findings = self.check()
        except Exception:  # fails open: everything is patched as before the check existed
            logging.getLogger("swift_safe_media").warning(
                "swift_safe_media: could not check that %s still has every patch target", self.label, exc_info=True)
            findings = []
        changed = {finding.where for finding in findings if finding.problem == moved_targets.SIGNATURE}
        functions = []
        for target in self.targets:
            if f"{target.module}.{target.name}" in changed:
                continue  # left as stock, named by the warning
            module = sys.modules.get(target.module)
            if target.is_method:
                class_name, method = target.name.split(".", 1)
                cls = getattr(module, class_name, None)
                if cls is None or not (target.only_if_missing or method in vars(cls)):
                    continue  # older host versions lack some targets
                if target.only_if_missing:
                    self._methods.add(cls, method, self.stand_in(target))
                else:
                    self._methods.replace(cls, method, self.stand_in(target))
            elif hasattr(module, target.name):  # older host versions lack some targets
                stand_in = self.stand_in(target)
                functions.append((target.module, target.name, self._wrap(stand_in) if self._wrap else stand_in))
        self._functions.replace_all(functions)
        moved_targets.warn(findings)

    def check(self) -> list:
        """What of the table (and of its known modules' decode functions) the installed host
        should have and lacks, as far as can be seen now (moved_targets.check)."""
        return moved_targets.check(self.label, self.targets, self.stand_in, self.decode_functions)

    def warn_what_moved(self) -> None:
        """The check's warnings without patching: for a table none of whose modules is loaded
        yet, whose gone modules would otherwise trigger nothing."""
        moved_targets.warn(self.check())

    def unpatch(self) -> None:
        self._functions.restore()
        self._methods.restore()

    def is_patched(self) -> bool:
        return bool(self._functions) or bool(self._methods)

    def sites(self) -> list[tuple[str, str]]:
        """(module, attribute) pairs that now call a function's stand-in."""
        return self._functions.sites()

    def missing(self) -> list[str]:
        """Targets whose module is loaded but lacks them ('module.name'), absent by design
        or not: a table that no longer fits the host (tests assert there are none)."""
        missing = []
        for target in self.targets:
            if target.module in sys.modules and not target.only_if_missing and moved_targets.lookup(target) is None:
                missing.append(f"{target.module}.{target.name}")
        return missing
