"""How a zygote process comes to be, and what it takes from its caller before it serves
(the protocol it then speaks is :mod:`.zygote`).

- **Start by exec**: :func:`popen_zygote` runs a fresh interpreter (never a fork of the
  caller, which may have threads) with the caller's environment, thread pools of one
  thread, and the package's own folder first on ``PYTHONPATH``, in a neutral directory.
  (The warm forkserver forks one instead: :mod:`..workers.forkserver`.)
- **The preparation**: what the caller sends first (:func:`preparation`): its import
  path, argv, directory and main module, what to preload, whether sandboxes are confined,
  and the caller's pid and temporary folders (removed if the caller dies: see
  :mod:`.run_folders`). The zygote applies it (:func:`apply_preparation`), preloads the
  decoders and builds the confinement policy once.
- **A sandbox started by exec**, where forking the zygote is not safe any more (a
  preloaded module started a thread): :func:`exec_sandbox`, :func:`exec_sandbox_main`.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import socket
import subprocess
import sys

from .. import config
from ..confinement import policy as confine, environment as confine_env, output as confine_output
from . import run_folders, sandbox

log = logging.getLogger("swift_safe_media")

# Where zygote and sandboxes run: not the caller's directory, so nothing a decoder
# resolves against the working directory (a playlist's relative entry, say) lands among
# the caller's files. Inputs reach the sandbox as absolute paths (decoders.inputs).
NEUTRAL_DIRECTORY = "/"

_PREP_ENV = "_SWIFT_SAFE_MEDIA_PREP"  # the preparation, for a sandbox started by exec
# Set by the warm forkserver (:mod:`..workers.forkserver`) for what it forks: its own thread count
# after its imports, which the zygote it forks reports in READY (more than 1: unsafe).
PARENT_THREADS_ENV = "_SWIFT_SAFE_MEDIA_FORKSERVER_THREADS"


def popen_zygote(zygote_end: socket.socket, listener: socket.socket | None = None) -> subprocess.Popen:
    """A zygote started by exec, serving ``zygote_end`` (and, shared, ``listener``)."""
    fds = (zygote_end.fileno(),) + ((listener.fileno(),) if listener is not None else ())
    code = f"from swift_safe_media.engine.zygote import zygote_main; zygote_main({', '.join(map(str, fds))})"
    # `-c` puts the working directory first on sys.path: a `swift_safe_media/` folder there
    # must not stand in for the package the caller imported (on PYTHONPATH).
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, env=zygote_environment(),
                            cwd=NEUTRAL_DIRECTORY, stdin=subprocess.DEVNULL, close_fds=True)


def zygote_environment() -> dict:
    env = confine_env.allowed()  # never the trainer's tokens (confine_env)
    # The budget is resolved here, where the DataLoader's worker count is known, and each
    # sandbox sizes its pools to it after the fork; the zygote imports with pools of one
    # thread, since a pool started at import would leave it unsafe to fork.
    env.update({name: "1" for name in config.THREAD_ENV_VARS})
    env[config.THREADS] = str(config.decoder_threads())
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["swift_safe_media"].__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return env


def environment_for_sandbox() -> dict:
    """The caller's environment (its allowed part, :mod:`..confinement.environment`), which a sandbox
    takes instead of the zygote's: the caller may have changed it since the zygote started
    (a shared zygote starts at ``enable()``), and the thread budget is resolved here, where
    the DataLoader's worker count is known."""
    environment = {name: value for name, value in confine_env.allowed().items()
                   if name not in (config.ZYGOTE, config.CONFINE_WARNED)}  # the caller's bookkeeping
    environment[config.THREADS] = str(config.decoder_threads())
    # Pools are sized by that budget after the fork (sandbox._limit_threads); a library a
    # sandbox imports later starts with one thread, as in the zygote.
    environment.update({name: "1" for name in config.THREAD_ENV_VARS})
    return environment


def take_environment(environment: dict) -> None:
    """The caller's environment replaces the zygote's (the caller may have changed it);
    only its allowed names, whoever sent it."""
    if environment:
        os.environ.clear()
        os.environ.update(confine_env.allowed(environment))


def preparation(confined: bool = True) -> dict:
    """What the zygote needs of the caller: its import path, argv, directory and main
    module, whether its sandboxes are confined, and who it is and what it leaves behind."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    main_name = spec.name if spec is not None and spec.name != "__main__" else None
    main_path = getattr(main, "__file__", None)
    if main_path and not os.path.isfile(main_path):
        main_path = None  # "<stdin>": nothing a sandbox could load
    return {
        "sys_path": list(sys.path),
        "argv": confine_env.redacted_argv(sys.argv),  # no --hub_token value in a sandbox
        "cwd": os.getcwd(),
        "main": {"name": main_name, "path": None if main_name else main_path},
        "preload": config.preload_modules(),
        "confine": confined,
        "read_roots": config.read_roots(),
        "caller": os.getpid(),
        "leftovers": run_folders.owned(),
    }


def apply_preparation(prep: dict) -> None:
    cwd = prep["cwd"]
    # The caller's relative import paths ("" among them) and script keep meaning what they
    # meant there once this process leaves that directory.
    sys.path[:] = [os.path.join(cwd, entry) for entry in prep["sys_path"]]
    sys.argv[:] = prep["argv"]
    main = dict(prep["main"] or {})
    if main.get("path"):
        main["path"] = os.path.join(cwd, main["path"])
    try:
        os.chdir(NEUTRAL_DIRECTORY)
    except OSError:
        pass
    sandbox.remember_caller_main(main)


def prepare_confinement(prep: dict) -> confine.Policy | None:
    """Built once here, after the imports (which may write caches), applied in each sandbox."""
    if not prep["confine"]:
        return None
    main_path = prep["main"].get("path")
    confine_output.prepare()
    return confine.prepare(prep["read_roots"], [os.path.dirname(main_path)] if main_path else [])


def load(name: str) -> None:
    """Import ``name``; ``module:function``: then call it (a library's own warm-up, such as
    audioread's list of backends, which runs programs the first time: not in a sandbox)."""
    module, _, function = name.partition(":")
    loaded = importlib.import_module(module)
    if function:
        getattr(loaded, function)()


def preload(names, still_wanted=lambda: True, on_abandon=None) -> None:
    """Import ``names``; stop (exit, after ``on_abandon()``) once ``still_wanted()`` says
    the caller is gone: a short run must not leave seconds of imports behind it."""
    for name in names:
        if not still_wanted():
            if on_abandon is not None:
                on_abandon()
            os._exit(0)
        try:
            load(name)
        except Exception as exc:  # a missing optional decoder must not stop the sandbox
            log.debug("swift_safe_media: preload of %s skipped: %s", name, exc)


_left_to_the_sandbox: set[str] = set()  # modules whose import starts a thread (or fails)
_loaded_before_fork: set[str] = set()  # what import_before_fork did (a ``module:function`` is never in sys.modules)


def import_before_fork(imports) -> None:
    """Import each ``(module, folder)`` here once (``folder``, if any, put last on the import
    path first), so that a sandbox forked for one call starts with them: it would otherwise
    import them under the call's own timeout, every call. A module whose import starts a
    thread (tried first in a child) is left to the sandboxes: a zygote with threads can no
    longer fork safely."""
    missing = [(name, folder) for name, folder in imports
               if name not in sys.modules and name not in _loaded_before_fork and name not in _left_to_the_sandbox]
    # pyarrow's jemalloc starts a purging thread as it loads (datasets imports pyarrow):
    # without it the zygote stays single-threaded, and its sandboxes use little of arrow.
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    # Libraries that size a pool as they load (OpenCV) start none: one thread, as the
    # sandboxes' own environment says (environment_for_sandbox), where a zygote forked from
    # the warm forkserver has the trainer's.
    os.environ.update({variable: "1" for variable in config.THREAD_ENV_VARS})
    for name, folder in missing:
        if folder and folder not in sys.path:
            sys.path.append(folder)
        if _import_keeps_one_thread(name):
            try:
                load(name)
                _loaded_before_fork.add(name)
            except Exception as exc:  # the call reports it; not tried again per fork
                _left_to_the_sandbox.add(name)
                log.debug("swift_safe_media: %s not loaded before fork: %s", name, exc)
        else:
            _left_to_the_sandbox.add(name)
            log.info("swift_safe_media: importing %s starts a thread; each sandbox imports it itself", name)
    if missing:
        gc.collect()
        gc.freeze()  # as after the preload: the sandboxes' collections leave these pages alone


def _import_keeps_one_thread(name: str) -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            load(name)
        except BaseException:
            pass
        os._exit(0 if fork_is_safe() else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def fork_is_safe() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


def exec_sandbox(sandbox_end, prep, memory_cap_mb, environment) -> int:
    env = confine_env.allowed(environment or os.environ)
    env.update({name: "1" for name in config.THREAD_ENV_VARS})  # its imports, as the zygote's
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")  # this package first, as for the zygote
    env[_PREP_ENV] = json.dumps(prep)
    os.set_inheritable(sandbox_end.fileno(), True)
    code = (f"from swift_safe_media.engine.zygote_start import exec_sandbox_main; "
            f"exec_sandbox_main({sandbox_end.fileno()}, {memory_cap_mb}, {os.getpid()})")
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], env)


def exec_sandbox_main(fd: int, memory_cap_mb: int, parent: int) -> None:
    prep = json.loads(os.environ.pop(_PREP_ENV))
    apply_preparation(prep)
    preload(prep["preload"])
    try:
        sandbox.become_sandbox(socket.socket(fileno=fd), memory_cap_mb, parent, prepare_confinement(prep),
                               prep.get("deferred", False), prep.get("broker"))
    finally:
        os._exit(70)
