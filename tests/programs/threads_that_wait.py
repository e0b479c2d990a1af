"""Threads that burn CPU natively and end, each reporting its own time in the run queue:
``python -m tests.programs.threads_that_wait THREADS SECONDS MAIN_SECONDS``.

Prints ``ready``, waits for a line on stdin, prints where its call begins (a JSON line: its
clocks, and its main thread's times as a DataLoader worker's mark carries them), then runs
THREADS threads of SECONDS of CPU each (hashing, the GIL released) and joins them, burns MAIN_SECONDS of CPU in the main
thread, prints one JSON line (each thread's and the main thread's seconds on a CPU and in
the run queue, from their own ``schedstat``, and the seconds it all took) and sleeps until
stdin closes."""

import hashlib
import json
import sys
import threading
import time

from swift_safe_media.engine.fair_clock import this_thread_at_start

BUFFER = bytes(1 << 20)


def schedstat() -> tuple[float, float]:
    with open("/proc/thread-self/schedstat") as stat:
        ran, waited = (int(field) / 1e9 for field in stat.read().split()[:2])
    return ran, waited


def burn(seconds: float, into: list) -> None:
    ran, waited = schedstat()
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        hashlib.sha256(BUFFER).digest()
    ran_now, waited_now = schedstat()
    into.append((ran_now - ran, waited_now - waited))


def main() -> None:
    threads, seconds, main_seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    print("ready", flush=True)
    sys.stdin.readline()
    began = time.monotonic()
    print(json.dumps({"monotonic": began, "boot": time.clock_gettime(time.CLOCK_BOOTTIME),
                      "times": this_thread_at_start()}), flush=True)
    ended: list = []
    workers = [threading.Thread(target=burn, args=(seconds, ended)) for _ in range(threads)]
    mine: list = []
    ran, waited = schedstat()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    burn(main_seconds, mine)
    ran_now, waited_now = schedstat()
    print(json.dumps({"threads": ended, "main": (ran_now - ran, waited_now - waited),
                      "took": time.monotonic() - began}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
