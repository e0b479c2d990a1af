"""Valid decodes on oversubscribed CPUs (issue 35's load figure): K processes decode the
same valid 720p clips at once through ms-swift's InternVL loader, with a timeout of 3x
the idle decode time (``--factor``) and a quarantine registry per side: with the fair clock
(time a sandbox waited for a CPU is not counted, up to SWIFT_SAFE_MEDIA_TIMEOUT_CEILING),
without it (ceiling 1: wall time), and with ``--before DIR`` the fair clock of another
checkout (first on PYTHONPATH). The sides alternate, ``--repeat`` times. Prints, for each
side and time, the decodes, the timeouts (those cut by the ceiling apart), every refusal
(the timeouts and the refusals of the files they quarantined) and the slowest decode.

    python bench/oversubscribed.py [--processes 6] [--clips 6] [--rounds 2] [--factor 3]
                                   [--repeat 1] [--before DIR]
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


def loop(clips, rounds, env, code: str = ROOT) -> subprocess.Popen:
    full = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    full.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys([code, ROOT])), "SWIFT_SAFE_MEDIA_WARM_START": "0", **env})
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
    parser.add_argument("--factor", type=float, default=3.0, help="the timeout, as a multiple of the idle decode")
    parser.add_argument("--repeat", type=int, default=1, help="times each side runs, the sides alternating")
    parser.add_argument("--before", help="a checkout whose fair clock is a third side")
    args = parser.parse_args()
    sides = [("fair (ceiling 5x)", "5", ROOT), ("wall time (ceiling 1)", "1", ROOT)]
    if args.before:
        sides.insert(1, (f"fair, {os.path.basename(os.path.normpath(args.before))}", "5", args.before))
    with tempfile.TemporaryDirectory() as folder:
        clips = make_clips(folder, args.clips)
        idle = statistics.median(result(loop(clips, 2, {}))["seconds"][len(clips):])
        timeout = args.factor * idle
        print(f"idle decode {idle:.2f} s; timeout {timeout:.2f} s; {args.processes} processes x {args.rounds} rounds "
              f"x {len(clips)} clips on {os.cpu_count()} CPUs")
        print("| clock | time | decodes | timeouts (at the ceiling) | refused | slowest decode |\n|---|---|---|---|---|---|")
        for time_ in range(1, args.repeat + 1):
            for label, ceiling, code in sides:
                registry = os.path.join(folder, f"q-{label}-{time_}", "quarantine.jsonl")
                env = {"SWIFT_SAFE_MEDIA_TIMEOUT": f"{timeout:.3f}", "SWIFT_SAFE_MEDIA_TIMEOUT_CEILING": ceiling,
                       "SWIFT_SAFE_MEDIA_QUARANTINE": registry}
                results = [result(process) for process in
                           [loop(clips, args.rounds, env, code) for _ in range(args.processes)]]
                failures = [failure for found in results for failure in found["failures"]]
                timeouts = [failure for failure in failures if failure.startswith("MediaDecodeTimeout")]
                capped = sum("the ceiling" in failure for failure in timeouts)
                decodes = sum(len(found["seconds"]) for found in results)
                slowest = max(max(found["seconds"][len(clips):]) for found in results)
                print(f"| {label} | {time_} | {decodes} | {len(timeouts)} ({capped}) | {len(failures)} | "
                      f"{slowest:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
