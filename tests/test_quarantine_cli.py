"""The registry holds files proven bad (issue 35): the proof rule, and `swift-safe-media
quarantine list | recheck | forget` on a real registry, with real decodes."""

import pytest

from swift_safe_media.records.quarantine import Registry

from .fresh import ROOT, clean_environment, run_python
from .swift_scenario import _av_source, _ffmpeg


@pytest.fixture
def registry_with_a_valid_and_a_bad_file(tmp_path):
    valid, bad = tmp_path / "valid.mp4", tmp_path / "garbage.mp4"
    _ffmpeg(*_av_source(1), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac",
            "-shortest", str(valid))
    bad.write_bytes(bytes(range(256)) * 64)
    path = str(tmp_path / "q" / "quarantine.jsonl")
    registry = Registry(path)
    # As an older version would have recorded a valid file after its sandbox was killed:
    registry.record(str(valid), "crash", "sandbox pid 1 died during the decode: killed by signal 9 (SIGKILL)", 1.0)
    registry.record(str(bad), "error", "decode failed (torchcodec): not a video", 0.01)
    return path, str(valid), str(bad)


def cli(*args, check=False):
    return run_python(module="swift_safe_media.cli", args=["quarantine", *args], check=check, timeout=300,
                      env=clean_environment({"PYTHONPATH": ROOT}))


def test_list_recheck_and_forget(registry_with_a_valid_and_a_bad_file):
    path, valid, bad = registry_with_a_valid_and_a_bad_file
    listed = cli("list", path, check=True)
    assert valid in listed.stdout and bad in listed.stdout and "SIGKILL" in listed.stdout
    rechecked = cli("recheck", path, "--timeout", "60")
    assert rechecked.returncode == 1, rechecked.stderr[-3000:]  # one still fails
    assert f"decodes now, forgotten: {valid}" in rechecked.stdout and f"still fails: {bad}" in rechecked.stdout
    assert Registry(path).lookup(valid) is None and Registry(path).lookup(bad) is not None
    assert valid not in cli("list", path, check=True).stdout
    assert cli("forget", path, bad).returncode == 0
    assert Registry(path).current() == [] and cli("list", path, check=True).stdout == ""
    assert cli("forget", path, bad).returncode == 1  # nothing left to forget


def test_a_forgotten_file_that_fails_again_is_quarantined_again(registry_with_a_valid_and_a_bad_file):
    path, _, bad = registry_with_a_valid_and_a_bad_file
    reader = Registry(path)  # a running process: it sees the forget, and a later record
    assert reader.lookup(bad) is not None
    assert Registry(path).forget(bad)
    assert reader.lookup(bad) is None
    import time
    time.sleep(1.1)  # records are ordered by their time, to the second
    Registry(path).record(bad, "error", "decode failed again", 0.01)
    assert reader.lookup(bad)["reason"] == "decode failed again"


def test_an_ambiguous_failure_needs_a_second_one(tmp_path, capfd):
    clip = tmp_path / "slow.mp4"
    clip.write_bytes(b"x")
    registry = Registry(str(tmp_path / "quarantine.jsonl"))
    registry.record(str(clip), "timeout", "overran its 1 s timeout, not counting 4.00 s it waited for a CPU "
                                          "(the ceiling)", 5.0, ambiguous=True)
    assert registry.lookup(str(clip)) is None
    assert "not quarantined yet" in capfd.readouterr().err
    registry.record(str(clip), "timeout", "overran its 1 s timeout", 5.0, ambiguous=True)
    assert registry.lookup(str(clip))["reason"].endswith("(its second failure)")
