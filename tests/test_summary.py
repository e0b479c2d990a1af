"""Run summary merged across real DataLoader worker processes."""

import json
import time

import pytest
import torch.utils.data

from swift_safe_media import call, summary

from . import sandboxed
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
    time.sleep(summary.FLUSH_EVERY_S + 0.5)
    assert written()["counts"]["ok"] == 3
    summary.note_step(4)
    assert (written()["rank"], written()["step"]) == (1, 4)
    assert summary.collect(str(tmp_path))["steps_by_rank"] == {"1": 4}
