"""The processes behind ``call``: a zygote and the sandboxes it forks.

The zygote is a fresh interpreter (never a fork of the caller, which may have threads)
that imports the decoders once and stays single-threaded, so forking a sandbox from it
is safe and takes milliseconds. Each sandbox leads its own process group, so one
SIGKILL to the group also stops helpers such as an ffmpeg child stuck on a FIFO.
Neither outlives the caller: the zygote exits on EOF of its control socket after
killing its sandboxes, and a sandbox gets SIGKILL when the zygote dies.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import logging
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import traceback

from . import config, transport

log = logging.getLogger("swift_safe_media")

SPAWN, REAP = b"S", b"R"
CONTROL_REQUEST = struct.Struct("!cQ")
SPAWN_REPLY = struct.Struct("!q")
REAP_REPLY = struct.Struct("!qq")  # wait status, peak RSS in KiB
READY = struct.Struct("!q")

_PREP_ENV = "_SWIFT_SAFE_MEDIA_PREP"
_PR_SET_PDEATHSIG = 1

_caller_main: dict | None = None


def zygote_main(control_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = socket.socket(fileno=control_fd)
    _, prep = transport.receive(control)
    _apply_preparation(prep)
    _preload(prep["preload"])
    control.sendall(READY.pack(os.getpid()))
    children: set[int] = set()
    try:
        while True:
            try:
                request = transport.receive_exactly(control, CONTROL_REQUEST.size)
            except (EOFError, ConnectionError):
                break
            op, value = CONTROL_REQUEST.unpack(request)
            if op == SPAWN:
                pid, caller_end = _start_sandbox(control, prep, value)
                children.add(pid)
                socket.send_fds(control, [SPAWN_REPLY.pack(pid)], [caller_end.fileno()])
                caller_end.close()
            elif op == REAP:
                children.discard(value)
                _kill_group(value)
                control.sendall(REAP_REPLY.pack(*_reap(value)))
    finally:
        # The caller is gone or done: nothing of ours may outlive it.
        for pid in children:
            _kill_group(pid)
        for pid in children:
            _reap(pid)
        os._exit(0)


def _apply_preparation(prep: dict) -> None:
    global _caller_main
    sys.path[:] = prep["sys_path"]
    sys.argv[:] = prep["argv"]
    try:
        os.chdir(prep["cwd"])
    except OSError:
        pass
    _caller_main = prep["main"]


def _preload(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional decoder must not stop the sandbox
            log.debug("swift_safe_media: preload of %s skipped: %s", name, exc)


def _fork_is_safe() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


def _start_sandbox(control, prep, memory_cap_mb):
    caller_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if not _fork_is_safe():
        # A preloaded module started a thread: forking now could deadlock the child.
        log.warning("swift_safe_media: the zygote has threads; starting sandboxes by exec")
        pid = _exec_sandbox(sandbox_end, prep, memory_cap_mb)
        sandbox_end.close()
        return pid, caller_end
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            caller_end.close()
            _become_sandbox(sandbox_end, memory_cap_mb, parent=zygote)
        finally:
            os._exit(70)
    sandbox_end.close()
    return pid, caller_end


def _exec_sandbox(sandbox_end, prep, memory_cap_mb) -> int:
    env = dict(os.environ, **{_PREP_ENV: json.dumps(prep)})
    os.set_inheritable(sandbox_end.fileno(), True)
    code = (f"from swift_safe_media.sandbox import exec_sandbox_main; "
            f"exec_sandbox_main({sandbox_end.fileno()}, {memory_cap_mb}, {os.getpid()})")
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], env)


def exec_sandbox_main(fd: int, memory_cap_mb: int, parent: int) -> None:
    prep = json.loads(os.environ.pop(_PREP_ENV))
    _apply_preparation(prep)
    _preload(prep["preload"])
    try:
        _become_sandbox(socket.socket(fileno=fd), memory_cap_mb, parent=parent)
    finally:
        os._exit(70)


def _become_sandbox(conn, memory_cap_mb: int, parent: int) -> None:
    os.setsid()
    _die_with_parent()
    if os.getppid() != parent:  # the zygote died before the death signal was armed
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _cap_memory(memory_cap_mb)
    _limit_threads()
    faulthandler.enable()
    from . import engine, watchdog

    watchdog.answer_stack_dumps()

    engine.mark_in_sandbox()
    serve(conn, memory_cap_mb)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _current_address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _cap_memory(memory_cap_mb: int) -> None:
    if memory_cap_mb <= 0:
        return
    # Counted above the preloaded baseline: torch alone maps gigabytes it never touches.
    limit = _current_address_space() + (memory_cap_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_threads() -> None:
    threads = config.decoder_threads()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    if "cv2" in sys.modules:
        sys.modules["cv2"].setNumThreads(threads)


arena: transport.SharedArena | None = None
_caller: socket.socket | None = None


def serve(conn, memory_cap_mb: int = 0) -> None:
    global arena, _caller
    arena, _caller = transport.SharedArena(), conn
    while True:
        try:
            kind, request = transport.receive(conn, unpickler=_SandboxUnpickler)
        except (EOFError, ConnectionError):
            os._exit(0)
        except BaseException as exc:
            _reply_error(conn, exc, memory_cap_mb)
            continue
        if kind == transport.RETURN_BLOCKS:
            arena.take_back(request)
            continue
        fn, args, kwargs = request
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            _reply_error(conn, exc, memory_cap_mb)
            continue
        finally:
            fn = args = kwargs = None
        try:
            transport.send(conn, transport.RESULT, result, arena=arena)
        except (BrokenPipeError, ConnectionError):
            os._exit(0)
        except BaseException as exc:
            _reply_error(conn, TypeError(f"the result ({type(result).__name__}) cannot be "
                                         f"sent back to the caller: {exc}"), memory_cap_mb)
        result = None


def run_each(fn, arguments):
    """``engine.call_each`` in the sandbox: the caller hears when each call after the
    first starts, so that call gets its own timeout and a failure is pinned on its file."""
    results = []
    for index, args in enumerate(arguments):
        if index:
            transport.send(_caller, transport.PROGRESS, index)
        results.append(fn(*args))
    return results


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or (
        isinstance(exc, OSError) and exc.errno == 12)


def _reply_error(conn, exc: BaseException, memory_cap_mb: int) -> None:
    details = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "out_of_memory": is_out_of_memory(exc),
        "memory_cap_mb": memory_cap_mb,
    }
    exc.__traceback__ = None
    try:
        pickle.loads(pickle.dumps(exc))
        payload = (exc, details)
    except BaseException:
        payload = (None, details)
    try:
        transport.send(conn, transport.ERROR, payload)
    except (BrokenPipeError, ConnectionError):
        os._exit(0)


class _SandboxUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "__main__":
            _load_caller_main()
        return super().find_class(module, name)


def _load_caller_main() -> None:
    """Functions defined in the caller's script pickle as ``__main__.name``; load that
    script the way multiprocessing's spawn does (guarded by ``__name__ == "__main__"``)."""
    global _caller_main
    main, _caller_main = _caller_main, None
    if not main:
        return
    import multiprocessing.spawn as mp_spawn

    if main.get("name"):
        mp_spawn._fixup_main_from_name(main["name"])
    elif main.get("path"):
        mp_spawn._fixup_main_from_path(main["path"])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> tuple[int, int]:
    try:
        _, status, usage = os.wait4(pid, 0)
        return status, usage.ru_maxrss
    except ChildProcessError:
        return -1, 0
