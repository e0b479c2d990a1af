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
