"""Start early, off the critical path: what ``enable()`` starts in a training process (a
rank) long before its first batch, so their imports overlap the model's loading.

- **The warm forkserver.** CPython's own forkserver (``multiprocessing.forkserver``), told
  to preload :mod:`._forkserver_preload`: that imports, once, the zygote's modules and
  the data stack of the enabled hosts (``WORKER_PRELOAD`` of each adapter, plus
  ``SWIFT_SAFE_MEDIA_WORKER_PRELOAD``) with thread pools of one thread, then the trainer's
  main script when its top level only imports and defines, then counts its threads. It is
  forked from the trainer where the trainer had one thread (:mod:`.forked_forkserver`:
  it shares the trainer's torch), else started by exec. DataLoader workers started by
  ``forkserver`` (the default ``SWIFT_SAFE_MEDIA_MP_CONTEXT``) fork from it: a clean
  process that never ran the caller's threads, locks or decoder state, as spawn gives,
  at fork speed and sharing its pages. It dies with the trainer (``PR_SET_PDEATHSIG``, when the
  trainer's main thread started it): torch's workers watch only their own parent, and
  CPython's forkserver would outlive a killed trainer as long as any child of it lives.
- **The shared zygote** (:class:`.shared_zygote.SharedZygote`): one per rank, used by the rank
  and all its DataLoader workers, forked from the same forkserver (so it shares those
  pages too), or started by exec where the forkserver is not ours to use.

Both start in the background, first thing in ``enable()``; ``enable()`` returns as soon as
the pre-flight check has passed, and a run the check refuses stops them (:func:`withdraw`).
A forkserver with a thread after its imports is not forked from: DataLoaders asking for it
get spawn (one warning) and the zygote is started by exec instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading

from .. import config, process
from ..engine.shared_zygote import SharedZygote
from ..engine.zygote_start import PARENT_THREADS_ENV
from . import forked_forkserver

log = logging.getLogger("swift_safe_media")

PRELOAD_MODULE = "swift_safe_media.workers._forkserver_preload"
FORKSERVER = "forkserver"

def in_forkserver() -> bool:
    """In the warm forkserver itself (or its template importing ahead), not in what it forks."""
    return process.current().in_forkserver


def start(hosts) -> None:
    """The warm forkserver (when DataLoader workers will use it) and this rank's shared zygote,
    started once per process; a later ``enable()`` keeps them."""
    state = process.current()
    if state.shared_zygote is not None or state.warm_start_underway or not config.get(config.WARM_START):
        return
    state.warm_start_underway = True  # an import below may run a host's enable(): its start is this one
    try:
        wanted = _forkserver_wanted()
        # First: the fork, if any, happens before anything of ours holds a descriptor.
        if wanted:
            forked_forkserver.fork_ahead(for_hosts=bool(set(worker_preload(hosts)) - set(config.preload_modules())))
        else:
            forked_forkserver.dismiss()
        # Its socket is named in the environment before the forkserver copies the environment.
        try:
            shared = state.shared_zygote = SharedZygote(config.confine())
        except OSError as exc:  # fail open: each process then starts its own zygote, as before
            log.warning("swift_safe_media: no shared zygote (%s); each process starts its own", exc)
            forked_forkserver.dismiss()
            return
        start_zygote = None
        try:
            if wanted and _start_forkserver(hosts):
                start_zygote = fork_zygote
        except Exception as exc:  # the workers' start method still works, from a cold forkserver
            log.warning("swift_safe_media: could not start the warm forkserver: %s", exc)
        shared.start(start_zygote)
    finally:
        state.warm_start_underway = False


def fork_ahead(host: str) -> None:
    """As ``host`` begins importing with protection asked for on its command line: fork the
    forkserver's template while the trainer has one thread; ``enable()`` uses it later.
    Meanwhile the template imports what the forkserver would (LLaMA-Factory's data stack,
    2 s, while the trainer imports the rest of LLaMA-Factory and reads its YAML: not after)."""
    if config.get(config.WARM_START) and _forkserver_wanted():
        forked_forkserver.fork_ahead(for_hosts=True, ahead=worker_preload([host]))


def _forkserver_wanted() -> bool:
    """DataLoader workers will use the warm forkserver: the start method is ``forkserver``,
    the host did not say the run has none (``swift infer``, ms-swift's launcher), and its
    children, which import the main script again (as spawn's do), may: the statement running
    now is under ``if __name__ == "__main__":`` or an import (``SWIFT_SAFE_MEDIA=1``)."""
    from . import spawn_guard

    return (config.mp_context() == FORKSERVER and process.current().dataloader_workers_expected is not False
            and spawn_guard.unguarded_main_statement(imports_are_harmless=True) is None)


def stop() -> None:
    forked_forkserver.dismiss()
    state = process.current()
    if state.shared_zygote is not None:
        state.shared_zygote.close()
        state.shared_zygote = None


def withdraw() -> None:
    """Undo :func:`start` for a run that will not be protected after all (``enable()``
    refused it): the zygote stops, the warm forkserver is killed mid-import, and
    CPython's forkserver is left as it was found, so a caller that goes on unprotected
    forks from nothing of ours."""
    from multiprocessing import forkserver

    stop()  # first: a zygote not yet forked will not be, a template not yet used goes
    state = process.current()
    if state.forkserver_environment is None:
        return
    state.forkserver_environment = None
    server = forkserver._forkserver
    # Under its lock: nothing starting a process meanwhile finds it dead and starts it again.
    with server._lock:
        pid = server._forkserver_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # it is importing for seconds: asking it to stop would wait for that
            server._stop_unlocked()  # reaps it and forgets its address
        server._preload_modules, state.forkserver_preload_before = state.forkserver_preload_before, None


def worker_preload(hosts) -> list[str]:
    """What the warm forkserver imports: the zygote's modules, the data stacks of the hosts
    named (or, with none named, of those this process has imported: a host that is merely
    installed is not worth importing), the user's."""
    from ..patching import host_adapters as integrations

    names = list(config.preload_modules())
    for host in hosts or [host for host in integrations.known_hosts() if host in sys.modules]:
        names += integrations.adapter_for(host).WORKER_PRELOAD
    names += config.get(config.WORKER_PRELOAD)
    return list(dict.fromkeys(names))


def _start_forkserver(hosts) -> bool:
    """Start CPython's forkserver with our preload, unless it already runs (then it is
    someone else's: left alone). True when it is ours."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        forked_forkserver.dismiss()
        return False
    template = forked_forkserver.take()  # None: started by exec
    config.put(config.FORKSERVER_PRELOAD, ",".join(worker_preload(hosts)))
    config.put(config.FORKSERVER_MAIN, _main_for_forkserver())
    # The parent-death signal follows the thread that forks: only the main thread lasts as
    # long as the process.
    by_main = template.parent_thread_is_main if template else threading.current_thread() is threading.main_thread()
    config.put(config.FORKSERVER_PARENT, os.getpid() if by_main else 0)
    # Ours first, so nothing imports before the thread pools are quieted: not even the main
    # script (CPython's default preload, which CPython imports before any other); ours
    # imports it after the rest, when that is safe (_main_for_forkserver).
    found = list(getattr(server, "_preload_modules", ()))
    theirs = [name for name in found if name not in (PRELOAD_MODULE, "__main__")]
    multiprocessing.get_context(FORKSERVER).set_forkserver_preload([PRELOAD_MODULE, *theirs])
    state = process.current()
    state.forkserver_environment, state.forkserver_preload_before = dict(os.environ), found
    # Starts it (by exec, or the template becomes it) and returns; it imports in the background.
    with template.serving() if template else contextlib.nullcontext():
        server.ensure_running()
    return True


def _main_for_forkserver() -> str | None:
    """How the forkserver names this process's main script, so that workers forked from it
    find it imported (``path:FILE`` or ``module:NAME``, as CPython tells a child), or None:
    when it is off, or the script's top level does more than import and define."""
    from . import spawn_guard

    if not config.get(config.FORKSERVER_IMPORTS_MAIN):
        return None
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or not spawn_guard.only_imports_and_defines(script):
        return None
    return spawn_guard.main_as_told()


class _WithEnvironment:
    """A DataLoader ``worker_init_fn`` that first brings the worker's environment up to
    date with its parent's (picklable, so it reaches the worker with its arguments)."""

    def __init__(self, changed: dict, removed: list, init_fn):
        self.changed, self.removed, self.init_fn = changed, removed, init_fn

    def __call__(self, worker_id):
        adopt_environment(self.changed, self.removed)
        if self.init_fn is not None:
            return self.init_fn(worker_id)


def adopt_environment(changed: dict, removed: list) -> None:
    """In a process forked from the warm forkserver: its parent's environment (see
    :func:`environment_changes`)."""
    for name in removed:
        os.environ.pop(name, None)
    os.environ.update(changed)


def environment_changes() -> tuple[dict, list]:
    """(changed, removed): how this process's environment now differs from the one the warm
    forkserver started with."""
    base = process.current().forkserver_environment
    if base is None:  # CPython's own, started with the environment of its moment: our settings as now
        return ({name: value for name, value in os.environ.items() if name in config.SETTINGS},
                [name for name in config.SETTINGS if name not in os.environ])
    return ({name: value for name, value in os.environ.items() if base.get(name) != value},
            [name for name in base if name not in os.environ])


@contextlib.contextmanager
def workers_see_current_environment(loader, method: str):
    """While ``loader`` starts workers from a forkserver: they adopt the loader's process's
    environment as it is now (variables set after ``enable()`` included; our settings only,
    from a forkserver not ours)."""
    if method != FORKSERVER or loader.num_workers <= 0:
        yield
        return
    changed, removed = environment_changes()
    if not changed and not removed:
        yield
        return
    init_fn = loader.worker_init_fn
    loader.worker_init_fn = _WithEnvironment(changed, removed, init_fn)
    try:
        yield
    finally:
        loader.worker_init_fn = init_fn


# The name of the zygote's process: the warm forkserver prepares it without the main script.
ZYGOTE_PROCESS = "swift-safe-media-zygote"


def fork_zygote(zygote_end, listener):
    """Start the shared zygote as a child of the warm forkserver (blocks until it is forked,
    which is once the forkserver has imported)."""
    child = multiprocessing.get_context(FORKSERVER).Process(
        target=_zygote_child, args=(zygote_end, listener), name=ZYGOTE_PROCESS, daemon=True)
    child.start()
    return child


def _zygote_child(zygote_end, listener) -> None:
    from ..confinement import environment as confine_env
    from ..engine import zygote

    confine_env.scrub()  # forked from a process holding the trainer's environment
    zygote.zygote_main(zygote_end.detach(), listener.detach())


def forkserver_verdict(timeout: float) -> str | None:
    """Why DataLoader workers must not fork from the warm forkserver (it has threads), or
    None. Waits (up to ``timeout``) for the shared zygote's report, when it was forked there."""
    zygote = process.current().shared_zygote
    if zygote is None or zygote.started_by is not fork_zygote:
        return None
    zygote.ready.wait(timeout)
    return zygote.parent_problem


# -- in the forkserver ----------------------------------------------------------------
def preload_in_forkserver() -> None:
    """Run by :mod:`._forkserver_preload` in the forkserver, before it forks anything."""
    process.current().in_forkserver = True
    parent = os.getppid()  # the process that started it: once it is gone, so are we
    trainer = config.get(config.FORKSERVER_PARENT)
    if trainer:
        process.die_with_parent(trainer)
    os.register_at_fork(after_in_child=_forked_from_forkserver)
    _zygote_skips_main_script()
    if config.stall_timeout() > 0:
        # What it forks answers the stall watchdog's stack dumps. The start-up hook, which
        # makes spawned workers answer, looks for the watchdog's folder: enable() starts this
        # process before it installs the watchdog.
        from ..records import watchdog

        watchdog.answer_stack_dumps()
    with quietly_importing():
        from ..engine import zygote_start

        forked_forkserver.announce_hosts_imported_ahead()  # with the settings the orders brought
        zygote_start.preload(config.get(config.FORKSERVER_PRELOAD), lambda: os.getppid() == parent)
        threads_before_main = len(process.thread_names())
        if os.getppid() == parent:
            from . import spawn_guard

            spawn_guard.import_main(config.get(config.FORKSERVER_MAIN))
    # What is imported now stays shared with everything forked from here: frozen, the
    # objects are left out of the children's garbage collections, which would otherwise
    # write to (and so copy) every page holding one.
    gc.collect()
    gc.freeze()
    _map_large_blocks(config.get(config.WORKER_MMAP_THRESHOLD_KB))
    threads = process.thread_names()
    os.environ[PARENT_THREADS_ENV] = str(len(threads))
    if len(threads) > 1:
        by_main = (f" ({len(threads) - threads_before_main} started by importing the main script; "
                   f"{config.FORKSERVER_IMPORTS_MAIN}=0 leaves it to the workers)"
                   if len(threads) > threads_before_main else "")
        log.warning("swift_safe_media: the warm forkserver has %d threads after its imports (%s)%s; "
                    "DataLoader workers will be spawned instead", len(threads), ", ".join(threads), by_main)


@contextlib.contextmanager
def quietly_importing():
    """Within: thread pools of one thread for what imports (a pool started at import would leave
    the process unsafe to fork: :func:`.forked_forkserver.quiet_import_environment`); after, the
    environment as it was, which is what the workers see."""
    quiet = forked_forkserver.quiet_import_environment()
    saved = {name: os.environ.get(name) for name in quiet}
    os.environ.update(quiet)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _zygote_skips_main_script() -> None:
    """What this forkserver forks runs the parent's main script first (as spawn does): in the
    zygote, an unguarded script's top-level decode would wait for the zygote itself until the
    start-up timeout. The zygote needs nothing of it (a sandbox loads the functions a call names),
    and a holding server imports it only where its objects need it (:mod:`.held_arguments`):
    their preparation leaves it out."""
    from multiprocessing import spawn

    prepare = spawn.prepare
    if getattr(prepare, "_swift_safe_media", False):
        return

    def prepare_child(data):
        if data.get("name") in (ZYGOTE_PROCESS, process.HOLDING_NAME):
            data = {key: value for key, value in data.items()
                    if key not in ("init_main_from_path", "init_main_from_name")}
        return prepare(data)

    prepare_child._swift_safe_media = True
    spawn.prepare = prepare_child


def _map_large_blocks(kib: int) -> None:
    """Fix glibc's mmap threshold at ``kib`` for this process and all it forks. A worker
    frees a sample's frames and tensors after each batch; under glibc's sliding threshold
    they are carved from the heap, which keeps the freed pages. Mapped blocks go back to
    the system when freed. Anything but glibc: left as it is."""
    if not kib:
        return
    m_mmap_threshold = -3  # glibc's mallopt parameter
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not mallopt(m_mmap_threshold, kib * 1024):
        log.debug("swift_safe_media: mallopt(M_MMAP_THRESHOLD, %d KiB) refused", kib)


def _forked_from_forkserver() -> None:
    process.current().in_forkserver = False
    try:
        from . import trainer_watchdog as worker_watchdog

        worker_watchdog.watch_the_trainer()  # a forkserver killed from outside leaves its workers at work
    except Exception:
        pass
