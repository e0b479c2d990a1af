"""The machine's process table read from /proc, for the tests that watch a real CLI's
processes (tests/test_lerobot_train.py's ``run_train``) or kill them (tests/fault_killer.py)."""

from __future__ import annotations

import os
from typing import NamedTuple


class Process(NamedTuple):
    parent: int
    start: int  # clock ticks after boot: with the pid, says it is the same process
    command: str  # the command line, arguments joined by spaces
    state: str  # R running, S sleeping, Z zombie...
    name: str  # /proc/<pid>/comm: what a process named itself (our sandboxes and zygotes do)


def process_table() -> dict[int, Process]:
    """pid -> Process for every process now (those gone while it reads are left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ')'
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/comm") as comm:
                name = comm.read().strip()
        except (OSError, IndexError):
            continue
        table[int(entry)] = Process(int(fields[1]), int(fields[19]), command, fields[0], name)
    return table


def descendants(table: dict[int, Process], root: int, living: bool = False) -> dict[int, Process]:
    """The processes under ``root`` in ``table`` (found by parent: sandboxes lead sessions of
    their own); ``living``: without zombies and those being reaped."""
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, row in table.items():
            if row.parent == parent and pid not in found and not (living and row.state in ("Z", "X")):
                found[pid] = row
                frontier.append(pid)
    return found


def forkservers(seen: dict[int, Process]) -> set[int]:
    """The warm forkservers among ``seen``: exec'd (CPython's command line) or forked from
    the trainer where it had one thread (named so: it has the trainer's command line)."""
    from swift_safe_media.process import FORKSERVER_NAME

    return {pid for pid, row in seen.items() if row.name == FORKSERVER_NAME
            or ("multiprocessing.forkserver" in row.command and "multiprocessing.forkserver" not in
                getattr(seen.get(row.parent), "command", ""))}


def from_forkservers(seen: dict[int, Process]) -> set[int]:
    """The warm forkservers among ``seen``, their templates forked from the trainer (one that
    never became the forkserver: a fresher one was forked at ``enable()``), and everything
    descending from them."""
    from swift_safe_media.process import TEMPLATE_NAME

    found = forkservers(seen) | {pid for pid, row in seen.items() if row.name == TEMPLATE_NAME}
    while True:
        more = {pid for pid, row in seen.items() if row.parent in found} - found
        if not more:
            return found
        found |= more


def trainer_copies(seen: dict[int, Process], command: str, sightings: dict[int, int] | None = None) -> list[str]:
    """Processes with the trainer's command line (``command`` in it) forked by the trainer's
    own code: not the warm forkserver forked from it nor anything descending from it; with
    ``sightings``, only those seen more than 3 times (a fork about to exec a helper keeps
    the trainer's command line for a moment)."""
    clean = from_forkservers(seen)
    return [row.command for pid, row in seen.items() if command in row.command and pid not in clean
            and (sightings is None or sightings.get(pid, 0) > 3)]
