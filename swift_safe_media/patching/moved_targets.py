"""Whether the installed hosts still have what protection patches, said at start-up.

Protection is a set of patch targets in other projects' code. A target the installed
version lacks is skipped (older versions lack some by design), so the day a host
renames or moves a function, protection of what it did would stop without a word.
Here each table's rows are checked as the table is applied, and each problem gets one
WARNING naming the host, its version, the target and what is no longer protected:

- **moved**: a target that should exist here and does not: its module is installed but
  lacks it, or its module is gone. Where a target must exist is its row's
  ``expected_in``, a requirement on an installed distribution (``"ms-swift>=4.3"``,
  ``"datasets<4.8"``); a row without one must exist wherever its distribution is
  installed (the host's adapter already refuses versions outside its range). A target
  absent by design on this version is quiet.
- **signature changed**: a host function whose parameters differ from those recorded on
  the newest tested release at or below the installed one (:mod:`.recorded_signatures`),
  where the stand-in names parameters of its own (a twin). Such a target is left
  unpatched, as stock: a stand-in called with arguments it does not know would break
  every decode instead of bounding it. A stand-in that forwards ``*args, **kwargs`` (stock
  run in the sandbox) does not depend on the signature and stays patched.
- **not covered**: a decode function of a known module (a name that matches the
  module's :class:`DecodeFunctions` pattern) that no target covers and that is not known
  to be reached only through one: a new decoder, whose calls run unbounded.

Warnings come from the process that runs the host (rank 0's trainer), not from its
sandboxes, DataLoader workers or pool processes, once each per process. ``swift-safe-media
targets`` and ``doctor`` print the same findings, every target's state included.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import inspect
import logging
import multiprocessing
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import process
from . import import_hooks, recorded_signatures
from .versions import COMPARE, installed_version, parse_requirement, parse_version

log = logging.getLogger("swift_safe_media")

# The distribution of a top-level module, where its name is not the distribution's.
DISTRIBUTIONS = {"swift": "ms-swift", "qwen_vl_utils": "qwen-vl-utils", "qwen_omni_utils": "qwen-omni-utils",
                 "keye_vl_utils": "keye-vl-utils", "minicpmo": "minicpmo-utils", "whisper": "openai-whisper"}

MOVED, SIGNATURE, NOT_COVERED = "moved", "signature changed", "not covered"
# A target's state, for ``swift-safe-media targets``.
PRESENT, ABSENT_BY_DESIGN, NOT_INSTALLED, NOT_IMPORTED = "present", "absent by design", "not installed", "not imported"


@dataclass(frozen=True)
class DecodeFunctions:
    """The decode functions of a known module: names there (functions, or methods of its
    classes as ``Class.method``) matching ``pattern`` must be a target, or be listed in
    ``inner`` (reached only through a target: a backend its target calls)."""
    module: str
    pattern: str
    inner: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    table: str  # what the rows protect: "ms-swift", "torch's DataLoader", ...
    distribution: str
    version: str | None
    where: str  # module.name
    problem: str  # MOVED, SIGNATURE or NOT_COVERED
    detail: str
    unprotected: str  # what runs as stock because of it

    def message(self) -> str:
        return (f"swift_safe_media: {self.distribution} {self.version}: {self.where} {self.detail}; "
                f"not protected: {self.unprotected} ({self.table})")


# -- versions --------------------------------------------------------------------------------
def distribution_of(module_name: str) -> str:
    top = module_name.split(".", 1)[0]
    return DISTRIBUTIONS.get(top, top)


# What is installed does not change during a run: each distribution is looked up once.
version_of = functools.lru_cache(maxsize=None)(installed_version)


@functools.lru_cache(maxsize=None)
def holds(requirement: str) -> bool | None:
    """Whether the installed distribution meets ``requirement``; None if not installed."""
    name, clauses = parse_requirement(requirement)
    installed = version_of(name)
    if installed is None:
        return None
    found = parse_version(installed)
    # Compare on the clause's own length: "<4.8" holds for 4.7.2, not for 4.8.0.
    return all(COMPARE[op](found[:len(bound)], bound) for op, bound in clauses)


# -- where a target should be ----------------------------------------------------------------
def expected_here(target) -> bool | None:
    """True: the installed version should have ``target``; False: absent by design here;
    None: its distribution is not installed."""
    requirement = getattr(target, "expected_in", None)
    if requirement:
        return holds(requirement)
    return None if version_of(distribution_of(target.module)) is None else True


@functools.lru_cache(maxsize=None)  # what is installed does not change during a run
def module_file_exists(module_name: str) -> bool | None:
    """Whether ``module_name`` has a file under its top-level package, found without
    importing anything (a submodule's ``find_spec`` would run its packages' ``__init__``);
    None when the top-level package itself is not found."""
    top, *parts = module_name.split(".")
    try:
        spec = sys.modules[top].__spec__ if top in sys.modules else importlib.util.find_spec(top)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None:
        return None
    if not parts:
        return True
    for location in getattr(spec, "submodule_search_locations", None) or ():
        base = Path(location).joinpath(*parts)
        if (base / "__init__.py").is_file() or base.is_dir():
            return True
        if any(base.parent.joinpath(base.name + suffix).is_file()
               for suffix in importlib.machinery.all_suffixes()):
            return True
    return False


def lookup(target):
    """The host's own object a loaded target names (unwrapped where we patched it), or None."""
    module = sys.modules.get(target.module)
    if module is None:
        return None
    owner, _, name = target.name.rpartition(".")
    holder = getattr(module, owner, None) if owner else module
    if holder is None:
        return None
    value = vars(holder).get(name) if owner and isinstance(holder, type) else getattr(holder, name, None)
    while value is not None and getattr(value, "__swift_safe_media_original__", None) is not None:
        value = value.__swift_safe_media_original__
    return getattr(value, "__func__", value)  # a classmethod's or staticmethod's function


# -- signatures ------------------------------------------------------------------------------
def parameters_of(function) -> tuple[str, ...] | None:
    """Parameter names as recorded: ``*args`` and ``**kwargs`` with their stars."""
    try:
        signature = inspect.signature(function, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(star.get(parameter.kind, "") + name for name, parameter in signature.parameters.items())


@functools.lru_cache(maxsize=None)
def forwards_everything(stand_in) -> bool:
    """Whether ``stand_in`` takes ``*args`` and ``**kwargs`` (a forwarder: the host's
    parameters are not its concern)."""
    names = parameters_of(stand_in) or ()
    return any(name.startswith("**") for name in names) and any(
        name.startswith("*") and not name.startswith("**") for name in names)


def recorded_parameters(target) -> tuple[str | None, tuple[str, ...] | None]:
    """(release, parameters) recorded for ``target`` on the newest tested release of its
    distribution at or below the installed one; (None, None) where none applies."""
    distribution = distribution_of(target.module)
    installed = parse_version(version_of(distribution))
    releases = recorded_signatures.SIGNATURES.get(distribution, {})
    at_or_below = [release for release in releases if parse_version(release) <= installed]
    if not at_or_below:
        return None, None
    release = max(at_or_below, key=parse_version)
    return release, releases[release].get(f"{target.module}.{target.name}")


def signature_change(target, function, stand_in) -> str | None:
    """How the host's ``function`` (the target, looked up) now differs from what ``stand_in``
    was written for, or None (same, nothing recorded, or a stand-in that forwards everything)."""
    if getattr(target, "only_if_missing", False) or forwards_everything(stand_in):
        return None
    return _compared(target, function)


@functools.lru_cache(maxsize=None)  # checked at each import that triggers the table: once is enough
def _compared(target, function) -> str | None:
    release, recorded = recorded_parameters(target)
    if recorded is None:
        return None
    found = parameters_of(function)
    if found is None or found == recorded:
        return None
    return f"now takes ({', '.join(found)}), not ({', '.join(recorded)}) as in {release}"


# -- the check -------------------------------------------------------------------------------
_RUNS_AS_STOCK_RENAMED = "what it did runs as stock under whatever name it has now, with no timeout and no sandbox"


def _finding(table: str, target, problem: str, detail: str, unprotected: str) -> Finding:
    distribution = distribution_of(target.module)
    return Finding(table, distribution, version_of(distribution), f"{target.module}.{target.name}", problem,
                   detail, unprotected)


def check(table: str, targets, stand_in_of, decode_functions=()) -> list[Finding]:
    """The problems of ``targets`` (and of the known modules' decode functions) that can be
    seen now: rows whose module is loaded (and done executing), or whose module is gone."""
    findings = []
    for target in targets:
        if getattr(target, "only_if_missing", False) or not expected_here(target):
            continue  # an addition of ours, absent by design here, or its distribution not installed
        if target.module in sys.modules:
            if not import_hooks.done_executing(target.module):
                continue  # what it has not defined yet is checked when it is done
            function = lookup(target)
            if function is None:
                findings.append(_finding(table, target, MOVED, "is missing (renamed or moved?)",
                                         _RUNS_AS_STOCK_RENAMED))
                continue
            change = signature_change(target, function, stand_in_of(target))
            if change:
                findings.append(_finding(table, target, SIGNATURE, change,
                                         f"its calls run as stock, with no timeout and no sandbox "
                                         f"({target.stand_in} is written for the old parameters and is left out)"))
        elif module_file_exists(target.module) is False:
            findings.append(_finding(table, target, MOVED, f"is missing: its module {target.module} is gone "
                                     f"(renamed or moved?)", _RUNS_AS_STOCK_RENAMED))
    for decode in decode_functions:
        if import_hooks.done_executing(decode.module):
            findings += not_covered(table, decode, targets)
    return findings


def decode_functions_in(decode: DecodeFunctions) -> list[str]:
    """The names in ``decode.module`` (functions, and ``Class.method`` of its classes) that
    match its pattern: what is defined there, not what it imports."""
    module = sys.modules[decode.module]
    pattern = re.compile(decode.pattern)
    found = []
    for name, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value) and pattern.search(name):
            found.append(name)
        elif isinstance(value, type):
            found += [f"{name}.{member}" for member, function in vars(value).items()
                      if callable(getattr(function, "__func__", function)) and pattern.search(member)]
    return found


def not_covered(table: str, decode: DecodeFunctions, targets) -> list[Finding]:
    covered = {target.name for target in targets if target.module == decode.module} | set(decode.inner)
    distribution = distribution_of(decode.module)
    return [Finding(table, distribution, version_of(distribution), f"{decode.module}.{name}", NOT_COVERED,
                    "is a decode function no patch target covers (new since the release tested?)",
                    "its calls run as stock, with no timeout and no sandbox")
            for name in decode_functions_in(decode) if name not in covered]


def state(target) -> str:
    """One target's state here, for ``swift-safe-media targets`` (its module imported or not)."""
    expected = expected_here(target)
    if expected is None:
        return NOT_INSTALLED
    if not expected:
        return f"{ABSENT_BY_DESIGN} (where {target.expected_in} holds)"
    if target.module not in sys.modules:
        return NOT_IMPORTED if module_file_exists(target.module) is not False else MOVED
    return PRESENT if lookup(target) is not None else MOVED


# -- saying it -------------------------------------------------------------------------------
_said: set[tuple[str, str]] = set()


def speaks_here() -> bool:
    """Whether this process says what the checks find: the main process of rank 0, not a
    sandbox, a DataLoader worker or a pool's process (each would repeat it)."""
    sandbox = sys.modules.get("swift_safe_media.engine.sandbox")
    if sandbox is not None and sandbox.in_sandbox():
        return False
    return multiprocessing.parent_process() is None and process.rank() == 0


def warn(findings) -> None:
    """One WARNING per finding, once per process."""
    if not findings or not speaks_here():
        return
    for finding in findings:
        key = (finding.where, finding.problem)
        if key not in _said:
            _said.add(key)
            log.warning(finding.message())
