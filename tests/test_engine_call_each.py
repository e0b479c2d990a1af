"""``call_each``: several calls in one round trip to the sandbox, each still bounded by
its own timeout and accounted as its own decode."""

import threading
import time

import pytest

from swift_safe_media import MediaDecodeTimeout, MediaQuarantined
from swift_safe_media.records import summary
from swift_safe_media.engine.calls import FAILED_PATH, call, call_each

from . import sandboxed

SLACK = 0.5


def test_results_come_back_in_order():
    paths = ["/data/a.mp4", "/data/b.mp4", "/data/c.mp4"]
    assert call_each(sandboxed.echo, [(path,) for path in paths], paths) == paths
    assert call_each(sandboxed.echo, [], []) == []
    with pytest.raises(ValueError, match="2 calls but 1 paths"):
        call_each(sandboxed.echo, [(1,), (2,)], ["/x"])


def test_each_call_has_its_own_timeout():
    # 3 x 0.6 s in one batch under a 1 s timeout: no single call overran.
    started = time.monotonic()
    results = call_each(sandboxed.sleep_then_return, [(0.6, index) for index in range(3)],
                        ["/a", "/b", "/c"], timeout=1.0)
    assert results == [0, 1, 2] and time.monotonic() - started >= 1.8


def test_a_hang_is_pinned_on_its_own_file_within_its_timeout():
    paths = ["/data/good.mp4", "/data/hangs.mp4", "/data/never_reached.mp4"]
    previous = call(sandboxed.sandbox_pid)
    started = time.monotonic()
    with pytest.raises(MediaDecodeTimeout) as caught:
        call_each(sandboxed.hang_on, [(path, paths[1]) for path in paths], paths, timeout=1.0)
    elapsed = time.monotonic() - started
    assert caught.value.path == paths[1] and paths[1] in str(caught.value)
    assert getattr(caught.value, FAILED_PATH) == paths[1]
    assert elapsed < 1.0 + SLACK + 0.5  # the good call's own time comes on top of the timeout
    assert call(sandboxed.sandbox_pid) != previous, "the killed sandbox was replaced"
    assert call_each(sandboxed.echo, [(1,), (2,)], ["/a", "/b"]) == [1, 2]


def test_an_exception_names_the_call_that_raised_it():
    paths = ["/data/a.mp4", "/data/b.mp4"]
    with pytest.raises(ValueError, match="cannot decode /data/b.mp4") as caught:
        call_each(sandboxed.fail_on, [(path, paths[1]) for path in paths], paths)
    assert getattr(caught.value, FAILED_PATH) == paths[1]


def test_quarantine_and_statistics_count_each_call(tmp_path, monkeypatch, fifo):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(tmp_path / "quarantine.jsonl"))
    monkeypatch.setenv(summary.STATS_DIR, str(tmp_path / "stats"))
    good = tmp_path / "good.mp4"
    good.write_bytes(b"x")
    paths = [str(good), fifo]
    with pytest.raises(MediaDecodeTimeout):
        call_each(sandboxed.hang_on, [(path, fifo) for path in paths], paths, timeout=1.0)
    # The FIFO is quarantined, not the good file decoded before it in the same batch.
    with pytest.raises(MediaQuarantined) as caught:
        call_each(sandboxed.echo, [(path,) for path in paths], paths)
    assert caught.value.path == fifo and getattr(caught.value, FAILED_PATH) == fifo
    assert call_each(sandboxed.echo, [(str(good),)], [str(good)]) == [str(good)]
    counts = summary.collect()
    assert (counts["ok"], counts["timeout"], counts["quarantined"]) == (2, 1, 1), counts


def test_sandbox_setup_runs_once_per_sandbox_outside_the_calls_timeout(fresh_engine, tmp_path, monkeypatch):
    from swift_safe_media.engine import calls as engine

    monkeypatch.setenv(summary.STATS_DIR, str(tmp_path / "stats"))
    engine.set_up_sandboxes(sandboxed.slow_setup)
    engine.set_up_sandboxes(sandboxed.slow_setup)  # registered once
    try:
        # 1.5 s of setup, then calls bounded by 1 s each: the setup is not the call's time.
        assert call(sandboxed.setups_run, timeout=1.0) == 1
        assert call(sandboxed.setups_run, timeout=1.0) == 1
        with pytest.raises(MediaDecodeTimeout):
            call(sandboxed.hold_gil_on_locked_mutex, timeout=0.5)
        assert call(sandboxed.setups_run, timeout=1.0) == 1, "the replacement sandbox ran it too"
        counts = summary.collect()
        assert (counts["ok"], counts["timeout"], counts["error"]) == (3, 1, 0), counts
        assert counts["latency_p99_s"] < 1.0, "the 1.5 s setups are not decode time"
    finally:
        engine.forget_sandbox_setup(sandboxed.slow_setup)


def test_latency_counts_the_call_not_the_sandbox_start(fresh_engine, tmp_path, monkeypatch):
    monkeypatch.setenv(summary.STATS_DIR, str(tmp_path / "stats"))
    call(sandboxed.add, 1, 2)  # starts the zygote and a sandbox: seconds
    counts = summary.collect()
    assert counts["ok"] == 1 and counts["latency_p99_s"] < 0.5, counts


def test_parallel_calls_run_at_once_each_under_its_own_timeout():
    # 3 x 0.6 s under a 1 s timeout: at once, in well under the 1.8 s they take in turn.
    call_each(sandboxed.echo, [(0,)], ["/warm"])  # the sandbox is up
    started = time.monotonic()
    results = call_each(sandboxed.sleep_then_return, [(0.6, index) for index in range(3)],
                        ["/a", "/b", "/c"], timeout=1.0, parallel=True)
    assert results == [0, 1, 2] and time.monotonic() - started < 1.5


def test_a_parallel_error_names_the_first_call_that_failed():
    paths = ["/data/a.mp4", "/data/b.mp4", "/data/c.mp4"]
    with pytest.raises(ValueError, match="cannot decode /data/b.mp4") as caught:
        call_each(sandboxed.fail_on, [(path, paths[1]) for path in paths], paths, parallel=True)
    assert getattr(caught.value, FAILED_PATH) == paths[1]


def test_a_parallel_hang_is_pinned_on_its_own_file(tmp_path, monkeypatch):
    """A hang that holds the GIL stops the calls beside it too: which one hung is found by
    running the batch again in turn; only that file is quarantined."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(tmp_path / "quarantine.jsonl"))
    paths = [str(tmp_path / name) for name in ("good.mp4", "hangs.mp4", "other.mp4")]
    for path in paths:
        open(path, "wb").close()
    started = time.monotonic()
    with pytest.raises(MediaDecodeTimeout) as caught:
        call_each(sandboxed.hang_on, [(path, paths[1]) for path in paths], paths, timeout=1.0, parallel=True)
    assert caught.value.path == paths[1] and getattr(caught.value, FAILED_PATH) == paths[1]
    assert time.monotonic() - started < 2 * (1.0 + SLACK) + 1.0
    assert call_each(sandboxed.echo, [(paths[0],), (paths[2],)], [paths[0], paths[2]], parallel=True) == \
        [paths[0], paths[2]]
    with pytest.raises(MediaQuarantined):
        call_each(sandboxed.echo, [(paths[1],)], [paths[1]])


def test_a_setup_that_cannot_be_sent_fails_its_call_and_frees_its_sandbox(fresh_engine):
    """A setup that cannot be pickled (a closure) fails the call with the reason, and the
    sandbox it held goes back: with one sandbox per process, a slot lost here would make
    every later call wait for ever."""
    from swift_safe_media.engine import calls as engine

    def not_module_level():
        pass

    engine.set_up_sandboxes(not_module_level)
    try:
        with pytest.raises(TypeError, match="module-level function"):
            call(sandboxed.add, 1, 2, timeout=5.0)
    finally:
        engine.forget_sandbox_setup(not_module_level)
    results = []  # in a thread: a lost slot would block this call for ever
    later = threading.Thread(target=lambda: results.append(call(sandboxed.add, 1, 2, timeout=5.0)), daemon=True)
    later.start()
    later.join(60)
    assert results == [3]
