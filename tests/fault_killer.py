"""A killer thread for the machine-fault tests of real training runs (issue 35): it
SIGKILLs sandboxes, zygotes, DataLoader workers and the warm forkserver of a run while
decodes are in flight."""

import os
import threading
import time

from swift_safe_media.process import FORKSERVER_NAME, SANDBOX_NAME, ZYGOTE_NAME

from .proc_table import descendants as proc_descendants, process_table


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (what it is: sandbox, zygote, forkserver, worker or other; its state) for every
    living process under ``root``."""
    table = process_table()
    kinds = {pid: {SANDBOX_NAME: "sandbox", ZYGOTE_NAME: "zygote", FORKSERVER_NAME: "forkserver"}.get(row.name) or
             ("forkserver" if "multiprocessing.forkserver" in row.command else "other")
             for pid, row in table.items()}
    for pid, row in table.items():
        # What a forkserver forks (DataLoader workers) has its command line too.
        if kinds[pid] in ("forkserver", "other") and kinds.get(row.parent) == "forkserver":
            kinds[pid] = "worker"
    return {pid: (kinds[pid], row.state) for pid, row in proc_descendants(table, root, living=True).items()}


def session_of(marker: str) -> int | None:
    """The session (its leader's pid) of the run whose command line names ``marker``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read() and os.getsid(int(entry)) == int(entry):
                        return int(entry)
            except OSError:
                continue
    return None


class Killer(threading.Thread):
    """SIGKILLs, ``gap`` s apart, what ``plan`` names (sandbox, zygote, forkserver, worker: a
    DataLoader worker the warm forkserver started) among the
    descendants of the process whose command line names ``marker``, each while one of its
    sandboxes runs (a decode in flight); ``killed`` says what it hit, ``seen`` every
    sandbox, zygote and forkserver it saw. Stops when ``done`` is set."""

    def __init__(self, marker: str, plan, gap: float = 2.0):
        super().__init__(daemon=True)
        self.marker, self.plan, self.gap = marker, plan, gap
        self.killed, self.seen, self.done = [], set(), threading.Event()

    def run(self):
        session = None
        while session is None and not self.done.is_set():
            session = session_of(self.marker)
            time.sleep(0.2)
        for target in self.plan:
            while not self.done.is_set():
                found = descendants(session)
                self.seen.update(pid for pid, (kind, _) in found.items() if kind != "other")
                victims = [pid for pid, (kind, _) in found.items() if kind == target]
                decoding = [pid for pid, (kind, state) in found.items() if kind == "sandbox" and state == "R"]
                if target == "sandbox":
                    victims = decoding
                if victims and decoding:  # a decode runs now
                    try:
                        os.kill(victims[0], 9)
                        self.killed.append(target)
                    except ProcessLookupError:
                        continue
                    break
                time.sleep(0.02)
            self.done.wait(self.gap)
