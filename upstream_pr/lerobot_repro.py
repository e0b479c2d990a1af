"""LeRobot decodes episode videos with no bound: a repro, stock vs. `decode_video_frames(..., timeout_s=)`.

    python lerobot_repro.py               # stock: each bad file is still decoding when --wait runs out
    python lerobot_repro.py --timeout 3   # patched: each bad file raises VideoDecodeTimeoutError naming it

Makes, in a temporary folder: good.mp4 (ffmpeg's test pattern); spin.mp4, a valid MPEG-2 video whose shown
frames sit behind 1,000,000 frames its edit list hides, so that every query decodes all of them in native
code (a minute or more of CPU, longer the more frames are hidden); stuck.mp4, a FIFO: a read that never
returns, as from a stalled network mount. Decodes good, spin, stuck and good again the way LeRobot's dataset
reader does (torchcodec, cached decoder), each in a thread waited on for at most --wait seconds, and prints
one line per decode: RESULT {"file", "outcome", "seconds", "detail"}. Stock, the second good decode never
returns either: VideoDecoderCache opens stuck.mp4 under its lock, and every camera of that DataLoader worker
waits behind it.
"""

import argparse
import fractions
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import av
import numpy as np

from lerobot.datasets.video_utils import decode_video_frames

TEST_PATTERN = "ffmpeg -v error -f lavfi -i testsrc=size=64x48:rate=30:duration=2 -pix_fmt yuv420p"


def spin_video(path: str, hidden: int = 1_000_000) -> None:
    """One keyframe, `hidden` copies of an all-skip frame before the edit list's start, 10 shown frames."""
    encoder = av.CodecContext.create("mpeg2video", "w")
    encoder.width, encoder.height, encoder.pix_fmt = 96, 64, "yuv420p"
    encoder.time_base, encoder.framerate, encoder.gop_size = fractions.Fraction(1, 30), 30, 1 << 30
    gray = av.VideoFrame.from_ndarray(np.full((64, 96, 3), 128, np.uint8), format="rgb24")
    packets = []
    for pts in range(2):
        frame = gray.reformat(format="yuv420p")
        frame.pts = pts
        packets += [bytes(packet) for packet in encoder.encode(frame)]
    packets += [bytes(packet) for packet in encoder.encode(None)]
    with av.open(path, "w", format="mp4") as out:
        stream = out.add_stream("mpeg2video", rate=30)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.time_base = fractions.Fraction(1, 30)
        for number in range(hidden + 10):
            packet = av.Packet(packets[0] if number == 0 else packets[1])
            packet.stream, packet.time_base = stream, stream.time_base
            packet.pts = packet.dts = number - hidden  # negative: before the edit list's start
            packet.is_keyframe = number == 0
            out.mux(packet)


def attempt(name: str, path: str, wait: float, **kwargs) -> None:
    result = {}

    def decode():
        start = time.monotonic()
        try:
            frames = decode_video_frames(path, [0.0, 0.5], 1e-4, "torchcodec", **kwargs)
            result.update(outcome="frames", detail=list(frames.shape))
        except Exception as e:
            result.update(outcome=type(e).__name__, detail=str(e).splitlines()[0])
        result["seconds"] = round(time.monotonic() - start, 1)

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    thread.join(wait)
    if thread.is_alive():
        result = {
            "outcome": "still running",
            "seconds": wait,
            "detail": "no bound: the training step waits too",
        }
    print("RESULT " + json.dumps({"file": name, **result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timeout", type=float, default=None, help="timeout_s (needs the patch)")
    parser.add_argument("--wait", type=float, default=60, help="how long to wait on each decode")
    parser.add_argument("--no-spin", action="store_true", help="leave spin.mp4 out (a minute or more of CPU)")
    args = parser.parse_args()
    kwargs = {"timeout_s": args.timeout} if args.timeout else {}
    folder = tempfile.mkdtemp(prefix="lerobot-repro-")
    good, spin, stuck = (os.path.join(folder, name) for name in ("good.mp4", "spin.mp4", "stuck.mp4"))
    subprocess.run([*TEST_PATTERN.split(), good], check=True)
    if not args.no_spin:
        spin_video(spin)
    os.mkfifo(stuck)
    for name, path in [("good.mp4", good), ("spin.mp4", spin), ("stuck.mp4", stuck), ("good.mp4", good)]:
        if not (args.no_spin and path == spin):
            attempt(name, path, args.wait, **kwargs)
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)  # stock: threads stuck in native code would keep the interpreter from exiting


if __name__ == "__main__":
    main()
