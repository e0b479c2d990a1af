"""Sandboxes that serve one call each (``BY_NAME``, ``PROGRAMS``): the next one forked
ahead, and the last one kept for the next call on the same files.

Such a sandbox is confined as its call begins, with read rules for exactly that call's
files (:func:`.sandbox.confine_then_call`). Its cost is the fork and, mostly, the first
use of a fresh process (some 4,500 page faults on a first PyAV read, measured): 40-80 ms
a call against a pooled sandbox. Two things take it off the call's path:

- **the spare** (:func:`spare_sandbox`): the next call's sandbox is asked for while this
  one runs (:meth:`.Zygote.spawn_ahead`);
- **the kept sandbox** (:func:`take_kept`, :func:`keep`): a host often reads one file
  several times in a row (LLaMA-Factory's preprocessing: a row's video frames, its stream
  metadata, its audio), so a by-name sandbox outlives its call, and the next call on the
  very same files runs there: its rules are the ones that call would get (no file more,
  none less); a call on other files ends it. A sandbox that runs ffmpeg
  is never kept (its writable folder goes with its call).
"""

from __future__ import annotations

from .. import config
from .sandbox_kinds import imports_before_fork
from .zygote import spawn_request


def spare_sandbox(pool, zygote, deadline: float):
    """A sandbox for one call: the one asked for ahead (forked while the last call ran)
    when it fits this call, and the next one asked for now (the fork, some 20 ms of a
    zygote full of imports, is off the call's path)."""
    memory_cap_mb, imports = config.max_memory_mb(), imports_before_fork()
    spare, pool._spare = pool._spare, None
    box = None
    if spare is not None and spare.zygote is zygote:
        box = spare.sandbox(deadline)
        if not spare.matches(zygote, memory_cap_mb, imports):  # the environment changed since
            box.kill()
            zygote.retire(box.pid)
            box = None
    if box is None:
        box = zygote.spawn(memory_cap_mb, deadline, pool.confined, imports)
    pool._spare = zygote.spawn_ahead(memory_cap_mb, pool.confined, imports)
    return box


def take_kept(pool, grants):
    """The kept sandbox, checked out, if it was confined for exactly the files of ``grants``; else None."""
    if grants is None:
        return None
    with pool._lock:
        box = pool._kept
        if box is None or grants != box.grants or box.memory_cap_mb != config.max_memory_mb() \
                or box.request != spawn_request(imports_before_fork()) \
                or not box.is_alive() or not pool._link.serves(box.origin):
            return None  # the environment, the imports or the cap changed since: a new one
        pool._kept = None
        pool._busy += 1
        return box


def keep(pool, box) -> bool:
    """After a call: keep ``box`` (a by-name sandbox that served it) for the next call,
    ending the one kept before. False where it is not to be kept (no grants: one that runs
    ffmpeg, or whose files could not be told)."""
    if box.grants is None or not box.is_alive():
        return False
    with pool._lock:
        if pool._closed:
            return False
        previous, pool._kept = pool._kept, box
        pool._busy -= 1
        pool._lock.notify()
    if previous is not None:
        end(pool, previous)
    return True


def end(pool, box) -> None:
    """Kill a sandbox of one call and have its zygote collect it."""
    box.kill()
    with pool._link.lock:
        try:
            if pool._link.serves(box.origin):
                box.origin.retire(box.pid)
        except OSError:
            pool._link.drop()
