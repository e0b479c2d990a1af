"""OpenCV in forked DataLoader workers (issue 43, item 4): the futex deadlock, and the same
script under ``enable()``.

``tests/programs/opencv_fork.py`` is a user's script: a thread of the trainer waits inside
``cv2.VideoCapture`` on a stream that does not answer (a FIFO nobody writes, named .mp4),
then a DataLoader with 2 workers reads frames with ``cv2.VideoCapture`` in each sample. As
stock, the workers are forked from the trainer mid-open, with OpenCV's lock held by a thread
that does not exist in them: both block on that futex for ever, and only the DataLoader's own
``timeout`` ends the loop. Under ``enable()`` the same script's workers start from the warm
forkserver, which never ran the trainer's threads: every sample is read, with stock OpenCV's
frames (read here, in the test's own process).
"""

from __future__ import annotations

import concurrent.futures
import os
import platform
import re
import signal
import subprocess
import sys
import time
import zlib

import pytest

from swift_safe_media.process import FORKSERVER_NAME, HOLDING_NAME

from .fresh import ROOT, clean_environment

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless is pinned in requirements-test.txt")

STOCK_TIMEOUT_S = 5  # the DataLoader's timeout in the stock run: its workers never answer
RUN_BOUND_S = 120
FUTEX = {"x86_64": "202", "aarch64": "98"}.get(platform.machine())  # the futex system call's number


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("opencv")
    clip, stream = folder / "clip.mp4", folder / "stream.mp4"
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc2=size=160x120:rate=25:duration=2", "-c:v", "mpeg4", str(clip)], check=True, timeout=60)
    os.mkfifo(stream)
    return str(clip), str(stream), folder


@pytest.fixture(scope="module")
def runs(media) -> dict:
    """``stock`` and ``protected``: (the run's stdout, its stderr, the trainer's pid, seconds)."""
    clip, stream, folder = media

    def run(protected: bool):
        name = "protected" if protected else "stock"
        env = clean_environment({"PROTECT": "1" if protected else "0",
                                 "TIMEOUT": str(RUN_BOUND_S if protected else STOCK_TIMEOUT_S)},
                                warm_start=True, pythonpath=[ROOT])
        out, err = folder / f"{name}.out", folder / f"{name}.err"
        started = time.monotonic()
        # Into files, not pipes: the stock run's stuck workers outlive it, holding what they inherited.
        with open(out, "w") as stdout, open(err, "w") as stderr:
            child = subprocess.Popen([sys.executable, "-m", "tests.programs.opencv_fork", clip, stream], cwd=ROOT,
                                     env=env, stdout=stdout, stderr=stderr, start_new_session=True)
            try:
                child.wait(timeout=RUN_BOUND_S + 30)
            finally:
                try:  # the run's process group: its stuck workers, the forkserver, the zygote
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        seconds = time.monotonic() - started
        print(f"{name}: {seconds:.1f} s")
        return name, (out.read_text(), err.read_text(), child.pid, seconds)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, (False, True)))


def _workers(stdout: str) -> list[tuple[int, int, str]]:
    return [(int(pid), int(parent), command) for pid, parent, command in
            re.findall(r"^WORKER (\d+) (\d+) (.*)$", stdout, re.M)]


def stock_frames(clip: str) -> str:
    """What the script's samples checksum to, read here by OpenCV itself."""
    capture, read = cv2.VideoCapture(clip), []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        read.append(frame)
    sums = [zlib.crc32(read[index * 5].tobytes()) for index in range(8)]
    return f"FRAMES 8 {zlib.crc32(repr(sums).encode())}"


@pytest.mark.timeout(3 * RUN_BOUND_S)
def test_stock_forked_workers_deadlock_on_opencvs_futex(runs):
    stdout, stderr, trainer, seconds = runs["stock"]
    workers = _workers(stdout)
    assert len(workers) == 2 and {parent for _, parent, _ in workers} == {trainer}, stdout + stderr[-3000:]
    assert "TIMED OUT DataLoader timed out after" in stdout, stdout + stderr[-3000:]
    stuck = dict(re.findall(r"^STUCK (\d+) (\S+)$", stdout, re.M))
    assert sorted(map(int, stuck)) == sorted(pid for pid, _, _ in workers), stdout
    if FUTEX is not None:
        assert set(stuck.values()) == {FUTEX}, stuck  # each blocked in a futex wait
    assert "FRAMES" not in stdout


@pytest.mark.timeout(3 * RUN_BOUND_S)
def test_under_enable_the_same_workers_start_from_the_warm_forkserver_and_read_stocks_frames(runs, media):
    stdout, stderr, trainer, seconds = runs["protected"]
    assert "TIMED OUT" not in stdout and "Traceback" not in stderr, stdout + stderr[-3000:]
    assert re.search(r"^FRAMES .*$", stdout, re.M)[0] == stock_frames(media[0]), stdout
    assert f"TRAINER {trainer}" in stdout, stdout
    workers = _workers(stdout)
    assert len(workers) == 2, stdout + stderr[-3000:]
    for _, parent, command in workers:
        # Forked from CPython's forkserver, preloaded by ours: not from the trainer and its threads
        # (a forkserver forked from the trainer, while it had one thread, is named so).
        assert parent != trainer, workers
        # Or from the server holding the loader's dataset, itself forked from that forkserver.
        assert command.startswith((FORKSERVER_NAME, HOLDING_NAME)) or (
            "multiprocessing.forkserver" in command and "swift_safe_media.workers._forkserver_preload" in command), \
            command
    assert len({parent for _, parent, _ in workers}) == 1, workers
