"""A user's own script under ``torchrun --nproc_per_node 2`` (issue 43): gloo, each rank a
DataLoader with 2 workers under ``enable(timeout=...)``, one ``all_reduce`` per batch. Rank 1's
list of WAV files (CLIPS) has, in one file's place, STALL: a FIFO nobody writes, named .wav,
on which ``soundfile.read`` would wait for ever. The dataset skips a sample whose decode
fails, as docs/engine.md shows (catching ``MediaDecodeError``); the training loop drops it.
Each rank prints one JSON line: its steps, its samples' checksums, the samples of both ranks
(summed by ``all_reduce``), its loop's wall time."""

import json
import os
import sys
import time
import zlib

import soundfile
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import swift_safe_media


class Clips(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        try:
            samples, rate = soundfile.read(self.paths[index], dtype="int16")
        except swift_safe_media.MediaDecodeError as exc:
            print(f"skipping {exc.path}: {type(exc).__name__}: {exc.reason}", file=sys.stderr, flush=True)
            return -1
        return zlib.crc32(samples.tobytes()) + rate


def main():
    swift_safe_media.enable(timeout=float(os.environ["DECODE_TIMEOUT"]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = os.environ["CLIPS"]
    paths = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".wav"))
    if rank == 1:
        paths[1] = os.environ["STALL"]
    started, steps, sums, reduced = time.monotonic(), 0, [], 0.0
    for batch in DataLoader(Clips(paths), batch_size=2, num_workers=2):
        good = batch[batch >= 0]
        sums += good.tolist()
        total = torch.tensor([float(len(good))])
        dist.all_reduce(total)
        steps, reduced = steps + 1, reduced + total.item()
    elapsed = time.monotonic() - started
    dist.barrier()
    print(json.dumps({"rank": rank, "steps": steps, "sums": sums, "seconds": elapsed, "samples": reduced}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
