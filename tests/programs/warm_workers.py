"""DataLoader workers and sandboxes under the warm start (forkserver workers, one shared
zygote per process that enables protection).

``python -m tests.programs.warm_workers CASE [START_METHOD]`` prints one JSON object:

- ``shared``: what two workers and the parent see: each sample's worker pid, the worker's
  parent and thread count at its start, its sandbox's pid and the sandbox's parent (the
  zygote); the parent's own sandbox; the shared zygote's pid; an environment variable
  and a setting changed after ``enable()``, as workers and their sandboxes see them;
  whether each process maps a large block again after freeing one (glibc's threshold);
- ``held_lock``: a parent thread holds a lock (as OpenCV's or a decoder's futex would
  be held) while the DataLoader starts its workers; each worker then takes that lock
  (5 s at most) and says whether it could;
- ``lerobot_cycle``: LeRobot's ``cycle`` draws from a DataLoader that names no start
  method, with a variable set after ``enable()`` (called before LeRobot is imported): the
  method the adapter chooses, the workers' parent, the variable as the workers see it, the
  shared zygote and how it started, and the trainer's children that are zygotes;
- ``trainer_killed``: the parent draws a few samples, so that its workers go idle, prints
  the pids of its forkserver, workers, zygote and their sandboxes, then SIGKILLs itself;
- ``zygote_dies``: the shared zygote is killed between two calls of the parent;
- ``child_exits``: a child of ``os.fork`` makes a call and exits as a program does (its
  at-exit handlers run), between two calls of the parent: the zygote's pid and state after it,
  and the child's exit status and stderr;
- ``what_starts``: what ``enable()`` starts, given what the host knows of the run;
- ``slow_arguments``: a dataset whose unpickling waits for a file the parent creates only
  once ``iter(loader)`` has returned, then reads 2 MB more (past a pipe's buffer): how long
  ``iter`` took, the items, and the workers' parent;
- ``pid_on_demand``: processes of the warm launch context, started while the forkserver is
  stopped (SIGSTOP), so that it cannot fork them yet: whether ``start()`` returned and the pid
  was still unread; then, the forkserver resumed, each child's own pid and parent against
  ``Process.pid``, a ``join`` with a timeout on a sleeping child, exit codes and a
  terminate; last, a child started while the forkserver is stopped and then killed: its
  ``exitcode`` and what asking for its pid raises.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

import swift_safe_media
from swift_safe_media import call, config, process
from torch.utils.data import DataLoader, Dataset

from tests import sandboxed
from tests.proc_table import process_table

# Sandboxes keep only allow-listed variables (confine_env): the late one is named to them.
os.environ["SWIFT_SAFE_MEDIA_SANDBOX_ENV"] = "WARM_WORKERS_LATE"
LOCK = threading.Lock()  # module state a worker inherits by fork, and not by forkserver


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def large_block_is_mapped(size: int = (3 << 20) + 12345) -> bool:
    """Whether glibc maps a block of ``size`` bytes again after one was freed: under its
    sliding threshold the free raises the threshold and the second block comes from the
    heap; under a fixed threshold below ``size`` it is mapped each time."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = _MallInfo2
    libc.free(libc.malloc(size))
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblks == before + 1
    libc.free(block)
    return mapped


def worker_facts():
    return {"pid": os.getpid(), "ppid": os.getppid(), "late": os.environ.get("WARM_WORKERS_LATE"),
            "maps_large_blocks": large_block_is_mapped()}


def sandbox_facts():
    return {**sandboxed.process_facts(), "max_pixels": config.get(config.MAX_PIXELS),
            "late": os.environ.get("WARM_WORKERS_LATE"), "maps_large_blocks": large_block_is_mapped()}


class Samples(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return {"index": index, "worker": worker_facts(), "sandbox": call(sandbox_facts)}


class TakeTheLock(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        got = LOCK.acquire(timeout=5)
        if got:
            LOCK.release()
        return {"worker": os.getpid(), "got_lock": got}


def note_start(_worker_id):
    os.environ["WARM_WORKERS_THREADS_AT_START"] = str(len(os.listdir("/proc/self/task")))


class WithStartThreads(Samples):
    def __getitem__(self, index):
        return {**super().__getitem__(index), "threads_at_start": int(os.environ["WARM_WORKERS_THREADS_AT_START"])}


def _context(method):
    return {} if method == "default" else {"multiprocessing_context": method}


def shared(method):
    swift_safe_media.enable(hosts=[])
    os.environ["WARM_WORKERS_LATE"] = "set after enable"
    config.put(config.MAX_PIXELS, 12345)
    owner = process.current().shared_zygote
    owner.ready.wait(120)
    loader = DataLoader(WithStartThreads(), batch_size=None, num_workers=2, worker_init_fn=note_start,
                        **_context(config.mp_context() if method == "ours" else method))
    items = list(loader)
    from multiprocessing import forkserver

    return {"items": items, "parent": {"pid": os.getpid(), "sandbox": call(sandbox_facts),
                                       "maps_large_blocks": large_block_is_mapped()},
            "zygote": owner.pid, "zygote_problem": owner.problem,
            "forkserver": forkserver._forkserver._forkserver_pid}


def held_lock(method):
    swift_safe_media.enable(hosts=[])
    holding, release = threading.Event(), threading.Event()

    def hold():
        with LOCK:
            holding.set()
            release.wait(60)

    threading.Thread(target=hold, daemon=True).start()
    holding.wait()
    loader = DataLoader(TakeTheLock(), batch_size=None, num_workers=2,
                        **_context(config.mp_context() if method == "ours" else method))
    items = list(loader)
    release.set()
    return {"items": items}


def lerobot_cycle(_method):
    swift_safe_media.enable(hosts=["lerobot"])
    os.environ["WARM_WORKERS_LATE"] = "set after enable"
    from lerobot.datasets.utils import cycle
    from multiprocessing import forkserver

    loader = DataLoader(WithStartThreads(), batch_size=None, num_workers=2, worker_init_fn=note_start)
    batches = cycle(loader)
    items = [next(batches) for _ in range(6)]
    shared = process.current().shared_zygote
    zygotes = [pid for pid, row in process_table().items()
               if row.parent == os.getpid() and row.name == process.ZYGOTE_NAME]
    return {"items": items, "start_method": loader.multiprocessing_context.get_start_method(),
            "forkserver": forkserver._forkserver._forkserver_pid, "zygote": shared.pid,
            "holding_servers": [server.process.pid for server in process.current().holding_servers],
            "holding_why_not": [server.why_not for server in process.current().holding_servers],
            "zygote_started_by": shared.started_by.__name__, "zygotes_of_the_trainer": zygotes}


class Pids(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, index):
        return {"worker": os.getpid(), "sandbox": call(sandbox_facts)["pid"]}


def trainer_killed(_method):
    from multiprocessing import forkserver

    swift_safe_media.enable(hosts=[])
    owner = process.current().shared_zygote
    owner.ready.wait(120)
    batches = iter(DataLoader(Pids(), batch_size=None, num_workers=2, multiprocessing_context=config.mp_context()))
    items = [next(batches) for _ in range(6)]
    time.sleep(1)  # the workers have prefetched what they may, and wait
    print(json.dumps({"forkserver": forkserver._forkserver._forkserver_pid, "zygote": owner.pid,
                      "workers": sorted({item["worker"] for item in items}),
                      "sandboxes": sorted({item["sandbox"] for item in items})}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def zygote_dies(_method):
    swift_safe_media.enable(hosts=[])
    owner = process.current().shared_zygote
    owner.ready.wait(120)
    before = call(sandbox_facts)
    os.kill(owner.pid, signal.SIGKILL)
    time.sleep(0.5)
    after = call(sandbox_facts)
    return {"zygote": owner.pid, "before": before, "after": after}


def child_exits(_method):
    import tempfile

    swift_safe_media.enable(hosts=[])
    owner = process.current().shared_zygote
    owner.ready.wait(120)
    before = call(sandbox_facts)
    stderr = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(stderr.fileno(), 2)
        call(sandbox_facts)
        sys.exit(0)  # as a program ends: multiprocessing's at-exit handler runs
    _, status = os.waitpid(pid, 0)
    time.sleep(0.5)
    stderr.seek(0)
    zygote = process_table().get(owner.pid)
    return {"zygote": owner.pid, "zygote_state": zygote.state if zygote else "", "child_status": status,
            "child_stderr": stderr.read().decode(), "before": before, "after": call(sandbox_facts)}


def what_starts(expected):
    """What ``enable()`` starts when the host says the run has DataLoader workers
    (``workers``), has none (``none``, as ``swift infer``), or says nothing (``unknown``)."""
    from multiprocessing import forkserver

    if expected != "unknown":
        process.current().dataloader_workers_expected = expected == "workers"
    swift_safe_media.enable(hosts=[])
    owner = process.current().shared_zygote
    owner.ready.wait(120)
    return {"forkserver": forkserver._forkserver._forkserver_pid, "zygote": owner.pid,
            "zygote_started_by": owner.started_by.__name__, "problem": owner.problem,
            "sandbox_parent": call(sandbox_facts)["ppid"]}


GATE_WAIT_S = 20


def _wait_for(path: str) -> str:
    """Unpickling a :class:`Gate`: wait (at most ``GATE_WAIT_S``) until ``path`` exists."""
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "opened" if os.path.exists(path) else "timed out"


class Gate:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return _wait_for, (self.path,)


class SlowArguments(Dataset):
    """Unpickled in a worker: the gate first, then the payload."""

    def __init__(self, gate_path: str):
        self.gate = Gate(gate_path)
        self.payload = os.urandom(2 << 20)

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"index": index, "gate": self.gate, "payload_bytes": len(self.payload), "ppid": os.getppid()}


def slow_arguments(_method):
    """With the forkserver's stock launch, ``iter`` waits for each worker to read its
    arguments, and so for the gate: GATE_WAIT_S a worker."""
    import tempfile
    from multiprocessing import forkserver

    swift_safe_media.enable(hosts=[])
    process.current().shared_zygote.ready.wait(120)
    gate = os.path.join(tempfile.mkdtemp(), "gate")
    loader = DataLoader(SlowArguments(gate), batch_size=None, num_workers=2)
    started = time.monotonic()
    batches = iter(loader)
    iter_seconds = time.monotonic() - started
    open(gate, "w").close()
    items = list(batches)
    return {"iter_seconds": iter_seconds, "items": items, "forkserver": forkserver._forkserver._forkserver_pid,
            "context": type(loader.multiprocessing_context).__name__}


def _report_and_sleep(connection, seconds, code):
    connection.send((os.getpid(), os.getppid()))
    time.sleep(seconds)
    sys.exit(code)


def pid_on_demand(_method):
    from multiprocessing import forkserver

    from swift_safe_media.workers import forkserver_launch

    swift_safe_media.enable(hosts=[])
    process.current().shared_zygote.ready.wait(120)
    context = forkserver_launch.warm_context()
    server = forkserver._forkserver._forkserver_pid
    read, write = context.Pipe(duplex=False)
    os.kill(server, signal.SIGSTOP)  # it accepts the connections but forks nobody
    try:
        children = [context.Process(target=_report_and_sleep, args=(write, seconds, code), daemon=True)
                    for seconds, code in ((0.0, 3), (30.0, 0), (30.0, 0))]
        started = time.monotonic()
        for child in children:
            child.start()
        start_seconds = time.monotonic() - started
        unread = [child._popen._pid is None for child in children]
        alive_while_stopped = [child.is_alive() for child in children]
    finally:
        os.kill(server, signal.SIGCONT)
    reports = dict(read.recv() for _ in children)
    children[0].join(30)
    began = time.monotonic()
    children[1].join(0.3)
    join_seconds = time.monotonic() - began
    still_alive = children[1].is_alive() and children[1].exitcode is None
    children[2].terminate()
    children[2].join(30)
    facts = {"start_seconds": start_seconds, "unread_after_start": unread, "alive_while_stopped": alive_while_stopped,
             "pids": [child.pid for child in children], "reported": reports,
             "forkserver": server, "join_seconds": join_seconds, "alive_after_join": still_alive,
             "exitcodes": [children[0].exitcode, children[2].exitcode]}
    children[1].kill()
    children[1].join(30)
    os.kill(server, signal.SIGSTOP)
    orphan = context.Process(target=_report_and_sleep, args=(write, 0.0, 0), daemon=True)
    orphan.start()
    os.kill(server, signal.SIGKILL)
    orphan.join(30)
    try:
        facts["orphan_pid"] = orphan.pid
    except EOFError as exc:
        facts["orphan_pid"] = f"EOFError: {exc}"
    facts["orphan_exitcode"] = orphan.exitcode
    return facts


if __name__ == "__main__":
    case, method = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "ours")
    cases = {"shared": shared, "held_lock": held_lock, "zygote_dies": zygote_dies, "child_exits": child_exits,
             "lerobot_cycle": lerobot_cycle, "trainer_killed": trainer_killed, "what_starts": what_starts,
             "slow_arguments": slow_arguments, "pid_on_demand": pid_on_demand}
    print(json.dumps(cases[case](method)))
