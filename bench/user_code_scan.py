"""How long the scan of a user's own code takes (``checks/user_code.py``: what ``enable()``
runs on the training script and ``doctor --script`` prints). Not a timed test.

Scripts of 20 and 40 datasets (about 550 and 1,100 lines), each dataset reaching decord
through 5 helpers (``tests/test_user_code_scan.long_script``), written here; each is scanned
once to warm ``ast``'s own code, then ``--rounds`` times. Printed: the median and the spread
in milliseconds, with the machine's load average before and after.

    .venv/bin/python bench/user_code_scan.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swift_safe_media.checks import user_code  # noqa: E402
from tests.test_user_code_scan import long_script  # noqa: E402


def timed_scans(script: Path, rounds: int) -> list[float]:
    user_code.scan_script(str(script))  # the first read of ast's own code
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        user_code.scan_script(str(script))
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    os.environ["SWIFT_SAFE_MEDIA_BOUND_OPENERS"] = "0"  # every opener named: the whole walk is timed
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    with tempfile.TemporaryDirectory() as folder:
        for datasets in (20, 40):
            script = Path(folder) / f"train_{datasets}.py"
            text = long_script(datasets)
            script.write_text(text)
            lines = len(text.splitlines())
            times = timed_scans(script, args.rounds)
            print(f"{datasets} datasets, {lines} lines: {statistics.median(times):.1f} ms "
                  f"[{min(times):.1f}-{max(times):.1f}] over {args.rounds} scans")
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
