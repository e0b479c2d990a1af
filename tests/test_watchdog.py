"""Stall watchdog with real stuck processes: a DataLoader worker and a sandbox each
stuck in a native call that holds the GIL."""

import os
import time

import pytest

from .fresh import ROOT, clean_environment, run_python


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start", ["spawn", "warm"])
def test_stall_dumps_every_process_then_aborts(start):
    """Also with the warm start: workers from the forkserver, sandboxes from the shared
    zygote (named by their process names, since they share the forkserver's command line)."""
    env = dict(os.environ, SWIFT_SAFE_MEDIA_STALL_TIMEOUT="20", SWIFT_SAFE_MEDIA_STALL_ACTION="abort",
               PYTHONPATH=ROOT)
    started = time.monotonic()
    done = run_python(module="tests.programs.stalling_training", args=["warm"] if start == "warm" else [],
                      env=env, timeout=150, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 75, done.stderr[-3000:]
    log = done.stderr
    assert "STALL: no batch for" in log
    assert "/data/stuck_in_sandbox.mp4" in log, "the media in flight in the worker is named"
    # Both stuck processes answered while holding the GIL: the worker and the sandbox.
    assert log.count("in hold_gil_on_locked_mutex") >= 2, log[-6000:]
    assert "(sandbox) ---" in log and "(worker) ---" in log
    assert "stacks of the main process" in log
    assert elapsed < 120


@pytest.mark.timeout(60)
def test_watchdog_is_off_unless_configured(monkeypatch):
    from swift_safe_media.records import watchdog

    monkeypatch.delenv("SWIFT_SAFE_MEDIA_STALL_TIMEOUT", raising=False)
    assert watchdog.install() is None
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STALL_ACTION", "explode")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STALL_TIMEOUT", "5")
    with pytest.raises(ValueError, match="SWIFT_SAFE_MEDIA_STALL_ACTION"):
        watchdog.install()


@pytest.mark.timeout(120)
def test_disable_undoes_the_watchdog():
    """enable() with a stall timeout patches DataLoader iteration and starts the watchdog;
    disable() restores torch's own ``__next__``, stops the thread and drops the in-flight folder."""
    env = clean_environment({"SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "30"}, pythonpath=[ROOT])
    done = run_python(module="tests.programs.watchdog_disable", env=env, timeout=100)
    assert done.stdout.splitlines() == ["True True True", "True False False False"]
