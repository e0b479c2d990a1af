"""The fresh-interpreter harness: patches, the start-up hook and the environment are
process-wide, so most tests of them run their case in a new ``python``.

``ROOT`` is the checkout; :func:`clean_environment` is this process's environment
without any ``SWIFT_SAFE_MEDIA*`` setting (so the outer test run cannot leak into the
case), without the warm start unless asked, plus what the case sets; :func:`run_python` runs a program (``-c`` text or
``-m`` module) with it and returns the finished process.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Cases about patches, flags and settings run without the warm start (a forkserver and a
# zygote importing the decoders in the background of every short program on a 2-core box);
# the cases that start DataLoader workers (the real `swift sft` and LeRobot runs, the warm
# start's own tests) pass ``warm_start=True``: the default users get.
COLD = {"SWIFT_SAFE_MEDIA_WARM_START": "0"}


def is_ours(name: str) -> bool:
    """A setting of ours (``SWIFT_SAFE_MEDIA*``) or an internal variable (``_SWIFT_SAFE_MEDIA_*``)."""
    return name.lstrip("_").startswith("SWIFT_SAFE_MEDIA")


def clean_environment(extra: dict | None = None, *, pythonpath: list[str] | None = None,
                      warm_start: bool = False) -> dict:
    env = {key: value for key, value in os.environ.items() if not is_ours(key)}
    if not warm_start:
        env.update(COLD)
    env.update(extra or {})
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return env


def run_python(*, code: str | None = None, module: str | None = None, args=(), env: dict | None = None,
               cwd: str = ROOT, timeout: float = 120, check: bool = True,
               python: str | None = None) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` or ``python -m MODULE ARGS`` in ``cwd`` (``python``: another
    environment's interpreter); with ``check``, assert it exited 0 (showing the end of its
    stderr if not)."""
    program = ["-c", code] if code is not None else ["-m", module]
    done = subprocess.run([python or sys.executable, *program, *map(str, args)], env=clean_environment() if env is None else env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done
