"""A DataLoader whose dataset's class is of ``__main__``, in a script the warm forkserver does not
import (its top level does more than import and define: it notes each run of itself), with 2
workers started from the warm forkserver under ``enable()``; then one of a list, whose
holding server needs nothing of the script.

``python -m tests.programs.held_main`` prints one JSON object: each sample of the first loader
with the pid and parent of the worker that made it, the second's workers (pid, parent), the
forkserver's pid, the holding servers (pid, why not), and every run of the script's top level
(pid and process name) read from the file ``HELD_MAIN_RUNS`` names.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import swift_safe_media
from swift_safe_media import process
from torch.utils.data import DataLoader, Dataset

with open(os.environ["HELD_MAIN_RUNS"], "a") as runs:  # not only imports and definitions: no forkserver import
    runs.write(f"{os.getpid()} {multiprocessing.current_process().name}\n")


class Squares(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"square": index * index, "pid": os.getpid(), "ppid": os.getppid()}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("PPid:")).split()[1])


def main() -> dict:
    from multiprocessing import forkserver

    swift_safe_media.enable(hosts=[])
    process.current().shared_zygote.ready.wait(120)
    loader = DataLoader(Squares(), batch_size=None, num_workers=2)
    samples = list(loader)
    plain = iter(DataLoader([0, 1, 2, 3], batch_size=None, num_workers=2))  # a list: plain, of no module
    next(plain)  # its workers run: their parents are read while they do
    plain_workers = [(worker.pid, _parent(worker.pid)) for worker in plain._workers]
    list(plain)
    with open(os.environ["HELD_MAIN_RUNS"]) as runs:
        ran = [line.split(" ", 1) for line in runs.read().splitlines()]
    return {"samples": samples, "plain_workers": plain_workers, "forkserver": forkserver._forkserver._forkserver_pid, "trainer": os.getpid(),
            "servers": [{"pid": server.process.pid, "why_not": server.why_not}
                        for server in process.current().holding_servers],
            "ran": [{"pid": int(pid), "name": name} for pid, name in ran]}


if __name__ == "__main__":
    print(json.dumps(main()))
