"""The warm forkserver SIGKILLed from outside mid-epoch (issue 35):
``python -m tests.programs.forkserver_killed [slow] [ours]`` prints one JSON object: what a
DataLoader whose workers were forked from it gave for the epoch, and what a second DataLoader,
whose workers come from a new forkserver, gave; each item a decode in a sandbox. The loaders
name ``forkserver`` (CPython's launch), or with ``ours`` no start method (our launch,
``workers.forkserver_launch``, as LeRobot's and LLaMA-Factory's loaders get)."""

import json
import os
import signal
import sys
import time

import torch.utils.data

import swift_safe_media
from swift_safe_media import call, process


def double(value):
    return 2 * value


class Slow(torch.utils.data.Dataset):
    def __init__(self, slow_item: bool = False):
        self.slow_item = slow_item

    def __len__(self):
        return 12

    def __getitem__(self, index):
        # The epoch is still running when the forkserver is killed; item 6 takes longer than
        # torch's worker status check (5 s), which then finds the workers of a dead forkserver.
        time.sleep(6 if index == 6 and self.slow_item else 0.2)
        return call(double, index, path=f"/data/item{index}.mp4")


def main(slow_item: bool, ours: bool) -> None:
    swift_safe_media.enable()
    from multiprocessing import forkserver

    loaders = [torch.utils.data.DataLoader(Slow(slow_item and epoch == 0), batch_size=None, num_workers=2,
                                           multiprocessing_context=None if ours else "forkserver")
               for epoch in range(2)]
    first, killed = [], None
    for index, item in enumerate(loaders[0]):
        first.append(item)
        if index == 2:
            killed = forkserver._forkserver._forkserver_pid
            os.kill(killed, signal.SIGKILL)
    second = list(loaders[1])
    print(json.dumps({"first": first, "second": second, "killed": killed,
                      "new_forkserver": forkserver._forkserver._forkserver_pid,
                      "holding_servers": [server.process.pid for server in process.current().holding_servers],
                      "launch": type(loaders[0].multiprocessing_context).__name__}), flush=True)


if __name__ == "__main__":
    main("slow" in sys.argv[1:], "ours" in sys.argv[1:])
