"""Per-process state: what the package holds for the process it runs in, in one object.

:func:`current` returns this process's :class:`ProcessState`. One rule for fork: a
forked child starts from a fresh state (``os.register_at_fork``), after dropping its
copies of what belonged to the parent (the pool's sockets and zygote handle, without
touching the parent's processes). Nothing here is inherited on purpose: settings travel
in the environment (:mod:`.config`), patches live in the hosts' modules.

What a forked child rightly keeps stays with the module that registers it: the
adapters' patches and enabled hosts (:mod:`.patching.host_adapters`), post-import hooks, sandbox
setups (:mod:`.engine.pool`), at-exit reports (:mod:`.records.summary`), the quarantine registries'
read caches (:mod:`.records.quarantine`), the watchdog (:mod:`.records.watchdog`, the training
process's own) and the in-sandbox flag (:mod:`.engine.sandbox`, true in a sandbox's children too).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ProcessState:
    # pool.Engine by confinement (True: decodes; False: fetches, confine=False): this
    # process's sandboxes, each pool started on its first call
    engines: dict = field(default_factory=dict)
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    # zygote_link.ZygoteLink by confinement: the one zygote all of this process's pools fork from
    zygote_links: dict = field(default_factory=dict)
    budget: object = None  # budget.ErrorBudget: failed samples counted in this process
    recorders: dict = field(default_factory=dict)  # stats folder -> summary.Recorder
    failed_files: object = None  # quarantine.Registry in memory: LeRobot's files that failed here
    last_logged_failure: tuple | None = None  # ms-swift: (path, reason) last logged (its retries are not)
    batches_drawn: int = 0  # LeRobot: batches lerobot-train has drawn through ``cycle``
    # Whether the run this process starts will have DataLoader workers (an adapter knows it
    # from the parsed arguments; None: unknown): the warm forkserver is started only for them
    dataloader_workers_expected: bool | None = None
    shared_zygote: object = None  # shared_zygote.SharedZygote this process started for its workers (warm_start)
    # warm_start.start is running: an import it makes (torchvision's, as the template is forked) may
    # start a host's enable() inside it, whose own start must leave the work to this one
    warm_start_underway: bool = False
    # The environment the warm forkserver this process started was given (None: none is
    # ours): what it forks starts with that, not with this process's environment of the
    # moment (CPython's rule), so workers are brought up to date (warm_start)
    forkserver_environment: dict | None = None
    forkserver_template: object = None  # forked_forkserver.Template, forked ahead, not yet the forkserver
    in_forkserver: bool = False  # the warm forkserver itself (or its template, importing ahead), not what it forks
    hosts_imported_ahead: tuple = ()  # in a forkserver forked ahead: hosts its template imported before its orders
    forkserver_preload_before: list | None = None  # CPython's forkserver preload before ours (warm_start.withdraw)
    # held_memory.RecycledBuffers for arrays made here per sample (LeRobot's float frames)
    recycled_buffers: object = None
    # Temporary folders this process made -> the descriptor that holds its lock (run_folders):
    # a forked child owns none (it only shares the parent's locks while it lives)
    temporary_folders: dict = field(default_factory=dict)
    # workers.decode_deadline: this DataLoader worker's Slot (or InTrainer), made at first use
    deadline_slot: object = None
    # workers.held_arguments: the holding servers of this process's loaders, and the one the
    # loader starting its workers now uses (None: none)
    holding_servers: list = field(default_factory=list)
    held_for_start: object = None
    # workers.loaded_ahead: the holding servers of what from_pretrained loaded (oldest first), the
    # tokenizer handed ahead (HeldTokenizer), the loads running now (nested: the outermost's count)
    loads_held_ahead: bool = False  # its rows patched while protection is on (install)
    loaded_ahead: list = field(default_factory=list)
    held_tokenizer: object = None
    loads_underway: int = 0
    holding_parent: object = None  # the server a holding server starting now is forked from (None: the forkserver)
    scratch_folder: str | None = None  # run_folders.scratch_for_call's parent, made on first use


_state = ProcessState()


def current() -> ProcessState:
    return _state


def rank() -> int:
    """This process's rank in a distributed run (torchrun's ``RANK``); 0 outside one."""
    return int(os.environ.get("RANK", 0))


def _after_fork_in_child() -> None:
    global _state
    inherited, _state = _state, ProcessState()
    for engine in inherited.engines.values():
        engine.abandon()
    for link in inherited.zygote_links.values():
        link.abandon()
    if inherited.shared_zygote is not None:
        inherited.shared_zygote.abandon()  # the parent's; the child reaches it as a caller


os.register_at_fork(after_in_child=_after_fork_in_child)


# What a zygote and a sandbox call themselves in /proc/<pid>/comm (ps, top, the watchdog's
# report): forked from the warm forkserver, they have its command line.
ZYGOTE_NAME, SANDBOX_NAME = "ssm-zygote", "ssm-sandbox"
# A warm forkserver forked from the trainer has the trainer's command line: it goes by this
# name, and what it forks by the trainer's again; its template, while it waits, by the other.
FORKSERVER_NAME, TEMPLATE_NAME = "ssm-forkserver", "ssm-template"
# A holding server (workers.held_arguments), forked from the warm forkserver: what it forks goes
# by the name it had before.
HOLDING_NAME = "ssm-holding"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def name(pid: int | str = "self") -> str:
    """What a process calls itself (``/proc/<pid>/comm``); "" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def set_name(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread of ``parent`` that forked it exits
    (``PR_SET_PDEATHSIG``); exit now if ``parent`` died before the signal was armed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


# The OOM killer's most favoured victim: a sandbox dies alone and its decode is retried
# (a machine fault), where the trainer or a DataLoader worker taken instead ends the run.
OOM_SCORE_ADJ_MAX = 1000


def first_for_the_oom_killer() -> None:
    """Make this process the OOM killer's first choice (``oom_score_adj`` 1000: any process
    may raise its own). Fail-open: without /proc the kernel's own choice stands."""
    try:
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write(str(OOM_SCORE_ADJ_MAX))
    except OSError:
        pass


# Processes the zygote forks (sandboxes), ended by the zygote or by their caller.
def kill_group(pid: int) -> None:
    """SIGKILL a sandbox's process group (it leads one: helpers it started go too)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)  # just forked: not yet the leader of its own group
        except (ProcessLookupError, PermissionError):
            pass
    except PermissionError:
        pass


def reap(pid: int, block: bool = True, patience: float = 2.0) -> tuple[int, int]:
    """Collect a child of this process: (wait status, peak RSS in KiB), or (-1, 0). With
    ``block=False`` it waits at most ``patience`` seconds (a shared zygote serves others)."""
    deadline = time.monotonic() + patience
    try:
        while True:
            got, status, usage = os.wait4(pid, 0 if block else os.WNOHANG)
            if got:
                return status, usage.ru_maxrss
            if time.monotonic() > deadline:
                return -1, 0
            time.sleep(0.002)
    except ChildProcessError:
        return -1, 0


def collected(pid: int, patience: float = 2.0) -> bool:
    status, _ = reap(pid, block=False, patience=patience)
    return status != -1 or not exists(pid)


def exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def thread_names() -> list[str]:
    """This process's threads, by their names in ``/proc``."""
    try:
        names = []
        for task in sorted(os.listdir("/proc/self/task")):
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        return names
    except OSError:
        return ["?"] * threading.active_count()


def default_signal_handlers() -> None:
    """The signal handlers an exec would leave (a fork of another process that becomes a
    program of its own): its Python handlers go; a signal it ignores stays ignored."""
    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if callable(signal.getsignal(number)):
                signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
