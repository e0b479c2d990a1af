"""Sandboxes for code that opens its media by name (``BY_NAME``, ``PROGRAMS``): brokered ones,
pooled, where the kernel can (``BY_NAME``: :func:`ask_pooled`, :func:`listening`), else
sandboxes that serve one call each: the next one forked ahead, and the last one kept for the
next call on the same files.

A brokered sandbox is confined as it starts, no media readable, and sends its caller the
listener of its opens by name (:mod:`..confinement.broker`); the caller answers them during
each call, handing the sandbox its own copy of a file handed with that call, so that call may
read what a sandbox per call could (its files, no file more) in a sandbox that served the calls
before it.

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

A pooled sandbox may be asked for ahead too (:func:`take_asked`): a DataLoader worker's first,
forked while the worker unpickles its arguments (:mod:`..workers.first_sandbox`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time

from .. import config
from ..confinement import broker as confine_broker
from .sandbox_kinds import imports_before_fork
from .zygote import spawn_request

log = logging.getLogger("swift_safe_media")


def _pooled_request(pool) -> tuple:
    """(memory cap, confined, imports, broker) of a pooled sandbox of ``pool`` asked for now;
    brokered: for calls by name, its opens answered by this process; a download's (deferred):
    confined as each call begins."""
    if pool.brokered:
        return config.max_memory_mb(), True, imports_before_fork(), os.getpid()
    return config.max_memory_mb(), pool.confined, () if pool.deferred else None, None


def ask_pooled(pool, zygote):
    """A pooled sandbox of ``pool``, asked for (:meth:`.Zygote.spawn_ahead`)."""
    return zygote.spawn_ahead(*_pooled_request(pool))


def take_asked(pool, zygote, deadline: float):
    """The pooled sandbox asked for ahead (:meth:`.SandboxPool.ask_ahead`) if one asked for now
    would be the same; else None."""
    memory_cap_mb, _, imports, broker = _pooled_request(pool)
    return _take_spare(pool, zygote, deadline, memory_cap_mb, imports, broker)


def _take_spare(pool, zygote, deadline: float, memory_cap_mb: int, imports, broker=None):
    """``pool``'s sandbox asked for ahead, if a request made now would be the same (zygote, cap,
    environment, imports: :meth:`.SpawnAhead.matches`); else None, and one that no longer fits
    is ended (one of a zygote dropped since died with it)."""
    spare, pool._spare = pool._spare, None
    if spare is None or spare.zygote is not zygote:
        return None
    box = spare.sandbox(deadline)
    if spare.matches(zygote, memory_cap_mb, imports, broker):
        return box
    box.kill()
    zygote.retire(box.pid)
    return None


# A brokered sandbox runs code we do not own call after call: code that leaves a file open
# each call (a sandbox per call never noticed) would run it out of descriptors. It is replaced
# once it holds this many (some 20 after its first call).
MOST_DESCRIPTORS = 256


def worn_out(box) -> bool:
    """Whether a brokered sandbox, after a call, holds so many descriptors it is to be replaced."""
    try:
        return len(os.listdir(f"/proc/{box.pid}/fd")) > MOST_DESCRIPTORS
    except OSError:
        return False


def still_fits(box) -> bool:
    """Whether a brokered sandbox, idle, was started with what a call now would get (the
    environment, the zygote's imports): else its successor takes them."""
    return box.request == spawn_request(imports_before_fork(), os.getpid())


def listening(pool, box, deadline: float):
    """``box`` once it has sent the listener of its opens; where it could not listen (a kernel
    older than it looked), this pool starts a sandbox per call from now on, and one now."""
    try:
        box.listener = confine_broker.receive_listener(box.conn, box.pid, deadline)
        return box
    except confine_broker.NoListener as exc:
        log.warning("swift_safe_media: %s; code that opens its media by name gets a sandbox per call", exc)
        pool.brokered = False
        pool._end(box)
        return pool._spawn(deadline)
    except BaseException:
        pool._end(box)
        raise


@contextlib.contextmanager
def answering_opens(box, message):
    """During a call: a brokered sandbox's opens of the files handed with it (``message.handed``)
    are answered here, from copies taken before the message sends and closes them."""
    if box.listener < 0:
        yield
        return
    box.broker = confine_broker.Broker(box.listener, getattr(message, "handed", ()))
    try:
        yield
    finally:
        box.broker.close()
        box.broker = None


def answer_opens_until_readable(box, poller, clock) -> None:
    """Wait for the sandbox's next message as :func:`.pool._receive` does (TimeoutError once
    the clock says so), answering its opens as they come."""
    poller.register(box.listener, select.POLLIN)
    listening = True
    try:
        while True:
            ready = dict(poller.poll(max(clock.wake_at() - time.monotonic(), 0) * 1000))
            if box.conn.fileno() in ready:
                return
            if ready and listening:
                if ready[box.listener] & (select.POLLHUP | select.POLLERR):
                    poller.unregister(box.listener)  # nothing opens any more: it is ending
                    listening = False
                else:
                    box.broker.answer()
                if time.monotonic() < clock.wake_at():
                    continue
            if not clock.tick():
                raise TimeoutError
    finally:
        if listening:
            poller.unregister(box.listener)


def spare_sandbox(pool, zygote, deadline: float):
    """A sandbox for one call: the one asked for ahead (forked while the last call ran)
    when it fits this call, and the next one asked for now (the fork, some 20 ms of a
    zygote full of imports, is off the call's path)."""
    memory_cap_mb, imports = config.max_memory_mb(), imports_before_fork()
    box = _take_spare(pool, zygote, deadline, memory_cap_mb, imports)  # the one forked while the last call ran
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
