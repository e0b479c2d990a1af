"""The error budget in ms-swift's real ``LazyLLMDataset``, in the process that encodes
(as with ``--dataloader_num_workers 0``; the end-to-end test covers a spawned worker),
with the real, patched ``load_audio``; each case in a fresh interpreter."""

import json
import wave

import pytest

from .fresh import ROOT, clean_environment, run_python

pytest.importorskip("swift.dataset", reason="ms-swift is in requirements-test.txt")

def run(case, paths, tmp_path, env):
    """``tests/programs/swift_budget_rows.py`` CASE PATHS with protection on; its JSON lines."""
    child_env = clean_environment({"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "30",
                                   "SWIFT_SAFE_MEDIA_QUARANTINE": str(tmp_path / "quarantine.jsonl"), **env},
                                  pythonpath=[ROOT])
    done = run_python(module="tests.programs.swift_budget_rows", args=[case, *paths], env=child_env,
                      cwd=str(tmp_path), timeout=150)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def good_wav(tmp_path):
    path = tmp_path / "tone.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"\x00\x10" * 1600)
    return str(path)


@pytest.mark.timeout(180)
def test_a_spent_budget_crosses_the_resample_loop(tmp_path, fifo, good_wav):
    found = run("spent", [fifo], tmp_path, {"SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "3"})
    spent, restored = found
    # Not swallowed by LazyLLMDataset (which gives up with a ValueError after 5 tries here).
    assert spent["raised"] == "ErrorBudgetExceeded", spent
    assert spent["message"].startswith("swift_safe_media: 3 consecutive samples failed to decode (limit 3")
    assert f"Last failure: {fifo}: quarantined after an earlier error" in spent["message"]
    assert restored == {"encode_func restored": True}


@pytest.mark.timeout(180)
def test_the_failure_fraction_counts_rows_not_loader_calls(tmp_path, fifo, good_wav):
    """A bad row substituted by a good one, again and again: no run of consecutive failures,
    but half the rows tried fail. ms-swift's Template.encode tries a failed row 3 times:
    the budget counts the row once."""
    found = run("fraction", [fifo, good_wav], tmp_path,
                {"SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "2", "SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION": "0.4"})
    under, over = found
    assert under == {"ok": [1600] * 40}  # 40 of 80 rows tried failed: 50 %, judged from the 100th row on
    assert over["raised"] == "ErrorBudgetExceeded"
    assert "51 of 101 samples (50.5%) failed to decode (limit 40.0%" in over["message"], over
