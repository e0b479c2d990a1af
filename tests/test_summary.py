"""Run summary merged across real DataLoader worker processes."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch.utils.data

from swift_safe_media import call
from swift_safe_media.records import summary

from . import fresh, sandboxed
from .loader_datasets import SandboxedDataset


@pytest.mark.timeout(240)
def test_summary_merges_every_worker(tmp_path, monkeypatch, fifo):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STATS_DIR", str(tmp_path / "stats"))
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(tmp_path / "quarantine.jsonl"))
    loader = torch.utils.data.DataLoader(SandboxedDataset(8, fifo_index=5, fifo=fifo), batch_size=None,
                                         num_workers=2, multiprocessing_context="spawn")
    assert len(list(loader)) == 8
    with pytest.raises(Exception):  # in this process: the FIFO is quarantined now
        call(sandboxed.open_fifo, fifo, timeout=1)
    merged = summary.collect()
    # 7 good items make 2 calls each; item 5 makes 1 (it times out); here 1 quarantined hit.
    assert merged["processes"] == 3
    assert (merged["ok"], merged["timeout"], merged["quarantined"], merged["crash"]) == (14, 1, 1, 0)
    assert merged["decodes"] == 16
    assert merged["latency_p50_s"] < merged["latency_p99_s"]
    assert merged["slowest"][0]["path"] == fifo and merged["slowest"][0]["outcome"] == "timeout"
    written = summary.write_summary(str(tmp_path / "summary.json"), step=8)
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 8
    text = summary.format_summary(written, step=8)
    assert "16 decodes" in text and "1 timeouts" in text and fifo in text and "p99" in text


def test_no_stats_folder_means_no_recording(monkeypatch):
    monkeypatch.delenv("SWIFT_SAFE_MEDIA_STATS_DIR", raising=False)
    assert summary.recorder() is None
    assert call(sandboxed.add, 1, 1) == 2


def test_counts_reach_the_file_without_an_exit_hook_and_ranks_report_their_step(tmp_path, monkeypatch):
    """A DataLoader's idle worker, or a `datasets.map` pool process, is killed, never
    reaching an exit hook: failures are written at once, other counts within a second."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STATS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    found = summary.recorder()

    def written():
        return json.loads(open(found.path).read())

    found.record("a.mp4", "ok", 0.01)
    found.record("b.mp4", "ok", 0.01)
    assert written()["counts"]["ok"] == 1
    found.record("c.mp4", "error", 0.01)
    assert written()["counts"]["error"] == 1 and written()["counts"]["ok"] == 2
    found.record("d.mp4", "ok", 0.01)
    assert os.path.exists(found.pending_path)  # held back, and marked so
    time.sleep(summary.FLUSH_EVERY_S + 0.5)
    assert written()["counts"]["ok"] == 3
    assert not os.path.exists(found.pending_path)
    summary.note_step(4)
    assert (written()["rank"], written()["step"]) == (1, 4)
    assert summary.collect(str(tmp_path))["steps_by_rank"] == {"1": 4}


HOLDS_BACK = """
import sys, time
from swift_safe_media import summary
found = summary.recorder()
found.record("a.mp4", "ok", 0.01)  # written at once (the first)
found.record("b.mp4", "ok", 0.01)  # held back for up to a second
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_a_final_summary_waits_for_counts_another_process_holds_back(tmp_path, monkeypatch):
    """A final summary ends once no other process holds counts back; a mark left by a
    process killed while holding some does not make it wait past its limit."""
    stats = tmp_path / "stats"
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STATS_DIR", str(stats))
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(tmp_path / "quarantine.jsonl"))
    stats.mkdir()
    (stats / "pending-2147483646").write_text("")  # a killed process's mark
    child = subprocess.Popen([sys.executable, "-c", HOLDS_BACK], env=dict(os.environ), stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert (stats / f"pending-{child.pid}").exists()
        written = summary.report(final=True)
        assert written["ok"] == 2 and written["processes"] == 1
        assert not (stats / f"pending-{child.pid}").exists()
    finally:
        child.kill()
        child.wait()


def test_slow_list_names_each_file_once_with_its_worst_time_and_count(tmp_path, monkeypatch):
    """Two processes' files (a worker's and a trainer's, say) timing the same files: each
    file appears once, with its worst time, that decode's outcome and all its decodes."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_STATS_DIR", str(tmp_path))
    first, second = summary.Recorder(str(tmp_path)), summary.Recorder(str(tmp_path))
    second.path = str(tmp_path / "stats-other.json")
    for elapsed in (2.05, 2.06, 0.0):
        first.record("hang.mp4", "timeout" if elapsed else "quarantined", elapsed)
    second.record("hang.mp4", "timeout", 2.10)
    for number in range(3 * summary._SLOW_FILES_KEPT):  # many quick files: the table stays bounded
        first.record(f"good_{number}.mp4", "ok", 0.001 + number * 1e-6)
    first.record("slow_once.mp4", "ok", 0.9)
    second.record("slow_once.mp4", "ok", 0.002)
    first.flush(), second.flush()
    assert len(first.slow_files) == summary._SLOW_FILES_KEPT

    slowest = summary.collect(str(tmp_path))["slowest"]
    paths = [entry["path"] for entry in slowest]
    assert len(paths) == len(set(paths)) == summary._SLOWEST
    assert slowest[0] == {"path": "hang.mp4", "elapsed_s": 2.1, "outcome": "timeout", "count": 4}
    assert slowest[1] == {"path": "slow_once.mp4", "elapsed_s": 0.9, "outcome": "ok", "count": 2}
    text = summary.format_summary(summary.collect(str(tmp_path)))
    assert text.count("hang.mp4") == 1 and "hang.mp4 worst 2.10 s (timeout), 4 decodes" in text


POOL_DECODES = r"""
import sys
from swift_safe_media.records import summary

library = __import__(sys.argv[1])  # multiprocessing, or dill's multiprocess (datasets.map's)


def decode(index):
    summary.recorder().record(f"/clips/{index}.mp4", "ok", 0.01)
    return index


if __name__ == "__main__":
    # As datasets.map uses its pool: `with`, whose exit terminates the workers (SIGTERM)
    # as soon as the last result is in, well within a second of their last decode.
    with library.get_context(sys.argv[2]).Pool(2) as pool:
        assert sorted(pool.map(decode, range(8), chunksize=1)) == list(range(8))
"""


@pytest.mark.parametrize("library, method", [("multiprocessing", "fork"), ("multiprocessing", "forkserver"),
                                             ("multiprocess", "fork")])
def test_a_pools_workers_lose_no_count_when_the_pool_terminates_them(tmp_path, library, method):
    """Pool workers end by SIGTERM, which runs no exit hook: every count they made is in the
    stats folder anyway (before, all but each worker's first decode were lost), and they
    leave no mark of counts held back for a final summary to wait on."""
    pytest.importorskip(library)
    stats = tmp_path / "stats"
    script = tmp_path / "pool_decodes.py"  # a file: forkserver's workers import the main module
    script.write_text(POOL_DECODES)
    done = subprocess.run([sys.executable, str(script), library, method], capture_output=True, text=True,
                          timeout=120, env=fresh.clean_environment({"SWIFT_SAFE_MEDIA_STATS_DIR": str(stats)},
                                                                   pythonpath=[fresh.ROOT]))
    assert done.returncode == 0, done.stderr[-3000:]
    merged = summary.collect(str(stats))
    assert (merged["decodes"], merged["ok"]) == (8, 8), merged
    assert not list(stats.glob("pending-*"))
