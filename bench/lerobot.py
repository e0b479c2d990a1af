"""LeRobot decode throughput: stock ``decode_video_frames`` vs ours, side by side in one run.

A 2-camera, 30 fps, 480p episode encoded the way LeRobot records (AV1 with libsvtav1,
GOP 2, CRF 30, yuv420p; made here with ffmpeg). Each sample asks every camera for the
frame at one timestamp, in shuffled order, as a shuffled DataLoader does. Stock is
LeRobot's own function in this process with its cached torchcodec decoder; ours is the
same call through the patched function (the sandbox holds the decoder cache). Rounds
alternate and the ratio of median frames/s is printed. Torch runs one thread, as in a
DataLoader worker, where LeRobot decodes.

    .venv/bin/python bench/lerobot.py [--rounds 7] [--samples 150]
"""

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This file is named lerobot.py: keep its folder from shadowing the lerobot package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

FPS = 30
CAMERAS = ("observation.images.front", "observation.images.wrist")


def make_episode(folder: Path, seconds: int) -> dict:
    videos = {}
    for number, camera in enumerate(CAMERAS):
        path = folder / f"{camera}.mp4"
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                        f"testsrc2=size=640x480:rate={FPS}:duration={seconds}",
                        "-vf", f"hue=h={number * 90}", "-c:v", "libsvtav1", "-g", "2", "-crf", "30",
                        "-preset", "12", "-pix_fmt", "yuv420p", str(path)], check=True)
        videos[camera] = str(path)
    return videos


def run_round(decode, videos, timestamps) -> float:
    """Frames per second decoding every camera at each timestamp."""
    started = time.perf_counter()
    for timestamp in timestamps:
        for path in videos.values():
            frames = decode(path, [timestamp], 1 / FPS - 1e-4, "torchcodec")
            assert frames.shape == (1, 3, 480, 640)
    return len(timestamps) * len(videos) / (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=150, help="timestamps per round")
    parser.add_argument("--seconds", type=int, default=20, help="episode length")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lerobot.datasets import video_utils

    from swift_safe_media.engine import get_engine
    from swift_safe_media.integrations import lerobot as adapter

    stock = video_utils.decode_video_frames
    ours = adapter.safe_decode_video_frames
    with tempfile.TemporaryDirectory() as folder:
        videos = make_episode(Path(folder), args.seconds)
        frame_count = args.seconds * FPS
        draw = random.Random(0)
        every_timestamp = [index / FPS for index in range(frame_count)]
        # Warm-up: the sandbox starts and imports LeRobot; both caches open their decoders.
        for decode in (stock, ours):
            run_round(decode, videos, every_timestamp[:5])
        results = {"stock": [], "ours": []}
        for _ in range(args.rounds):
            timestamps = draw.sample(every_timestamp, args.samples)
            results["stock"].append(run_round(stock, videos, timestamps))
            results["ours"].append(run_round(ours, videos, timestamps))

    stock_fps, ours_fps = statistics.median(results["stock"]), statistics.median(results["ours"])
    print(f"LeRobot decode_video_frames, torchcodec, 2 cameras x 640x480 AV1 at {FPS} fps, "
          f"{args.samples} shuffled samples x {args.rounds} rounds (median frames/s)")
    print(f"  stock (in process, cached decoder):  {stock_fps:7.1f} frames/s")
    print(f"  swift_safe_media (sandbox cache):    {ours_fps:7.1f} frames/s")
    print(f"  per frame: {1e3 / stock_fps:.2f} ms stock, {1e3 / ours_fps:.2f} ms ours "
          f"(+{1e3 / ours_fps - 1e3 / stock_fps:.2f} ms: the round trip to the sandbox)")
    print(f"  ratio ours/stock: {ours_fps / stock_fps:.3f}x (target >= 0.95x)")
    print(f"  sandbox calls: {get_engine().stats['calls']}, sandboxes started: "
          f"{get_engine().stats['sandboxes_started']}")


if __name__ == "__main__":
    main()
