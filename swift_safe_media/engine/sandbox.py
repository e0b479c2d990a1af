"""Inside a sandbox: what a process forked by the zygote (:mod:`.zygote`) becomes, and
the loop that runs the caller's requests.

A sandbox leads its own process group, dies with its zygote (``PR_SET_PDEATHSIG``), runs
under an address-space cap above its preloaded baseline, with its thread pools sized to
``SWIFT_SAFE_MEDIA_THREADS``, and answers the stall watchdog's stack-dump signal. Then
:func:`serve` runs one request at a time: a function and its arguments in, its result
(large buffers through a :class:`~.transport.SharedArena`) or its exception and
traceback out. Code running here sees :func:`in_sandbox` true, so a nested ``call``
runs in place.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import pickle
import resource
import signal
import socket
import sys
import threading
import traceback
import types

from .. import config, errors, process
from ..confinement import broker as confine_broker, environment as confine_env, policy as confine, output as confine_output, handed, \
    programs as confine_programs
from . import faults, transport

log = logging.getLogger("swift_safe_media")


_in_sandbox = False
_caller_main: dict | None = None  # how to load the caller's __main__, if a request needs it


def in_sandbox() -> bool:
    """True in a sandbox (and where :func:`mark_in_sandbox` was called): calls run in place."""
    return _in_sandbox


def mark_in_sandbox() -> None:
    global _in_sandbox
    _in_sandbox = True


def remember_caller_main(main: dict | None) -> None:
    global _caller_main
    _caller_main = main


def become_sandbox(conn, memory_cap_mb: int, parent: int, policy: confine.Policy | None = None,
                   deferred: bool = False, broker_for: int | None = None) -> None:
    """``deferred``: a sandbox for one call of code that opens its files by name, confined
    as that call begins (:func:`confine_then_call`); ``broker_for``: one for many such calls,
    confined now, whose opens by name the caller of that pid answers (:mod:`..confinement.broker`)."""
    os.setsid()
    process.set_name(process.SANDBOX_NAME)
    process.die_with_parent(parent)  # the zygote
    process.first_for_the_oom_killer()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _cap_memory(memory_cap_mb)
    _limit_threads()
    faulthandler.enable()
    from ..records import watchdog

    watchdog.answer_stack_dumps()

    mark_in_sandbox()
    handed.install_open_hook()
    if policy is not None and deferred:
        global _pending_policy
        _pending_policy = policy
    elif policy is not None:
        _confine(policy)
        if broker_for is not None:
            confine_broker.send_listener(conn, broker_for)
    serve(conn, memory_cap_mb)


_pending_policy: confine.Policy | None = None  # a sandbox for one call: confined as it begins


def _confine(policy: confine.Policy, readable_fds=(), network: bool = False, scratch: str | None = None) -> None:
    try:
        confine.apply(policy, readable_fds, network, scratch)
    except OSError as exc:  # never serve unconfined when confinement was asked for
        sys.stderr.write(f"swift_safe_media: sandbox pid {os.getpid()} could not be confined: {exc}\n")
        os._exit(71)
    confine_output.capture()


def confine_then_call(files, fn, args, kwargs, network: bool = False, scratch: str | None = None):
    """In a sandbox started for one call (``SPAWN_FOR_FILES``): confined now, as the twins'
    sandboxes are, with one more read rule for each file the caller handed with the call
    (``files`` and any other handed path among the arguments: Landlock allows a rule to
    name one regular file, here by the handed descriptor), then ``fn`` runs. Stock code may
    then open those files by name, and nothing else beyond what decoding needs; the request
    was unpickled before (it holds no media, only names and descriptors). ``network``: a
    download's sandbox, which may also connect out (see ``confine.apply``); ``scratch``: one
    that runs ffmpeg, which may also write in that folder (its ``TMPDIR``)."""
    global _pending_policy
    policy, _pending_policy = _pending_policy, None
    if scratch is not None:
        confine_programs.write_here(scratch)
    if network:
        confine_env.without_token_file()
    if policy is not None:
        _confine(policy, handed.handed_fds(), network, scratch)
    del files
    return fn(*args, **kwargs)


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
            handed.release()
            _reply_error(conn, exc, memory_cap_mb)
            continue
        if kind == transport.RETURN_BLOCKS:
            arena.take_back(request)
            continue
        fn, args, kwargs = request
        failed = False
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            _reply_error(conn, exc, memory_cap_mb)
            failed = True
        finally:
            fn = args = kwargs = None
            handed.release()  # the request's media descriptors
        if failed:  # the error and its frames are gone now
            arena.call_ended()
            continue
        confine_output.take()  # a call that succeeded: what it printed goes nowhere
        try:
            transport.send(conn, transport.RESULT, result, arena=arena)
        except (BrokenPipeError, ConnectionError):
            os._exit(0)
        except BaseException as exc:
            _reply_error(conn, _unsendable(result, exc), memory_cap_mb)
        result = None
        arena.call_ended()


def result_buffer(size: int) -> memoryview | None:
    """In a sandbox, ``size`` bytes of shared memory for the call's result to be written
    into (a decode's frames), sent back without a copy; elsewhere, or where no shared
    memory is to be had (a file-size limit caps memfds too; a full tmpfs; no descriptor
    left), None: the caller makes its own array, and the reply sends it as it can or
    says whose fault it was that it could not (:func:`_unsendable`), as for any result.
    Out of memory stays an error: the memory cap's."""
    if arena is None:
        return None
    try:
        return arena.for_result(size)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise
        return None


def _unsendable(result, exc: BaseException) -> errors.MediaDecodeError:
    """The error for a result that could not be sent back (unpicklable, or no memory for
    the shared copy): a MediaDecodeError, which the caller completes with the file's name."""
    size = transport.payload_bytes(result)
    described = type(result).__name__
    if size:
        described += f", {size / (1 << 20):.0f} MB of arrays" if size >= 1 << 20 else f", {size} bytes of arrays"
    error = errors.MediaDecodeError(None, f"the result ({described}) cannot be sent back to the caller: "
                                          f"{errors.short_reason(exc)}")
    if faults.is_machine_error(exc):  # the machine ran out of something (no space, too many files)
        error.fault = errors.MACHINE
    return error


def run_each(fn, arguments):
    """``engine.call_each`` in the sandbox: the caller hears when each call after the
    first starts, so that call gets its own timeout and a failure is pinned on its file."""
    results = []
    for index, args in enumerate(arguments):
        if index:
            transport.send(_caller, transport.PROGRESS, index)
        results.append(fn(*args))
    return results


def run_parallel(fn, arguments):
    """``engine.call_each(parallel=True)`` in the sandbox: every call at once, each on a
    thread of its own (native decoders release the GIL). The caller hears ``(index, ok)``
    as each call ends, and then gets the results in order, or the first failure in order
    once all have ended (as a host's own thread pool would raise it)."""
    from concurrent.futures import ThreadPoolExecutor

    outcomes: list = [None] * len(arguments)
    sending = threading.Lock()

    def one(index):
        try:
            outcomes[index] = (True, fn(*arguments[index]))
        except BaseException as exc:
            outcomes[index] = (False, exc)
        with sending:
            transport.send(_caller, transport.PROGRESS, (index, outcomes[index][0]))

    with ThreadPoolExecutor(max_workers=len(arguments), thread_name_prefix="ssm-call") as threads:
        list(threads.map(one, range(len(arguments))))
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


def is_out_of_memory(exc: BaseException) -> bool:
    return errors.is_out_of_memory(exc)


def _reply_error(conn, exc: BaseException, memory_cap_mb: int) -> None:
    refused = confine.refusal(exc)
    if refused is not None:
        # The caller fills in the path; the original error stays in the traceback.
        detail = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        cause, exc = exc, errors.MediaDecodeError(getattr(exc, "path", None), f"sandbox refused {refused}: {detail}")
        exc.__cause__ = cause
    output = confine_output.take()
    if output:
        confine_output.add_to_error(exc, output)
    details = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": exc.reason if isinstance(exc, errors.MediaDecodeError) else str(exc),
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
        # In a spawned or forkserver worker the script runs as __mp_main__, and its
        # functions pickle under that name (multiprocessing aliases it to __main__ here).
        if module in ("__main__", "__mp_main__"):
            _load_caller_main()
            try:
                return super().find_class(module, name)
            except AttributeError:
                raise AttributeError(
                    f"{name} is defined in the caller's __main__ (python -c, stdin, an interactive session "
                    f"or a notebook cell), which a sandbox cannot load: define it in a module (a .py file "
                    f"beside the script or notebook) and import it from there") from None
        return super().find_class(module, name)


def _load_caller_main() -> None:
    """Functions defined in the caller's script pickle as ``__main__.name``; load that
    script the way multiprocessing's spawn does (as ``__mp_main__``, so what runs under
    ``if __name__ == "__main__":`` does not run here). A script that does work outside
    that guard (a quick script calling a loader at its top level) is not run again: only
    its imports and definitions are (:func:`.spawn_guard.definitions_of`)."""
    global _caller_main
    main, _caller_main = _caller_main, None
    if not main:
        return
    import importlib.util
    import multiprocessing.spawn as mp_spawn

    from ..workers import spawn_guard

    path = main.get("path")
    if main.get("name"):
        spec = importlib.util.find_spec(main["name"])
        path = spec.origin if spec is not None and spec.has_location else None
        if path is None or spawn_guard.only_imports_and_defines(path):
            return mp_spawn._fixup_main_from_name(main["name"])
    if not path:
        return
    if spawn_guard.only_imports_and_defines(path) or getattr(sys.modules["__main__"], "__file__", None) == path:
        return mp_spawn._fixup_main_from_path(path)
    definitions = spawn_guard.definitions_of(path)
    if definitions is None:
        return mp_spawn._fixup_main_from_path(path)
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    exec(compile(definitions, path, "exec"), module.__dict__)
