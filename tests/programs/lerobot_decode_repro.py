"""The stuck-read repro against a LeRobot tree (pristine or with our upstream series).

Run by path, ``python tests/programs/lerobot_decode_repro.py MODE ...``, with the LeRobot
tree alone on ``PYTHONPATH`` (nothing of our checkout belongs in the host's process).

- ``stock STUCK``: prints ``DECODING``, then ``decode_video_frames(STUCK)`` (a FIFO: the
  read never returns) and ``RETURNED SHAPE`` should it ever return;
- ``patched STUCK GOOD``: prints ``RESULT {json}``: the shape of a decode of GOOD, what a
  decode of STUCK with a 3 s timeout did (the timeout error's message) and how long it
  took, and the shape of a decode of GOOD after it.
"""

from __future__ import annotations

import json
import sys
import time


def stock(stuck: str) -> None:
    from lerobot.datasets.video_utils import decode_video_frames
    print("DECODING", flush=True)
    frames = decode_video_frames(stuck, [0.0], 1e-4)
    print("RETURNED", tuple(frames.shape), flush=True)


def patched(stuck: str, good: str) -> None:
    from lerobot.datasets.video_decode_worker import VideoDecodeTimeoutError
    from lerobot.datasets.video_utils import decode_video_frames
    res = {"good_shape": list(decode_video_frames(good, [0.0, 0.5], 1e-4, timeout_s=60).shape)}
    t = time.monotonic()
    try:
        decode_video_frames(stuck, [0.0], 1e-4, timeout_s=3)
        res["stuck"] = "returned"
    except VideoDecodeTimeoutError as e:
        res["stuck"] = str(e)
    res["stuck_s"] = time.monotonic() - t
    res["after_shape"] = list(decode_video_frames(good, [1.0], 1e-4, timeout_s=60).shape)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    {"stock": stock, "patched": patched}[sys.argv[1]](*sys.argv[2:])
