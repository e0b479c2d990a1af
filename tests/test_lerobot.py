"""LeRobot 0.4.4, for real: a dataset recorded with LeRobot's own API, one episode video
that hangs the stock decoder (a FIFO: opening it blocks for ever) and one truncated.

Every scenario runs in a fresh interpreter (tests/lerobot_scenarios.py): patches and the
start-up hook are process-wide, and the unprotected runs hang for real, so they are
killed, with their DataLoader workers, after a bound.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swift_safe_media.records import quarantine

from .fresh import ROOT, clean_environment

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lerobot") is None,
                                reason="LeRobot is not installed")

REPO = Path(ROOT)
CAMERA = "observation.images.front"
HANGING_EPISODE, TRUNCATED_EPISODE = 1, 2


def start_scenario(*args, env=None) -> subprocess.Popen:
    environment = clean_environment(env, warm_start=True)
    return subprocess.Popen([sys.executable, "-m", "tests.lerobot_scenarios", *map(str, args)],
                            cwd=REPO, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_scenario(*args, env=None, bound=200.0):
    """Run a scenario; return (exit code, its JSON result, stdout, stderr)."""
    process = start_scenario(*args, env=env)
    try:
        stdout, stderr = process.communicate(timeout=bound)
    finally:
        kill_scenario(process)
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1]) if process.returncode == 0 and lines else None
    return process.returncode, result, stdout, stderr


def kill_scenario(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # DataLoader workers and sandboxes too
    except ProcessLookupError:
        pass


def video_file(root: Path, episode: int) -> Path:
    # Recorded with one video file per episode, so file N holds episode N.
    return root / "videos" / CAMERA / "chunk-000" / f"file-{episode:03d}.mp4"


def variant(clean: Path, name: str, hanging=(), truncated=()) -> Path:
    root = clean.parent / name
    shutil.copytree(clean, root)
    for episode in hanging:
        video_file(root, episode).unlink()
        os.mkfifo(video_file(root, episode))  # no writer ever: open() blocks for ever
    for episode in truncated:
        path = video_file(root, episode)
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size * 4 // 10)
    return root


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    clean = tmp_path_factory.mktemp("lerobot") / "clean"
    code, result, _, stderr = run_scenario("build", clean, 6, 10, bound=240)
    assert code == 0, stderr[-3000:]
    assert result == {"frames": 60, "episodes": 6}
    return {
        "clean": clean,
        "hostile": variant(clean, "hostile", hanging=[HANGING_EPISODE], truncated=[TRUNCATED_EPISODE]),
        "truncated": variant(clean, "truncated", truncated=[TRUNCATED_EPISODE]),
        "all_truncated": variant(clean, "all_truncated", truncated=range(6)),
        "mostly_truncated": variant(clean, "mostly_truncated", truncated=range(1, 6)),
    }


@pytest.mark.timeout(480)
def test_frames_are_bit_identical_to_stock_with_two_cameras_in_one_round_trip(tmp_path):
    """AV1, as LeRobot records by default; two cameras, two frames each per sample."""
    root = tmp_path / "two_cameras"
    code, result, _, stderr = run_scenario("build", root, 3, 8, 2, "libsvtav1", bound=240)
    assert code == 0, stderr[-3000:]
    code, stock, _, stderr = run_scenario("item_digests", root)
    assert code == 0 and not stock["patched"], stderr[-3000:]
    code, ours, _, stderr = run_scenario("item_digests", root, env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0 and ours["patched"], stderr[-3000:]
    assert len(ours["keys"]) == 2 and len(ours["digests"]) == 2 * result["frames"]
    assert ours["digests"] == stock["digests"]
    assert len(set(stock["digests"])) > result["frames"], "frames differ from sample to sample"


PROTECTED = {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "2",
             # 2 bad episodes of 6 are far above the default 10 %: this test is about skipping.
             "SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION": "0.6"}


CLEAN_BATCHES = 15  # 60 frames in batches of 4
CLEAN_STATES = [[float(episode), float(frame)] for episode in range(6) for frame in range(10)]


@pytest.mark.timeout(480)
def test_protected_epoch_substitutes_bad_episodes_and_keeps_the_batch_count(datasets):
    code, result, _, stderr = run_scenario("epoch", datasets["hostile"], "spawn", env=PROTECTED, bound=400)
    assert code == 0, stderr[-3000:]
    assert result["batches"] == result["expected_batches"] == CLEAN_BATCHES
    assert result["samples"] == len(CLEAN_STATES)
    # Every item is real data, and none comes from a bad episode.
    assert all(state in CLEAN_STATES for state in result["states"])
    episodes = {int(episode) for episode, _ in result["states"]}
    assert HANGING_EPISODE not in episodes and TRUNCATED_EPISODE not in episodes

    # The FIFO that hangs stock is refused before any decoder opens it (the guards in front
    # of the demuxer check), without waiting for the timeout.
    for episode, reason in ((HANGING_EPISODE, "MediaDecodeError"), (TRUNCATED_EPISODE, "RuntimeError")):
        path = video_file(datasets["hostile"], episode)
        logged = [line for line in stderr.splitlines()
                  if f"(episode {episode}, camera {CAMERA}, file {path}) failed: {reason}" in line]
        assert logged, stderr[-3000:]
        assert "substituted by sample" in logged[0]
        if episode == HANGING_EPISODE:
            assert "not a regular file (FIFO)" in logged[0], logged[0]


@pytest.mark.timeout(480)
def test_training_loop_logs_the_run_summary_every_log_freq_batches_and_at_exit(datasets, tmp_path):
    """lerobot-train draws batches with next(cycle(loader)); with an output_dir the registry
    and the summary land under it, and the summary is logged every log_freq batches."""
    output_dir = tmp_path / "outputs"
    output_dir.mkdir()  # lerobot-train creates it before the first batch
    registry = output_dir / "safe_media" / "quarantine.jsonl"
    code, result, _, stderr = run_scenario(
        "train_loop", datasets["hostile"], 12,
        env={**PROTECTED, "SWIFT_SAFE_MEDIA_QUARANTINE": str(registry), "SWIFT_SAFE_MEDIA_SUMMARY_STEPS": "5"},
        bound=400)
    assert code == 0, stderr[-3000:]
    assert result == {"steps": 12, "start_method": "forkserver"}
    for step in (5, 10, 12):  # every 5 batches, then the last one at exit
        assert f"swift_safe_media summary at step {step}: " in stderr, stderr[-3000:]
    summary = json.loads((registry.parent / "safe_media_summary.json").read_text())
    assert summary["step"] == 12 and summary["ok"] > 0
    assert summary["timeout"] + summary["error"] + summary["quarantined"] >= 2, summary
    recorded = {entry["path"] for entry in quarantine.entries(registry)}
    assert str(video_file(datasets["hostile"], HANGING_EPISODE).resolve()) in recorded


@pytest.mark.timeout(300)
def test_without_protection_the_hanging_episode_stalls_the_epoch(datasets):
    """Stock LeRobot (fork workers, its default) delivers the two batches before the
    hanging episode, then nothing more: the FIFO's open() blocks a worker for ever."""
    process = start_scenario("epoch", datasets["hostile"], env={"SWIFT_SAFE_MEDIA": "0"})
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while "batch 2\n" not in lines and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "batch 2\n" in lines, process.stderr.read() if process.poll() is not None else "no progress"
        time.sleep(15)  # far longer than the rest of a clean epoch takes
        assert process.poll() is None, f"the stock epoch ended (exit code {process.returncode})"
        assert lines == ["batch 1\n", "batch 2\n"]
    finally:
        kill_scenario(process)
        process.wait()


@pytest.mark.timeout(300)
def test_without_protection_the_truncated_episode_kills_the_epoch(datasets):
    code, _, _, stderr = run_scenario("epoch", datasets["truncated"], env={"SWIFT_SAFE_MEDIA": "0"})
    assert code not in (0, None)
    assert "Failed to open input buffer" in stderr  # torchcodec's error; it does not name the file


@pytest.mark.timeout(300)
def test_every_failed_file_is_named_once_substitutes_included(datasets):
    """5 of 6 episodes truncated: substitutes often fail too. Each warning names every file
    that failed on the way, each once; across the epoch every bad file is named."""
    env = {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "0",
           "SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION": "1"}
    code, result, _, stderr = run_scenario("epoch", datasets["mostly_truncated"], "none", 0, env=env)
    assert code == 0, stderr[-3000:]
    assert result["batches"] == CLEAN_BATCHES and {int(episode) for episode, _ in result["states"]} == {0}
    warnings = [line for line in stderr.splitlines() if "substituted by sample" in line]
    named_per_warning = [re.findall(r"file (\S+)\) failed: ", line) for line in warnings]
    assert all(len(named) == len(set(named)) for named in named_per_warning)
    assert max(len(named) for named in named_per_warning) >= 2, warnings[:5]
    bad = {str(video_file(datasets["mostly_truncated"], episode)) for episode in range(1, 6)}
    assert set().union(*named_per_warning) == bad
    assert "other candidates failed" not in stderr


@pytest.mark.timeout(300)
def test_error_budget_stops_a_run_with_nothing_left_to_train_on(datasets):
    env = {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "5"}
    code, _, _, stderr = run_scenario("epoch", datasets["all_truncated"], "none", 0, env=env)
    assert code not in (0, None)
    assert "ErrorBudgetExceeded" in stderr
    assert "5 consecutive samples failed to decode (limit 5, SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES)" in stderr


PATCHED_SITES = ["lerobot.datasets.lerobot_dataset.decode_video_frames", "lerobot.datasets.utils.cycle",
                 "lerobot.datasets.video_utils.decode_video_frames"]


def assert_patched(state):
    assert state["video_utils"] and state["lerobot_dataset"] and state["getitem"] and state["cycle"]
    assert state["same_object"] and state["is_patched"]
    assert state["sites"] == PATCHED_SITES
    assert state["sandbox_setup"], "sandboxes import LeRobot before their first decode"


def assert_stock(state):
    assert not (state["video_utils"] or state["lerobot_dataset"] or state["getitem"] or state["cycle"])
    assert state["same_object"] and not state["is_patched"] and state["sites"] == []
    assert not state["sandbox_setup"], "disable() undoes the sandbox setup too"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["enable_first", "import_first"])
def test_patch_unpatch_in_either_import_order(order):
    code, result, _, stderr = run_scenario("import_order", order)
    assert code == 0, stderr[-3000:]
    assert "could not patch" not in stderr
    enabled, enabled_twice, disabled, enabled_again = result["states"]
    assert_patched(enabled)
    assert enabled_twice == enabled
    assert_stock(disabled)
    assert_patched(enabled_again)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("_swift_safe_media_startup") is None,
                    reason="the start-up hook ships only with an installed package")
def test_environment_turns_it_on_through_the_start_up_hook():
    code, result, _, stderr = run_scenario("patch_state", env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    assert_patched(result)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("draccus") is None, reason="draccus is not installed")
@pytest.mark.skipif(importlib.util.find_spec("_swift_safe_media_startup") is None,
                    reason="the start-up hook ships only with an installed package")
def test_flags_parse_through_lerobots_draccus_parser(tmp_path):
    output_dir = tmp_path / "outputs" / "train"
    code, result, _, stderr = run_scenario(
        "flags", "--batch_size=3", "--safe_media=true", "--safe_media_timeout=7",
        "--safe_media_mp_context", "forkserver", "--num_workers", "1", f"--output_dir={output_dir}",
        "--safe_media_stall_timeout=600", "--safe_media_stall_action", "abort")
    assert code == 0, stderr[-3000:]
    assert result["parsed"] == {"batch_size": 3, "num_workers": 1, "output_dir": str(output_dir)}
    assert result["argv"] == ["--batch_size=3", "--num_workers", "1", f"--output_dir={output_dir}"]
    expected = {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "7", "SWIFT_SAFE_MEDIA_MP_CONTEXT": "forkserver",
                "SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "600", "SWIFT_SAFE_MEDIA_STALL_ACTION": "abort",
                # The registry defaults to the run's output_dir, which must not exist yet for lerobot-train.
                "SWIFT_SAFE_MEDIA_QUARANTINE": str(output_dir / "safe_media" / "quarantine.jsonl"),
                "SWIFT_SAFE_MEDIA_STATS_DIR": str(output_dir / "safe_media" / "swift_safe_media_stats")}
    assert {name: result["env"].get(name) for name in expected} == expected
    assert not output_dir.exists()
    assert_patched(result["state"])

    # A registry named on the command line wins over the default; so does the environment.
    chosen = tmp_path / "shared" / "quarantine.jsonl"
    code, result, _, stderr = run_scenario("flags", f"--safe_media_quarantine={chosen}",
                                           f"--output_dir={output_dir}", env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    assert result["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == str(chosen)
    code, result, _, stderr = run_scenario("flags", f"--output_dir={output_dir}",
                                           env={"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_QUARANTINE": ""})
    assert code == 0, stderr[-3000:]
    assert result["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == ""  # set empty: quarantine off

    # The flag wins over the environment.
    code, result, _, stderr = run_scenario("flags", "--safe_media=false", env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    assert result["env"]["SWIFT_SAFE_MEDIA"] == "0"
    assert_stock(result["state"])


@pytest.mark.timeout(300)
def test_lerobot_train_dataloaders_get_the_configured_start_method():
    code, result, _, stderr = run_scenario("start_method", env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    # Set on the torch DataLoader that starts the workers, also under a wrapper that keeps
    # attribute writes to itself (accelerator.prepare in lerobot-train).
    assert result == {"workers": "forkserver", "forwarding_wrapper": "forkserver", "accelerate_prepared": "forkserver",
                      "workers_forkserver": "forkserver", "workers_default": None,
                      "user_choice": "fork", "no_workers": None,
                      "train_config_0_4_4_has_field": False, "newer_has_field": True}


def test_take_flags_accepts_draccus_spellings():
    from swift_safe_media.hosts.lerobot.adapter import take_flags

    assert take_flags(["--safe_media=true", "--steps=5"]) == ({"enabled": True}, ["--steps=5"])
    assert take_flags(["--safe_media", "--steps", "5"]) == ({"enabled": True}, ["--steps", "5"])
    assert take_flags(["--safe_media", "false"]) == ({"enabled": False}, [])
    assert take_flags(["--safe_media_max_memory_mb=4096"]) == ({"max_memory_mb": "4096"}, [])
    with pytest.raises(ValueError, match="expected true or false"):
        take_flags(["--safe_media=maybe"])
