"""Valid decodes on oversubscribed CPUs (issue 35's load figure): K processes decode the
same valid 720p clips at once through ms-swift's InternVL loader, with a timeout of 3x
the idle decode time and a shared quarantine registry, once with the fair clock (time a
sandbox waited for a CPU is not counted, up to SWIFT_SAFE_MEDIA_TIMEOUT_CEILING) and
once without it (ceiling 1: wall time, as before). Prints decodes refused and files
quarantined for each.

    python bench/oversubscribed.py [--processes 6] [--clips 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_clips(folder: str, count: int) -> list[str]:
    paths = []
    for index in range(count):
        path = os.path.join(folder, f"valid_{index}.mp4")
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-f", "lavfi", "-i",
                        "testsrc2=size=1280x720:rate=30:duration=4", "-vf", f"hue=h={index * 60}", "-c:v", "libx264",
                        "-preset", "ultrafast", "-pix_fmt", "yuv420p", path], check=True)
        paths.append(path)
    return paths


def loop(clips, rounds, env) -> subprocess.Popen:
    full = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    full.update({"PYTHONPATH": ROOT, "SWIFT_SAFE_MEDIA_WARM_START": "0", **env})
    return subprocess.Popen([sys.executable, "-m", "tests.programs.decode_loop", str(rounds), *clips], cwd=ROOT,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def result(process) -> dict:
    out, _ = process.communicate()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--clips", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        clips = make_clips(folder, args.clips)
        idle = statistics.median(result(loop(clips, 2, {}))["seconds"][len(clips):])
        timeout = 3 * idle
        print(f"idle decode {idle:.2f} s; timeout {timeout:.2f} s; {args.processes} processes x {args.rounds} rounds "
              f"x {len(clips)} clips on {os.cpu_count()} CPUs")
        print("| clock | decodes | refused | quarantined | slowest decode |\n|---|---|---|---|---|")
        for label, ceiling in (("fair (ceiling 5x)", "5"), ("wall time (ceiling 1)", "1")):
            registry = os.path.join(folder, f"q{ceiling}", "quarantine.jsonl")
            env = {"SWIFT_SAFE_MEDIA_TIMEOUT": f"{timeout:.3f}", "SWIFT_SAFE_MEDIA_TIMEOUT_CEILING": ceiling,
                   "SWIFT_SAFE_MEDIA_QUARANTINE": registry}
            results = [result(process) for process in [loop(clips, args.rounds, env) for _ in range(args.processes)]]
            from swift_safe_media.records import quarantine

            refused = sum(len(found["failures"]) for found in results)
            decodes = sum(len(found["seconds"]) for found in results)
            slowest = max(max(found["seconds"][len(clips):]) for found in results)
            print(f"| {label} | {decodes} | {refused} | {len(quarantine.Registry(registry).current())} | "
                  f"{slowest:.2f} s |")


if __name__ == "__main__":
    main()
