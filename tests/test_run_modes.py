"""Every way a user runs Python works as stock does under ``enable()`` (issue 43, item 3, and
the torchrun part of item 4). One script of a user's own (``tests/programs/run_modes_dataset.py``:
a Dataset whose ``__getitem__`` decodes WAV files made here with ``soundfile.read``, a
DataLoader with 2 workers, every batch drawn) runs, each in a fresh interpreter, as a file with
and without ``if __name__ == "__main__":``, with ``-m``, with ``-c``, on stdin (``python -``,
which once crashed), as a notebook cell exec'd into ``__main__`` (``tests/programs/notebook_cell.py``)
and as a cell of a real Jupyter kernel (``tests/programs/kernel_cell.py``). Each prints stock's
checksum (the script without ``enable()``), runs ``main()`` once, and its reads were bounded.
Under ``torchrun --nproc_per_node 2`` (gloo), a decode that stalls on rank 1 is bounded, named,
skipped by the dataset as docs/engine.md shows, and both ranks take the same steps.

Also covered elsewhere: which start method each mode gets, for a dataset of tensors
(tests/test_spawn_guard.py: file, -m, -c, stdin, IPython in a terminal); ms-swift's loader at the
top level of an unguarded script (tests/test_unguarded_scripts.py: the same modes, ``python -i``);
``swift sft`` under torchrun (tests/test_swift_e2e.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
import soundfile

from .fresh import ROOT, clean_environment

pytest.importorskip("jupyter_client", reason="ipykernel and jupyter_client are in requirements-test.txt")

PROGRAMS = os.path.join(ROOT, "tests", "programs")
SCRIPT = os.path.join(PROGRAMS, "run_modes_dataset.py")
TEXT = open(SCRIPT).read()
GUARD = 'if __name__ == "__main__":\n    main()\n'
UNGUARDED = TEXT.replace(GUARD, "main()\n")  # also the notebook cells: a cell has no guard
_DEFINED = TEXT.index("class Clips")  # the class and main(), defined under the guard instead
CLASS_UNDER_GUARD = TEXT[:_DEFINED] + GUARD.splitlines()[0] + "\n" + textwrap.indent(UNGUARDED[_DEFINED:], "    ")
STALL_TIMEOUT_S = 3
RUN_BOUND_S = 180  # one run, on a busy 2-core box with others at once
AT_ONCE = 4  # runs side by side: much of each is waiting (imports in the forkserver, the stall, the kernel)


def _runs(work: str, clips: str, stall: str) -> dict:
    """Each run's (argv, stdin, extra environment): the modes protected, two stock, torchrun."""
    python = sys.executable
    runs = {
        "file": ([python, SCRIPT], None),
        "file without main guard": ([python, os.path.join(work, "unguarded.py")], None),
        "file with the Dataset under the main guard": ([python, os.path.join(work, "class_under_guard.py")], None),
        "-m": ([python, "-m", "tests.programs.run_modes_dataset"], None),
        "-c": ([python, "-c", TEXT], None),
        "stdin": ([python, "-"], TEXT),
        "notebook cell": ([python, os.path.join(PROGRAMS, "notebook_cell.py"), os.path.join(work, "cell.py")], None),
        "jupyter kernel": ([python, "-m", "tests.programs.kernel_cell", os.path.join(work, "cell.py")], None),
    }
    runs = {mode: (argv, stdin, {"PROTECT": "1", "CLIPS": clips}) for mode, (argv, stdin) in runs.items()}
    runs["stock file"] = ([python, SCRIPT], None, {"PROTECT": "0", "CLIPS": clips})
    runs["stock file without main guard"] = (runs["file without main guard"][0], None, {"PROTECT": "0", "CLIPS": clips})
    # The stalled read is opened in a confined sandbox: its folder must be readable there, or
    # confinement refuses the FIFO before it can stall (conftest's `fifo` fixture does the same).
    runs["torchrun"] = ([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         os.path.join(PROGRAMS, "run_modes_torchrun.py")], None,
                        {"CLIPS": clips, "STALL": stall, "DECODE_TIMEOUT": str(STALL_TIMEOUT_S),
                         "SWIFT_SAFE_MEDIA_READ_ROOTS": os.path.dirname(stall)})
    return runs


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """WAV files of different tones, a FIFO named .wav in a folder of its own, the script's variants."""
    clips, stall, work = (tmp_path_factory.mktemp(name) for name in ("clips", "stall", "work"))
    rate = 16000
    for index in range(6):
        tone = 0.2 * np.sin(2 * np.pi * (220 + 55 * index) * np.arange(rate // 4) / rate)
        soundfile.write(clips / f"clip{index}.wav", tone.astype(np.float32), rate, subtype="PCM_16")
    os.mkfifo(stall / "stalled.wav")
    (work / "unguarded.py").write_text(UNGUARDED)
    (work / "cell.py").write_text(UNGUARDED)
    (work / "class_under_guard.py").write_text(CLASS_UNDER_GUARD)
    return str(clips), str(stall / "stalled.wav"), str(work)


@pytest.fixture(scope="module")
def results(made):
    """Each run's (returncode, stdout, stderr, seconds), or the exception it raised."""
    clips, stall, work = made

    def run(item):
        mode, (argv, stdin, extra) = item
        env = clean_environment(extra, warm_start=True, pythonpath=[ROOT])
        if mode == "jupyter kernel":  # the kernel's connection file and sockets, IPython's profile: not in $HOME
            env.update(JUPYTER_RUNTIME_DIR=work, IPYTHONDIR=os.path.join(work, "ipython"))
        started = time.monotonic()
        # A session of its own: a run past its bound goes with all it started (ranks, kernel, forkservers).
        child = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT if mode == "-m" else work, env=env,
                                 start_new_session=True)
        try:
            stdout, stderr = child.communicate(stdin, timeout=RUN_BOUND_S)
        except BaseException as exc:  # reported by that mode's test
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return mode, exc
        return mode, (child.returncode, stdout, stderr, time.monotonic() - started)

    runs = _runs(work, clips, stall)
    order = ["torchrun", "jupyter kernel", *[mode for mode in runs if mode not in ("torchrun", "jupyter kernel")]]
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(pool.map(run, [(mode, runs[mode]) for mode in order]))


def _finished(results, mode):
    if isinstance(results[mode], BaseException):
        raise results[mode]
    returncode, stdout, stderr, seconds = results[mode]
    print(f"{mode}: {seconds:.1f} s")
    assert returncode == 0, (stdout + stderr)[-4000:]
    return stdout, stderr


def _report(stdout: str) -> dict:
    mains = re.findall(r"^MAIN \d+$", stdout, re.M)
    [checksum] = re.findall(r"^CHECKSUM .*$", stdout, re.M)
    [flags] = re.findall(r"^BOUNDED .*$", stdout, re.M)
    return {"mains": len(mains), "checksum": checksum, "flags": flags}


# How the workers start under enable(): from the warm forkserver where a child can import what
# the dataset needs of __main__; otherwise forked, as stock's, with one warning saying why.
WARM = {"file": None, "-m": None,
        "file without main guard": "starts DataLoader workers at line",
        "-c": "defined in a main module without a file", "jupyter kernel": "defined in a main module without a file",
        "stdin": "the main script is <stdin>, which a child cannot run",
        "notebook cell": "needs Clips of the main module",
        "file with the Dataset under the main guard": "needs Clips of the main module"}


@pytest.mark.timeout(2 * RUN_BOUND_S + 60)
@pytest.mark.parametrize("mode", list(WARM))
def test_a_dataloader_with_two_workers_under_enable_works_as_stock_however_python_runs_it(results, stock_samples,
                                                                                          mode):
    stdout, stderr = _finished(results, mode)
    stock = _report(_finished(results, "stock file without main guard" if mode == "file without main guard"
                              else "stock file")[0])
    ours = _report(stdout)
    assert stock["flags"] == "BOUNDED [False] WORKERS 2 FORKED True", stock
    assert ours["mains"] == 1 == stock["mains"], stdout[-3000:]  # nothing ran the training again
    assert ours["checksum"] == stock["checksum"] == f"CHECKSUM 6 {zlib.crc32(repr(stock_samples).encode())}", \
        stdout[-3000:]
    warning = WARM[mode]
    assert ours["flags"] == f"BOUNDED [True] WORKERS 2 FORKED {warning is not None}", (stdout + stderr)[-3000:]
    forked = [line for line in stderr.splitlines() if "forks its workers" in line]
    assert len(forked) == (warning is not None), stderr[-3000:]
    assert warning is None or warning in forked[0], forked
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def stock_samples(made) -> list[int]:
    """What the script's dataset returns per file, read here by stock soundfile."""
    sums = []
    for name in sorted(os.listdir(made[0])):
        samples, rate = soundfile.read(os.path.join(made[0], name), dtype="int16")
        sums.append(zlib.crc32(samples.tobytes()) + rate)
    return sums


@pytest.mark.timeout(2 * RUN_BOUND_S + 60)
def test_a_stalled_decode_on_one_torchrun_rank_is_bounded_named_and_the_ranks_keep_step(results, made, stock_samples):
    stdout, stderr = _finished(results, "torchrun")
    ranks = {row["rank"]: row for row in map(json.loads, re.findall(r"^\{.*\}$", stdout, re.M))}
    assert sorted(ranks) == [0, 1], stdout[-3000:]
    stall, samples = made[1], stock_samples
    assert f"skipping {stall}: MediaDecodeTimeout: decode overran its {STALL_TIMEOUT_S} s timeout" in stderr, \
        stderr[-3000:]
    assert ranks[0]["sums"] == samples and ranks[1]["sums"] == samples[:1] + samples[2:], ranks  # stock's samples
    assert ranks[0]["steps"] == ranks[1]["steps"] == 3, ranks  # the same all_reduce steps
    assert ranks[0]["samples"] == ranks[1]["samples"] == 11, ranks  # every good sample of both ranks, once
    # Rank 1 waited one timeout (and a sandbox's restart) more than rank 0 at most, not for ever.
    assert ranks[1]["seconds"] <= ranks[0]["seconds"] + STALL_TIMEOUT_S + 10, ranks
    assert "Traceback" not in stderr, stderr[-3000:]


def test_what_a_child_importing_the_script_gets_of_main(tmp_path):
    """The names a script binds as ``__mp_main__`` (what the check above reads), and what a
    pickle of the dataset needs of ``__main__``: by qualified name, found by its first part."""
    from swift_safe_media.workers import spawn_guard

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os.path as osp, torch.utils.data
        try:
            from fast import Loader
        except ImportError:
            Loader = None
        class Clips: pass
        if __name__ != "__main__":
            def worker_only(): pass
        else:
            class UnderGuard: pass
        if __name__ == "__main__":
            class AlsoUnderGuard: pass
    """))
    missing = spawn_guard._not_defined_on_import(
        str(script), {"Clips", "Clips.Inner", "Loader", "worker_only", "osp", "torch", "UnderGuard", "AlsoUnderGuard"})
    assert missing == {"UnderGuard", "AlsoUnderGuard"}
    script.write_text("from helpers import *\n")  # what it binds cannot be told: nothing is called missing
    spawn_guard._bound_on_import.cache_clear()
    assert spawn_guard._not_defined_on_import(str(script), {"Clips"}) == set()
    data, names = spawn_guard.pickle_noting_main([spawn_guard.pickle_noting_main, os.path.join])
    assert names == frozenset() and data
