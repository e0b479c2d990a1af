"""The calling API: ``call``, ``call_each`` and ``isolated`` run functions in a sandbox
process with a hard timeout, and the heuristics that name the media of a call.

Where the rest lives: the pool of sandboxes and one exchange with a sandbox in
:mod:`.pool` (``get_engine``, ``shutdown``, ``set_up_sandboxes``), both ends of the
zygote protocol in :mod:`.zygote`, the sandbox's side in :mod:`.sandbox`, messages and
shared memory in :mod:`.transport`, and what is counted around each decode (quarantine,
in-flight marker, statistics) in :mod:`..records.accounting`. Those names are re-exported here,
where callers have always found them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time

from .. import config
from . import faults, sandbox
from ..confinement import handed
from ..records import watchdog
from ..records.accounting import Accounting
from ..errors import MACHINE, MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout, MediaMachineFault, MediaQuarantined
from .pool import (BY_NAME, NETWORK, PROGRAMS, RemoteTraceback, SandboxPool, describe_status, forget_sandbox_setup, get_engine,
                   by_name, import_before_fork, set_up_sandboxes, shutdown)
from .pool import SandboxPool as Engine  # its old name
from .sandbox import in_sandbox, mark_in_sandbox

log = logging.getLogger("swift_safe_media")

__all__ = ["call", "call_each", "isolated", "fetch", "SharedTimeout", "path_hint", "FAILED_PATH",
           # re-exported from .pool and .sandbox
           "SandboxPool", "Engine", "RemoteTraceback", "describe_status", "get_engine", "shutdown",
           "set_up_sandboxes", "forget_sandbox_setup", "in_sandbox", "mark_in_sandbox", "BY_NAME",
           "NETWORK", "PROGRAMS", "by_name", "import_before_fork"]


def _looks_like_path(value) -> bool:
    if isinstance(value, os.PathLike):
        return True
    return (isinstance(value, str) and 0 < len(value) < 4096 and "\n" not in value
            and not value.startswith("data:") and ("/" in value or "." in value))


def path_hint(args, kwargs, explicit=None):
    if explicit is not None:
        return os.fspath(explicit) if isinstance(explicit, os.PathLike) else str(explicit)
    for value in (*args, *kwargs.values()):
        if _looks_like_path(value):
            return os.fspath(value) if isinstance(value, os.PathLike) else value
    return None


@functools.lru_cache(maxsize=512)
def _accepts_path(fn) -> bool:
    try:
        return "path" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def call(fn, *args, timeout: float | None = None, path=None, confine: bool = True, **kwargs):
    """Run ``fn(*args, **kwargs)`` in this process's sandbox and return its result.

    ``timeout`` (seconds) defaults to ``SWIFT_SAFE_MEDIA_TIMEOUT`` (60). On overrun the
    sandbox's process group is killed and :class:`MediaDecodeTimeout` is raised; a
    sandbox that dies raises :class:`MediaDecodeCrash`. Exceptions raised by ``fn`` come
    back as themselves, with the sandbox traceback as their ``__cause__``. ``path`` names
    the media in error messages (else the first path-like argument does); it is passed
    on to ``fn`` only if ``fn`` has a parameter called ``path``. ``confine=False`` runs
    it in an unconfined sandbox (one that may use the network, run programs, write files);
    ``confine=BY_NAME`` in a confined sandbox of its own that may open ``path`` (and no
    other media) by name, for code that does not take a descriptor; ``confine=PROGRAMS``
    likewise, and it may also run ffmpeg and write in a folder of its own (its ``TMPDIR``).

    A failure that is the machine's, not the file's (its sandbox killed from outside or
    by the OOM killer, a sandbox that could not start, a zygote gone) is retried in a
    fresh sandbox, ``SWIFT_SAFE_MEDIA_MACHINE_RETRIES`` times; then it raises
    :class:`MediaMachineFault`, and the file is not quarantined.
    """
    if path is not None and _accepts_path(fn):
        kwargs["path"] = path
    if in_sandbox():
        return fn(*args, **kwargs)
    media = path_hint(args, kwargs, path)
    args, kwargs = handed.hand_media(args, kwargs, media)  # the media's file goes along, open
    return _call(fn, args, kwargs, timeout, media, confine)


class SharedTimeout:
    """What an argument of a call carries when the call finishes a decode whose first step
    ran before it (a URL's download, see :func:`fetch`): ``deadline`` (``time.monotonic()``),
    by which the call must end, and ``timeout``, the one timeout both steps share. A call
    given such an argument runs for what is left of it."""

    deadline: float | None = None
    timeout: float | None = None


def fetch(fn, *args, path, timeout: float | None = None) -> tuple[object, float, float]:
    """The first step of a decode of ``path`` that needs the network (a download): runs
    in a download's sandbox (``NETWORK``: confined, but it may connect out), so only its
    result reaches the confined decode. Quarantine
    and failures count as for that decode; a success is not counted (the decode is).

    Returns ``(result, deadline, timeout)``: the step and the decode after it share one
    timeout, counted from the moment the step starts to run (a sandbox's start-up is never
    counted); hand ``deadline`` and ``timeout`` to the decode in a :class:`SharedTimeout`."""
    timeout = config.timeout() if timeout is None else float(timeout)
    if in_sandbox():
        return fn(*args), time.monotonic() + timeout, timeout
    started = []
    result = _call(fn, args, {}, timeout, path, confined=NETWORK, count_success=False,
                   on_start=lambda: started.append(time.monotonic()))
    return result, (started[0] if started else time.monotonic()) + timeout, timeout


def _shared_timeout(args, kwargs) -> SharedTimeout | None:
    shared = [value for value in (*args, *kwargs.values())
              if isinstance(value, SharedTimeout) and value.deadline is not None]
    return min(shared, key=lambda value: value.deadline) if shared else None


def _call(fn, args, kwargs, timeout, media, confined, count_success=True, on_start=None):
    timeout = config.timeout() if timeout is None else float(timeout)
    shared = _shared_timeout(args, kwargs)
    if shared is not None:
        timeout = min(timeout, shared.deadline - time.monotonic())
    accounting = Accounting(fn)
    accounting.check(media)

    def started():
        accounting.restart_clock()
        if on_start is not None:
            on_start()

    attempt = 1
    while True:
        accounting.begin(media)
        try:
            if timeout <= 0:  # the first step took it all (and ended just short of it)
                raise MediaDecodeTimeout(media, "overran its timeout before the decode could start", 0.0)
            result = get_engine(confined).run(fn, args, kwargs, timeout, media, on_start=started)
            break
        except MediaDecodeTimeout as exc:
            if shared is not None:
                ambiguous = exc.ambiguous
                exc = MediaDecodeTimeout(exc.path, f"the download and the decode together overran their "
                                                   f"{shared.timeout:g} s timeout ({exc.reason})", exc.elapsed)
                exc.ambiguous = ambiguous
            accounting.end(exc)
            raise exc from None
        except BaseException as exc:
            retry = _retries(exc, attempt, media)
            accounting.end(exc, retried=retry)
            if not retry:
                _raise_given_up(exc)
            attempt += 1
    if count_success:
        accounting.end()
    else:
        accounting.forget()
    return result


FAILED_PATH = "swift_safe_media_path"  # set by call_each on the exception it raises


def call_each(fn, arguments, paths, timeout: float | None = None, parallel: bool = False,
              confine: bool = True) -> list:
    """``[fn(*args) for args in arguments]`` in one round trip to the sandbox.

    Each call has its own timeout and counts as its own decode of ``paths[i]``
    (quarantine, statistics, the watchdog's in-flight marker). The first failure is
    raised as :func:`call` would raise it for that call alone, naming its path, which is
    also set on the exception as ``swift_safe_media_path``; the calls after it do not run.
    With ``parallel`` the calls run at once, on threads of the sandbox (for a host that
    decodes a sample's cameras on threads): see :func:`_call_parallel`. ``confine=False``
    runs them in an unconfined sandbox, as :func:`call` does.
    """
    arguments, paths = [tuple(args) for args in arguments], [str(path) for path in paths]
    if len(arguments) != len(paths):
        raise ValueError(f"call_each: {len(arguments)} calls but {len(paths)} paths")
    if not arguments:
        return []
    if in_sandbox():
        return [fn(*args) for args in arguments]
    arguments = [handed.hand_media(args, {}, path)[0] for args, path in zip(arguments, paths)]
    timeout = config.timeout() if timeout is None else float(timeout)
    if parallel and len(arguments) > 1:
        return _call_parallel(fn, arguments, paths, timeout, confine)
    return _call_each(fn, arguments, paths, timeout, confine)


def _call_each(fn, arguments, paths, timeout: float, confine: bool, attempt: int = 1) -> list:
    """``call_each`` one call after another; a machine fault runs the batch again (its
    calls before the fault are counted again: they are decoded again)."""
    accounting = Accounting(fn)
    current = 0

    def next_call(index):
        nonlocal current
        accounting.end()
        current = index
        accounting.begin(paths[index])
        return paths[index]

    try:
        for path in paths:
            accounting.check(path)
        accounting.begin(paths[0])
        results = get_engine(confine).run(sandbox.run_each, (fn, arguments), {}, timeout, paths[0], files=paths,
                                   on_progress=next_call, on_start=accounting.restart_clock)
    except BaseException as exc:
        retry = _retries(exc, attempt, paths[current])
        accounting.end(exc, retried=retry)
        if retry:
            return _call_each(fn, arguments, paths, timeout, confine, attempt + 1)
        failed = exc.path if isinstance(exc, MediaQuarantined) else paths[current]
        _raise_given_up(exc, failed)
    accounting.end()
    return results


def _is_machine_fault(exc: BaseException) -> bool:
    return isinstance(exc, MediaDecodeError) and exc.fault == MACHINE


def _retries(exc: BaseException, attempt: int, media) -> bool:
    """Whether a failed attempt is tried again: a machine fault, with retries left."""
    attempts = config.machine_retries() + 1
    if not _is_machine_fault(exc) or attempt >= attempts or getattr(exc, "exhausted", False) \
            or faults.caller_gone():
        return False
    reason = exc.reason if "a machine fault" in exc.reason else f"{exc.reason}; a machine fault, not the file's"
    log.warning("swift_safe_media: %s: %s; trying again in a fresh sandbox (attempt %d of %d)",
                media, reason, attempt + 1, attempts)
    return True


def _raise_given_up(exc: BaseException, failed_path=None):
    """Raise the error of a call that failed for good: a machine fault as a
    :class:`MediaMachineFault` (the sample is skipped for this run, the file not
    quarantined); ``failed_path`` is set on it for ``call_each``."""
    final = exc
    if _is_machine_fault(exc) and not isinstance(exc, MediaMachineFault):
        final = MediaMachineFault(exc.path, f"{exc.reason} (a machine fault, not the file's)", exc.elapsed)
    elif _is_machine_fault(exc) and config.machine_retries() and not getattr(exc, "exhausted", False):
        final = MediaMachineFault(exc.path, f"{exc.reason}; {config.machine_retries()} more tries failed too",
                                  exc.elapsed)
    if failed_path is not None:
        try:
            setattr(final, FAILED_PATH, failed_path)
        except AttributeError:
            pass
    if final is exc:
        raise exc
    raise final from exc


def _begin_batch(fn, paths) -> tuple[list[Accounting], object]:
    """One accounting per call of a parallel batch, each checked against the quarantine
    (a refused file fails the batch before it starts) and begun; the batch's tracker."""
    accountings = [Accounting(fn) for _ in paths]
    try:
        for accounting, path in zip(accountings, paths):
            accounting.check(path)
    except MediaQuarantined as exc:
        setattr(exc, FAILED_PATH, exc.path)
        raise
    tracker = accountings[0].tracker
    for accounting, path in zip(accountings, paths):
        accounting.tracker = None  # one in-flight marker for the batch, naming the call it would blame
        accounting.begin(path)
    return accountings, tracker


def _call_parallel(fn, arguments, paths, timeout: float, confine: bool) -> list:
    """``call_each(parallel=True)``: the calls start together on threads of one sandbox, so
    each call's own timeout runs from that start (one deadline for all). The sandbox says
    as each call ends; an error is pinned on the first call (in order) that failed, a
    timeout or a crash on the one call still running. With several still running, which
    one hung (a hang holding the GIL stops the others too) or crashed is not known: the
    batch runs again one call after another, which pins it on its own file."""
    accountings, tracker = _begin_batch(fn, paths)
    pending, failed = set(range(len(paths))), []

    def culprit() -> int:
        return min(pending) if pending else min(failed) if failed else 0

    marker = tracker.begin(paths[0], fn) if tracker is not None else ""

    def ended(payload):
        nonlocal marker
        index, ok = payload
        pending.discard(index)
        if ok:
            accountings[index].end()
        else:
            failed.append(index)
        if tracker is not None and pending:
            marker = tracker.begin(paths[culprit()], fn)  # the same file, rewritten
        return paths[culprit()]

    def started():
        for accounting in accountings:
            accounting.restart_clock()

    try:
        results = get_engine(confine).run(sandbox.run_parallel, (fn, arguments), {}, timeout, paths[0], files=paths,
                                   on_progress=ended, on_start=started, restart_on_progress=False)
    except BaseException as exc:
        machine = _is_machine_fault(exc)
        retry = machine and _retries(exc, 1, paths[culprit()])
        if (isinstance(exc, (MediaDecodeTimeout, MediaDecodeCrash)) and len(pending) > 1 and not machine) or retry:
            if retry:
                accountings[culprit()].end(exc, retried=True)
            for index in pending | set(failed):
                accountings[index].forget()
            watchdog.InFlight.end(marker)
            # The batch runs again one call after another (after a machine fault: its second attempt).
            return _call_each(fn, arguments, paths, timeout, confine, attempt=2 if retry else 1)
        blamed = culprit()
        for index in sorted(pending | set(failed)):
            if index == blamed:
                accountings[index].end(exc)
            else:
                accountings[index].forget()
        try:
            setattr(exc, FAILED_PATH, exc.path if isinstance(exc, MediaQuarantined) else paths[blamed])
        except AttributeError:
            pass
        raise
    finally:
        watchdog.InFlight.end(marker)
    return results


def isolated(timeout: float | None = None, confine: bool = True):
    """Decorator: every call of the function runs through :func:`call`.

    Use as ``@isolated`` or ``@isolated(timeout=10)`` on a module-level function;
    ``@isolated(confine=BY_NAME)`` for one whose library opens the file by its name
    (PyAV, decord, OpenCV: a confined sandbox of its own that may read that call's files);
    ``@isolated(confine=False)`` for one that needs the network or writes files.
    """
    if callable(timeout):
        return isolated()(timeout)

    def decorate(fn):
        @functools.wraps(fn)
        def run_isolated(*args, **kwargs):
            if in_sandbox():
                return fn(*args, **kwargs)
            # The wrapper itself is what pickles by name; inside the sandbox it runs fn.
            return call(run_isolated, *args, timeout=timeout, confine=confine, **kwargs)

        return run_isolated

    return decorate
