"""``call`` and ``isolated``: run a function in a sandbox process with a hard timeout.

One pool of sandboxes per calling process (one sandbox unless
``SWIFT_SAFE_MEDIA_SANDBOXES`` says more). Threads of one process share the pool: a
caller waits for a free sandbox, and the timeout counts only the time its function
runs, so a slow neighbour never turns into a false timeout. DataLoader workers are
separate processes and each gets its own pool; a forked child drops the pool it
inherited and starts its own.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import config, quarantine, sandbox, summary, transport, watchdog
from .errors import MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout, MediaQuarantined

log = logging.getLogger("swift_safe_media")

_in_sandbox = False


def mark_in_sandbox() -> None:
    global _in_sandbox, _engine
    _in_sandbox, _engine = True, None


def in_sandbox() -> bool:
    return _in_sandbox


class RemoteTraceback(Exception):
    """Carries the sandbox-side traceback as the ``__cause__`` of a re-raised exception."""

    def __str__(self):
        return self.args[0]


class _Sandbox:
    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.conn = pid, conn
        self.blocks = transport.MappedBlocks()
        self.setups_done = 0  # how many of _sandbox_setups have run here

    def hand_back_blocks(self, deadline) -> None:
        """Tell the sandbox which of its arena blocks no array here views any more."""
        ids = []
        while self.blocks.returned:
            ids.append(self.blocks.returned.pop())
        if ids:
            transport.send(self.conn, transport.RETURN_BLOCKS, ids, deadline)

    def is_alive(self) -> bool:
        """An idle sandbox never writes: anything readable means it closed or died."""
        readable, _, _ = select.select([self.conn], [], [], 0)
        return not readable


class _Zygote:
    def __init__(self, start_timeout: float):
        caller_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = f"from swift_safe_media.sandbox import zygote_main; zygote_main({zygote_end.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[zygote_end.fileno()], env=_zygote_environment(),
            stdin=subprocess.DEVNULL, close_fds=True)
        zygote_end.close()
        self.control = caller_end
        deadline = time.monotonic() + start_timeout
        try:
            transport.send(self.control, transport.REQUEST, _preparation(), deadline)
            self._read(sandbox.READY.size, deadline)
        except BaseException:
            self.close()
            raise

    def _read(self, size, deadline):
        return transport.receive_exactly(self.control, size, deadline)

    def spawn(self, memory_cap_mb: int, deadline: float) -> _Sandbox:
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(sandbox.CONTROL_REQUEST.pack(sandbox.SPAWN, memory_cap_mb))
        head, fds, _, _ = socket.recv_fds(self.control, sandbox.SPAWN_REPLY.size, 1)
        if not fds:
            raise EOFError("the zygote sent no sandbox")
        head += self._read(sandbox.SPAWN_REPLY.size - len(head), deadline)
        (pid,) = sandbox.SPAWN_REPLY.unpack(head)
        return _Sandbox(pid, socket.socket(fileno=fds[0]))

    def reap(self, pid: int, deadline: float) -> tuple[int, int]:
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(sandbox.CONTROL_REQUEST.pack(sandbox.REAP, pid))
        return sandbox.REAP_REPLY.unpack(self._read(sandbox.REAP_REPLY.size, deadline))

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def close(self, wait: float = 2.0) -> None:
        self.control.close()  # EOF tells the zygote to kill its sandboxes and exit
        try:
            self.process.wait(wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def abandon(self) -> None:
        """In a forked child: the zygote belongs to the parent; drop our copies only."""
        self.control.close()
        self.process.returncode = 0  # keeps Popen.__del__ from tracking the parent's child


def _zygote_environment() -> dict:
    env = dict(os.environ)
    threads = str(config.decoder_threads())
    env.update({name: threads for name in config.THREAD_ENV_VARS})
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return env


def _preparation() -> dict:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    main_name = spec.name if spec is not None and spec.name != "__main__" else None
    main_path = getattr(main, "__file__", None)
    return {
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "main": {"name": main_name, "path": None if main_name else main_path},
        "preload": config.preload_modules(),
    }


class Engine:
    def __init__(self):
        self._lock = threading.Condition()
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._idle: list[_Sandbox] = []
        self._busy = 0
        self._closed = False
        self.stats = {"calls": 0, "timeouts": 0, "crashes": 0, "sandboxes_started": 0,
                      "last_kill_to_ready_s": None}

    # -- pool ---------------------------------------------------------------------
    def _checkout(self) -> _Sandbox:
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError("swift_safe_media engine is shut down")
                if self._idle and (self._zygote is None or not self._zygote.is_alive()):
                    self._drop_orphaned_sandboxes()
                while self._idle:
                    box = self._idle.pop()
                    if box.is_alive():
                        self._busy += 1
                        return box
                    self._discard_quietly(box)
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
        """Sandboxes of a dead zygote are dying of PR_SET_PDEATHSIG, maybe not dead yet."""
        for box in self._idle:
            sandbox._kill_group(box.pid)
            box.conn.close()
        self._idle.clear()

    def _checkin(self, box: _Sandbox) -> None:
        with self._lock:
            self._busy -= 1
            self._idle.append(box)
            self._lock.notify()

    def _release_slot(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify()

    def _spawn(self, deadline: float | None = None) -> _Sandbox:
        with self._zygote_lock:
            if self._zygote is None or not self._zygote.is_alive():
                self._drop_zygote()
                self._zygote = _Zygote(config.start_timeout())
            try:
                box = self._zygote.spawn(config.max_memory_mb(),
                                         deadline or time.monotonic() + config.start_timeout())
            except BaseException:
                self._drop_zygote()  # a reply may still be on its way: the channel is out of step
                raise
        self.stats["sandboxes_started"] += 1
        return box

    def _drop_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close(wait=0.5)
            self._zygote = None

    def _end(self, box: _Sandbox) -> tuple[int, int]:
        """Kill the sandbox's whole process group, then collect its exit status."""
        sandbox._kill_group(box.pid)
        box.conn.close()
        with self._zygote_lock:
            if self._zygote is None:
                return -1, 0
            try:
                return self._zygote.reap(box.pid, time.monotonic() + 5.0)
            except (OSError, EOFError):
                self._drop_zygote()
                return -1, 0

    def _discard_quietly(self, box: _Sandbox) -> None:
        status, _ = self._end(box)
        log.warning("swift_safe_media: an idle sandbox (pid %d) had died (%s); replaced",
                    box.pid, describe_status(status))

    def _replace(self, box: _Sandbox) -> tuple[int, int]:
        """End a failed sandbox and start its successor now, so the next call finds it ready."""
        killed_at = time.monotonic()
        status = self._end(box)
        zygote = self._zygote
        if zygote is None or not zygote.is_alive():
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
    def run(self, fn, args, kwargs, timeout: float, path, on_progress=None, on_start=None):
        """``on_start()`` is called once a sandbox is ready and set up, as the call itself starts."""
        message, fd, owned = _encode_request(fn, args, kwargs)
        try:
            box = self._checkout()
            self._set_up(box, path)
        except BaseException as exc:
            if owned:
                os.close(fd)
            if isinstance(exc, (OSError, EOFError)):
                raise MediaDecodeCrash(path, f"could not start a sandbox: {exc!r}") from exc
            raise
        self.stats["calls"] += 1
        if on_start is not None:
            on_start()
        return self._exchange(box, message, fd, owned, timeout, path, on_progress)

    def _set_up(self, box: _Sandbox, path) -> None:
        """Run the setups registered since this sandbox started (see ``set_up_sandboxes``)."""
        while box.setups_done < len(_sandbox_setups):
            message, fd, owned = _encode_request(_sandbox_setups[box.setups_done], (), {})
            self._exchange(box, message, fd, owned, config.start_timeout(), path, keep=True)
            box.setups_done += 1

    def _exchange(self, box: _Sandbox, message, fd, owned, timeout: float, path, on_progress=None,
                  keep: bool = False):
        """Send one request and return its result. The sandbox goes back to the pool
        afterwards, or stays checked out with ``keep`` and a result; one that failed
        is replaced."""
        started = time.monotonic()
        deadline = started + timeout
        try:
            try:
                box.hand_back_blocks(deadline)
            except BaseException:
                if owned:
                    os.close(fd)
                raise
            transport.send_encoded(box.conn, message, fd, owned, deadline)
            kind, payload = transport.receive(box.conn, deadline, blocks=box.blocks)
            while kind == transport.PROGRESS:  # the next call of a call_each batch starts
                path = on_progress(payload)
                started = time.monotonic()
                deadline = started + timeout
                kind, payload = transport.receive(box.conn, deadline, blocks=box.blocks)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self._replace(box)
            raise MediaDecodeTimeout(
                path, f"decode overran its {timeout:g} s timeout; sandbox pid {box.pid} was killed",
                time.monotonic() - started) from None
        except (EOFError, ConnectionError) as exc:
            self.stats["crashes"] += 1
            status, peak_kib = self._replace(box)
            reason = f"sandbox pid {box.pid} died during the decode: {describe_status(status)}"
            cap = config.max_memory_mb()
            if cap and peak_kib >= 0.9 * cap * 1024:
                reason += f" (peak memory {peak_kib >> 10} MB, near the {cap} MB cap)"
            raise MediaDecodeCrash(path, reason, time.monotonic() - started) from exc
        except BaseException:
            self._replace(box)  # interrupted mid-exchange: the stream is out of step
            raise
        elapsed = time.monotonic() - started
        if kind == transport.RESULT:
            if not keep:
                self._checkin(box)
            return payload
        exc, details = payload
        if details["out_of_memory"]:
            self._replace(box)  # a heap that hit its cap is not worth reusing
            raise MediaDecodeError(
                path, f"memory limit of {details['memory_cap_mb']} MB exceeded "
                      f"({details['type']}: {details['message']})", elapsed) from None
        self._checkin(box)
        raise _rebuild_exception(exc, details, path, elapsed, box.pid)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for box in idle:
            box.conn.close()
        with self._zygote_lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None

    def abandon(self) -> None:
        for box in self._idle:
            box.conn.close()
        self._idle = []
        if self._zygote is not None:
            self._zygote.abandon()


def _encode_request(fn, args, kwargs):
    try:
        return transport.encode(transport.REQUEST, (fn, args, kwargs))
    except (AttributeError, TypeError, ImportError, __import__("pickle").PicklingError) as exc:
        raise TypeError(f"swift_safe_media.call needs a module-level function and picklable "
                        f"arguments; cannot send {getattr(fn, '__qualname__', fn)!r}: {exc}") from exc


def describe_status(status: int) -> str:
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


def _rebuild_exception(exc, details, path, elapsed, pid):
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


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine() -> Engine:
    global _engine
    engine = _engine
    if engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine()
            engine = _engine
    return engine


def shutdown() -> None:
    """Stop this process's sandboxes and zygote (also done at exit)."""
    global _engine
    with _engine_lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.close()


def _after_fork_in_child() -> None:
    global _engine, _engine_lock
    _engine_lock = threading.Lock()
    if _engine is not None:
        _engine.abandon()
    _engine = None


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)


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


def call(fn, *args, timeout: float | None = None, path=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` in this process's sandbox and return its result.

    ``timeout`` (seconds) defaults to ``SWIFT_SAFE_MEDIA_TIMEOUT`` (60). On overrun the
    sandbox's process group is killed and :class:`MediaDecodeTimeout` is raised; a
    sandbox that dies raises :class:`MediaDecodeCrash`. Exceptions raised by ``fn`` come
    back as themselves, with the sandbox traceback as their ``__cause__``. ``path`` names
    the media in error messages (else the first path-like argument does); it is passed
    on to ``fn`` only if ``fn`` has a parameter called ``path``.
    """
    if path is not None and _accepts_path(fn):
        kwargs["path"] = path
    if _in_sandbox:
        return fn(*args, **kwargs)
    timeout = config.timeout() if timeout is None else float(timeout)
    media = path_hint(args, kwargs, path)
    accounting = _Accounting(fn)
    accounting.check(media)
    accounting.begin(media)
    try:
        result = get_engine().run(fn, args, kwargs, timeout, media, on_start=accounting.restart_clock)
    except BaseException as exc:
        accounting.end(exc)
        raise
    accounting.end()
    return result


_sandbox_setups: list = []


def set_up_sandboxes(fn) -> None:
    """Run ``fn()`` (a module-level function) once in each sandbox of this process before
    the sandbox's first call, replacements included: imports a host needs there, say.
    It runs under the start-up timeout (``SWIFT_SAFE_MEDIA_START_TIMEOUT``), not the
    call's, and is not counted as a decode."""
    if fn not in _sandbox_setups:
        _sandbox_setups.append(fn)


FAILED_PATH = "swift_safe_media_path"  # set by call_each on the exception it raises


def call_each(fn, arguments, paths, timeout: float | None = None) -> list:
    """``[fn(*args) for args in arguments]`` in one round trip to the sandbox.

    Each call has its own timeout and counts as its own decode of ``paths[i]``
    (quarantine, statistics, the watchdog's in-flight marker). The first failure is
    raised as :func:`call` would raise it for that call alone, naming its path, which is
    also set on the exception as ``swift_safe_media_path``; the calls after it do not run.
    """
    arguments, paths = [tuple(args) for args in arguments], [str(path) for path in paths]
    if len(arguments) != len(paths):
        raise ValueError(f"call_each: {len(arguments)} calls but {len(paths)} paths")
    if not arguments:
        return []
    if _in_sandbox:
        return [fn(*args) for args in arguments]
    timeout = config.timeout() if timeout is None else float(timeout)
    accounting = _Accounting(fn)
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
        results = get_engine().run(sandbox.run_each, (fn, arguments), {}, timeout, paths[0],
                                   on_progress=next_call, on_start=accounting.restart_clock)
    except BaseException as exc:
        accounting.end(exc)
        failed = exc.path if isinstance(exc, MediaQuarantined) else paths[current]
        try:
            setattr(exc, FAILED_PATH, failed)
        except AttributeError:
            pass
        raise
    accounting.end()
    return results


class _Accounting:
    """Around each decode: the quarantine check and record, the in-flight marker the
    stall watchdog reads, and the run statistics."""

    def __init__(self, fn):
        self.fn = fn
        self.registry = quarantine.current()
        self.stats = summary.recorder()
        self.tracker = watchdog.in_flight()
        self.media, self.started, self.marker = None, None, ""

    def check(self, media) -> None:
        if self.registry is not None and media is not None:
            try:
                self.registry.check(media)
            except MediaQuarantined:
                if self.stats is not None:
                    self.stats.record(media, "quarantined", 0.0)
                raise

    def begin(self, media) -> None:
        self.media, self.started = media, time.monotonic()
        self.marker = self.tracker.begin(media, self.fn) if self.tracker is not None else ""

    def restart_clock(self) -> None:
        """Latency counts the decode, not the sandbox's start or setup before it."""
        self.started = time.monotonic()

    def end(self, exc: BaseException | None = None) -> None:
        """Close the current decode: ok without ``exc``, else the failure ``exc``."""
        if self.started is None:
            return  # failed before it began (quarantined)
        watchdog.InFlight.end(self.marker)
        elapsed = time.monotonic() - self.started
        outcome = "ok"
        if exc is not None:
            outcome = _FAILURE_KINDS.get(type(exc), "error")
            if isinstance(exc, MediaDecodeError) and self.registry is not None and self.media is not None:
                self.registry.record(self.media, outcome, exc.reason, exc.elapsed)
        if self.stats is not None:
            self.stats.record(self.media, outcome, elapsed)
        self.marker, self.started = "", None


_FAILURE_KINDS = {MediaDecodeTimeout: "timeout", MediaDecodeCrash: "crash"}


def isolated(timeout: float | None = None):
    """Decorator: every call of the function runs through :func:`call`.

    Use as ``@isolated`` or ``@isolated(timeout=10)`` on a module-level function.
    """
    if callable(timeout):
        return isolated()(timeout)

    def decorate(fn):
        @functools.wraps(fn)
        def run_isolated(*args, **kwargs):
            if _in_sandbox:
                return fn(*args, **kwargs)
            # The wrapper itself is what pickles by name; inside the sandbox it runs fn.
            return call(run_isolated, *args, timeout=timeout, **kwargs)

        return run_isolated

    return decorate
