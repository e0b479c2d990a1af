"""`swift-safe-media scan` over a mixed corpus finds exactly the planted bad files."""

import json
import os
import subprocess
import sys

import pytest

from swift_safe_media.records import quarantine

from .fresh import ROOT


def ffmpeg(*args):
    subprocess.run(["ffmpeg", "-v", "error", "-y", *args], check=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scan")
    good = {
        "good.wav": ["-f", "lavfi", "-i", "sine=frequency=440:duration=1", "-ar", "16000"],
        "good.flac": ["-f", "lavfi", "-i", "sine=frequency=300:duration=1"],
        "good.mp4": ["-f", "lavfi", "-i", "testsrc2=size=160x120:rate=15:duration=2", "-c:v", "libx264",
                     "-pix_fmt", "yuv420p"],
        "good.png": ["-f", "lavfi", "-i", "testsrc2=size=64x48", "-frames:v", "1"],
    }
    for name, args in good.items():
        ffmpeg(*args, str(folder / name))
    bad = {}
    (folder / "truncated.mp4").write_bytes((folder / "good.mp4").read_bytes()[:2000])
    bad["truncated.mp4"] = "video"
    (folder / "empty.wav").write_bytes(b"")
    bad["empty.wav"] = "audio"
    (folder / "notes.mp4").write_text("these are meeting notes, not a video\n" * 20)
    bad["notes.mp4"] = "video"
    os.mkfifo(folder / "pipe.mp4")
    bad["pipe.mp4"] = "video"
    (folder / "folder.wav").mkdir()
    bad["folder.wav"] = "audio"
    os.mkfifo(folder / "seg0.ts")
    (folder / "playlist.mp4").write_text("#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2.0,\nseg0.ts\n#EXT-X-ENDLIST\n")
    bad["playlist.mp4"] = "video"
    rows = [{"messages": [{"role": "user", "content": "<audio>"}], "audios": ["good.wav"]},
            {"messages": [{"role": "user", "content": "<video>"}], "videos": ["good.mp4"], "images": ["good.png"]},
            {"audios": ["good.flac", "empty.wav", "folder.wav"]},
            {"videos": ["truncated.mp4", "notes.mp4", "pipe.mp4", "playlist.mp4"]}]
    with open(folder / "train.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    return folder, bad


def run_scan(*args):
    return subprocess.run([sys.executable, "-m", "swift_safe_media.cli", "scan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(300)
def test_scan_finds_exactly_the_planted_bad_files(corpus, tmp_path):
    folder, bad = corpus
    report, registry = tmp_path / "report.json", tmp_path / "quarantine.jsonl"
    done = run_scan(str(folder / "train.jsonl"), "--workers", "2", "--timeout", "10",
                    "--report", str(report), "--quarantine", str(registry))
    assert done.returncode == 1, done.stderr
    summary = json.loads(report.read_text())
    assert summary["scanned"] == 10
    found = {os.path.basename(problem["path"]): problem for problem in summary["problems"]}
    assert set(found) == set(bad)
    assert "FIFO" in found["pipe.mp4"]["problem"] and "directory" in found["folder.wav"]["problem"]
    assert all(problem["elapsed"] < 10 for problem in summary["problems"]), "nothing may block"
    for name in bad:
        assert name in done.stdout  # the table names every bad file
    recorded = {os.path.basename(entry["path"]) for entry in quarantine.entries(registry)}
    assert recorded == set(bad)
    assert "items/s" in done.stderr or "items/s" in done.stdout


@pytest.mark.timeout(300)
def test_scan_of_a_directory_and_a_clean_dataset(corpus, tmp_path):
    folder, bad = corpus
    done = run_scan(str(folder), "--workers", "2", "--timeout", "10", "--no-progress")
    assert done.returncode == 1
    for name in bad:
        assert name in done.stdout
    assert "seg0.ts" in done.stdout  # a FIFO named like media is reported, never opened
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"audios": [str(folder / "good.wav")], "videos": [str(folder / "good.mp4")]}) + "\n")
    done = run_scan(str(clean), "--workers", "1", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no problems found" in done.stdout


@pytest.mark.timeout(300)
def test_scan_reports_partial_files_as_truncated(tmp_path):
    from tests import damaged_media

    folder = tmp_path / "downloads"
    folder.mkdir()
    damaged_media.ffmpeg(*damaged_media.video_src(4), *damaged_media.H264, "-movflags", "+faststart",
                         str(folder / "whole.mp4"))
    damaged_media.ffmpeg(*damaged_media.tone(2, 16000), str(folder / "whole.wav"))
    damaged_media.cut(folder / "whole.mp4", folder / "interrupted.mp4", 0.5)
    damaged_media.cut(folder / "whole.wav", folder / "interrupted.wav", 0.5)
    report, registry = tmp_path / "report.json", tmp_path / "quarantine.jsonl"
    done = run_scan(str(folder), "--workers", "2", "--timeout", "10", "--no-progress",
                    "--report", str(report), "--quarantine", str(registry))
    assert done.returncode == 1, done.stdout + done.stderr
    found = {os.path.basename(problem["path"]): problem["problem"] for problem in json.loads(report.read_text())["problems"]}
    assert set(found) == {"interrupted.mp4", "interrupted.wav"}
    assert "truncated: index promises 120 frames, file holds" in found["interrupted.mp4"]
    assert "truncated: index promises 32000 frames, file holds" in found["interrupted.wav"]
    assert "truncated" in done.stdout
    recorded = quarantine.entries(str(registry))
    assert {os.path.basename(entry["path"]) for entry in recorded} == {"interrupted.mp4", "interrupted.wav"}
    assert all("truncated" in entry["reason"] for entry in recorded)
