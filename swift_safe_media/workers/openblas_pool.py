"""OpenBLAS's thread pool around the trainer's fork of the warm forkserver's template.

numpy's OpenBLAS starts its pool (one thread per core but one) as it loads, and a thread of
the trainer stops that fork (:mod:`.forked_forkserver`). OpenBLAS keeps its own pool safe
across a fork: its ``pthread_atfork`` handler stops the pool before every fork, and the pool
starts again at its next use, with as many threads. :func:`stop` does the same ahead of the
count of the trainer's threads, through ``blas_thread_shutdown_``, where the library exports
it (the scipy-openblas of numpy up to 2.4). A build that does not (numpy 2.5's scipy-openblas
0.3.34 keeps it hidden) stops its pool only at the fork itself: :func:`stop` says so, and the
trainer counts its threads again once it has forked (:func:`threads_once_forked`), which is
when the pool's threads are gone if they were the only others.
"""

from __future__ import annotations

import ctypes
import time

from .. import process

SHUTDOWN = "blas_thread_shutdown_"  # OpenBLAS's own, which its fork handler calls
# A joined thread may stay listed in /proc a moment after its join (longer on a loaded machine,
# where the exiting thread waits for a core); waited only where another thread is listed.
_GONE_PATIENCE_S = 0.2


def loaded() -> list[str]:
    """The OpenBLAS libraries this process has loaded (numpy's and torch's may be two)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps
                           if "openblas" in line.rsplit("/", 1)[-1].lower() and "/" in line})
    except OSError:
        return []


def stop() -> bool:
    """Stop the pool of every OpenBLAS loaded, as its fork handler does. False where one of
    them does not export how: its pool, if it runs, stops only as this process forks."""
    stopped = True
    for path in loaded():
        try:
            getattr(ctypes.CDLL(path), SHUTDOWN)()
        except AttributeError:
            stopped = False
        except OSError:
            pass
    return stopped


def threads_once_forked(fork_safe: frozenset) -> list[str]:
    """This process's threads but ``fork_safe`` ones, read just after it forked: a thread
    listed then ran through the fork (one that OpenBLAS's handler stopped is gone)."""
    deadline = time.monotonic() + _GONE_PATIENCE_S
    while True:
        threads = [name for name in process.thread_names() if name not in fork_safe]
        if len(threads) <= 1 or time.monotonic() > deadline:
            return threads
        time.sleep(0.001)
