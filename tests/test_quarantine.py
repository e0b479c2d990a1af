"""Quarantine registry with real processes: a failing file costs its timeout once."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from swift_safe_media import MediaDecodeTimeout, MediaQuarantined, call
from swift_safe_media.records import quarantine
from swift_safe_media.records.quarantine import Registry

from . import sandboxed
from .fresh import ROOT, run_python



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
    (entry,) = quarantine.entries(registry_path)
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
    done = run_python(module="tests.programs.quarantine_restart", args=[fifo], env=dict(os.environ), timeout=60,
                      check=False)
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
    writer_files = quarantine.registry_files(registry_path)[1:]
    assert len(writer_files) == 4 and not os.path.exists(registry_path)  # one file per writer, no shared one
    entries = []
    for name in writer_files:
        lines = open(name).read().splitlines()
        assert len(lines) == 4 * 50 and len({json.loads(line)["pid"] for line in lines}) == 1
        entries += [json.loads(line) for line in lines]
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
    scratch_registry = Registry(str(scratch))
    scratch_registry.record(str(other), "crash", "SIGSEGV", 0.1)
    line_b = open(scratch_registry.writer_file()).read()
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


def _posing_as_host(registry_path, hostname, file_list, go_file, rounds=3):
    """A writer in its own UTS and PID namespaces (its own hostname, pid 1) where flock fails."""
    return subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--uts", "--pid", "--fork",
         sys.executable, "-m", "tests.registry_writer", str(registry_path), hostname, str(file_list),
         str(go_file), str(rounds)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(subprocess.run(["unshare", "--user", "--map-root-user", "--uts", "--pid", "--fork", "true"],
                                   capture_output=True).returncode != 0, reason="no user namespaces here")
def test_writers_on_different_hosts_need_no_lock(tmp_path):
    """Six writers posing as four hosts (two share a hostname, all are pid 1), each where
    the kernel refuses flock with ENOLCK, record the same files at once while a reader
    reads: every record arrives whole, once per round, in each writer's own file."""
    files = []
    for index in range(40):
        path = tmp_path / "media" / f"clip{index}.mp4"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"%d" % index)
        files.append(str(path))
    file_list, go_file = tmp_path / "files.txt", tmp_path / "go"
    file_list.write_text("\n".join(files))
    registry_path = tmp_path / "shared" / "quarantine.jsonl"
    registry_path.parent.mkdir()
    old = tmp_path / "old.mp4"
    old.write_bytes(b"recorded by an older version in the single file")
    Registry(str(tmp_path / "scratch.jsonl")).record(str(old), "timeout", "overran", 5.0)
    registry_path.write_text(open(quarantine.registry_files(str(tmp_path / "scratch.jsonl"))[1]).read())
    hosts = ["node-a", "node-b", "node-c", "node-d", "node-a", "node-b"]
    writers = [_posing_as_host(registry_path, host, file_list, go_file) for host in hosts]
    try:
        for writer in writers:
            ready = writer.stdout.readline()
            assert ready.startswith("ready node-") and ready.endswith(" pid 1\n"), ready + writer.stderr.read()
        go_file.write_text("go")
        reader = Registry(str(registry_path))
        while any(writer.poll() is None for writer in writers):
            reader.lookup(files[0])  # reading while they write
        for writer in writers:
            assert writer.wait(60) == 0, writer.stderr.read()
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
    writer_files = quarantine.registry_files(str(registry_path))[1:]
    assert len(writer_files) == len(hosts)
    by_host = {}
    for name in writer_files:
        lines = open(name).read().splitlines()
        records = [json.loads(line) for line in lines]  # raises on an interleaved line
        assert len(records) == 3 * len(files) and len({(r["host"], r["pid"]) for r in records}) == 1
        by_host[records[0]["host"]] = by_host.get(records[0]["host"], 0) + 1
        assert os.path.basename(name).startswith(records[0]["host"] + "-rank0-pid1-")
    assert by_host == {"node-a": 2, "node-b": 2, "node-c": 1, "node-d": 1}
    assert len(quarantine.entries(str(registry_path))) == 1 + 3 * len(files) * len(hosts)
    fresh = Registry(str(registry_path))
    assert all(fresh.lookup(path) for path in files) and fresh.lookup(str(old))["kind"] == "timeout"
    assert all(reader.lookup(path) for path in files) and reader.lookup(str(old)) is not None


def test_a_replaced_or_not_yet_visible_registry_file_is_read_again(tmp_path):
    clips = []
    for name in ("a.mp4", "b.mp4", "c.mp4"):
        clip = tmp_path / name
        clip.write_bytes(name.encode())
        clips.append(str(clip))
    registry_path = str(tmp_path / "q.jsonl")
    writer = Registry(registry_path)
    writer.record(clips[0], "error", "bad header", 0.1)
    own_file = writer.writer_file()
    reader = Registry(registry_path)
    assert reader.lookup(clips[0]) is not None
    # Another node's append whose bytes are not visible here yet: its size shows, its data reads as NULs.
    scratch = Registry(str(tmp_path / "scratch.jsonl"))
    scratch.record(clips[1], "crash", "SIGSEGV", 0.2)
    line_b = open(scratch.writer_file(), "rb").read()
    with open(own_file, "ab") as out:
        out.write(b"\0" * (len(line_b) - 1) + b"\n")
    assert reader.lookup(clips[1]) is None
    with open(own_file, "r+b") as out:  # the data arrives
        out.seek(-len(line_b), os.SEEK_END)
        out.write(line_b)
    assert reader.lookup(clips[1])["kind"] == "crash"
    # The file replaced by a copy (rsync, a restore): read again from the start.
    scratch.record(clips[2], "timeout", "overran", 5.0)
    replacement = tmp_path / "replacement.jsonl"
    replacement.write_bytes(open(scratch.writer_file(), "rb").read())
    os.replace(replacement, own_file)
    assert reader.lookup(clips[2])["kind"] == "timeout"

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
