"""What bounding a user's own decodes costs on a plain pipeline (issue 43, item 2): a
``Dataset`` of the user's that reads clips with decord (or PyAV) in ``__getitem__``, 2
DataLoader workers, batch size 2. Not a timed test.

Sides, each in a fresh interpreter, side by side in alternating rounds:

- ``stock``: no protection, workers forked (torch's default on Linux);
- ``protected``: ``swift_safe_media.enable()`` (workers from the warm forkserver, the
  openers' calls marked, the trainer watching the marks);
- ``unbounded``: the same with ``SWIFT_SAFE_MEDIA_BOUND_OPENERS=0``: what is left of the
  cost without the bound (the warm forkserver's start and memory, issue 45's);
- ``sliding`` (with ``--sliding``): protected, with ``SWIFT_SAFE_MEDIA_WORKER_MMAP_THRESHOLD_KB=0``:
  the workers keep glibc's sliding mmap threshold, as forked ones do, so the frames they
  free stay in their heap instead of being mapped (and faulted in) afresh each sample.

Printed: first batch (s), steady samples/s after it, peak PSS of the process tree (the
interpreter and every descendant, sampled every 0.2 s), medians with every round, and
each side's ratio to stock. Inputs: 480p H.264 clips of 4 s made here with ffmpeg.

    .venv/bin/python bench/own_code.py [--clips 24] [--rounds 3] [--library decord|av] [--sliding]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDES = {"stock": {}, "protected": {}, "unbounded": {"SWIFT_SAFE_MEDIA_BOUND_OPENERS": "0"},
         "sliding": {"SWIFT_SAFE_MEDIA_WORKER_MMAP_THRESHOLD_KB": "0"}}
KEYS = ("first_batch_s", "steady_samples_per_s", "peak_pss_mb")
FRAMES = 8


def make_clips(folder: Path, count: int) -> list[str]:
    clips = []
    for index in range(count):
        path = folder / f"clip_{index:03d}.mp4"
        if not path.exists():
            subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                            f"testsrc2=size=854x480:rate=25:duration=4,hue=h={index * 15}", "-c:v", "libx264",
                            "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path)], check=True, timeout=300)
        clips.append(str(path))
    return clips


# -- the user's pipeline, in the child ---------------------------------------------------
class Clips:
    def __init__(self, files, library):
        self.files, self.library = files, library

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        import numpy as np

        path = self.files[index]
        if self.library == "decord":
            import decord

            reader = decord.VideoReader(path)
            frames = reader.get_batch(np.linspace(0, len(reader) - 1, FRAMES).astype(int).tolist()).asnumpy()
        else:
            import av

            with av.open(path) as container:
                frames = np.stack([frame.to_ndarray(format="rgb24")
                                   for frame, _ in zip(container.decode(video=0), range(FRAMES))])
        return frames.mean(axis=(1, 2, 3))


def child(args) -> None:
    if args.side != "stock":
        import swift_safe_media

        swift_safe_media.enable()
    import torch

    started = time.perf_counter()
    loader = torch.utils.data.DataLoader(Clips(json.loads(args.inputs), args.library), batch_size=2,
                                         num_workers=2)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - started
    count, steady_started = 0, time.perf_counter()
    for batch in batches:
        count += len(batch)
    steady = count / (time.perf_counter() - steady_started)
    print(json.dumps({"first_batch_s": first, "steady_samples_per_s": steady}), flush=True)


# -- the parent ---------------------------------------------------------------------------
def run_side(side: str, args, clips) -> dict:
    sys.path.insert(0, str(HERE))
    from pipeline import run_child_measured  # the process tree's peak PSS, sampled as bench/pipeline.py does

    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env.update(SIDES[side])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", "--side", side, "--library", args.library,
               "--inputs", json.dumps(clips)]
    result, memory = run_child_measured(command, env, ROOT, 900, side)
    return {**result, "peak_pss_mb": memory.peak_kb / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--library", choices=("decord", "av"), default="decord")
    parser.add_argument("--sliding", action="store_true",
                        help="a side more: protected, workers under glibc's sliding mmap threshold")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--side", default="stock")
    parser.add_argument("--inputs", default="[]")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.clips < 4:  # the first batch takes 2; the steady rate needs a batch after it
        parser.error("--clips must be at least 4")
    folder = Path(tempfile.gettempdir()) / "swift-safe-media-bench-own-code"
    folder.mkdir(exist_ok=True)
    clips = make_clips(folder, args.clips)
    sides = [side for side in SIDES if args.sliding or side != "sliding"]
    runs = {side: [] for side in sides}
    for round_number in range(args.rounds):
        order = sides if round_number % 2 == 0 else sides[::-1]
        for side in order:
            runs[side].append(run_side(side, args, clips))
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"own code, {args.library}, {args.clips} clips of 480p, {FRAMES} frames each, 2 workers, "
          f"{args.rounds} rounds (load {load})")
    medians = {side: {key: statistics.median(run[key] for run in side_runs) for key in KEYS}
               for side, side_runs in runs.items()}
    for key in KEYS:
        cells = []
        for side in sides:
            spread = ", ".join(f"{run[key]:.2f}" for run in runs[side])
            ratio = "" if side == "stock" else f" = {medians[side][key] / medians['stock'][key]:.2f}x"
            cells.append(f"{side} {medians[side][key]:.2f} [{spread}]{ratio}")
        print(f"  {key:21s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
