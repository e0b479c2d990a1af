"""Rewrite docs/doctor.md's samples of ``swift-safe-media doctor`` from real runs.

- The block whose first line is ``$ [VAR=value ...] swift-safe-media doctor ...``: that
  command is run (its environment and flags as written, no other SWIFT_SAFE_MEDIA_*
  variable) and its standard output replaces the rest of the block.
- The block ``$ swift-safe-media doctor --script train.py``: the page's ``train.py`` (the
  python block before it) is scanned by that command, in a folder of its own, and what it
  prints replaces the rest of the block.

tests/test_doc_samples.py checks both blocks against fresh runs (and the page's refusal
message, which this does not write). Run it with the repository's venv:

    .venv/bin/python tools/doc_samples.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_doc_samples import (DOCTOR_PAGE, clean_environment, doctor_block, doctor_command,  # noqa: E402
                                    doctor_script_output, script_sample)


def main() -> int:
    block = doctor_block()
    env, argv = doctor_command(block[0])
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=folder, env=clean_environment(env), timeout=600)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        return done.returncode
    text = DOCTOR_PAGE.read_text()
    old = "\n".join(block)
    assert text.count(old) == 1, "the block is not unique in docs/doctor.md"
    DOCTOR_PAGE.write_text(text.replace(old, "\n".join([block[0], *done.stdout.rstrip("\n").splitlines()])))
    print(f"rewrote the sample in {DOCTOR_PAGE.relative_to(ROOT)} ({len(done.stdout.splitlines())} lines)")
    script, block = script_sample()
    with tempfile.TemporaryDirectory() as folder:
        printed = doctor_script_output(Path(folder), script).rstrip("\n").splitlines()
    text = DOCTOR_PAGE.read_text()
    old = "\n".join(block)
    assert text.count(old) == 1, "the --script block is not unique in docs/doctor.md"
    DOCTOR_PAGE.write_text(text.replace(old, "\n".join([block[0], *printed])))
    print(f"rewrote the --script sample in {DOCTOR_PAGE.relative_to(ROOT)} ({len(printed)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
