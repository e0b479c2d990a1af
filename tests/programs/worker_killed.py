"""DataLoader workers SIGKILLed from outside while they hold outstanding tasks (issue 35):
``python -m tests.programs.worker_killed CONTEXT KIND [pin] [persistent] [sent] [holding_lock]``
(CONTEXT: fork, forkserver; KIND: map, iterable) runs one epoch undisturbed and one in which
worker 0, then worker 1, are killed, each holding outstanding tasks (with ``sent``: once their
results are sent, not yet read; with ``persistent``: the same loader's second epoch, its
workers kept; with ``holding_lock``: each while it holds the lock of the result queue all
workers share, as a worker killed in the middle of sending a result does), and prints one
JSON object: both epochs' batches, what was killed, the error if the epoch ended, and the
run summary."""

import collections
import json
import os
import signal
import sys
import time

import torch.utils.data

import swift_safe_media

ITEMS = 24


def item(index):
    time.sleep(0.05)  # the epoch is still running when the workers are killed
    return torch.tensor([index, index * index])


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return ITEMS

    def __getitem__(self, index):
        return item(index)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return (item(index) for index in range(info.id, ITEMS, info.num_workers))


def holding_tasks(batches, planned: int) -> tuple[int, int]:
    """(worker id, its tasks whose results have not arrived): ``planned`` if it holds some,
    else the other worker (the main process reads nothing meanwhile, so this cannot change)."""
    held = collections.Counter(info[0] for info in batches._task_info.values() if len(info) == 1)
    worker = planned if held[planned] else max(held, key=held.get, default=planned)
    return worker, held[worker]


def pin_thread_without_an_accelerator() -> None:
    """No GPU here: torch's accelerator calls are stood in for, so that torch's pin-memory
    thread runs (it hands each result from the workers' queue to the trainer's), pinning
    nothing."""
    if torch.accelerator.is_available():
        return
    from torch.utils.data._utils import pin_memory

    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda *args, **kwargs: None
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.set_device_index = lambda index: None
    pin_memory.pin_memory = lambda data, device=None: data


# Named by the worker's pid alone: a forkserver's worker imports this module again, as its own.
LOCK_TAKEN = os.path.join(os.environ.get("TMPDIR", "/tmp"), "worker_killed_lock_taken")


def take_the_result_lock_when_asked(worker_id):
    """A worker's ``worker_init_fn``: on SIGUSR1 it takes the lock of the result queue its
    ``_worker_loop`` writes to (the caller's ``data_queue``) and keeps it, as a worker's
    feeder thread does while it sends a result, then says so in a file."""
    frame = sys._getframe(1)
    while frame.f_code.co_name != "_worker_loop":  # through the wrappers of worker_init_fn
        frame = frame.f_back
    result_queue = frame.f_locals["data_queue"]

    def take(signum, _interrupted):
        result_queue._wlock.acquire()
        with open(f"{LOCK_TAKEN}.{os.getpid()}", "w"):
            pass

    signal.signal(signal.SIGUSR1, take)


def kill_holding_the_result_lock(pid: int) -> None:
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{LOCK_TAKEN}.{pid}"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {pid} did not take the result queue's lock")
        time.sleep(0.01)
    os.unlink(f"{LOCK_TAKEN}.{pid}")
    os.kill(pid, signal.SIGKILL)


def loader_of(context: str, kind: str, options) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        Items() if kind == "map" else Stream(), batch_size=2, num_workers=2, multiprocessing_context=context,
        pin_memory="pin" in options, persistent_workers="persistent" in options, shuffle=kind == "map",
        generator=torch.Generator().manual_seed(7) if kind == "map" else None,
        worker_init_fn=take_the_result_lock_when_asked if "holding_lock" in options else None)


def epoch(loader, kills: dict) -> dict:
    batches, out, killed, error = iter(loader), [], [], None
    try:
        for number, batch in enumerate(batches):
            out.append(batch.tolist())
            if number in kills:
                worker_id, outstanding = holding_tasks(batches, kills[number])
                if "sent" in sys.argv:  # killed once its results are in the queue, not yet read
                    time.sleep(0.5)
                pid = batches._workers[worker_id].pid
                if "holding_lock" in sys.argv:
                    kill_holding_the_result_lock(pid)
                else:
                    os.kill(pid, signal.SIGKILL)
                killed.append({"pid": pid, "worker": worker_id, "outstanding": outstanding})
    except RuntimeError as exc:
        error = str(exc)
    return {"batches": out, "killed": killed, "error": error, "pids": [worker.pid for worker in batches._workers],
            "pin_thread": getattr(batches, "_pin_memory_thread", None) is not None}


def main() -> None:
    context, kind, options = sys.argv[1], sys.argv[2], sys.argv[3:]
    swift_safe_media.enable()
    if "pin" in options:
        pin_thread_without_an_accelerator()
    # With persistent workers the kills come in a second epoch of the same loader (the
    # workers kept from the first), compared with a second epoch undisturbed.
    epochs = 2 if "persistent" in options else 1
    undisturbed = [epoch(loader, {}) for loader in [loader_of(context, kind, options)] * epochs][-1]
    disturbed = [epoch(loader, {} if number < epochs - 1 else {2: 0, 6: 1})
                 for loader in [loader_of(context, kind, options)] for number in range(epochs)][-1]
    from swift_safe_media import summary

    print(json.dumps({"undisturbed": undisturbed, "disturbed": disturbed, "summary": summary.collect()}), flush=True)

if __name__ == "__main__":
    main()
