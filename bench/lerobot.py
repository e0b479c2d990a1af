"""LeRobot decode throughput: stock vs swift_safe_media, side by side in one run.

A 2-camera, 30 fps, 640x480 episode recorded with LeRobot's own API (``add_frame`` /
``save_episode``, its default AV1 encoding), frames from ffmpeg's testsrc2. Each sample
asks every camera for the frame at one timestamp, in shuffled order, as a shuffled
DataLoader does. Two ways of reading it, each stock and ours:

- per sample, ``LeRobotDataset._query_videos`` (what ``dataset[i]`` runs): stock calls
  ``decode_video_frames`` once per camera in this process; ours decodes both cameras in
  one sandbox round trip;
- per call, ``decode_video_frames`` for one camera: stock in this process, ours through
  the sandbox.

Both use a cached torchcodec decoder (ours keeps LeRobot's cache in the sandbox).
Stock and ours alternate sample by sample (each going first half the time), so both see
the same load; the ratio of median frames/s over rounds is printed. Torch runs one
thread, as in a DataLoader worker, where LeRobot decodes.

    .venv/bin/python bench/lerobot.py [--rounds 7] [--samples 150] [--seconds 10]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

FPS = 30
WIDTH, HEIGHT = 640, 480
CAMERAS = ("observation.images.front", "observation.images.wrist")
REPO_ID = "local/bench"


def testsrc_frames(seconds: int, hue: int):
    """RGB frames of ffmpeg's testsrc2 pattern (moving, textured: it costs what video costs)."""
    size = WIDTH * HEIGHT * 3
    process = subprocess.Popen(
        ["ffmpeg", "-v", "error", "-f", "lavfi", "-i",
         f"testsrc2=size={WIDTH}x{HEIGHT}:rate={FPS}:duration={seconds}", "-vf", f"hue=h={hue}",
         "-f", "rawvideo", "-pix_fmt", "rgb24", "-"], stdout=subprocess.PIPE)
    while chunk := process.stdout.read(size):
        yield np.frombuffer(chunk, np.uint8).reshape(HEIGHT, WIDTH, 3)
    process.wait()


def record_episode(root: Path, seconds: int):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {camera: {"dtype": "video", "shape": (HEIGHT, WIDTH, 3), "names": ["height", "width", "channels"]}
                for camera in CAMERAS}
    features["action"] = {"dtype": "float32", "shape": (2,), "names": None}
    dataset = LeRobotDataset.create(REPO_ID, fps=FPS, features=features, root=root, use_videos=True)
    streams = [testsrc_frames(seconds, number * 90) for number in range(len(CAMERAS))]
    for images in zip(*streams):
        dataset.add_frame({**dict(zip(CAMERAS, images)), "action": np.zeros(2, np.float32), "task": "bench"})
    dataset.save_episode()
    dataset.finalize()
    return LeRobotDataset(REPO_ID, root=root)


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def interleaved(stock, ours, timestamps) -> tuple[float, float]:
    """Seconds spent by each side over ``timestamps``, alternating which goes first at each
    one, so both see the same load on a busy machine."""
    spent = [0.0, 0.0]
    for number, timestamp in enumerate(timestamps):
        sides = ((0, stock), (1, ours)) if number % 2 == 0 else ((1, ours), (0, stock))
        for side, work in sides:
            spent[side] += timed(lambda: work(timestamp))
    return spent[0], spent[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=150, help="timestamps per round")
    parser.add_argument("--seconds", type=int, default=10, help="episode length")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import swift_safe_media
    from lerobot.datasets import video_utils
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from swift_safe_media.engine import get_engine
    from swift_safe_media.integrations import lerobot as adapter

    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        dataset = record_episode(Path(folder) / "dataset", args.seconds)
        recorded_s = time.monotonic() - started
        videos = [str(dataset.root / dataset.meta.get_video_file_path(0, camera)) for camera in CAMERAS]
        # enable() then disable(): the settings (and the statistics every call records)
        # stay, LeRobot's own functions are back, and ours are called by name: what the
        # patch installs, side by side with the stock functions.
        swift_safe_media.enable(hosts=["lerobot"])
        swift_safe_media.disable()
        stock_query = LeRobotDataset._query_videos
        tolerance_s = 1 / FPS - 1e-4

        def sample(query_videos):
            def read(timestamp):
                item = query_videos(dataset, {camera: [timestamp] for camera in CAMERAS}, 0)
                assert all(item[camera].shape == (3, HEIGHT, WIDTH) for camera in CAMERAS)
            return read

        def each_camera(decode):
            def read(timestamp):
                for path in videos:
                    assert decode(path, [timestamp], tolerance_s, "torchcodec").shape == (1, 3, HEIGHT, WIDTH)
            return read

        levels = {
            "sample": (sample(stock_query),
                       sample(lambda *query: adapter.query_videos_in_one_call(stock_query, *query))),
            "call": (each_camera(video_utils.decode_video_frames), each_camera(adapter.safe_decode_video_frames)),
        }
        every_timestamp = [index / FPS for index in range(args.seconds * FPS)]
        for stock, ours in levels.values():  # warm-up: the sandbox starts, both open their decoders
            interleaved(stock, ours, every_timestamp[:5])
        draw = random.Random(0)
        results = {}
        for _ in range(args.rounds):
            timestamps = draw.sample(every_timestamp, args.samples)
            frames = len(timestamps) * len(CAMERAS)
            for level, (stock, ours) in levels.items():
                stock_s, ours_s = interleaved(stock, ours, timestamps)
                results.setdefault(f"stock {level}", []).append(frames / stock_s)
                results.setdefault(f"ours {level}", []).append(frames / ours_s)
        calls = get_engine().stats["calls"]

    fps = {name: statistics.median(values) for name, values in results.items()}
    print(f"LeRobot {adapter.get_version()} torchcodec decode, {len(CAMERAS)} cameras x "
          f"{WIDTH}x{HEIGHT} at {FPS} fps recorded with LeRobot's API ({recorded_s:.0f} s), "
          f"{args.samples} shuffled samples x {args.rounds} rounds (median frames/s, side by side)")
    for level, what in (("sample", "per sample, LeRobotDataset._query_videos (both cameras)"),
                        ("call", "per call, decode_video_frames (one camera)")):
        stock, ours = fps[f"stock {level}"], fps[f"ours {level}"]
        print(f"  {what}:")
        print(f"    stock {stock:7.1f} frames/s ({1e3 / stock:.2f} ms/frame), ours {ours:7.1f} frames/s "
              f"({1e3 / ours:.2f} ms/frame): ratio ours/stock {ours / stock:.3f}x")
    print(f"  target >= 0.95x; sandbox calls {calls}, sandboxes started {get_engine().stats['sandboxes_started']}")


if __name__ == "__main__":
    main()
