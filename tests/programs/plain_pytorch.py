"""A user's own PyTorch training script: ``swift_safe_media.enable()`` and a plain
DataLoader, no host (issue 32, point 5).

``python -m tests.programs.plain_pytorch FOLDER SPIN_LIBRARY`` prints one JSON object. Its
dataset reads, through the libraries users call themselves: a FIFO with ``librosa.load``
(stock blocks for ever), WeNet-style audio bytes from a tar shard with ``soundfile.read``
(compared with stock's samples of the same bytes), and a decode of the user's own that
spins in native code holding the GIL, run with ``swift_safe_media.isolated``. Two
DataLoaders: one over that dataset (its workers' parent says where they started) and
one over a dataset that cannot be pickled (a lambda), which forks with one warning.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import sys
import tarfile

import librosa
import numpy as np
import soundfile
from torch.utils.data import DataLoader, Dataset

import swift_safe_media as ssm
from swift_safe_media.decoders.stock import stock_function


@ssm.isolated(timeout=3)
def spinning_decode(library):
    ctypes.PyDLL(library).spin_forever()


def read_member(shard, name):
    with tarfile.open(shard) as tar:
        return tar.extractfile(name).read()


class Clips(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        kind, value = self.items[index]
        row = {"index": index, "kind": kind, "worker_parent": os.getppid()}
        try:
            if kind == "fifo":
                librosa.load(value, sr=16000)
            elif kind == "spin":
                spinning_decode(value)
            else:
                shard, member = value
                samples, rate = soundfile.read(io.BytesIO(read_member(shard, member)))
                row.update(rate=rate, samples=samples.tolist())
            row["ok"] = True
        except ssm.MediaDecodeError as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return row


class Unpicklable(Clips):
    def __init__(self, items):
        super().__init__(items)
        self.transform = lambda row: row


def draw(dataset):
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    return [row for row in loader]


def main(folder, library):
    ssm.enable(timeout=3)
    fifo = os.path.join(folder, "stuck.wav")
    os.mkfifo(fifo)
    rate = 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate // 4) / rate)).astype(np.float32)
    wav = os.path.join(folder, "utt1.wav")
    soundfile.write(wav, tone, rate, subtype="PCM_16")
    shard = os.path.join(folder, "shard-000.tar")
    with tarfile.open(shard, "w") as tar:
        tar.add(wav, arcname="utt1.wav")
    stock_samples, stock_rate = stock_function("soundfile", "read")(io.BytesIO(read_member(shard, "utt1.wav")))
    items = [("fifo", fifo), ("tar", (shard, "utt1.wav")), ("spin", library)]
    print(json.dumps({
        "trainer": os.getpid(),
        "rows": draw(Clips(items)),
        "unpicklable_rows": draw(Unpicklable(items[1:2])),
        "stock": {"rate": stock_rate, "samples": stock_samples.tolist()},
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
