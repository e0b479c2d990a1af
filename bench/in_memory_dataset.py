"""What protection costs a dataset held in memory: a ``TensorDataset`` over one float32
tensor (1 GiB by default), 2 DataLoader workers, batch size 4. Not a timed test.

Sides, each in a fresh interpreter, side by side in alternating rounds:

- ``stock``: no protection, workers forked (torch's default on Linux): they inherit the tensor;
- ``protected``: ``swift_safe_media.enable()``: workers from the warm forkserver, to which
  torch's pickler sends the tensor's storage through shared memory (moved there once);
- ``before`` (with ``--before PATH``): the same, with the package's code at PATH (another
  checkout), to measure a change side by side.

Printed: first batch (s, from ``iter()``), steady samples/s after it, the trainer's own peak
RSS (``ru_maxrss``: a copy the trainer makes shows there) and the peak PSS of the process tree
(sampled every 0.2 s, as ``bench/pipeline.py`` does), medians [spread] and each side's ratio
to stock.

    .venv/bin/python bench/in_memory_dataset.py [--mib 1024] [--rounds 3] [--before PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("first_batch_s", "steady_samples_per_s", "trainer_peak_rss_mb", "peak_pss_mb")


def child(args) -> None:
    if args.side != "stock":
        import swift_safe_media

        swift_safe_media.enable()
    import torch

    rows = args.mib // 4  # a row of 1024 x 1024 float32: 4 MiB
    dataset = torch.utils.data.TensorDataset(torch.ones(rows, 1024, 1024))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    started = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - started
    count, steady_started = 0, time.perf_counter()
    for (batch,) in batches:
        count += len(batch)
    steady = count / (time.perf_counter() - steady_started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"first_batch_s": first, "steady_samples_per_s": steady, "trainer_peak_rss_mb": peak}),
          flush=True)


def run_side(side: str, args) -> dict:
    sys.path.insert(0, str(HERE))
    from pipeline import run_child_measured  # the process tree's peak PSS, sampled as bench/pipeline.py does

    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    code_root = args.before if side == "before" else str(ROOT)
    env["PYTHONPATH"] = code_root + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", "--side", side, "--mib", str(args.mib)]
    result, memory = run_child_measured(command, env, code_root, 900, side)
    return {**result, "peak_pss_mb": memory.peak_kb / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="the tensor's size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="a checkout of this repository: a side more, protected, with its code")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--side", default="stock")
    args = parser.parse_args()
    if args.child:
        return child(args)
    sides = ["stock", "protected"] + (["before"] if args.before else [])
    runs = {side: [] for side in sides}
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    for round_number in range(args.rounds):
        for side in sides[round_number % len(sides):] + sides[:round_number % len(sides)]:  # rotating
            runs[side].append(run_side(side, args))
    load += " -> " + " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"in-memory dataset, {args.mib} MiB float32 tensor, batch 4, 2 workers, {args.rounds} rounds (load {load})")
    for key in KEYS:
        stock = statistics.median(run[key] for run in runs["stock"])
        cells = []
        for side in sides:
            values = [run[key] for run in runs[side]]
            median = statistics.median(values)
            cells.append(f"{side} {median:.2f} [{min(values):.2f}-{max(values):.2f}] ({median / stock:.2f}x)")
        print(f"  {key}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
