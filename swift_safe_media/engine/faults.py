"""Whose fault a failed decode is: the file's or the machine's.

A file's failure (a decode error, a timeout while its sandbox ran or waited on the
file, a signal the decode raised itself, the sandbox's own memory cap) may quarantine
the file. A machine's failure (a SIGKILL the engine did not send, the OOM killer, a
sandbox that could not start, a zygote or transport gone, a machine resource that ran
out) never does: the call retries it in a fresh sandbox (see :mod:`.calls`).

The readers here are what the kernel says about the machine:

- :class:`FairClock`: the time a sandbox lost to the run queue (from each thread's
  ``/proc/<pid>/task/<tid>/schedstat``: ns on a CPU, ns runnable but not running) or to
  its cgroup's CPU quota (``cpu.stat``) is added to its timeout, up to a ceiling
  (``SWIFT_SAFE_MEDIA_TIMEOUT_CEILING`` times the timeout), so a busy node makes a
  valid decode slower, never refused, and a stuck one still ends the call.
- :func:`oom_kills`: the OOM killer's counters (``/proc/vmstat``, and ``memory.events``
  (cgroup v2) or ``memory.oom_control`` (v1) of this process's cgroup and its
  ancestors); one that rose while a sandbox died of SIGKILL names the OOM killer.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import select
import signal
import sys
import time

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


def _keyed_value(path: str, key: str) -> int | None:
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
        value = _keyed_value(path, "oom_kill")
        if value is not None:
            counters[path] = value
    return counters


def risen(before: dict[str, int], after: dict[str, int]) -> str | None:
    """The first counter that rose between two readings of :func:`oom_kills`."""
    for path, value in after.items():
        if value > before.get(path, value):
            return f"{path} oom_kill {before[path]} -> {value}"
    return None


# -- fair timeouts --------------------------------------------------------------------
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _thread_times(pid: int, known: dict[int, float]) -> dict[int, tuple[int, int, float]]:
    """(ns on a CPU, ns runnable but not running, CLOCK_BOOTTIME seconds it started) of
    each thread of ``pid``; ``known`` caches the start times (they never change)."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for name in tids:
        tid = int(name)
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                ran, waited = (int(field) for field in stat.read().split()[:2])
            if tid not in known:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                    known[tid] = int(stat.read().rsplit(b")", 1)[1].split()[19]) * _TICK_S
        except (OSError, ValueError, IndexError):
            continue
        found[tid] = (ran, waited, known[tid])
    return found


def _stolen_ns() -> float:
    """ns of CPU time the hypervisor gave to other guests, per CPU of this machine: on a
    shared virtual machine a thread the kernel counts as running may not run at all."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = stat.readline().split()
        return int(fields[8]) * _TICK_S * 1e9 / (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def _throttled_ns() -> int:
    """ns this process's cgroups were throttled by a CPU quota (the largest of them)."""
    most = 0
    for path in cgroup_files("cpu", "cpu.stat", "cpu.stat"):
        microseconds = _keyed_value(path, "throttled_usec")  # v2
        nanoseconds = _keyed_value(path, "throttled_time") if microseconds is None else microseconds * 1000
        most = max(most, nanoseconds or 0)
    return most


def time_lost(waits: list[float], runs: list[float], elapsed: float) -> float:
    """Wall time a process lost to the run queue, from each thread's wait and run time
    over ``elapsed``. Its threads may wait side by side (the loss is the largest wait) or
    in turn, one idle while another waits for it (the loss is their sum), so: their sum,
    but never more than the time no thread ran (``elapsed`` less the longest run) nor less
    than the largest wait."""
    if not waits:
        return 0.0
    return max(max(waits), min(sum(waits), elapsed - max(runs)))


class FairClock:
    """The deadline of one call in a sandbox: ``timeout`` seconds of the sandbox running
    or waiting on its file, plus the time it was kept from a CPU, at most ``ceiling``
    times the timeout in all.

    Nothing is read in the first half of the timeout (most calls end there and cost no more
    than they did). From then on, each thread's run-queue wait and run time are read every
    window (20-100 ms), so a decoder's threads are seen before they end: one started since
    the call began is counted whole, from its last reading; an older thread is counted from
    the first reading, and its time before that is taken to have gone as its time since (the
    share it waited, times the time before).
    :func:`time_lost` turns the threads' times into the call's loss. Time its cgroup was
    throttled, or that the hypervisor stole from this machine's CPUs, counts too, where
    more."""

    def __init__(self, pid: int, timeout: float, ceiling: float):
        self.pid, self.timeout, self.ceiling = pid, timeout, max(ceiling, 1.0)
        self.window = min(0.1, max(0.02, 0.1 * timeout))
        self.restart()

    def restart(self, started: float | None = None, started_boot: float | None = None) -> None:
        """A new call begins (the next of a ``call_each`` batch): now, or at ``started``
        (``time.monotonic()``) and ``started_boot`` (CLOCK_BOOTTIME), where another process
        saw it begin."""
        self.started = time.monotonic() if started is None else started
        self.started_boot = time.clock_gettime(time.CLOCK_BOOTTIME) if started_boot is None else started_boot
        self.deadline = self.started + self.timeout
        self.waited, self.capped = 0.0, False
        # the first reading: half way to the deadline, while the threads a decode started still run
        self.next_reading = self.started + self.timeout / 2 if self.ceiling > 1 else math.inf
        self._mark = None  # (when, each thread's (run, wait), throttled ns, stolen ns) at the first reading
        self._seen: dict[int, tuple[int, int, float]] = {}  # each thread's last reading: one that ends still counts
        self._started_at: dict[int, float] = {}  # each thread's start (never changes)

    def wake_at(self) -> float:
        """When the caller should look again: the next reading, or the deadline."""
        return min(self.next_reading, self.deadline)

    def tick(self) -> bool:
        """At :meth:`wake_at`: a reading, and past the deadline its verdict (:meth:`extend`)."""
        now = time.monotonic()
        if now < self.deadline:
            self._read(now)
            return True
        return self.extend()

    def _read(self, now: float) -> None:
        """Each thread's times now, and the next reading a window later."""
        self._seen.update(_thread_times(self.pid, self._started_at))
        if self._mark is None:
            at_mark = {tid: (ran, waited) for tid, (ran, waited, _) in self._seen.items()}
            self._mark = (now, at_mark, _throttled_ns(), _stolen_ns())
        self.next_reading = now + self.window

    def _kept_from_cpu(self, now: float) -> float:
        """Seconds of the call the sandbox lost to the run queue, a CPU quota or the hypervisor."""
        marked, at_mark, throttled, stolen = self._mark
        scale = (now - self.started) / max(now - marked, 1e-3)  # an older thread's time since the mark, whole
        # started since the call began, to the clock tick the kernel rounds start times down to
        begun = self.started_boot - _TICK_S
        waits, runs = [], []
        for tid, (ran, waited, born) in self._seen.items():
            if born > begun:
                waits.append(waited / 1e9)
                runs.append(ran / 1e9)
            else:
                ran_before, waited_before = at_mark.get(tid, (ran, waited))
                waits.append((waited - waited_before) / 1e9 * scale)
                runs.append((ran - ran_before) / 1e9 * scale)
        machine = max(_throttled_ns() - throttled, _stolen_ns() - stolen, 0) / 1e9 * scale
        return max(time_lost(waits, runs, now - self.started), machine)

    def extend(self) -> bool:
        """At the deadline: move it by the time kept from a CPU so far (up to the ceiling).
        True when there is time left, False when the call has had its time."""
        now = time.monotonic()
        if self.ceiling <= 1:
            return False
        first = self._mark is None
        self._read(now)
        if first:  # nothing to compare with yet: a window more
            self.deadline = now + self.window
            return True
        most = self.timeout * (self.ceiling - 1)
        self.waited = min(self._kept_from_cpu(now), most)
        self.capped = self.waited >= most - 1e-3
        self.deadline = self.started + self.timeout + self.waited
        return self.deadline - now > 0.005

    def describe(self) -> str:
        """What the timeout message adds about the CPU."""
        if self.waited < 0.01:
            return ""
        text = f", not counting {self.waited:.2f} s it waited for a CPU"
        if self.capped:
            text += f" (the ceiling: {self.ceiling:g}x the timeout; SWIFT_SAFE_MEDIA_TIMEOUT_CEILING)"
        return text


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
