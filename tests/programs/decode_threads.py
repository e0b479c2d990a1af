"""The decode thread budget each sandbox gets, seen from real zygotes and sandboxes.

``python -m tests.programs.decode_threads`` prints one JSON object: the usable cores, the
threads of a sandbox of this process alone, the zygote's thread count, what the sandboxes
of two forked DataLoader workers get, then (each from a fresh zygote) with
``LOCAL_WORLD_SIZE=2`` and with ``SWIFT_SAFE_MEDIA_THREADS=3``.
"""

from __future__ import annotations

import json
import os

import swift_safe_media
from swift_safe_media import call, config
from torch.utils.data import DataLoader, Dataset

from tests import sandboxed


class Ask(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return json.dumps(call(sandboxed.decode_threads))


def fresh(**env):
    swift_safe_media.shutdown()  # the next call starts a zygote that reads the budget anew
    os.environ.update(env)
    return call(sandboxed.decode_threads)


def main() -> None:
    found = {"cores": config.usable_cores(), "alone": call(sandboxed.decode_threads)}
    zygote = swift_safe_media.engine.calls.get_engine()._link.zygote.process.pid
    found["zygote_threads"] = len(os.listdir(f"/proc/{zygote}/task"))  # still safe to fork
    loader = DataLoader(Ask(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    found["workers"] = [json.loads(item) for item in loader]
    found["two_ranks"] = fresh(LOCAL_WORLD_SIZE="2")
    found["explicit"] = fresh(SWIFT_SAFE_MEDIA_THREADS="3")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
