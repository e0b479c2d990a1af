"""Stall watchdog with real stuck processes: a DataLoader worker and a sandbox each
stuck in a native call that holds the GIL."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from .fresh import ROOT, clean_environment


SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch.utils.data
    from swift_safe_media import watchdog
    from tests.loader_datasets import StallingDataset

    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
        watchdog.install()
        loader = torch.utils.data.DataLoader(StallingDataset(), batch_size=None, num_workers=2,
                                             multiprocessing_context="spawn")
        for item in loader:
            print("batch", item, flush=True)
""")


@pytest.mark.timeout(180)
def test_stall_dumps_every_process_then_aborts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SWIFT_SAFE_MEDIA_STALL_TIMEOUT="20", SWIFT_SAFE_MEDIA_STALL_ACTION="abort",
               PYTHONPATH=ROOT)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=150)
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
    from swift_safe_media import watchdog

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
    code = textwrap.dedent("""
        import os, threading
        import swift_safe_media
        from torch.utils.data import dataloader
        stock = dataloader._BaseDataLoaderIter.__next__
        swift_safe_media.enable(hosts=["swift"])
        folder = os.environ["SWIFT_SAFE_MEDIA_INFLIGHT_DIR"]
        watching = [t.name for t in threading.enumerate() if t.name == "swift-safe-media-watchdog"]
        print(dataloader._BaseDataLoaderIter.__next__ is not stock, watching != [], os.path.isdir(folder))
        swift_safe_media.disable()
        watching = [t for t in threading.enumerate() if t.name == "swift-safe-media-watchdog"]
        for thread in watching:
            thread.join(5)
        print(dataloader._BaseDataLoaderIter.__next__ is stock, any(t.is_alive() for t in watching),
              os.path.isdir(folder), "SWIFT_SAFE_MEDIA_INFLIGHT_DIR" in os.environ)
    """)
    env = clean_environment({"SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "30"}, pythonpath=[ROOT])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True True True", "True False False False"]
