"""Installed versions and version requirements, read the one way every check here reads them:
the first three numbers of a version (``"2.14.0+cu130"`` -> ``(2, 14, 0)``), and requirements of
the plain form ``"datasets>=4.0,<4.8"`` (the patch targets' ``expected_in``)."""

from __future__ import annotations

import importlib.metadata
import re


def parse_version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or "")[:3])


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*([0-9][0-9.]*)\s*")
COMPARE = {">=": tuple.__ge__, "<=": tuple.__le__, "==": tuple.__eq__, "!=": tuple.__ne__,
           "<": tuple.__lt__, ">": tuple.__gt__}


def parse_requirement(requirement: str) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    """``"datasets>=4.0,<4.8"`` -> ``("datasets", [(">=", (4, 0)), ("<", (4, 8))])``."""
    name = re.match(r"\s*([A-Za-z0-9._-]+)", requirement)
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    clauses = []
    for text in filter(None, requirement[name.end():].split(",")):
        clause = _CLAUSE.fullmatch(text)
        if clause is None:
            raise ValueError(f"not a version clause in {requirement!r}: {text!r}")
        clauses.append((clause[1], parse_version(clause[2])))
    return name[1], clauses
