"""No script stalls (issue 26): a loader called at the top level of a script without
``if __name__ == "__main__":`` decodes at once under ``SWIFT_SAFE_MEDIA=1``, however
the script is run: as a file, with ``-m``, with ``-c``, from stdin, typed into the
interactive interpreter and into IPython (a notebook's ``__main__``, without a file),
both driven through a real pty. The script (``tests/programs/unguarded_check.py``) calls
ms-swift's own ``load_video_llava``; once the shared zygote, forked from the warm
forkserver, ran the script again and the decode waited for it until the start-up timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from .damaged_media import ffmpeg, video_src
from .fresh import ROOT, clean_environment

SCRIPT = os.path.join(ROOT, "tests", "programs", "unguarded_check.py")
LINES = [line for line in open(SCRIPT).read().splitlines() if line and not line.startswith("#")]
RUN_BOUND_S = 240  # ms-swift's import on a busy 2-core box; the stall it guards against was 180 s more


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("unguarded") / "clip.mp4"
    ffmpeg(*video_src(2, size="64x48", rate=10), "-pix_fmt", "yuv420p", str(path))
    return str(path)


def _env(clip):
    # The start-up timeout well below the test's: a stall fails the case, it does not hang it.
    return clean_environment({"SWIFT_SAFE_MEDIA": "1", "CLIP": clip, "SWIFT_SAFE_MEDIA_START_TIMEOUT": "120"},
                             warm_start=True, pythonpath=[ROOT])


def _run(argv, clip, stdin=None) -> str:
    done = subprocess.run(argv, cwd=ROOT, env=_env(clip), input=stdin, capture_output=True, text=True,
                          timeout=RUN_BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _typed(argv, clip) -> str:
    """Run ``argv`` on a pty, type the script's lines, then ``exit()``; its whole output."""
    main, terminal = pty.openpty()
    child = subprocess.Popen(argv, cwd=ROOT, env=dict(_env(clip), TERM="dumb"), stdin=terminal, stdout=terminal,
                             stderr=terminal, start_new_session=True)
    os.close(terminal)
    output, deadline = b"", time.monotonic() + RUN_BOUND_S
    try:
        for line in LINES:
            os.write(main, line.encode() + b"\n")
        typed_exit = False
        while time.monotonic() < deadline:
            if not typed_exit and re.search(rb"SHARED ZYGOTE \S+\r?\n", output):
                os.write(main, b"exit()\n")
                typed_exit = True
            readable, _, _ = select.select([main], [], [], 1.0)
            if readable:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the interpreter closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        os.close(main)
    text = output.decode(errors="replace").replace("\r", "")
    assert child.returncode == 0, text[-3000:]
    return text


def _check(output: str) -> None:
    # The echo of a typed line shows the marker followed by a quote, never by a number.
    assert len(re.findall(r"SCRIPT STARTED \d+", output)) == 1, output[-4000:]  # nothing ran it again
    assert re.search(r"DECODED [1-9]\d*\b", output), output[-4000:]
    assert re.search(r"SHARED ZYGOTE None\b", output), output[-4000:]  # the rank's zygote served it
    assert "could not start" not in output and "not answering" not in output, output[-4000:]


MODES = ["file", "module", "-c", "stdin", "interactive", "ipython"]
AT_ONCE = 3  # the modes run side by side, three at a time: most of each is ms-swift's import


def _run_mode(mode: str, clip: str) -> tuple[str, float]:
    python, started = sys.executable, time.monotonic()
    if mode == "file":
        output = _run([python, SCRIPT], clip)
    elif mode == "module":
        output = _run([python, "-m", "tests.programs.unguarded_check"], clip)
    elif mode == "-c":
        output = _run([python, "-c", "\n".join(LINES)], clip)
    elif mode == "stdin":
        output = _run([python, "-"], clip, stdin="\n".join(LINES) + "\n")
    elif mode == "interactive":
        output = _typed([python, "-i", "-q"], clip)
    else:
        output = _typed([python, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"], clip)
    return output, time.monotonic() - started


@pytest.fixture(scope="module")
def runs(clip):
    """Each mode's output, or the exception its run raised."""
    def attempt(mode):
        try:
            return _run_mode(mode, clip)
        except BaseException as exc:  # reported by that mode's test
            return exc

    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(MODES, pool.map(attempt, MODES)))


@pytest.mark.timeout(2 * RUN_BOUND_S + 60)
@pytest.mark.parametrize("mode", MODES)
def test_a_loader_at_the_top_level_of_an_unguarded_script_decodes_at_once(runs, mode):
    if isinstance(runs[mode], BaseException):
        raise runs[mode]
    output, elapsed = runs[mode]
    print(f"{mode}: {elapsed:.1f} s")
    _check(output)


# A function of the script itself, run in a sandbox (swift_safe_media.call): the sandbox
# needs the script's definitions, and once ran the whole script again to get them.
OWN_FUNCTION = """import swift_safe_media
SCALE = 2
print("SCRIPT STARTED", flush=True)
def double(value):
    return value * SCALE
print("RESULT", swift_safe_media.call(double, 21), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_function_of_an_unguarded_script_runs_without_the_script_running_again(tmp_path):
    script = tmp_path / "own_function.py"
    script.write_text(OWN_FUNCTION)
    done = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True, text=True,
                          env=clean_environment(pythonpath=[ROOT]), timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("SCRIPT STARTED") == 1 and "RESULT 42" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_function_typed_on_stdin_is_refused_saying_where_to_define_it(tmp_path):
    done = subprocess.run([sys.executable, "-"], input=OWN_FUNCTION, cwd=str(tmp_path), capture_output=True,
                          text=True, env=clean_environment(pythonpath=[ROOT]), timeout=100)
    assert done.returncode != 0 and done.stdout.count("SCRIPT STARTED") == 1, done.stdout + done.stderr[-3000:]
    assert ("double is defined in the caller's __main__" in done.stderr
            and "define it in a module" in done.stderr), done.stderr[-3000:]
