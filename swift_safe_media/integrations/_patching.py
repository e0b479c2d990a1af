"""Replace host functions by name: in the defining module and in every loaded module
of the host that holds the same object (``from x import y`` copies the name)."""

from __future__ import annotations

import functools
import sys

MARK = "__swift_safe_media_original__"


def original_of(function):
    return getattr(function, MARK, None)


def mark(replacement, original):
    setattr(replacement, MARK, original)
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
        current = getattr(sys.modules[module_name], name)
        if original_of(current) is not None:
            return  # patched already

        @functools.wraps(current)
        def replacement(*args, **kwargs):
            return safe_function(*args, **kwargs)

        mark(replacement, current)
        self._originals[id(replacement)] = (replacement, current)
        self._swap({id(current): replacement})

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
        """Make ``cls.name(self, ...)`` call ``stand_in(original, self, ...)``."""
        current = cls.__dict__[name]
        if original_of(current) is not None:
            return  # patched already

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
