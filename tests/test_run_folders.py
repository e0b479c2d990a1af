"""No temporary folder, socket or process survives a trainer SIGKILLed mid-decode (issue
26): its zygote removes the trainer's folders once it is dead; when the zygote dies with
it (a job's whole process group killed), the next protected run removes them. Real
SIGKILLs of a real trainer with DataLoader workers, each process stuck in a sandbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from swift_safe_media.engine import run_folders
from swift_safe_media.records import watchdog

from .fresh import ROOT, clean_environment

IN_FLIGHT = 3  # the trainer's own decode and one per worker


@pytest.fixture
def temp_dir():
    """A short TMPDIR of the test's own (a socket's path must fit in 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="ssm-t")
    yield folder
    subprocess.run(["rm", "-rf", folder], check=False)


def _ours(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith(run_folders.PREFIX))


def _alive(pid: int) -> bool:
    return not run_folders.is_dead(pid)


def _start_trainer(temp_dir: str, **popen):
    env = clean_environment({"TMPDIR": temp_dir, "SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "600"}, warm_start=True,
                            pythonpath=[ROOT])
    trainer = subprocess.Popen([sys.executable, "-m", "tests.programs.killed_mid_decode"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    facts = json.loads(trainer.stdout.readline() or "{}")
    assert facts.get("pid") == trainer.pid, trainer.stderr.read()[-3000:] if trainer.poll() is not None else facts
    deadline = time.monotonic() + 180
    while len([name for name in os.listdir(facts["inflight"]) if not name.startswith(".")]) < IN_FLIGHT:
        assert trainer.poll() is None and time.monotonic() < deadline, "the decodes never started"
        time.sleep(0.2)
    return trainer, facts


def _wait_for(condition, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_decode_leaves_no_folder_socket_or_process(temp_dir):
    trainer, facts = _start_trainer(temp_dir)
    kinds = sorted(os.path.basename(folder).split("-")[3] for folder in facts["folders"])
    assert kinds == ["deadline", "inflight", "stats", "zygote"], facts
    assert all(folder.startswith(temp_dir) for folder in facts["folders"])
    # Forkserver, workers, zygote, sandboxes. A decode is recorded in flight just before its
    # sandbox is forked, so the last sandbox may still be on its way.
    expected = 2 + 1 + 1 + IN_FLIGHT
    assert _wait_for(lambda: len(watchdog._descendants(trainer.pid)) >= expected, within=60), \
        watchdog._descendants(trainer.pid)
    below = watchdog._descendants(trainer.pid)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert _wait_for(lambda: not _ours(temp_dir), within=30), _ours(temp_dir)
    assert _wait_for(lambda: not any(_alive(pid) for pid in below), within=30), \
        [(pid, watchdog._describe(pid)) for pid in below if _alive(pid)]
    trainer.stdout.close()
    trainer.stderr.close()


@pytest.mark.timeout(300)
def test_what_a_killed_process_group_leaves_goes_with_the_next_run(temp_dir):
    """Trainer, forkserver, workers and zygote killed at once: nobody is left to clean up;
    the next protected run removes those folders, and only those."""
    trainer, facts = _start_trainer(temp_dir, start_new_session=True)
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()
    time.sleep(1)
    left = _ours(temp_dir)
    assert left and set(left) <= {os.path.basename(folder) for folder in facts["folders"]}, left
    # A folder without a lock (an older version's, or one being made now) is not judged.
    legacy = os.path.join(temp_dir, "swift-safe-media-stats-legacy")
    os.mkdir(legacy)
    env = clean_environment({"TMPDIR": temp_dir}, pythonpath=[ROOT])
    done = subprocess.run([sys.executable, "-c", "import swift_safe_media; swift_safe_media.enable(hosts=[])"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _ours(temp_dir) == [os.path.basename(legacy)]  # and the new run's own went as it exited
    trainer.stdout.close()
    trainer.stderr.close()


def test_a_live_runs_folder_is_never_swept(temp_dir, monkeypatch):
    monkeypatch.setenv("TMPDIR", temp_dir)
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches the folder it found
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from swift_safe_media import run_folders; "
                               "print(run_folders.make('stats'), flush=True); sys.stdin.read()"],
                              cwd=ROOT, env=dict(os.environ, TMPDIR=temp_dir, PYTHONPATH=ROOT),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        folder = holder.stdout.readline().strip()
        assert os.path.isdir(folder)
        assert run_folders.sweep() == [] and os.path.isdir(folder)
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert not os.path.exists(folder)  # removed by its maker at exit
