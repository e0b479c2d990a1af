"""`make newest`: this package on release day of every dependency at once.

Run with .venv-newest's python (the Makefile builds it: the newest release of torch, torchcodec,
transformers, datasets, PyAV, numpy, the test libraries and each host, the hosts' caps ignored; its
comment says what is left out or kept at a pin, and why), it

1. prints the versions installed;
2. runs ``swift-safe-media targets`` (every patch target of every host: present, absent by
   design, moved, signature changed) and picks out the targets that warned;
3. runs the parity, hang and host-entry tests in this venv (two pytest processes, a timeout per
   test);
4. writes a short report (date, versions, targets that warned, counts, each failure's one-line
   reason) to stdout and build/newest-report.md, for docs/figures.md.

A failing test is a finding, not a crash: the exit status is non-zero only when pytest could not
run. Tests that run in another venv of `make test` (.venv-lerobot*, .venv-llamafactory: the
LeRobot and LLaMA-Factory train/parity/flags/map/versions files) are not selected, since they would
test that venv, not this one; test_adapters' LLaMA-Factory case, which would too, is pointed at
this venv's python (this module is also the pytest plugin that does it: ``-p newest``).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "build" / "newest-report.md"
JUNIT = ROOT / "build" / "newest-junit.xml"
DISTRIBUTIONS = ["torch", "torchvision", "torchcodec", "transformers", "datasets", "av", "numpy", "pillow",
                 "librosa", "moviepy", "ms-swift", "lerobot", "llamafactory", "swift-safe-media"]
TESTS = [
    # parity: the twins against the stock loaders (ms-swift's, decord, librosa, PyAV, moviepy, Qwen's utils)
    "tests/test_decoders_parity.py", "tests/test_realworld_parity.py",
    # hangs: GIL-holding native calls, FIFOs, hostile playlists, bad input, stalled workers
    "tests/test_engine.py", "tests/test_decoders_bad_input.py", "tests/test_hostile_media.py",
    "tests/test_watchdog.py",
    # host entry: the adapters in every import order, ms-swift's aliases and flags, the templates'
    # decode paths, LeRobot's dataset in this venv
    "tests/test_adapters.py", "tests/test_swift_patching.py", "tests/test_swift_flags.py",
    "tests/test_coverage.py", "tests/test_lerobot.py",
    # the workers' start: the forkserver forked from the trainer (numpy's OpenBLAS pool), the
    # holding servers, the first sandbox, the workers' liveness (torch's DataLoader internals)
    "tests/test_forked_forkserver.py", "tests/test_held_arguments.py", "tests/test_first_sandbox.py",
    "tests/test_liveness.py",
]
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b: \S")
PER_TEST_TIMEOUT_S = 600  # a test's own timeout mark, where it has one, wins


def pytest_collection_finish(session):
    """As a pytest plugin: test_adapters runs its LLaMA-Factory case with this venv's python."""
    adapters = sys.modules.get("tests.test_adapters")
    if adapters is not None and "llamafactory" in getattr(adapters, "HOST_PYTHON", {}):
        adapters.HOST_PYTHON["llamafactory"] = Path(sys.executable)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def targets() -> tuple[str, list[str]]:
    """``swift-safe-media targets``'s output, and the lines that warn: a problem (MOVED,
    SIGNATURE CHANGED, NOT COVERED, ...), a host left untouched, or a target whose module the
    command tried to import and could not (the host itself breaks on these releases)."""
    command = Path(sys.executable).parent / "swift-safe-media"
    try:
        done = subprocess.run([str(command), "targets"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"swift-safe-media targets could not run: {error}", ["(targets: could not run)"]
    if done.returncode != 0:
        missing = "invalid choice" in done.stderr
        text = "swift-safe-media targets: " + ("missing (this release has no such subcommand)" if missing
                                                else f"exit {done.returncode}\n{done.stdout}{done.stderr[-2000:]}")
        return text, ["(targets: " + ("missing" if missing else "failed") + ")"]
    warned = [line.strip() for line in done.stdout.splitlines()
              if (line.startswith("  ") and line.strip() and line.split()[0].isupper())
              or "left untouched" in line or line.strip().startswith("not imported")]
    return done.stdout + done.stderr, warned


def run_tests() -> int:
    JUNIT.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "newest", "-n", "2", "--dist", "loadfile", "-m", "not serial",
               f"--timeout={PER_TEST_TIMEOUT_S}", "--continue-on-collection-errors", f"--junitxml={JUNIT}",
               "-o", "junit_family=xunit1", "--durations=15", *TESTS]
    print("$", " ".join(command), flush=True)
    environment = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent))  # -p newest
    return subprocess.run(command, cwd=ROOT, env=environment).returncode


def one_line(message: str, text: str) -> str:
    """The assertion's first line and, where it carries a child's traceback, the error that
    ended it (``AttributeError: module 'av' has no attribute 'option'``). JUnit's message is
    cut after a few lines: the ``E`` lines of the full report are read where there are any."""
    lines = [line[1:] for line in text.splitlines() if line.startswith("E ")] or message.splitlines()
    lines = [line.strip(" ^") for line in lines if line.strip(" ^")]
    if not lines:
        return "?"
    nested = [line for line in lines[1:] if ERROR_LINE.match(line)]
    if nested and lines[0].endswith("Traceback (most recent call last):"):
        found = nested[-1]
    elif nested and nested[-1] not in lines[0]:
        found = f"{lines[0]} ... {nested[-1]}"
    else:
        found = " / ".join(lines[:3]) if lines[0].endswith(":") else lines[0]
    return found[:300]


def results() -> tuple[Counter, list[str], Counter]:
    """Counts (passed, failed, error, skipped), the failures (the cases of one test that fail
    the same way on one line, their parameters listed) and the skip reasons."""
    counts, failed, skips = Counter(), {}, Counter()
    for case in ElementTree.parse(JUNIT).iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            skips[((outcome.get("message") or "?").splitlines() or ["?"])[0][:160]] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "error"] += 1
            test, _, parameters = case.get("name").partition("[")
            reason = one_line(outcome.get("message") or "", outcome.text or "")
            same_way = re.sub(r"'[^']*/[^']*'", "''", reason.rpartition(" ... ")[2])  # paths elided
            key = (f"{case.get('file') or case.get('classname')}::{test}", same_way)
            failed.setdefault(key, (reason, []))[1].append(parameters.rstrip("]"))
    failures = [f"`{test}`" + (f" ({len(cases)}: {', '.join(cases)})" if any(cases) else "") + f": {reason}"
                for (test, _), (reason, cases) in failed.items()]
    return counts, failures, skips


def main() -> int:
    started = datetime.datetime.now(datetime.timezone.utc)
    found = versions()
    width = max(map(len, found))
    print("\n".join(f"{name:<{width}}  {version}" for name, version in found.items()), flush=True)
    targets_text, warned = targets()
    print(targets_text, flush=True)
    JUNIT.unlink(missing_ok=True)
    status = run_tests()
    if status not in (0, 1) or not JUNIT.exists():
        print(f"pytest could not run (exit {status})", file=sys.stderr)
        return status or 1
    counts, failures, skips = results()
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    lines = [f"## `make newest`, {started:%Y-%m-%d}", "",
             "| " + " | ".join(found) + " |", "|" + "---|" * len(found), "| " + " | ".join(found.values()) + " |", "",
             "Targets that warned (`swift-safe-media targets`): " + ("none" if not warned else ""),
             *[f"- {line}" for line in warned], "",
             f"Tests ({len(TESTS)} files: parity, hang, host entry; {minutes:.0f} min): "
             + ", ".join(f"{counts[kind]} {kind}" for kind in ("passed", "failed", "error", "skipped")), "",
             *(["Failures:", *[f"- {line}" for line in failures], ""] if failures else []),
             *(["Skipped:", *[f"- {n} x {reason}" for reason, n in skips.most_common()], ""] if skips else [])]
    text = "\n".join(lines)
    REPORT.write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
