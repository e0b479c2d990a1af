"""The pool behind ``call``: one pool of sandboxes per calling process (one sandbox unless
``SWIFT_SAFE_MEDIA_SANDBOXES`` says more). Threads of one process share the pool: a caller waits
for a free sandbox, and the timeout counts only the time its function runs, so a slow neighbour
never turns into a false timeout. A DataLoader worker or a forked child starts a pool of its own.

:meth:`SandboxPool.run` is one exchange with a sandbox: send the request, wait for the result under
the timeout, and on overrun or death kill the sandbox, start its successor at once and raise the
typed error. Sandboxes come from :mod:`.zygote`; inside: :mod:`.sandbox`.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time

from .. import config, process
from ..confinement import broker as confine_broker, handed, policy as confine, reply_unpickler
from ..errors import MACHINE, MediaDecodeError, MediaDecodeTimeout, MediaMachineFault
from . import fair_clock, faults, per_call, run_folders, sandbox as sandbox_side, transport
from .faults import RemoteTraceback, describe_status  # noqa: F401  (RemoteTraceback: part of the API)
from .sandbox_kinds import (BY_NAME, NETWORK, PER_CALL, PROGRAMS, by_name, forget_sandbox_setup, import_before_fork,  # noqa: F401
                            refuse_what_cannot_be_handed, sandbox_setups, set_up_sandboxes)
from .zygote import SandboxHandle
from .zygote_link import ZygoteLink, for_this_process

log = logging.getLogger("swift_safe_media")


class SandboxPool:
    """A pool of sandboxes: confined ones (the default), unconfined ones for fetches and
    functions that need the network, or (``BY_NAME``) confined ones whose call's files are
    readable by name: pooled, their opens answered here where the kernel can, else one per call."""

    def __init__(self, confined: bool | str = True, link: ZygoteLink | None = None):
        self.deferred, self.network, self.programs = confined in PER_CALL, confined == NETWORK, confined == PROGRAMS
        self.brokered = confined == BY_NAME and confine_broker.available()  # opens answered here: per_call.listening
        self.confined = bool(confined)
        self._lock = threading.Condition()
        self._link = link or ZygoteLink(self.confined)  # the zygote, shared with this process's other pools
        self._spare = None  # the next sandbox, asked for ahead (zygote.SpawnAhead): per call, or a worker's first
        self._kept = None  # per call: the last one, kept for a call on the same files (per_call.keep)
        self._idle: list[SandboxHandle] = []
        self._busy = 0
        self._closed = False
        self.stats = {"calls": 0, "timeouts": 0, "crashes": 0, "sandboxes_started": 0, "last_kill_to_ready_s": None}
        self._oom_kills = faults.oom_kills()  # the OOM killer's counters, as last read

    @property
    def per_call(self) -> bool:
        """A sandbox of its own for each call, confined as it begins: ``deferred``, opens not brokered, not a
        download's (it reads no file by name: every call's grants are alike; a stream keeps its file open)."""
        return self.deferred and not self.network and not self.brokered

    # -- pool ---------------------------------------------------------------------
    def _checkout(self) -> SandboxHandle:
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError("swift_safe_media engine is shut down")
                self._drop_orphaned_sandboxes()
                memory_cap_mb = config.max_memory_mb()
                while self._idle:
                    box = self._idle.pop()
                    if not box.is_alive():
                        self._discard_quietly(box)
                    elif box.memory_cap_mb != memory_cap_mb or (self.brokered and not per_call.still_fits(box)):
                        # SWIFT_SAFE_MEDIA_MAX_MEMORY_MB changed since it started: a sandbox
                        # cannot raise or lower its own cap, so its successor takes the new one
                        # (a brokered one, also the environment and imports of a call by name).
                        self._end(box)
                    else:
                        self._busy += 1
                        return box
                if self._busy < config.max_sandboxes():
                    self._busy += 1
                    break
                self._lock.wait()
        try:
            return self._spawn()
        except BaseException:
            with self._lock:
                self._busy -= 1
                self._lock.notify()
            raise

    def _drop_orphaned_sandboxes(self) -> None:
        """Sandboxes of a dead (or replaced) zygote are dying of PR_SET_PDEATHSIG, maybe not dead yet."""
        orphans = [box for box in self._idle if not self._link.serves(box.origin)]
        for box in orphans:
            box.kill()
            self._idle.remove(box)

    def _checkin(self, box: SandboxHandle) -> None:
        with self._lock:
            self._busy -= 1
            self._idle.append(box)
            self._lock.notify()

    def _done_with(self, box: SandboxHandle) -> None:
        """After a call: the sandbox back to the pool, or, one for a single call, ended."""
        if self.brokered and per_call.worn_out(box):
            self._end(box)
            self._release_slot()
            return
        if not self.per_call:
            self._checkin(box)
            return
        if not per_call.keep(self, box):
            per_call.end(self, box)
            self._release_slot()

    def _release_slot(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify()

    def ask_ahead(self) -> None:
        """Have the zygote fork this pool's next sandbox now; the next start takes it if it
        still fits (``workers.first_sandbox``: while a DataLoader worker unpickles)."""
        with self._link.lock:
            if self._spare is None and not self.per_call:
                self._spare = per_call.ask_pooled(self, self._link.current())

    def _spawn(self, deadline: float | None = None) -> SandboxHandle:
        deadline = deadline or time.monotonic() + config.start_timeout()
        link = self._link
        with link.lock:
            while True:
                zygote = link.current()
                try:
                    if self.per_call:
                        box = per_call.spare_sandbox(self, zygote, deadline)
                    else:
                        box = per_call.take_asked(self, zygote, deadline) or \
                            per_call.ask_pooled(self, zygote).sandbox(deadline)
                    break
                except (OSError, EOFError) as exc:
                    shared = zygote.process is None
                    link.drop()  # a reply may still be on its way: the channel is out of step
                    # A slow answer is not a dead zygote (it may be importing, or forking
                    # for another caller): only a refused or broken connection is.
                    if not shared or isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                        raise
                    link.shared_unusable(exc)  # then once more, with a zygote of our own
                except BaseException:
                    link.drop()
                    raise
        box.origin = zygote
        self.stats["sandboxes_started"] += 1
        return per_call.listening(self, box, deadline) if self.brokered else box

    def _end(self, box: SandboxHandle) -> tuple[int, int]:
        """Kill the sandbox's whole process group, then collect its exit status."""
        box.kill()
        with self._link.lock:
            if not self._link.serves(box.origin):
                return -1, 0
            try:
                return box.origin.reap(box.pid, time.monotonic() + 5.0)
            except (OSError, EOFError):
                self._link.drop()
                return -1, 0

    def _discard_quietly(self, box: SandboxHandle) -> None:
        status, _ = self._end(box)
        log.warning("swift_safe_media: an idle sandbox (pid %d) had died (%s); replaced",
                    box.pid, describe_status(status))

    def _replace(self, box: SandboxHandle) -> tuple[int, int]:
        """End a failed sandbox and start its successor now, so the next call finds it ready."""
        killed_at = time.monotonic()
        status = self._end(box)
        if not self._link.serves(box.origin):
            self._release_slot()  # restarting a zygote takes seconds: leave it to the next call
            return status
        try:
            # Bounded, so the caller's error is never held up by a slow fork.
            successor = self._spawn(deadline=killed_at + 2.0)
        except BaseException as exc:
            log.warning("swift_safe_media: could not start a replacement sandbox yet: %s", exc)
            self._release_slot()
        else:
            self.stats["last_kill_to_ready_s"] = time.monotonic() - killed_at
            self._checkin(successor)
        return status

    # -- calls --------------------------------------------------------------------
    def run(self, fn, args, kwargs, timeout: float, path, on_progress=None, on_start=None,
            restart_on_progress: bool = True, files=None):
        """``on_start()`` is called once a sandbox is ready and set up, as the call itself
        starts; ``on_progress(payload)`` as the sandbox reports progress, returning the path a
        failure from then on is pinned on (and, with ``restart_on_progress``, the timeout
        starts again: the next call of a ``call_each`` batch has begun). ``files``: what a
        sandbox per call may open by name (default: ``path``)."""
        if self.deferred:
            readable = [handed.hand(os.path.abspath(name)) for name in (files or [path])
                        if isinstance(name, (str, os.PathLike)) and not self.network]
            grants = refuse_what_cannot_be_handed(readable)
            scratch = run_folders.scratch_for_call() if self.programs else None
            fn, args, kwargs = sandbox_side.confine_then_call, (readable, fn, args, kwargs, self.network, scratch), {}
            try:
                return self._run(fn, args, kwargs, timeout, path, on_progress, on_start, restart_on_progress,
                                 grants if self.per_call and not self.programs else None)
            finally:
                if scratch is not None:
                    run_folders.remove_scratch(scratch)  # its sandbox has ended (retired or killed)
        return self._run(fn, args, kwargs, timeout, path, on_progress, on_start, restart_on_progress)

    def _run(self, fn, args, kwargs, timeout, path, on_progress, on_start, restart_on_progress, grants=None):
        message, fd, owned = transport.encode_request(fn, args, kwargs)
        try:
            box = per_call.take_kept(self, grants) or self._ready_sandbox(path)
        except BaseException:
            if owned:
                os.close(fd)
            raise
        if box.grants is None:
            box.grants = grants  # confined by this call for these files (a kept one: for these same files)
        self.stats["calls"] += 1
        if on_start is not None:
            on_start()
        with per_call.answering_opens(box, message):
            return self._exchange(box, message, fd, owned, timeout, path, on_progress, restart=restart_on_progress)

    def _ready_sandbox(self, path) -> SandboxHandle:
        """A sandbox, set up, for a call. Failing either is never the file's (it is not open
        yet): a start the machine broke (a zygote killed as it started, say) is tried again,
        after growing pauses, for up to the start timeout; a zygote that exited by itself
        (its imports failed) is not."""
        first, pause = time.monotonic(), 0.25
        while True:
            try:
                box = self._checkout()
                self._set_up(box, path)
                return box
            except (OSError, EOFError) as exc:
                exited = getattr(exc, "zygote_exit", None)
                if (exited is not None and exited > 0) or faults.caller_gone() \
                        or time.monotonic() + pause - first > config.start_timeout():
                    error = MediaMachineFault(path, f"could not start a sandbox: {exc!r}")
                    error.exhausted = True  # tried for as long as a start may take: no retry on top
                    raise error from exc
                log.warning("swift_safe_media: could not start a sandbox (%r), a machine fault; trying again "
                            "in %.2g s", exc, pause)
                time.sleep(pause)
                pause = min(2 * pause, 2.0)
            except MediaDecodeError as exc:
                if exc.fault == MACHINE:
                    raise
                raise MediaMachineFault(path, f"could not set up a sandbox: {exc.reason}") from exc

    def _set_up(self, box: SandboxHandle, path) -> None:
        """Run the setups registered since this sandbox started (see ``set_up_sandboxes``)."""
        setups = () if self.deferred else sandbox_setups()  # confined as its call begins: the zygote imported for it
        while box.setups_done < len(setups):
            try:
                message, fd, owned = transport.encode_request(setups[box.setups_done], (), {})
            except BaseException:
                self._done_with(box)  # nothing was sent: the sandbox goes back as it was, its slot freed
                raise
            self._exchange(box, message, fd, owned, config.start_timeout(), path, keep=True)
            box.setups_done += 1

    def _exchange(self, box: SandboxHandle, message, fd, owned, timeout: float, path, on_progress=None,
                  keep: bool = False, restart: bool = True):
        """Send one request and return its result. The sandbox goes back to the pool
        afterwards, or stays checked out with ``keep`` and a result; one that failed
        is replaced. The timeout does not count time the sandbox waited for a CPU (up to
        a ceiling: see :class:`~.fair_clock.FairClock`)."""
        clock = fair_clock.FairClock(box.pid, timeout, config.timeout_ceiling())
        try:
            try:
                box.hand_back_blocks(clock.deadline)
            except BaseException:
                if owned:
                    os.close(fd)
                raise
            transport.send_encoded(box.conn, message, fd, owned, clock.deadline)
            kind, payload = _receive(box, clock)
            while kind == transport.PROGRESS:  # a call of a call_each batch starts (or ends)
                path = on_progress(payload)
                if restart:
                    clock.restart()
                kind, payload = _receive(box, clock)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self._replace(box)
            error = MediaDecodeTimeout(path, f"decode overran its {timeout:g} s timeout{clock.describe()}; "
                                             f"sandbox pid {box.pid} was killed", time.monotonic() - clock.started)
            error.ambiguous = clock.capped  # cut short by the ceiling: the machine may be to blame
            raise error from None
        except (EOFError, ConnectionError, reply_unpickler.RefusedReply) as exc:
            self.stats["crashes"] += 1
            status, peak_kib = self._replace(box)
            if isinstance(exc, reply_unpickler.RefusedReply):  # maybe hostile: nothing of it runs here
                raise exc.error(path, box.pid, time.monotonic() - clock.started) from None
            counters = faults.oom_kills()
            oom, self._oom_kills = faults.risen(self._oom_kills, counters), counters
            raise faults.crash_error(box.pid, status, peak_kib, oom, path, time.monotonic() - clock.started) from exc
        except BaseException:
            self._replace(box)  # interrupted mid-exchange: the stream is out of step
            raise
        elapsed = time.monotonic() - clock.started
        if kind == transport.RESULT:
            if not keep:
                self._done_with(box)
            return payload
        exc, details = payload
        if details["out_of_memory"]:
            self._replace(box)  # a heap that hit its cap is not worth reusing
            raise MediaDecodeError(
                path, f"memory limit of {details['memory_cap_mb']} MB exceeded "
                      f"({details['type']}: {details['message']})", elapsed) from None
        self._done_with(box)
        raise faults.rebuild_exception(exc, details, path, elapsed, box.pid)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle, kept, self._kept = self._idle, [], self._kept, None
        if kept is not None:
            per_call.end(self, kept)
        for box in idle:
            box.close()
        with self._link.lock:
            spare, self._spare = self._spare, None
            if spare is not None and spare.box is not None:
                spare.box.kill()  # one whose reply is unread dies with the zygote's connection

    def abandon(self) -> None:
        for box in self._idle + ([self._kept] if self._kept is not None else []):
            box.close()
        self._idle, self._kept = [], None
        if self._spare is not None and self._spare.box is not None:
            self._spare.box.conn.close()
        self._spare = None


def _receive(box: SandboxHandle, clock: fair_clock.FairClock):
    """The sandbox's next message, by the clock's deadline, moved on by the time the
    sandbox waited for a CPU. Waiting happens before a message starts, so a deadline
    never cuts one in half; the message itself gets a second more."""
    poller = select.poll()  # not select(): a trainer may hold more than 1024 descriptors
    poller.register(box.conn, select.POLLIN)
    if box.broker is not None:
        per_call.answer_opens_until_readable(box, poller, clock)
    else:
        while not poller.poll(max(clock.wake_at() - time.monotonic(), 0) * 1000):
            if not clock.tick():
                raise TimeoutError
    return transport.receive(box.conn, max(clock.deadline, time.monotonic() + 1.0), blocks=box.blocks)


def get_engine(confined: bool | str | None = None) -> SandboxPool:
    """This process's pool of confined sandboxes (unless ``SWIFT_SAFE_MEDIA_CONFINE=0``),
    with ``confined=False`` its pool of unconfined ones, with ``BY_NAME`` its confined
    sandboxes for one call each (a forked child gets its own: see :mod:`..process`)."""
    confined = True if confined is None else confined
    if not config.confine():
        confined = False
    state = process.current()
    engine = state.engines.get(confined)
    if engine is None:
        link = for_this_process()
        with state.engine_lock:
            if confined not in state.engines:
                if confined:
                    confine.warn_once_if_missing()
                state.engines[confined] = SandboxPool(confined, link)
            engine = state.engines[confined]
    return engine


def shutdown() -> None:
    """Stop this process's sandboxes and zygotes, the shared one it started included (also
    done at exit)."""
    state = process.current()
    with state.engine_lock:
        engines = list(state.engines.values())
        state.engines.clear()
    for engine in engines:
        engine.close()
    with state.engine_lock:
        links = list(state.zygote_links.values())
        state.zygote_links.clear()
    for link in links:  # each zygote after its pools: their sandboxes go first
        link.close()
    if state.shared_zygote is not None:  # after its callers here: their sandboxes go first
        state.shared_zygote.close()
        state.shared_zygote = None


atexit.register(shutdown)
