"""Quarantine registry with real processes: a failing file costs its timeout once."""

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest

from swift_safe_media import MediaDecodeTimeout, MediaQuarantined, call
from swift_safe_media.quarantine import Registry

from . import sandboxed
from .fresh import ROOT



@pytest.fixture
def registry_path(tmp_path, monkeypatch):
    path = tmp_path / "run" / "quarantine.jsonl"
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(path))
    return path


def test_a_timed_out_file_is_refused_at_once_afterwards(registry_path, fifo):
    with pytest.raises(MediaDecodeTimeout):
        call(sandboxed.open_fifo, fifo, timeout=1)
    started = time.monotonic()
    with pytest.raises(MediaQuarantined) as caught:
        call(sandboxed.open_fifo, fifo, timeout=1)
    assert time.monotonic() - started < 0.2
    assert caught.value.path == fifo and "earlier timeout" in caught.value.reason
    (entry,) = [json.loads(line) for line in registry_path.read_text().splitlines()]
    assert entry["path"] == os.path.realpath(fifo) and entry["kind"] == "timeout"
    assert {"size", "mtime_ns", "reason", "elapsed", "host", "rank", "time", "pid"} <= set(entry)


def test_a_changed_file_is_tried_again(registry_path, tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not a video")
    with pytest.raises(Exception):
        call(sandboxed.exit_with, 9, path=str(clip))
    with pytest.raises(MediaQuarantined):
        call(sandboxed.add, 1, 2, path=str(clip))
    clip.write_bytes(b"now a different file")
    assert call(sandboxed.add, 1, 2, path=str(clip)) == 3


def test_quarantine_survives_a_restart(registry_path, fifo):
    with pytest.raises(MediaDecodeTimeout):
        call(sandboxed.open_fifo, fifo, timeout=1)
    script = textwrap.dedent(f"""
        from swift_safe_media import MediaQuarantined, call
        from tests import sandboxed
        try:
            call(sandboxed.open_fifo, {fifo!r}, timeout=30)
        except MediaQuarantined as exc:
            print("refused", exc.path)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert done.stdout.strip() == f"refused {fifo}", done.stderr


def _write_many(registry_path, files, worker):
    registry = Registry(registry_path)
    for round_ in range(4):
        for path in files:
            registry.record(path, "error", f"worker {worker} round {round_} " + "x" * 300, 0.5)


def test_concurrent_writers_never_interleave(tmp_path):
    files = []
    for index in range(50):
        path = tmp_path / f"clip{index}.wav"
        path.write_bytes(b"%d" % index)
        files.append(str(path))
    registry_path = str(tmp_path / "shared.jsonl")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(registry_path, files, worker)) for worker in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    lines = open(registry_path).read().splitlines()
    assert len(lines) == 4 * 4 * 50
    entries = [json.loads(line) for line in lines]
    assert {entry["path"] for entry in entries} == {os.path.realpath(path) for path in files}
    assert all(Registry(registry_path).lookup(path) for path in files)


def test_a_torn_last_line_is_skipped_until_complete(tmp_path):
    clip = tmp_path / "a.mp4"
    clip.write_bytes(b"a")
    other = tmp_path / "b.mp4"
    other.write_bytes(b"b")
    registry_path = tmp_path / "q.jsonl"
    Registry(str(registry_path)).record(str(clip), "crash", "SIGSEGV", 0.1)
    scratch = tmp_path / "scratch.jsonl"
    Registry(str(scratch)).record(str(other), "crash", "SIGSEGV", 0.1)
    line_b = scratch.read_text()
    with open(registry_path, "a") as out:
        out.write(line_b[: len(line_b) // 2])  # a writer died mid-line
    reader = Registry(str(registry_path))
    assert reader.lookup(str(clip)) is not None and reader.lookup(str(other)) is None
    with open(registry_path, "a") as out:
        out.write(line_b[len(line_b) // 2:])  # the rest of the line arrives
    assert reader.lookup(str(other)) is not None


def test_an_unwritable_registry_warns_once_and_decoding_goes_on(tmp_path, monkeypatch, capfd, fifo):
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where the registry's folder should be")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_QUARANTINE", str(blocked / "q.jsonl"))
    for _ in range(2):
        with pytest.raises(MediaDecodeTimeout):
            call(sandboxed.open_fifo, fifo, timeout=0.5)
    assert capfd.readouterr().err.count("cannot write the quarantine registry") == 1
    assert call(sandboxed.add, 2, 2) == 4


def test_a_record_after_a_torn_line_stays_whole(tmp_path):
    clips = []
    for name in ("a.mp4", "b.mp4"):
        clip = tmp_path / name
        clip.write_bytes(name.encode())
        clips.append(str(clip))
    registry_path = tmp_path / "q.jsonl"
    registry_path.write_text('{"path": "/data/torn.mp4", "si')  # a writer killed mid-line
    Registry(str(registry_path)).record(clips[0], "timeout", "overran", 5.0)
    Registry(str(registry_path)).record(clips[1], "error", "no video stream", 0.2)
    reader = Registry(str(registry_path))
    assert reader.lookup(clips[0])["kind"] == "timeout" and reader.lookup(clips[1])["kind"] == "error"


def test_in_memory_registry_writes_nothing(tmp_path, caplog):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not a clip")
    registry = Registry.in_memory()
    assert len(registry) == 0 and registry.lookup(str(clip)) is None
    registry.record(str(clip), "timeout", "MediaDecodeTimeout: overran", 1.0)
    registry.record(str(tmp_path / "gone.mp4"), "error", "no such file", 0.0)  # remembered by name
    assert registry.lookup(str(clip))["reason"] == "MediaDecodeTimeout: overran"
    assert registry.lookup(str(tmp_path / "gone.mp4"))["reason"] == "no such file"
    assert len(registry) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
    assert "quarantined" not in caplog.text
    clip.write_bytes(b"a changed file is a new file")
    assert registry.lookup(str(clip)) is None
