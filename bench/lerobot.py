"""LeRobot decode throughput: stock vs swift_safe_media, side by side in one run.

A 2-camera, 30 fps, 640x480 episode recorded with LeRobot's own API (``add_frame`` /
``save_episode``, its default AV1 encoding), frames from ffmpeg's testsrc2. Each sample
asks every camera for the frame at one timestamp, in shuffled order, as a shuffled
DataLoader does. Two ways of reading it, each stock and ours:

- per sample, ``_query_videos`` (what ``dataset[i]`` runs; ``DatasetReader``'s from LeRobot
  0.5.1 on): stock calls ``decode_video_frames`` once per camera in this process (on
  threads, at once, from LeRobot 0.6); ours decodes both cameras in one sandbox round
  trip (at once, on threads of the sandbox, where LeRobot decodes them at once), and
  ``ours-in-turn`` (LeRobot 0.6 only) in one round trip one after the other, which is
  what one sandbox per process would give without the threads;
- per call, ``decode_video_frames`` for one camera: stock in this process, ours through
  the sandbox.

Both use a cached torchcodec decoder (ours keeps LeRobot's cache in the sandbox).
Each side runs in a fresh process of its own, one round at a time, the sides rotating
(each going first in turn), on the same shuffled timestamps:
sides sharing a process would share glibc's heap, and one side's allocations change
what the other's cost. The ratio of median frames/s over rounds is printed. Torch runs
one thread, as in a DataLoader worker, where LeRobot decodes. ``--python`` runs it with
another LeRobot (``.venv-lerobot-0.6/bin/python``: LeRobot 0.6.1).

    .venv/bin/python bench/lerobot.py [--rounds 7] [--samples 150] [--seconds 10] [--python PYTHON]
"""

import argparse
import json
import os
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


def timed(work, timestamps) -> float:
    started = time.perf_counter()
    for timestamp in timestamps:
        work(timestamp)
    return time.perf_counter() - started


def child(side: str, root: str, samples: int, seed: int, seconds: int) -> dict:
    """One round of one side in this (fresh) process: frames/s per sample and per call."""
    torch.set_num_threads(1)
    from lerobot.datasets import video_utils
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset(REPO_ID, root=root)
    owner = getattr(dataset, "reader", None) or dataset  # LeRobot 0.5.1 on: its DatasetReader
    videos = [str(dataset.root / dataset.meta.get_video_file_path(0, camera)) for camera in CAMERAS]
    stock_query = type(owner)._query_videos
    if side.startswith("ours"):
        import dataclasses

        import swift_safe_media
        from swift_safe_media.hosts.lerobot import decode as lerobot_decode, layouts as lerobot_layouts

        # enable() then disable(): the settings (and the statistics every call records)
        # stay, LeRobot's own functions are back, and ours are called by name.
        swift_safe_media.enable(hosts=["lerobot"])
        swift_safe_media.disable()
        from swift_safe_media.engine import calls as engine

        engine.set_up_sandboxes(lerobot_decode.import_lerobot_in_sandbox)  # the sandbox's setup, as patch() makes it
        if side == "ours-in-turn":  # one round trip, the cameras one after the other
            layout = dataclasses.replace(lerobot_layouts.installed(), cameras_on_threads=False)
            lerobot_layouts.installed = lambda: layout
        stand_in = (lerobot_decode.reader_query_videos if owner is not dataset
                    else lerobot_decode.dataset_query_videos)
        query = lambda *args: stand_in(stock_query, *args)  # noqa: E731
        decode = lerobot_decode.decode_video_frames
    else:
        query, decode = stock_query, video_utils.decode_video_frames
    tolerance_s = 1 / FPS - 1e-4

    def per_sample(timestamp):
        item = query(owner, {camera: [timestamp] for camera in CAMERAS}, 0)
        assert all(item[camera].shape == (3, HEIGHT, WIDTH) for camera in CAMERAS)

    def per_call(timestamp):
        for path in videos:
            assert decode(path, [timestamp], tolerance_s, "torchcodec").shape == (1, 3, HEIGHT, WIDTH)

    every_timestamp = [index / FPS for index in range(seconds * FPS)]
    for work in (per_sample, per_call):  # warm-up: the sandbox starts, the decoders open
        timed(work, every_timestamp[:5])
    timestamps = random.Random(seed).sample(every_timestamp, samples)
    frames = len(timestamps) * len(CAMERAS)
    result = {"sample": frames / timed(per_sample, timestamps), "call": frames / timed(per_call, timestamps)}
    import importlib.metadata

    result["lerobot"] = importlib.metadata.version("lerobot")
    if side.startswith("ours"):
        from swift_safe_media.engine.calls import get_engine

        result.update(calls=get_engine().stats["calls"], sandboxes=get_engine().stats["sandboxes_started"])
    return result


def run_child(side: str, root: Path, args, seed: int) -> dict:
    done = subprocess.run([args.python, __file__, "--child", side, "--root", str(root), "--samples",
                           str(args.samples), "--seed", str(seed), "--seconds", str(args.seconds)],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=150, help="timestamps per round")
    parser.add_argument("--seconds", type=int, default=10, help="episode length")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose LeRobot is measured")
    parser.add_argument("--child", choices=("stock", "ours", "ours-in-turn"), help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.root, args.samples, args.seed, args.seconds)))
        return
    if args.record:
        record_episode(Path(args.record), args.seconds)
        return

    load = " ".join(open("/proc/loadavg").read().split()[:3])
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        root = Path(folder) / "dataset"
        subprocess.run([args.python, __file__, "--record", str(root), "--seconds", str(args.seconds)],
                       check=True, capture_output=True, env={**os.environ, "SWIFT_SAFE_MEDIA": "0"})
        recorded_s = time.monotonic() - started
        sides = ["stock", "ours"]
        results: dict[str, list[float]] = {}
        ours = {}
        for number in range(args.rounds):
            for side in sides[number % len(sides):] + sides[:number % len(sides)]:
                found = run_child(side, root, args, seed=number)
                if number == 0 and side == "stock" and not found["lerobot"].startswith(("0.4", "0.5")):
                    sides.append("ours-in-turn")  # LeRobot decodes a sample's cameras at once
                for level in ("sample", "call"):
                    results.setdefault(f"{side} {level}", []).append(found[level])
                if side == "ours":
                    ours = found

    fps = {name: statistics.median(values) for name, values in results.items()}
    print(f"LeRobot {ours.get('lerobot')} torchcodec decode, {len(CAMERAS)} cameras x "
          f"{WIDTH}x{HEIGHT} at {FPS} fps recorded with LeRobot's API ({recorded_s:.0f} s), "
          f"{args.samples} shuffled samples x {args.rounds} rounds, each side in its own process "
          f"(median frames/s, rotating); load average before {load}, after "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])} ({os.cpu_count()} cores)")
    for level, what in (("sample", "per sample, _query_videos (both cameras)"),
                        ("call", "per call, decode_video_frames (one camera)")):
        stock = fps[f"stock {level}"]
        print(f"  {what}: stock {stock:7.1f} frames/s ({1e3 / stock:.2f} ms/frame) "
              f"[{', '.join(f'{value:.0f}' for value in results[f'stock {level}'])}]")
        for side in sides[1:]:
            if f"{side} {level}" not in results or (level == "call" and side == "ours-in-turn"):
                continue
            mine = fps[f"{side} {level}"]
            print(f"    {side:12s} {mine:7.1f} frames/s ({1e3 / mine:.2f} ms/frame) "
                  f"[{', '.join(f'{value:.0f}' for value in results[f'{side} {level}'])}]: "
                  f"ratio {side}/stock {mine / stock:.3f}x")
    print(f"  target >= 0.95x; sandbox calls {ours.get('calls')}, sandboxes started {ours.get('sandboxes')} "
          f"(last round of ours)")


if __name__ == "__main__":
    main()
