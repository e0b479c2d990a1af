"""``swift-safe-media targets``: every patch target of every table, and whether the
installed releases still have it; ``doctor`` shows the problems.

The tables are the media libraries', torch's DataLoader's and each installed host's
(LeRobot's: the layout its source matches). Each target's module is imported here (a
start-up imports them as the run reaches them), then each row gets its state: present,
absent by design on this release (its ``expected_in`` does not hold), not installed, or
MOVED; and the problems get the lines a protected run would log at start-up
(:mod:`..patching.moved_targets`): moved, signature changed, decode function not covered.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

from ..patching import host_adapters as integrations, media_libraries, moved_targets, torch_dataloader
from ..workers import loaded_ahead


@dataclass
class Table:
    label: str
    patches: object = None  # targets.Patches, or None where the host is left untouched
    note: str = ""  # why a host's table is not checked (not installed, outside its range, ...)
    findings: list = field(default_factory=list)
    import_errors: dict = field(default_factory=dict)  # module -> why it did not import here


def _host_table(host: str) -> Table:
    adapter = integrations.adapter_for(host)
    version = adapter.get_version()
    if version is None:
        return Table(adapter.DISTRIBUTION, note="not installed")
    if not integrations.in_supported_range(adapter, version):
        return Table(adapter.DISTRIBUTION, note=f"{version} is outside the supported range "
                                                f"{integrations.supported_range(adapter.SUPPORTED)}: left untouched, nothing patched")
    reason = adapter.unsupported()
    if reason:
        return Table(adapter.DISTRIBUTION, note=f"{version}: {reason}: left untouched, nothing patched")
    return Table(adapter.DISTRIBUTION, adapter.PATCHES)


def tables() -> list[Table]:
    found = [Table("the media libraries", media_libraries.PATCHES)]
    found += [Table(patches.label, patches) for patches in torch_dataloader._patches.values()]
    found.append(Table(loaded_ahead.PATCHES.label, loaded_ahead.PATCHES))
    return found + [_host_table(host) for host in integrations.known_hosts()]


def _import_targets(patches) -> dict:
    """Import each module of the table that is there; returns module -> why it did not import."""
    errors = {}
    wanted = [target.module for target in patches.targets if moved_targets.expected_here(target)]
    for module in dict.fromkeys(wanted + [decode.module for decode in patches.decode_functions]):
        if moved_targets.module_file_exists(module):
            try:
                importlib.import_module(module)
            except Exception as exc:  # a module this environment cannot import (Megatron without megatron-core)
                errors[module] = f"{type(exc).__name__}: {exc}"
    return errors


def checked() -> list[Table]:
    """Every table, its targets' modules imported, with its findings."""
    found = tables()
    for table in found:
        if table.patches is not None:
            table.import_errors = _import_targets(table.patches)
            table.findings = table.patches.check()
    return found


def report(out=sys.stdout) -> int:
    """Print every target's state and the problems; 0 either way (they are findings)."""
    def say(text=""):
        print(text, file=out, flush=True)

    problems = unchecked = 0
    for table in checked():
        say(f"{table.label}" + (f": {table.note}" if table.note else ""))
        if table.patches is None:
            continue
        for target in table.patches.targets:
            if not target.only_if_missing:
                state = moved_targets.state(target)
                if state == moved_targets.NOT_IMPORTED and target.module in table.import_errors:
                    state = f"{state} ({table.import_errors[target.module]}: unchecked)"
                    unchecked += 1
                say(f"  {state:<22} {target.module}.{target.name}")
        for finding in table.findings:
            say(f"  {finding.problem.upper():<22} {finding.message()}")
        problems += len(table.findings)
    if problems:
        say(f"\n{problems} problem(s): each is logged as a WARNING when protection starts")
    else:
        say("\n0 problem(s): " + ("every target that should exist here does, as recorded" if not unchecked
                                   else "among the targets checked"))
    if unchecked:
        say(f"{unchecked} target(s) unchecked: their module does not import here (see above)")
    return 0


def problems() -> tuple[list, list]:
    """The findings of every table, and the modules of the tables that did not import here
    (``doctor``)."""
    tables = checked()
    return ([finding for table in tables for finding in table.findings],
            sorted({module for table in tables for module in table.import_errors}))
