"""A user's own WebDataset training script (issue 43, item 4), as users write it: tar shards
of audio read by ``webdataset.WebDataset`` in a torch DataLoader with 2 workers (one shard
each), every member's bytes decoded in the pipeline, a bad member skipped by a handler of the
user's own that logs what it got. ``PROTECT=1`` calls ``swift_safe_media.enable()`` first.

``python -m tests.programs.user_shards SHARDS_FOLDER MODE [MODE ...]``, one pipeline after
another in the same run, each MODE one of:

- ``soundfile-map``: ``.map`` of ``soundfile.read(io.BytesIO(bytes))``;
- ``soundfile-decode``: webdataset's own ``Decoder`` (``.decode``) with a handler that calls
  ``soundfile.read`` on ``BytesIO`` (``wds.handle_extension``);
- ``torch_audio-decode``: webdataset's own audio decoder, ``.decode(wds.torch_audio)`` (it
  writes the bytes to a temporary file and calls ``torchaudio.load`` on it);
- ``torchaudio-map``: ``.map`` of ``torchaudio.load(io.BytesIO(bytes))``.

Each sample becomes one JSON line on stdout: its key, the checksum of its samples (int16 for
soundfile, float32 for torchaudio) and rate, the worker's pid and whether the decode function
it called was the bounded stand-in. Each sample the handler skipped: one line naming what was
raised (and, for webdataset's ``DecodingError``, the key, shard and field it names, and its
cause). After each pipeline, protected, the run's summary of decodes so far (``records.summary``).
Each line also carries its MODE and ``RUN`` (from the environment, which the workers inherit).
"""

import io
import json
import os
import select
import sys
import zlib
from functools import partial

import torch
import webdataset as wds
from torch.utils.data import DataLoader

import swift_safe_media

AUDIO = ("wav", "flac")


def emit(row: dict) -> None:
    row = {**row, "mode": os.environ["MODE"], "run": os.environ.get("RUN")}
    line = (json.dumps(row) + "\n").encode()
    assert len(line) <= select.PIPE_BUF, line  # one write of at most PIPE_BUF: whole lines, from either worker
    os.write(sys.stdout.fileno(), line)


def skip_and_log(exn) -> bool:
    """The user's handler: note what failed, go on (as ``wds.warn_and_continue``, without its sleep)."""
    row = {"skipped": type(exn).__name__, "message": str(exn)[:1000], "pid": os.getpid()}
    if isinstance(exn, wds.autodecode.DecodingError):  # webdataset's own: it names the sample
        row.update(key=exn.key, url=exn.url, field=exn.k)
    cause = exn.__cause__
    if cause is not None:
        row.update(cause=type(cause).__name__, cause_message=str(cause)[:1000])
    emit(row)
    return True


def audio_field(sample: dict) -> str:
    [field] = [name for name in sample if name in AUDIO]
    return field


def checksum(samples, rate) -> int:
    if isinstance(samples, torch.Tensor):
        samples = samples.numpy()
    return zlib.crc32(samples.tobytes()) + int(rate)


def soundfile_read(data: bytes):
    import soundfile

    return soundfile.read(io.BytesIO(data), dtype="int16")


def torchaudio_load(data: bytes):
    import torchaudio

    return torchaudio.load(io.BytesIO(data))


def read_with(decode, function_name, sample):
    """``.map``: the user's own decode of the sample's audio bytes."""
    samples, rate = decode(sample[audio_field(sample)])
    return row(sample, samples, rate, function_name)


def decoded_row(function_name, sample):
    """After ``.decode``: the audio field holds what the decoder returned."""
    samples, rate = sample[audio_field(sample)]
    return row(sample, samples, rate, function_name)


def row(sample, samples, rate, function_name):
    module, name = function_name.split(".")
    function = getattr(sys.modules[module], name)
    return {"key": sample["__key__"], "crc": checksum(samples, rate), "pid": os.getpid(),
            "bounded": hasattr(function, "__wrapped__")}


def pipeline(mode: str, shards: list[str]):
    dataset = wds.WebDataset(shards, shardshuffle=False, handler=skip_and_log)
    if mode == "soundfile-map":
        return dataset.map(partial(read_with, soundfile_read, "soundfile.read"), handler=skip_and_log)
    if mode == "torchaudio-map":
        return dataset.map(partial(read_with, torchaudio_load, "torchaudio.load"), handler=skip_and_log)
    if mode == "soundfile-decode":
        return dataset.decode(wds.handle_extension("wav flac", soundfile_read), handler=skip_and_log) \
            .map(partial(decoded_row, "soundfile.read"), handler=skip_and_log)
    if mode == "torch_audio-decode":
        return dataset.decode(wds.torch_audio, handler=skip_and_log).map(partial(decoded_row, "torchaudio.load"),
                                                                         handler=skip_and_log)
    raise SystemExit(f"unknown mode {mode}")


def main():
    folder, modes = sys.argv[1], sys.argv[2:]
    if os.environ.get("PROTECT") == "1":
        swift_safe_media.enable(timeout=30)
    # The decoders are imported where a user's script imports them: at the top, after enable().
    for mode in modes:
        __import__("torchaudio" if mode.startswith("torch") else "soundfile")
    shards = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".tar"))
    for mode in modes:
        os.environ["MODE"] = mode  # before the loader starts its workers, which copy it
        for sample in DataLoader(pipeline(mode, shards), batch_size=None, num_workers=2):
            emit(sample)
        if os.environ.get("PROTECT") == "1":
            from swift_safe_media.records import summary

            summary.wait_for_held_back_counts(summary.FLUSH_EVERY_S + 0.5)  # the workers' last counts
            counts = summary.collect()
            emit({"summary": {name: counts[name] for name in ("decodes", "ok", "error", "timeout", "crash")},
                  "slowest": sorted(entry["path"] for entry in counts["slowest"])})


if __name__ == "__main__":
    main()
