"""What the check of moved patch targets (swift_safe_media/patching/moved_targets.py) costs
a protected process (not a timed test). In ROUNDS fresh interpreters of this venv, each
importing what an ms-swift run imports (its template, dataset and trainer modules,
transformers' loaders, librosa, soundfile) with every stand-in already imported (patching
imports them anyway), it times the first check of every table (ms-swift's, the media
libraries', torch's DataLoader's three) and a second one, and prints the median and the
spread, against the process's own import time of those modules.

    .venv/bin/python bench/target_check.py [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """
import json, sys, time
sys.path.insert(0, {root!r})
started = time.perf_counter()
import swift.template, swift.dataset.utils, swift.trainers.mixin
import transformers.video_utils, transformers.audio_utils, soundfile, librosa
from swift_safe_media.hosts.swift import adapter
from swift_safe_media.patching import media_libraries, torch_dataloader
tables = (adapter.PATCHES, media_libraries.PATCHES, *torch_dataloader._patches.values())
for patches in tables:
    for target in patches.targets:
        try:
            patches.stand_in(target)
        except Exception:
            pass
imported = time.perf_counter() - started
times = []
for _ in range(2):
    started = time.perf_counter()
    for patches in tables:
        patches.check()
    times.append(time.perf_counter() - started)
print(json.dumps({{"imports_s": imported, "first_ms": times[0] * 1000, "again_ms": times[1] * 1000}}))
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    env = {**os.environ, "SWIFT_SAFE_MEDIA_WARM_START": "0", "SWIFT_SAFE_MEDIA": "0"}
    results = []
    for _ in range(rounds):
        done = subprocess.run([sys.executable, "-c", PROGRAM.format(root=ROOT)], capture_output=True, text=True,
                              env=env, timeout=600, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for key, unit in (("first_ms", "ms"), ("again_ms", "ms"), ("imports_s", "s")):
        values = sorted(result[key] for result in results)
        print(f"{key[:-3] if unit == 'ms' else key[:-2]:>8}: median {statistics.median(values):.2f} {unit} "
              f"[{values[0]:.2f}-{values[-1]:.2f}] over {rounds} processes")
    first = statistics.median(result["first_ms"] for result in results) / 1000
    print(f"first check / the imports it follows: {first / statistics.median(r['imports_s'] for r in results):.4f}")


if __name__ == "__main__":
    main()
