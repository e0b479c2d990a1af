"""A trainer that turns protection on before it imports torch, as ``SWIFT_SAFE_MEDIA=1``
or a host's ``--safe_media`` flag does (the host's first import, where the trainer has one
thread): its warm forkserver is forked from it.

``python -m tests.programs.forked_forkserver [CASE]`` prints one JSON object: the
trainer's pid, the forkserver's pid, parent, command line and threads, torch's and
OpenBLAS's thread counts in the trainer, and what each of two DataLoader workers saw
(its parent, its threads at start, the forkserver's thread count as it forked, a sample
decoded in a sandbox, whether a thread of its could import a module, the hosts protected
there). CASE ``thread``: the trainer starts a thread first; ``host``: protection is turned
on by importing ms-swift under ``SWIFT_SAFE_MEDIA=1`` (the fork happens inside that import)
instead of ``enable()``; ``ahead --safe_media true``: ms-swift's flag on the command line (the
fork happens inside its first import), ``enable()`` once the forkserver's template has
imported ``tests.programs.imported_ahead``, the last of its preload, as ms-swift's parser
would call it seconds later, a thread started meanwhile (so that the template stays);
``early --safe_media true``: the same, ``enable()`` at once; ``again --safe_media true``:
``enable()`` once the trainer has imported ms-swift, pyarrow (whose allocator runs a thread
fork leaves safe) and ``tests.programs.trainer_only``, no other thread started (a fresh
template is forked then).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import swift_safe_media
from swift_safe_media import call, process
from swift_safe_media.engine.zygote_start import PARENT_THREADS_ENV
from swift_safe_media.patching import host_adapters

from tests import proc_table, sandboxed


def threads(pid="self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class Samples:  # torch is imported after enable(), in main()
    def __len__(self):
        return 4

    def __getitem__(self, index):
        started = threads()
        importer = threading.Thread(target=__import__, args=("tests.programs.imported_by_a_worker_thread",), daemon=True)
        importer.start()
        importer.join(20)  # a forkserver holding the import lock it was forked under: for ever
        return {"index": index, "ppid": os.getppid(), "threads": started, "thread_imported": not importer.is_alive(),
                "forkserver_threads": os.environ.get(PARENT_THREADS_ENV),
                "sandbox": call(sandboxed.process_facts)["pid"], "hosts": sorted(host_adapters.enabled_hosts()),
                "trainer_only": "tests.programs.trainer_only" in sys.modules}


def catches(number: int, pid="self") -> bool:
    """Whether ``pid`` has a handler for signal ``number`` (its ``SigCgt`` mask)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(caught >> (number - 1) & 1)


def main():
    signal.signal(signal.SIGUSR1, lambda *_: None)  # the trainer's own: not the forkserver's
    if os.environ.get("HIDE_OPENBLAS_SHUTDOWN") == "1":  # as numpy 2.5's OpenBLAS: its pool stops only at a fork
        from swift_safe_media.workers import openblas_pool

        openblas_pool.SHUTDOWN = "blas_thread_shutdown_not_exported"
    if sys.argv[1:] == ["thread"]:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    enabled_at = None
    if sys.argv[1:] == ["host"]:
        import swift  # noqa: F401 (the start-up hook turns protection on as it begins importing)
    elif sys.argv[1:2] in (["ahead"], ["early"], ["again"]):
        import swift  # noqa: F401,F811 (the start-up hook forks the template as it begins importing)

        if sys.argv[1] == "again":
            import pyarrow  # noqa: F401 (its jemalloc starts a thread)

            import tests.programs.trainer_only  # noqa: F401
        else:  # a thread the host's imports left running: the template forked before it stays
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        waited = time.monotonic() + 120
        while sys.argv[1] == "ahead" and not _imported_ahead() and time.monotonic() < waited:
            time.sleep(0.05)
        enabled_at = time.monotonic()
        swift_safe_media.enable(hosts=["swift"])
    else:
        swift_safe_media.enable()
    from multiprocessing import forkserver

    import torch
    from threadpoolctl import threadpool_info
    from torch.utils.data import DataLoader

    loader = DataLoader(Samples(), batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    items = list(loader)
    server = forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline", "rb") as cmdline:
        command = cmdline.read().split(b"\0")
    with open(f"/proc/{server}/stat") as stat:
        parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{server}/comm") as comm:
        name = comm.read().strip()
    print(json.dumps({
        "trainer": os.getpid(), "forkserver": server, "forkserver_ppid": parent, "forkserver_name": name,
        "forkserver_command": [part.decode() for part in command if part],
        "trainer_command": open("/proc/self/cmdline", "rb").read().decode().split("\0")[:-1],
        "forkserver_threads": threads(server), "torch_threads": torch.get_num_threads(),
        "pools": sorted((pool["internal_api"], pool["num_threads"]) for pool in threadpool_info()),
        "items": items, "enabled_at": enabled_at, "imported_ahead": _imported_ahead(),
        "trainer_threads": process.thread_names(),
        "children": [pid for pid, row in proc_table.process_table().items() if row.parent == os.getpid()],
        "usr1_caught": {"trainer": catches(signal.SIGUSR1), "forkserver": catches(signal.SIGUSR1, server)}},
        default=str))


def _imported_ahead() -> list[dict]:
    """The lines tests.programs.imported_ahead wrote (none without that log)."""
    try:
        with open(os.environ["IMPORTED_AHEAD_LOG"]) as log:
            return [json.loads(line) for line in log]
    except (KeyError, OSError):
        return []


if __name__ == "__main__":
    main()
