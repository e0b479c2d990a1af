"""A map-style dataset whose items decode through the engine (importable by spawn workers)."""

import os

import torch.utils.data

from swift_safe_media import MediaDecodeError, call

from . import sandboxed


class SandboxedDataset(torch.utils.data.Dataset):
    def __init__(self, size, fifo_index, fifo):
        self.size, self.fifo_index, self.fifo = size, fifo_index, fifo

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        item = {"index": index, "worker": info.id if info else -1, "pid": os.getpid()}
        try:
            if index == self.fifo_index:
                call(sandboxed.open_fifo, self.fifo, timeout=1)
            item["value"] = call(sandboxed.add, index, index)
            item["sandbox"] = call(sandboxed.sandbox_pid)
        except MediaDecodeError as exc:
            item["error"] = f"{type(exc).__name__}: {exc}"
        return item


class StallingDataset(torch.utils.data.Dataset):
    """Items 2 and 3 never return: one is stuck in its sandbox, one in the worker itself,
    both in a native call that holds the GIL."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index == 0:
            return call(sandboxed.add, 0, 0)  # worker 0's sandbox is up before it gets stuck
        if index == 2:
            call(sandboxed.hold_gil_on_locked_mutex, path="/data/stuck_in_sandbox.mp4", timeout=600)
        if index == 3:
            sandboxed.hold_gil_on_locked_mutex()
        return index


class HangingDataset(torch.utils.data.Dataset):
    """Every item hangs in its sandbox, in a native call that holds the GIL."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return call(sandboxed.hold_gil_on_locked_mutex, path=f"/data/item{index}.mp4", timeout=600)


class SlowValidDataset(torch.utils.data.Dataset):
    """Each item a decode of a valid clip that takes half a second in its sandbox."""

    def __init__(self, clips):
        self.clips = clips

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, index):
        return call(sandboxed.sleep_then_return, 0.5, index, path=self.clips[index])
