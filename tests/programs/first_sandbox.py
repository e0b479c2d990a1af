"""A DataLoader worker's first sandbox, asked for as the worker begins (workers/first_sandbox.py).

``python -m tests.programs.first_sandbox CASE`` prints one JSON object with, for each
sample: the worker's pid, when the worker finished unpickling its dataset (which takes
0.5 s: a tokenizer's worth), the pid of the sandbox that served its call and when that
sandbox started (both on the boot clock), and what the sandbox saw of a variable set by
the trainer after ``enable()``, of a variable set by the worker's ``worker_init_fn`` and of
its thread budget; and the worker's own thread budget. ``CASE``:

- ``plain``: nothing changes after the worker starts;
- ``init_changes``: the ``worker_init_fn`` sets an allowed variable, so the sandbox asked
  for before it no longer fits the first call;
- ``nothing_decoded_here``: no host is enabled and the trainer makes no call before the
  loader (in the other cases it makes one).

The variables are named to the sandboxes in ``SWIFT_SAFE_MEDIA_SANDBOX_ENV``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import swift_safe_media
from swift_safe_media import call, config, process
from torch.utils.data import DataLoader, Dataset

os.environ["SWIFT_SAFE_MEDIA_SANDBOX_ENV"] = "FIRST_SANDBOX_LATE,FIRST_SANDBOX_INIT"
UNPICKLING_S = 0.5


def boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def started_at(pid: int) -> float:
    """When process ``pid`` started, on the boot clock (``/proc/PID/stat``, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def sandbox_view() -> dict:
    return {"pid": os.getpid(), "late": os.environ.get("FIRST_SANDBOX_LATE"),
            "init": os.environ.get("FIRST_SANDBOX_INIT"), "threads": os.environ.get(config.THREADS)}


class SlowToUnpickle(Dataset):
    def __init__(self):
        self.length = 4  # an empty state would not reach __setstate__

    def __len__(self):
        return self.length

    def __setstate__(self, state):
        time.sleep(UNPICKLING_S)
        self.__dict__.update(state)
        self.unpickled_at = boot_clock()

    def __getitem__(self, index):
        seen = call(sandbox_view)
        return {"index": index, "worker": os.getpid(), "unpickled_at": self.unpickled_at, "sandbox": seen,
                "sandbox_started_at": started_at(seen["pid"]), "worker_threads": config.decoder_threads()}


def first(batch):
    return batch[0]


def set_init_variable(_worker_id):
    os.environ["FIRST_SANDBOX_INIT"] = "set by worker_init_fn"


def main(case: str) -> None:
    swift_safe_media.enable(hosts=[])
    zygote = process.current().shared_zygote
    zygote.ready.wait(120)
    if case != "nothing_decoded_here":
        call(os.getpid)  # the trainer decodes too: its workers ask for the kind it used
    os.environ["FIRST_SANDBOX_LATE"] = "set after enable()"
    loader = DataLoader(SlowToUnpickle(), batch_size=1, num_workers=2, collate_fn=first,
                        worker_init_fn=set_init_variable if case == "init_changes" else None)
    items = list(loader)
    print(json.dumps({"items": items, "zygote": zygote.pid}))


if __name__ == "__main__":
    main(sys.argv[1])
