"""The allow-list unpickler's cost on a 720p frame batch reply, side by side with a plain one.

Two measurements, in alternating rounds (ABBA): (1) the caller's unpickling of the reply
alone (32 frames of 1280x720 RGB as a uint8 tensor, and the same as a numpy array with
its VideoInfo, pickled as a sandbox pickles them: the frames out of band), (2) whole
``call``s returning that batch from a real sandbox, the caller receiving with the
allow-list (as shipped) or with ``pickle.Unpickler`` (patched in for the round).

    .venv/bin/python bench/reply_unpickler.py [--rounds 40]
"""

import argparse
import functools
import io
import pickle
import statistics
import time

import numpy as np
import torch

from swift_safe_media import call
from swift_safe_media.engine import pickling, transport
from swift_safe_media.decoders.videoinfo import VideoInfo
from swift_safe_media.confinement.reply_unpickler import ReplyUnpickler

SHAPE = (32, 720, 1280, 3)


def batch(kind: str):
    frames = np.full(SHAPE, 7, np.uint8)
    if kind == "tensor":
        return torch.from_numpy(frames).permute(0, 3, 1, 2)  # strided, as torchcodec's NCHW
    return frames, VideoInfo(num_frames=32, fps=30.0, duration=10.0, width=1280, height=720)


def pickled(obj):
    """The pickle stream and its out-of-band buffers, as transport.encode makes them."""
    buffers = []

    def out_of_band(buffer):
        buffers.append(buffer.raw())
        return False

    stream = io.BytesIO()
    pickling.Pickler(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
    return stream.getvalue(), buffers


def unpickle_seconds(unpickler, body, buffers, repeat: int = 200) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        unpickler(io.BytesIO(body), buffers=buffers).load()
    return (time.perf_counter() - started) / repeat


def abba(rounds: int, measure) -> tuple[float, float]:
    """Median seconds with the allow-list and with the plain unpickler, alternating."""
    times = {ReplyUnpickler: [], pickle.Unpickler: []}
    for index in range(rounds):
        order = (ReplyUnpickler, pickle.Unpickler) if index % 4 in (0, 3) else (pickle.Unpickler, ReplyUnpickler)
        for unpickler in order:
            times[unpickler].append(measure(unpickler))
    return statistics.median(times[ReplyUnpickler]), statistics.median(times[pickle.Unpickler])


def through_call(unpickler, kind: str) -> float:
    original = transport.receive
    transport.receive = functools.partial(original, unpickler=unpickler)
    try:
        started = time.perf_counter()
        result = call(batch, kind)
        seconds = time.perf_counter() - started
    finally:
        transport.receive = original
    del result
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    for kind in ("tensor", "array + VideoInfo"):
        body, buffers = pickled(batch(kind))
        restricted, plain = abba(args.rounds, lambda u: unpickle_seconds(u, body, buffers))
        print(f"unpickle a 720p x32 {kind} reply: allow-list {restricted * 1e6:.1f} us, plain {plain * 1e6:.1f} us, "
              f"ratio {restricted / plain:.3f}, difference {(restricted - plain) * 1e6:+.1f} us")
    for kind in ("tensor", "array + VideoInfo"):
        call(batch, kind)  # warm
        restricted, plain = abba(args.rounds, lambda u: through_call(u, kind))
        print(f"call() returning a 720p x32 {kind}: allow-list {restricted * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms, "
              f"ratio {restricted / plain:.3f}")


if __name__ == "__main__":
    main()
