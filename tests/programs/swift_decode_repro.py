"""The decord hang repro against an ms-swift tree (pristine or with our upstream series).

Run by path, ``python tests/programs/swift_decode_repro.py MODE ...``, with the ms-swift
tree alone on ``PYTHONPATH``: the sdist's own top-level ``tests`` package would shadow
``tests.programs``, and nothing of our checkout belongs in the host's process.

- ``stock CUT``: prints ``DECODING``, then ``load_video_cogvlm2(CUT)`` (decord spins for
  ever on this clip) and ``RETURNED SHAPE`` should it ever return;
- ``patched CUT WAV``: starts the decode worker with ``load_audio(WAV)``, then prints
  ``RESULT {json}``: what ``load_video_cogvlm2(CUT)`` did with decord (a timeout error's
  message) and how long it took, then the shape and time with the torchcodec backend.
"""

from __future__ import annotations

import json
import os
import sys
import time


def stock(cut: str) -> None:
    from swift.template.vision_utils import load_video_cogvlm2
    print("DECODING", flush=True)
    video = load_video_cogvlm2(cut)
    print("RETURNED", tuple(video.shape), flush=True)


def patched(cut: str, wav: str) -> None:
    from swift.template.vision_utils import load_audio, load_video_cogvlm2
    from swift.template.media_worker import MediaDecodeTimeoutError
    load_audio(wav, 16000)  # start the decode worker
    res = {}
    t = time.monotonic()
    try:
        load_video_cogvlm2(cut)
        res["decord"] = "returned"
    except MediaDecodeTimeoutError as e:
        res["decord"] = str(e)
    res["decord_s"] = time.monotonic() - t
    os.environ["SWIFT_VIDEO_BACKEND"] = "torchcodec"
    t = time.monotonic()
    res["torchcodec_shape"] = list(load_video_cogvlm2(cut).shape)
    res["torchcodec_s"] = time.monotonic() - t
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    {"stock": stock, "patched": patched}[sys.argv[1]](*sys.argv[2:])
