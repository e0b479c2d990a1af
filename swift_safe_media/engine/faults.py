"""Whose fault a failed decode is: the file's or the machine's.

A file's failure (a decode error, a timeout while its sandbox ran or waited on the
file, a signal the decode raised itself, the sandbox's own memory cap) may quarantine
the file. A machine's failure (a SIGKILL the engine did not send, the OOM killer, a
sandbox that could not start, a zygote or transport gone, a machine resource that ran
out) never does: the call retries it in a fresh sandbox (see :mod:`.calls`).

The readers here are what the kernel says about the machine (the time a sandbox was kept
from a CPU is :mod:`.fair_clock`'s):

- :func:`oom_kills`: the OOM killer's counters (``/proc/vmstat``, and ``memory.events``
  (cgroup v2) or ``memory.oom_control`` (v1) of this process's cgroup and its
  ancestors); one that rose while a sandbox died of SIGKILL names the OOM killer.
"""

from __future__ import annotations

import errno
import functools
import os
import select
import signal
import sys

from .. import config
from ..errors import FILE, MACHINE, MediaDecodeCrash, MediaDecodeError, MediaMachineFault

# Signals a decode raises itself: a bad memory access, arithmetic, abort(), an illegal
# instruction, a system call the confinement refuses (seccomp kills with SIGSYS).
FILE_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT, signal.SIGILL,
                          signal.SIGSYS, signal.SIGTRAP})
# A sandbox that exits with these never served: it fell out of its start (70) or could
# not be confined (71) (see sandbox.become_sandbox and zygote._start_sandbox).
START_EXIT_CODES = frozenset({70, 71})
# errno values of a machine resource running out (not of a bad file): no space, the file
# size limit (`ulimit -f`), too many open files. (ENOMEM inside a sandbox is its own
# memory cap's doing: the file's.)
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EMFILE, errno.ENFILE})


def crash_verdict(status: int, oom_rose: str | None) -> tuple[str, bool, str]:
    """(fault, ambiguous, what to add to the reason) for a sandbox that died with wait
    ``status`` (-1: unknown) during a decode. ``oom_rose`` names an OOM-kill counter
    that rose meanwhile, if one did."""
    if status < 0:
        return MACHINE, False, "its zygote is gone, so its exit status is unknown"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number in FILE_SIGNALS:
            return FILE, False, ""
        if number == signal.SIGKILL and oom_rose:
            return MACHINE, False, f"the OOM killer ({oom_rose} rose)"
        return MACHINE, False, "a signal swift_safe_media did not send (from outside: an operator, a job " \
                               "scheduler, the OOM killer)"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) in START_EXIT_CODES:
        return MACHINE, False, "the sandbox could not start"
    return FILE, False, ""  # a decoder that ends the process mid-decode (exit(), _exit()) did so on this file


def crash_error(pid: int, status: int, peak_kib: int, oom_rose: str | None, path, elapsed: float) -> MediaDecodeError:
    """The error for sandbox ``pid`` that died (wait ``status``) during a decode of ``path``:
    a :class:`MediaDecodeCrash` when it is the file's (a signal the decode raised, memory
    near the sandbox's cap), else a :class:`MediaMachineFault`."""
    reason = f"sandbox pid {pid} died during the decode: {describe_status(status)}"
    cap = config.max_memory_mb()
    if cap and peak_kib >= 0.9 * cap * 1024:
        return MediaDecodeCrash(path, reason + f" (peak memory {peak_kib >> 10} MB, near the {cap} MB cap)", elapsed)
    fault, ambiguous, why = crash_verdict(status, oom_rose)
    if fault == MACHINE:
        return MediaMachineFault(path, f"{reason}; a machine fault, not the file's: {why}", elapsed)
    error = MediaDecodeCrash(path, reason, elapsed)
    error.ambiguous = ambiguous
    return error


def describe_status(status: int) -> str:
    """A wait status in words ("killed by signal 9 (SIGKILL)", "exited with code 3")."""
    if status < 0:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {number} ({name})"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def is_machine_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is a machine resource that ran out."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in MACHINE_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# -- whom this process works for ------------------------------------------------------
_parent = os.getppid()  # this process's parent as it started (a DataLoader worker's: its trainer)


def _remember_parent() -> None:
    global _parent
    _parent = os.getppid()


os.register_at_fork(after_in_child=_remember_parent)


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie too)."""
    try:
        descriptor = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return not os.path.exists(f"/proc/{pid}")
    try:
        poller = select.poll()
        poller.register(descriptor, select.POLLIN)
        return bool(poller.poll(0))
    finally:
        os.close(descriptor)


def caller_gone() -> bool:
    """Whether the process this one decodes for is gone: a DataLoader worker whose trainer
    was killed. Its machine faults are not retried (the zygote that died went with the
    trainer, and nobody waits for the sample)."""
    from ..workers.trainer_watchdog import TrainerWatchdog

    if TrainerWatchdog.trainer:  # forked from the warm forkserver: the trainer, not the parent
        return _exited(TrainerWatchdog.trainer)
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None and os.getppid() != _parent


# -- the OOM killer -------------------------------------------------------------------
def _cgroup_paths() -> list[tuple[str, str]]:
    """(hierarchy's controllers, path) of this process's cgroups; ("", path) is v2."""
    try:
        with open("/proc/self/cgroup") as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.append((parts[1], parts[2]))
    return found


@functools.lru_cache(maxsize=8)
def cgroup_files(v1_controller: str, v1_name: str, v2_name: str) -> tuple[str, ...]:
    """The files named so of this process's cgroup and its ancestors that exist here:
    ``v2_name`` in the unified hierarchy, ``v1_name`` in the ``v1_controller`` one."""
    found = []
    for controllers, path in _cgroup_paths():
        if controllers == "":
            mounts, name = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), v2_name
        elif v1_controller in controllers.split(","):
            mounts, name = (f"/sys/fs/cgroup/{controllers}", f"/sys/fs/cgroup/{v1_controller}"), v1_name
        else:
            continue
        for mount in mounts:
            folder = os.path.normpath(mount + path)
            while folder.startswith(mount):
                candidate = os.path.join(folder, name)
                if os.path.isfile(candidate) and candidate not in found:
                    found.append(candidate)
                if folder == mount:
                    break
                folder = os.path.dirname(folder)
    return tuple(found)


def keyed_value(path: str, key: str) -> int | None:
    try:
        with open(path) as counters:
            for line in counters:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_kills() -> dict[str, int]:
    """Every OOM-kill counter readable here: the kernel's, and each cgroup's up to the root."""
    counters = {}
    for path in ("/proc/vmstat",) + cgroup_files("memory", "memory.oom_control", "memory.events"):
        value = keyed_value(path, "oom_kill")
        if value is not None:
            counters[path] = value
    return counters


def risen(before: dict[str, int], after: dict[str, int]) -> str | None:
    """The first counter that rose between two readings of :func:`oom_kills`."""
    for path, value in after.items():
        if value > before.get(path, value):
            return f"{path} oom_kill {before[path]} -> {value}"
    return None


# -- an exception raised in a sandbox, as the caller raises it ------------------------------
class RemoteTraceback(Exception):
    """Carries the sandbox-side traceback as the ``__cause__`` of a re-raised exception."""

    def __str__(self):
        return self.args[0]


def rebuild_exception(exc, details, path, elapsed, pid):
    if exc is None:
        return MediaDecodeError(path, f"{details['type']}: {details['message']}\n{details['traceback']}",
                                elapsed)
    if isinstance(exc, MediaDecodeError):
        exc = exc.with_context(path, elapsed)
    exc.__cause__ = RemoteTraceback(f"\n\"\"\"\n{details['traceback']}\"\"\"")
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised in swift_safe_media sandbox pid {pid}"
                     + (f" while decoding {path}" if path is not None else ""))
    return exc
