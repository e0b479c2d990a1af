"""The fair clock against real threads kept from the CPU by processes spinning on these
cores, read as a caller that was itself kept from its CPU reads it: late, once the
decoder's threads have ended. The main thread's time in the run queue counts from the
call's start, and threads that ended before the first reading still count, whether the clock
read the call's start itself (a sandbox's) or was handed it (a DataLoader worker's mark).
(Under a loaded CI machine, a valid decode was refused when neither counted.)"""

import json
import os
import subprocess
import sys
import time

import pytest

from swift_safe_media.engine.fair_clock import FairClock

from .fresh import ROOT

# Alone, after the side-by-side part of `make test`: these tests take the CPUs themselves.
pytestmark = pytest.mark.serial


@pytest.fixture
def cpus_taken():
    """Two processes spinning per CPU, each in a session of its own (as a sandbox is)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(2 * len(os.sched_getaffinity(0)))]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def clock_over_threads(threads: int, seconds: float, main_seconds: float, route: str = "sandbox"):
    """A clock started as the child's call begins, first read only after the call's work is
    done: what it counts as kept from a CPU, and what the child's threads say they waited.
    ``route``: ``sandbox``, the clock reads the child's start itself, as for a sandbox's call;
    ``worker``, the child reads it and hands it over, as a DataLoader worker's mark does."""
    child = subprocess.Popen([sys.executable, "-m", "tests.programs.threads_that_wait", str(threads), str(seconds),
                              str(main_seconds)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        clock = FairClock(child.pid, timeout=0.01, ceiling=1000)
        child.stdin.write("go\n")
        child.stdin.flush()
        start = json.loads(child.stdout.readline())
        if route == "worker":
            assert start["times"][0] == child.pid  # its main thread's
            clock = FairClock(child.pid, timeout=0.01, ceiling=1000, started=start["monotonic"],
                              started_boot=start["boot"], start_times=tuple(start["times"]))  # as the trainer makes it
        report = json.loads(child.stdout.readline())
        assert clock.tick()  # past the deadline at the first reading: a window more
        time.sleep(clock.window)
        assert not clock.tick()  # the work is done: nothing more to wait for
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    return clock.waited, report


def test_the_main_threads_wait_before_the_first_reading_counts(cpus_taken):
    waited, report = clock_over_threads(0, 0.0, 0.2)
    main_waited = report["main"][1]
    print(f"main thread: {main_waited:.3f} s in the run queue over {report['took']:.3f} s; the clock: {waited:.3f} s")
    assert main_waited > 0.05, report  # the premise: it was kept from the CPU
    assert 0.9 * main_waited <= waited <= report["took"] + 0.05


@pytest.mark.parametrize("route", ["sandbox", "worker"])
def test_threads_that_ended_before_the_first_reading_still_count(cpus_taken, route):
    waited, report = clock_over_threads(2, 0.15, 0.05, route)
    threads_waited = min(wait for _, wait in report["threads"])
    main_waited = report["main"][1]
    print(f"threads: {report['threads']}, main thread {report['main']}, over {report['took']:.3f} s; "
          f"the clock: {waited:.3f} s")
    assert threads_waited > 0.05, report  # the premise: they were kept from the CPU
    # They count: more than the main thread alone saw, by a clear share of what they waited.
    # Not all of it: the kernel keeps no thread's wait once it has ended, so the clock gives
    # their CPU time the seen threads' share of waiting (one CI run: they waited 0.48 s each,
    # the main thread 0.04 s of its 0.05 s; the clock counted 0.31 s).
    assert waited >= main_waited + 0.25 * threads_waited, report
    assert waited <= report["took"] + 0.05
