"""Stall watchdog: when the training loop receives no batch for N seconds, say where
every process stands.

It logs the Python stacks of the main process, of every DataLoader worker and of
their sandboxes, and the media each worker has in flight. Stacks come from
``faulthandler``, whose signal handler walks the thread states in C, so it answers
even while a native call holds the GIL. With ``SWIFT_SAFE_MEDIA_STALL_ACTION=abort``
the process then exits with code 75 (EX_TEMPFAIL), so a scheduler can restart it.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref

from .. import config, process
from ..engine import run_folders
from ..patching import torch_dataloader
from ..config import INFLIGHT_DIR  # set by the watchdog; workers inherit it

log = logging.getLogger("swift_safe_media")

STALL_EXIT_CODE = 75
# SIGUSR1/2 are often taken (SLURM requeue handlers); a real-time signal is not.
DUMP_SIGNAL = signal.SIGRTMIN + 7  # also named in _swift_safe_media_startup.answer_stack_dumps


def answer_stack_dumps() -> None:
    """Make this process print its stacks on DUMP_SIGNAL (idempotent, run-once)."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError, AttributeError):
        pass


class InFlight:
    """What this process is decoding now, kept in a small file the watchdog can read."""

    def __init__(self, directory: str):
        self.directory = directory

    def begin(self, path, fn) -> str:
        name = os.path.join(self.directory, f"{os.getpid()}-{threading.get_ident()}.json")
        try:
            with open(name, "w") as out:
                json.dump({"pid": os.getpid(), "path": path, "function": getattr(fn, "__qualname__", repr(fn)),
                           "since": time.time()}, out)
        except OSError:
            return ""
        return name

    @staticmethod
    def end(name: str) -> None:
        if name:
            try:
                os.unlink(name)
            except OSError:
                pass


def in_flight() -> InFlight | None:
    directory = config.get(INFLIGHT_DIR)
    return InFlight(directory) if directory and os.path.isdir(directory) else None


def _parent_of(pid) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_of(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


# Waits until the aborting process has exited (gone, or a zombie its parent has not
# reaped yet), then kills what it left behind.
_KILL_AFTER_EXIT = """
import os, sys, time
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
while alive(int(sys.argv[1])):
    time.sleep(0.05)
for pid in sys.argv[2:]:
    try:
        os.kill(int(pid), 9)
    except OSError:
        pass
"""


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _describe(pid: int) -> str:
    text = _cmdline(pid)
    if text is None:
        return "gone"
    name = process.name(pid)  # zygotes and sandboxes forked from the warm forkserver share its command line
    if name in (process.ZYGOTE_NAME, process.SANDBOX_NAME, process.FORKSERVER_NAME):
        return {process.ZYGOTE_NAME: "zygote", process.SANDBOX_NAME: "sandbox"}.get(name, "forkserver")
    if name == process.HOLDING_NAME:
        return "holding server"
    if process.name(_parent_of(pid)) in (process.FORKSERVER_NAME, process.HOLDING_NAME):
        return "worker"  # it has the trainer's command line and name
    if "multiprocessing.forkserver import main" in text and "multiprocessing" not in (_cmdline(_parent_of(pid)) or ""):
        return "forkserver"
    forked_by_zygote = "zygote_main" in (_cmdline(_parent_of(pid)) or "")
    if "exec_sandbox_main" in text or ("zygote_main" in text and forked_by_zygote):
        return "sandbox"
    if "zygote_main" in text:
        return "zygote"
    if "multiprocessing" in text:
        return "worker"
    return text[:80]


class Watchdog:
    def __init__(self, timeout: float, action: str):
        self.timeout, self.action = timeout, action
        self.last_batch = time.monotonic()
        self.iterating = 0
        self.fired = False
        self.inflight_dir = run_folders.make("inflight")  # removed at exit, or by the zygote if killed
        config.put(INFLIGHT_DIR, self.inflight_dir)
        answer_stack_dumps()  # forked workers inherit the handler; spawned ones get it from the .pth
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="swift-safe-media-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if config.get(INFLIGHT_DIR) == self.inflight_dir:
            config.put(INFLIGHT_DIR, None)
        run_folders.release(self.inflight_dir)

    def batch_received(self) -> None:
        self.last_batch = time.monotonic()
        self.fired = False

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last_batch
            if self.iterating and not self.fired and idle >= self.timeout:
                self.fired = True
                self.report(idle)
                if self.action == "abort":
                    self.abort()

    def report(self, idle: float) -> None:
        lines = [f"swift_safe_media: STALL: no batch for {idle:.0f} s "
                 f"({config.STALL_TIMEOUT}={self.timeout:g}); stacks of every process follow"]
        for record in self._in_flight():
            lines.append(f"  in flight in pid {record['pid']}: {record['path']} "
                         f"({record['function']}, for {time.time() - record['since']:.0f} s)")
        log.error("\n".join(lines))
        sys.stderr.write(f"--- stacks of the main process (pid {os.getpid()}) ---\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for pid in _descendants(os.getpid()):
            # Only processes that answer: the default action of a real-time signal is to die.
            if not _catches(pid, DUMP_SIGNAL):
                continue
            sys.stderr.write(f"--- stacks of pid {pid} ({_describe(pid)}) ---\n")
            sys.stderr.flush()
            try:
                os.kill(pid, DUMP_SIGNAL)
            except (ProcessLookupError, PermissionError):
                continue
            time.sleep(0.3)  # one at a time, so their stacks do not interleave on the shared stderr
            _show_captured(pid)

    def abort(self) -> None:
        log.error("swift_safe_media: aborting the stalled run (exit code %d)", STALL_EXIT_CODE)
        logging.shutdown()
        sys.stderr.flush()
        # A worker stuck in native code never notices its parent is gone, so the whole
        # tree must go, or the restarted job shares the node with orphans. They are
        # killed only after we exit: killing a DataLoader worker first would make the
        # DataLoader's SIGCHLD handler raise in the main thread and win the race to exit.
        stuck = [str(pid) for pid in _descendants(os.getpid())]
        if stuck:
            quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
            os.posix_spawn(sys.executable, [sys.executable, "-S", "-c", _KILL_AFTER_EXIT, str(os.getpid()), *stuck],
                           os.environ, file_actions=quiet)
        os._exit(STALL_EXIT_CODE)

    def _in_flight(self) -> list[dict]:
        records = []
        for name in sorted(os.listdir(self.inflight_dir)):
            if name.startswith("."):  # the folder's lock (run_folders), not a record
                continue
            try:
                with open(os.path.join(self.inflight_dir, name)) as record:
                    records.append(json.load(record))
            except (OSError, ValueError):
                continue
        return records


_watchdog: Watchdog | None = None


def install() -> Watchdog | None:
    """Watch DataLoader iteration in this process if a stall timeout is configured."""
    global _watchdog
    timeout = config.stall_timeout()
    if timeout <= 0 or _watchdog is not None:
        return _watchdog
    _watchdog = Watchdog(timeout, config.stall_action())
    torch_dataloader.patch("stall watch")  # torch's targets, as data: DataLoader iteration tells it of batches
    return _watchdog


def uninstall() -> None:
    """Undo :func:`install`: the watchdog stops and DataLoader iteration is torch's own again."""
    global _watchdog
    watchdog, _watchdog = _watchdog, None
    torch_dataloader.unpatch("stall watch")
    if watchdog is not None:
        watchdog.stop()


def next_watched(original_next, iterator):
    """``_BaseDataLoaderIter.__next__``, telling the watchdog each time a batch arrives."""
    watchdog = _watchdog
    if watchdog is None:
        return original_next(iterator)
    if not getattr(iterator, "_swift_safe_media_watched", False):
        iterator._swift_safe_media_watched = True
        watchdog.iterating += 1
        watchdog.batch_received()
        weakref.finalize(iterator, _iteration_ended, watchdog)
    try:
        batch = original_next(iterator)
    except StopIteration:
        watchdog.batch_received()
        raise
    watchdog.batch_received()
    return batch


def _iteration_ended(watchdog: Watchdog) -> None:
    watchdog.iterating -= 1


def _show_captured(pid: int) -> None:
    """A confined sandbox dumps its stacks into its capture pipe (confine_output): shown
    here line by line, escaped and marked, so nothing it printed passes for a line of ours."""
    from ..confinement import output as confine_output

    output = confine_output.read_from(pid)
    if not output:
        return
    for line in output.decode("utf-8", "backslashreplace").splitlines():
        sys.stderr.write(f"  | {confine_output.escaped(line.encode())}\n")
    sys.stderr.flush()

