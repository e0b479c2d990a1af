"""Every media library entry point protection bounds (``integrations/media.py``), called
as a host or a user calls it, with protection on: stock's result on valid media, a
named ``MediaDecodeTimeout`` on a FIFO (stock blocks for ever on it).

``python -m tests.programs.library_entry_points FOLDER VIDEO WAV`` prints one JSON line per
case: ``same`` (the result equals stock's, computed here by the unpatched function, in this
process), and ``stuck``: what the call raised on a FIFO (where stock opens it, it blocks
for ever; transformers' loaders refuse anything but a regular file first), with
``stuck_seconds``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time

import numpy as np

import swift_safe_media as ssm
from swift_safe_media.decoders.stock import stock_function
from swift_safe_media.patching import media_libraries as media

# A model's own code, as InternLM-XComposer ships ixc_utils.load_video (decord inside).
REMOTE_UTILS = '''
import decord
import numpy as np


def load_video(video_path):
    reader = decord.VideoReader(video_path)
    return reader.get_batch(list(range(0, len(reader), 10))).asnumpy()
'''


# A valid file's first call in a fresh sandbox may compile librosa's numba functions
# (seconds on a loaded machine, as stock's first call in a process does); a FIFO never ends.
GOOD_TIMEOUT, STUCK_TIMEOUT = 60, 3


def same(ours, stock) -> bool:
    if dataclasses.is_dataclass(ours) and not isinstance(ours, type):
        return type(ours) is type(stock) and same(dataclasses.asdict(ours), dataclasses.asdict(stock))
    if isinstance(ours, dict):
        return ours.keys() == stock.keys() and all(same(ours[key], stock[key]) for key in ours)
    if isinstance(ours, (list, tuple)):
        return len(ours) == len(stock) and all(map(same, ours, stock))
    if isinstance(ours, io.BytesIO):
        return ours.getvalue() == stock.getvalue()
    if hasattr(ours, "getpixel"):  # PIL
        return ours.mode == stock.mode and np.array_equal(np.asarray(ours), np.asarray(stock))
    if hasattr(ours, "numpy") or isinstance(ours, np.ndarray):
        ours, stock = np.asarray(ours), np.asarray(stock)
        return ours.dtype == stock.dtype and np.array_equal(ours, stock, equal_nan=True)
    return ours == stock


def cases(folder, video, wav, fifo):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model = os.path.join(folder, "remote_model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "ixc_utils.py"), "w") as out:
        out.write(REMOTE_UTILS)
    with open(os.path.join(model, "config.json"), "w") as out:
        out.write("{}")

    def remote(path):  # what ms-swift's InternLM-XComposer template does
        return get_class_from_dynamic_module("ixc_utils.load_video", model)(path)

    def every_tenth(metadata, **kwargs):
        return np.arange(0, metadata.total_num_frames, 10)

    yield "transformers.load_video pyav", video, fifo, lambda path: _hf_video(path, num_frames=4, backend="pyav")
    yield "transformers.load_video decord", video, fifo, lambda path: _hf_video(path, num_frames=4, backend="decord")
    yield "transformers.load_video opencv", video, fifo, lambda path: _hf_video(path, num_frames=4, backend="opencv")
    yield "transformers.load_video lambda sampler", video, fifo, lambda path: _hf_video(
        path, backend="pyav", sample_indices_fn=lambda metadata, **kwargs: every_tenth(metadata))
    yield "transformers.load_audio", wav, fifo, lambda path: _hf_audio().load_audio(path, sampling_rate=16000)
    yield "transformers.load_audio_as", wav, fifo, lambda path: _hf_audio().load_audio_as(path, return_format="dict")
    yield "keye_vl_utils.fetch_video", video, fifo, lambda path: __import__("keye_vl_utils").fetch_video({"video": path})
    yield "minicpmo get_video_frame_audio_segments", video, fifo, lambda path: __import__(
        "minicpmo.utils").utils.get_video_frame_audio_segments(path, use_audio=True, stack_frames=1)
    yield "whisper.load_audio", wav, fifo, lambda path: __import__("whisper").load_audio(path)
    yield "librosa.load", wav, fifo, lambda path: __import__("librosa").load(path, sr=16000)
    yield "soundfile.read", wav, fifo, lambda path: __import__("soundfile").read(path)
    yield "soundfile.read bytes", wav, None, lambda path: __import__("soundfile").read(io.BytesIO(open(path, "rb").read()))
    yield "remote code ixc_utils.load_video", video, fifo, remote


def _hf_video(path, **kwargs):
    from transformers import video_utils
    return video_utils.load_video(path, **kwargs)


def _hf_audio():
    from transformers import audio_utils
    return audio_utils


def stock_of(call, path):
    """The same call with every bounded entry point unpatched for its duration."""
    media.PATCHES.unpatch()
    try:
        return call(path)
    finally:
        media.PATCHES.patch()


def main(folder, video, wav):
    ssm.enable(timeout=GOOD_TIMEOUT)
    fifo = os.path.join(folder, "stuck.mp4")
    os.mkfifo(fifo)
    for name, path, stuck, call in cases(folder, video, wav, fifo):
        row = {"case": name}
        os.environ["SWIFT_SAFE_MEDIA_TIMEOUT"] = str(GOOD_TIMEOUT)
        try:
            ours = call(path)
            row["same"] = same(ours, stock_of(call, path))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        if stuck is not None:
            os.environ["SWIFT_SAFE_MEDIA_TIMEOUT"] = str(STUCK_TIMEOUT)
            started = time.monotonic()
            try:
                call(stuck)
                row["stuck"] = "returned"
            except Exception as exc:
                row["stuck"] = f"{type(exc).__name__}: {exc}"
            row["stuck_seconds"] = round(time.monotonic() - started, 2)
        print(json.dumps(row), flush=True)
    assert stock_function("soundfile", "read") is not __import__("soundfile").read


if __name__ == "__main__":
    main(*sys.argv[1:4])
