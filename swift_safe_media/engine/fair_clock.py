"""The fair clock: a call's deadline that does not count the time its process was kept
from a CPU, so a busy node makes a valid decode slower, never refused, and a stuck one
still ends the call.

What the kernel says about a process, read here:

- each thread's ``/proc/<pid>/task/<tid>/schedstat``: ns on a CPU, ns runnable but not
  running (the run queue);
- the process's CPU time, its ended threads' included (its CPU-time clock);
- its cgroup's time throttled by a CPU quota (``cpu.stat``), and the time the hypervisor
  stole from this machine's CPUs (``/proc/stat``).

Used for a sandbox's call (:mod:`.pool`) and for a decode a DataLoader worker makes itself
(:mod:`..workers.decode_deadline`).
"""

from __future__ import annotations

import math
import os
import threading
import time

from .faults import cgroup_files, keyed_value

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_LEAST_SEEN_S = 0.005  # CPU seconds of the seen threads that tell the share the unseen ones waited
_CPUCLOCK_SCHED = 2  # a process CPU-time clock that counts in ns, as clock_getcpuclockid(3) makes it


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
            ran, waited = _schedstat(f"/proc/{pid}/task/{tid}/schedstat")
            if tid not in known:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                    known[tid] = int(stat.read().rsplit(b")", 1)[1].split()[19]) * _TICK_S
        except (OSError, ValueError, IndexError):
            continue
        found[tid] = (ran, waited, known[tid])
    return found


def _schedstat(path: str) -> tuple[int, int]:
    """(ns on a CPU, ns in the run queue) of one thread: one short read."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        ran, waited = (int(field) for field in os.read(descriptor, 128).split()[:2])
    finally:
        os.close(descriptor)
    return ran, waited


def _at_start(pid: int) -> tuple[int, int, int, int] | None:
    """(its id, ns on a CPU, ns in the run queue) of ``pid``'s main thread, and ns of CPU
    its threads have had: one short read and one clock (a few microseconds)."""
    try:
        return (pid, *_schedstat(f"/proc/{pid}/schedstat"), _cpu_ns(pid))
    except (OSError, ValueError):
        return None


def this_thread_at_start() -> tuple[int, int, int, int] | None:
    """:func:`_at_start` of the calling thread and its process, read by itself: for a clock
    another process keeps (a DataLoader worker's mark, read by its trainer)."""
    try:
        return (threading.get_native_id(), *_schedstat("/proc/thread-self/schedstat"), time.process_time_ns())
    except (OSError, ValueError):
        return None


def _cpu_ns(pid: int) -> int:
    """ns of CPU every thread of ``pid`` has had, ended ones included: its process CPU-time
    clock, as ``clock_getcpuclockid(pid)`` names it (the kernel's encoding of the pid)."""
    return time.clock_gettime_ns((~pid << 3) | _CPUCLOCK_SCHED)


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
        microseconds = keyed_value(path, "throttled_usec")  # v2
        nanoseconds = keyed_value(path, "throttled_time") if microseconds is None else microseconds * 1000
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
    """The deadline of one call in a process: ``timeout`` seconds of it running or waiting
    on its file, plus the time it was kept from a CPU, at most ``ceiling`` times the
    timeout in all.

    As a call starts here (:meth:`restart` without a time), the main thread's times and
    the process's CPU time are read: two short reads. (A DataLoader worker reads them for
    its calling thread itself, and its mark carries them.) From half the timeout on, the
    threads are read every window (20-100 ms), so a decoder's threads are seen before they
    end. A thread started since the call began counts whole, from its last reading; the
    main (calling) thread counts from the call's start. Another thread older than the call,
    or the main thread of a call whose start was not read, counts from the first reading,
    and its time before that is taken to have gone as its time since. A thread that ended
    unseen (the caller itself kept from its CPU past the readings) shows as CPU time of
    the process that no seen thread had: it is taken to have waited as the seen threads
    did. :func:`time_lost` turns the threads' times into the call's loss. Time its cgroup
    was throttled, or that the hypervisor stole from this machine's CPUs, counts too, where
    more."""

    def __init__(self, pid: int, timeout: float, ceiling: float, started: float | None = None,
                 started_boot: float | None = None, start_times: tuple[int, int, int, int] | None = None):
        self.pid, self.timeout, self.ceiling = pid, timeout, max(ceiling, 1.0)
        self.window = min(0.1, max(0.02, 0.1 * timeout))
        self.restart(started, started_boot, start_times)

    def restart(self, started: float | None = None, started_boot: float | None = None,
                start_times: tuple[int, int, int, int] | None = None) -> None:
        """A new call begins (the next of a ``call_each`` batch): now, or at ``started``
        (``time.monotonic()``) and ``started_boot`` (CLOCK_BOOTTIME), where another process
        saw it begin, and read its calling thread's times then (``start_times``, from
        :func:`this_thread_at_start`)."""
        self.started = time.monotonic() if started is None else started
        self.started_boot = time.clock_gettime(time.CLOCK_BOOTTIME) if started_boot is None else started_boot
        self.deadline = self.started + self.timeout
        self.waited, self.capped = 0.0, False
        if started is None:
            start_times = _at_start(self.pid) if self.ceiling > 1 else None
        self._start = start_times  # (calling thread's id, its ns on a CPU and in the run queue, process CPU ns)
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
        """Seconds of the call the process lost to the run queue, a CPU quota or the hypervisor."""
        marked, at_mark, throttled, stolen = self._mark
        scale = (now - self.started) / max(now - marked, 1e-3)  # an older thread's time since the mark, whole
        # started since the call began, to the clock tick the kernel rounds start times down to
        begun = self.started_boot - _TICK_S
        waits, runs = [], []
        for tid, (ran, waited, born) in self._seen.items():
            if born > begun:
                waits.append(waited / 1e9)
                runs.append(ran / 1e9)
            elif self._start is not None and tid == self._start[0]:
                waits.append((waited - self._start[2]) / 1e9)
                runs.append((ran - self._start[1]) / 1e9)
            else:
                ran_before, waited_before = at_mark.get(tid, (ran, waited))
                waits.append((waited - waited_before) / 1e9 * scale)
                runs.append((ran - ran_before) / 1e9 * scale)
        self._add_unseen(waits, runs, now - self.started)
        machine = max(_throttled_ns() - throttled, _stolen_ns() - stolen, 0) / 1e9 * scale
        return max(time_lost(waits, runs, now - self.started), machine)

    def _add_unseen(self, waits: list[float], runs: list[float], elapsed: float) -> None:
        """The threads that ended unseen, as one more: the process's CPU time since the call
        began that no seen thread had, waiting in the same share as the seen ones, but no
        longer than one thread could have."""
        if self._start is None or sum(runs) < _LEAST_SEEN_S:  # too little seen to tell a share by
            return
        try:
            unseen = (_cpu_ns(self.pid) - self._start[3]) / 1e9 - sum(runs)
        except OSError:  # it has gone
            return
        if unseen > 0:
            waits.append(min(unseen * sum(waits) / sum(runs), elapsed - unseen))
            runs.append(unseen)

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
