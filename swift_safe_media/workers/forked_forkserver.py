"""The warm forkserver forked from the trainer, where it can be, rather than started by
exec: both ends of the hand-over.

A forkserver started by exec imports torch (and torchvision) a second time: some 280 MB of
anonymous memory that no kernel can merge. Forked from the trainer once torch is imported,
it shares those pages. Forking is safe only while the trainer has a single thread, which
it has when protection is first asked for: as a host begins importing (``SWIFT_SAFE_MEDIA=1``
or the host's flag on the command line) or at an ``enable()`` at the top of a script.
There :func:`fork_ahead` imports torch, stops OpenBLAS's thread pool as OpenBLAS itself
does before any fork (:mod:`.openblas_pool`; it starts again at its next use), and forks a
*template*, which waits; where the host's flag asked (``enable()`` comes seconds later, once
the host parses its arguments), it imports the forkserver's preload meanwhile, as the forkserver would
(:func:`_import_while_waiting`). When ``enable()`` then starts the
warm forkserver (:mod:`.forkserver`), CPython's ``ensure_running`` builds its command and
would exec it; :meth:`Template.serving` hands that command, its descriptors and the
environment of the moment to the template instead, which makes itself what the exec
would have made (only those descriptors open, that environment, a fresh ``__main__``)
and runs the command. Everything after that, CPython's protocol and ours, is unchanged.

Where the trainer has imported more by the time ``enable()`` starts the forkserver (the
host's modules: 150-200 MB of ms-swift's and LLaMA-Factory's), :func:`fork_ahead` forks a
fresh template then and kills the stale one, so that the forkserver shares those too. At each
fork the trainer freezes its objects (``gc.freeze``): its collections leave those pages shared.
A thread stops a fork, but one its library makes safe (:data:`FORK_SAFE_THREADS`). Where
the trainer runs another (torch imported before, a flag only in a config file read after
the imports), the Python's forkserver command is not the one known here, or with
``SWIFT_SAFE_MEDIA_FORKSERVER_FROM_TRAINER=0``: exec, as before (or the stale template).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import types
import warnings

from .. import config, process
from ..engine import transport
from . import openblas_pool

log = logging.getLogger("swift_safe_media")

# What the trainer imports before the fork: the bulk of the forkserver's preload, which
# the trainer imports anyway (torchvision: the hosts' data stacks import it). Host packages
# cannot be: the fork point is inside the host's own first import.
EARLY_IMPORTS = ("torch",)
EARLY_IMPORTS_OF_HOSTS = ("torch", "torchvision")
# Threads that leave a fork safe: their library takes its locks around every fork and the
# child starts without them. jemalloc's purging thread (pthread_atfork handlers), which
# pyarrow starts as it loads, under datasets (ms-swift, LLaMA-Factory) and LeRobot; stock
# fork's workers fork beside it.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})
FORKSERVER_COMMAND = "from multiprocessing.forkserver import main"
_HEADER = struct.Struct("!Q")


class Template:
    """The trainer's end: a forked copy of the trainer waiting to become the forkserver
    (importing the forkserver's preload meanwhile, where it was given it)."""

    def __init__(self, pid: int, orders: socket.socket, parent_thread_is_main: bool):
        self.pid, self.orders = pid, orders
        self.parent_thread_is_main = parent_thread_is_main
        self.used = False
        self.modules_at_fork = len(sys.modules)  # the trainer's: more later, and a fresh fork shares them

    @contextlib.contextmanager
    def serving(self):
        """While CPython's forkserver starts: its exec goes to this template."""
        from multiprocessing import util

        spawn = util.spawnv_passfds

        def spawn_or_hand_over(path, args, passfds):
            if self.used or not any(FORKSERVER_COMMAND in str(arg) for arg in args):
                return spawn(path, args, passfds)  # the resource tracker, say
            self.hand_over(args, passfds)
            return self.pid

        util.spawnv_passfds = spawn_or_hand_over
        try:
            yield
        finally:
            util.spawnv_passfds = spawn

    def hand_over(self, args, passfds) -> None:
        payload = pickle.dumps({"args": list(args), "targets": list(passfds), "environment": dict(os.environ)})
        socket.send_fds(self.orders, [_HEADER.pack(len(payload))], list(passfds))
        self.orders.sendall(payload)
        self.used = True
        self.orders.close()

    def dismiss(self, patience: float = 0.2) -> None:
        """Not needed after all: it exits at the end of its orders (at once, or once the
        module it is importing ahead is imported: killed after ``patience`` seconds)."""
        if not self.used:
            self.used = True
            self.orders.close()
            if not process.collected(self.pid, patience=patience):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                process.reap(self.pid, block=False, patience=2.0)


def _why_not_fork() -> str | None:
    """Why the trainer cannot fork the forkserver at all (threads aside), or None."""
    from multiprocessing import forkserver

    if not config.get(config.FORKSERVER_FROM_TRAINER):
        return f"{config.FORKSERVER_FROM_TRAINER}=0"
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return "a forkserver already runs"
    try:
        import inspect

        if list(inspect.signature(forkserver.main).parameters) != [
                "listener_fd", "alive_r", "preload", "main_path", "sys_path"]:
            return "this Python's forkserver takes other arguments"
    except (TypeError, ValueError):
        return "this Python's forkserver cannot be read"
    return None


def fork_ahead(for_hosts: bool, ahead=()) -> None:
    """Fork the template now, if the trainer has one thread (but those of
    :data:`FORK_SAFE_THREADS`) once torch (and, for a host's run, torchvision) is imported;
    the trainer's thread settings are as they would have been. The template imports
    ``ahead`` while it waits (the trainer parses its arguments meanwhile, seconds for a
    host). Where a template waits already and the trainer has imported more since, fork a
    fresh one (it shares those modules), and the stale one goes; where the trainer may not
    fork now, the stale one stays."""
    state = process.current()
    stale = state.forkserver_template
    if stale is not None and len(sys.modules) <= stale.modules_at_fork:
        return
    why_not = _why_not_fork() or (_half_imported() if stale else None)
    if why_not is None:
        pools_stopped = _import_early(EARLY_IMPORTS_OF_HOSTS if for_hosts else EARLY_IMPORTS)
        threads = process.thread_names()
        others = [name for name in threads if name not in FORK_SAFE_THREADS][1:]
        if not others or not pools_stopped:  # else: OpenBLAS's pool may be what stops at the fork
            template = _fork_template(() if stale else ahead, threads, again=stale is not None, recount=bool(others))
            if template is not None:
                state.forkserver_template = template
                if stale is not None:
                    stale.dismiss(patience=0)  # what it imported ahead, the fresh one shares
                return
            threads = process.thread_names()  # what ran through the fork
        why_not = f"the trainer has {len(threads)} threads ({', '.join(threads)})"
    if stale is None:
        log.debug("swift_safe_media: the warm forkserver will be started by exec: %s", why_not)
    else:
        log.debug("swift_safe_media: the template forked as the host began importing stays: %s", why_not)


def _half_imported() -> str | None:
    """Why not fork again now: a module is being imported (this call is inside its import,
    LeRobot's ``enable()`` is): it would stay half-imported in the forkserver for good."""
    for name, module in list(sys.modules.items()):
        if getattr(getattr(module, "__spec__", None), "_initializing", False) is True:
            return f"{name} is being imported"
    return None


def take() -> Template | None:
    """The template for the forkserver about to start (once), or None."""
    state = process.current()
    template, state.forkserver_template = state.forkserver_template, None
    return template


def dismiss() -> None:
    template = take()
    if template is not None:
        template.dismiss()


def _import_early(names) -> bool:
    """Import ``names``, then stop OpenBLAS's thread pool (numpy loads it, and it starts its
    threads as it loads). False where a pool may still run: it stops at the fork itself."""
    try:
        for name in names:
            if name not in sys.modules and importlib.util.find_spec(name) is not None:
                __import__(name)
    except Exception as exc:  # fail open: the forkserver imports it, as before
        log.debug("swift_safe_media: early import failed: %r", exc)
    return openblas_pool.stop()


def _fork_template(ahead, threads: list[str], again: bool = False, recount: bool = False) -> Template | None:
    """``threads``: the trainer's, as :func:`fork_ahead` found them (for the log). ``recount``:
    more than one, and OpenBLAS's pool may be the others: the template is kept only where the
    trainer has one thread just after the fork, else ended (None)."""
    orders, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    trainer, main = os.getpid(), threading.current_thread() is threading.main_thread()
    hosts = tuple(host for host in _hosts_watched() if host in sys.modules)  # imported by now
    with warnings.catch_warnings():  # Python 3.12 warns of any other thread; those left are safe
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            orders.close()
            process.current().hosts_imported_ahead = hosts
            code = _become_forkserver(theirs, trainer if main else 0, ahead)
        finally:
            os._exit(code)
    theirs.close()
    template = Template(pid, orders, main)
    if recount and len(openblas_pool.threads_once_forked(FORK_SAFE_THREADS)) > 1:
        template.dismiss(patience=0)  # a thread other than the pool's ran through the fork
        return None
    if config.get(config.FREEZE_TRAINER_OBJECTS):
        # Python's advice before a fork without exec: a full collection in the trainer would
        # write to every page holding an object alive now (its GC header), copying the pages
        # it shares with the forkserver's family (85 MB of ms-swift's pipeline, measured).
        # Frozen objects are still freed when their last reference goes, never collected as
        # cycles (41 unreachable objects after torch's import, measured).
        gc.freeze()
    others = [name for name in threads if name in FORK_SAFE_THREADS]
    log.debug("swift_safe_media: template of the warm forkserver forked%s (pid %d, the trainer had 1 thread%s%s)",
              " again, the trainer having imported more" if again else "", pid,
              f" and {', '.join(others)}, which fork leaves safe" if others else "",
              ", OpenBLAS's pool stopped by the fork itself" if recount else "")
    return template


# -- in the template -------------------------------------------------------------------
def _become_forkserver(orders: socket.socket, trainer: int, ahead=()) -> int:
    """Wait for the forkserver's command, make this process what its exec would have made,
    run it. Returns the exit code (this copy of the trainer never returns into its code)."""
    trainers_name = process.name()
    process.set_name(process.TEMPLATE_NAME)
    atexit._clear()  # the trainer's: they are not this process's to run
    process.default_signal_handlers()
    if trainer:
        process.die_with_parent(trainer)
    # The trainer's objects, its garbage too, are never collected here nor in what this
    # forks: a collection would write to every page holding one (copying the trainer's
    # heap), and a finalizer would close descriptors that are no longer theirs.
    gc.freeze()
    keep = orders.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    _import_while_waiting(orders, ahead)
    try:
        header, fds, _, _ = socket.recv_fds(orders, _HEADER.size, 64)
        if len(header) < _HEADER.size:
            header += transport.receive_exactly(orders, _HEADER.size - len(header))
        told = pickle.loads(transport.receive_exactly(orders, _HEADER.unpack(header)[0]))
    except (OSError, EOFError, struct.error, pickle.UnpicklingError):
        return 0  # dismissed, or the trainer is gone
    orders.close()
    if len(fds) != len(told["targets"]):
        return 1
    _place(fds, told["targets"])
    os.environ.clear()
    os.environ.update(told["environment"])
    sys.argv[:] = ["-c"]
    _leave_the_trainers_import()
    _watch_the_hosts_again()
    process.set_name(process.FORKSERVER_NAME)
    os.register_at_fork(after_in_child=lambda: process.set_name(trainers_name))
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    from multiprocessing import process as mp_process

    mp_process._children.clear()
    code = 0
    try:
        exec(compile(told["args"][-1], "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    return code


def _import_while_waiting(orders: socket.socket, names) -> None:
    """Import the forkserver's preload (``names``) before its orders come: the trainer goes
    on meanwhile to the ``enable()`` that sends them. Stops as the orders come (or the
    trainer dismisses it): the forkserver's own preload imports the rest. Under pools of one
    thread, as there; the orders bring the environment back."""
    from ..engine import zygote_start

    if not names:
        return
    # What the forkserver will be, already: a host's hooks that run as its modules load (its
    # flags read from the command line, say) must not take this process for a new run.
    state = process.current()
    state.in_forkserver = True
    sys.argv[:] = ["-c"]
    os.environ.update(quiet_import_environment())
    hosts = [host for host in _hosts_watched() if host not in sys.modules]
    try:
        for name in names:
            if select.select([orders], [], [], 0)[0]:
                return
            try:
                zygote_start.load(name)
            except Exception as exc:  # the forkserver's preload meets it again, and says so
                log.debug("swift_safe_media: %s not imported ahead: %r", name, exc)
        # What the forkserver does once it has imported (0.3 s of LLaMA-Factory's objects),
        # done here while the trainer still goes on: its own collection then finds little.
        gc.collect()
        gc.freeze()
    finally:
        # The start-up hook saw none of these begin here (it had, in the trainer): the
        # forkserver turns them on once it has the trainer's settings (forkserver.preload_in_forkserver).
        state.hosts_imported_ahead += tuple(host for host in hosts if host in sys.modules)


def quiet_import_environment() -> dict:
    """Thread pools of one thread for what imports now: a pool started at import would leave
    the process unsafe to fork. pyarrow (under datasets and LeRobot) starts jemalloc's
    purging thread as it loads, unless told not to."""
    quiet = {name: "1" for name in config.THREAD_ENV_VARS}
    quiet["JE_ARROW_MALLOC_CONF"] = os.environ.get("JE_ARROW_MALLOC_CONF") or "background_thread:false"
    return quiet


def _leave_the_trainers_import() -> None:
    """The fork point is inside the host's first import, under the import lock and the
    host package's module lock: the forkserver's main thread would hold them for good, and
    a thread of anything it forks that imports would wait for ever."""
    import _imp
    from importlib import _bootstrap

    while _imp.lock_held():
        _imp.release_lock()
    me = threading.get_ident()
    for reference in list(getattr(_bootstrap, "_module_locks", {}).values()):
        lock = reference()
        with contextlib.suppress(Exception):
            while lock is not None and getattr(lock, "owner", None) == me and lock.count:
                lock.release()


def _watch_the_hosts_again() -> None:
    """The start-up hook saw the trainer's host begin importing, and stopped watching it; a
    forkserver started by exec sees it begin in its own imports (and so enables its
    patches for all it forks): so must this copy."""
    watcher = getattr(sys, "_swift_safe_media_watcher", None)
    hosts = _hosts_watched()
    if watcher is None or not hasattr(watcher, "pending"):
        return
    watcher.pending = {host for host in hosts if host not in sys.modules}
    if watcher.pending and watcher not in sys.meta_path:
        sys.meta_path.insert(0, watcher)


def _hosts_watched() -> tuple:
    """The host packages whose first import the start-up hook watches for."""
    return tuple(getattr(sys.modules.get("_swift_safe_media_startup"), "_HOSTS", ()))


def announce_hosts_imported_ahead() -> None:
    """In the warm forkserver, once it is one: what the start-up hook does as a host begins
    importing, for the hosts its template imported ahead."""
    state = process.current()
    hosts, state.hosts_imported_ahead = state.hosts_imported_ahead, ()
    watcher = getattr(sys, "_swift_safe_media_watcher", None)
    if not hasattr(watcher, "announce"):  # no start-up hook here (SWIFT_SAFE_MEDIA_STARTUP_HOOK=0)
        return
    for host in hosts:
        watcher.announce(host)


def _place(fds: list[int], targets: list[int]) -> None:
    """Put each received descriptor at the number the command names, as exec's
    ``pass_fds`` would have left it (above every target first, so none lands on another)."""
    import fcntl

    above = max(targets, default=2) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)  # inheritable, as exec leaves it
        os.close(fd)
