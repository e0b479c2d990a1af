"""Cost of the pre-flight check that ``enable()`` makes at the start of every protected run.

Each sample is a fresh interpreter that has imported torch already (as ms-swift's and
LeRobot's processes have when they parse their flags), then times one of:

- check: ``swift_safe_media.checks.preflight.require()`` (torchcodec's libraries loaded with
  ctypes, FFmpeg's with them, soundfile and soxr imported), as ``enable()`` runs it;
- import: ``import torchcodec, soundfile, soxr`` (torchcodec's import also imports
  ``torch._dynamo``), the obvious alternative;
- probe: a subprocess ``python -c "import torch, torchcodec, soundfile, soxr"`` started
  from that interpreter, the alternative that keeps the parent clean;
- child: ``require()`` in a process whose parent passed the check (DataLoader workers,
  ms-swift's training process): the verdict read from the environment.

Kinds alternate round by round; medians and ranges are printed.

    .venv/bin/python bench/preflight.py [--rounds 7]
"""

import argparse
import os
import statistics
import subprocess
import sys

SETUP = "import time, torch, swift_safe_media\n"
PROGRAMS = {
    "check": "t = time.perf_counter(); swift_safe_media.checks.preflight.require()",
    "import": "t = time.perf_counter(); import torchcodec, soundfile, soxr",
    "probe": ("import subprocess, sys; t = time.perf_counter(); subprocess.run([sys.executable, '-c', "
              "'import torch, torchcodec, soundfile, soxr'], check=True)"),
    "child": "t = time.perf_counter(); swift_safe_media.checks.preflight.require()",
}


def sample(kind: str, passed_marker: str) -> float:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    if kind == "child":
        env["SWIFT_SAFE_MEDIA_PREFLIGHT_PASSED"] = passed_marker
    program = SETUP + "import swift_safe_media.checks.preflight\n" + PROGRAMS[kind] + "\nprint((time.perf_counter() - t) * 1e3)"
    out = subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def passed_marker() -> str:
    program = ("import os, torch, swift_safe_media.checks.preflight as p; p.require(); "
               "print(os.environ['SWIFT_SAFE_MEDIA_PREFLIGHT_PASSED'])")
    return subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    marker = passed_marker()  # also warms the page cache for every kind
    times = {kind: [] for kind in PROGRAMS}
    for _ in range(args.rounds):
        for kind in PROGRAMS:
            times[kind].append(sample(kind, marker))
    median = {kind: statistics.median(values) for kind, values in times.items()}
    for kind, values in times.items():
        print(f"{kind:>6}: median {median[kind]:8.1f} ms  (range {min(values):.1f}-{max(values):.1f} ms, "
              f"{len(values)} rounds)")
    print(f"check / import: {median['check'] / median['import']:.3f}x   "
          f"check / probe: {median['check'] / median['probe']:.3f}x   child: {median['child']:.2f} ms")


if __name__ == "__main__":
    main()
