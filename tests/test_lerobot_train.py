"""The real ``lerobot-train`` CLI, end to end, in LeRobot's own environment.

LeRobot 0.4.4 pins torch<2.11, so it runs from ``.venv-lerobot/`` (built by ``make test``
from requirements-lerobot.txt, our package installed there as a user installs it). A
tiny ACT trains offline over a dataset recorded at test time with LeRobot's own API (two
AV1 cameras, one video file per episode), poisoned with a FIFO nobody writes (opening it
blocks for ever), a file cut to 40 % and a valid file whose every frame takes seconds of
CPU to decode (a very long GOP: tests/lerobot_scenarios.py ``slow_video``). Processes
are watched from /proc while the CLI runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from swift_safe_media.records import quarantine

from .proc_table import descendants, forkservers, process_table, trainer_copies

REPO = Path(__file__).resolve().parent.parent
LEROBOT_VENV = REPO / ".venv-lerobot"
LEROBOT_TRAIN = LEROBOT_VENV / "bin" / "lerobot-train"

pytestmark = pytest.mark.skipif(
    not LEROBOT_TRAIN.exists(),
    reason=f"{LEROBOT_VENV} is missing: `make test` builds it (LeRobot 0.4.4 with its own pins)")

FRONT, WRIST = "observation.images.front", "observation.images.wrist"
EPISODES, FRAMES = 8, 5
STEPS, BATCH = 10, 4  # one epoch: every episode, the bad ones too, is drawn
TIMEOUT_S = 2
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "TQDM_DISABLE": "1"}
# About 2 minutes a run on a 2-core machine busy with other jobs (load 14); room for a busier one.
RUN_BOUND_S = 900


def video_file(root: Path, camera: str, episode: int) -> Path:
    return root / "videos" / camera / "chunk-000" / f"file-{episode:03d}.mp4"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    clean = tmp_path_factory.mktemp("lerobot_train") / "clean"
    scenario("build", clean, EPISODES, FRAMES, 2, "libsvtav1")
    hostile = clean.parent / "hostile"
    shutil.copytree(clean, hostile)
    bad = {"hanging": video_file(hostile, FRONT, 1), "truncated": video_file(hostile, FRONT, 2),
           "slow": video_file(hostile, WRIST, 3)}
    bad["hanging"].unlink()
    os.mkfifo(bad["hanging"])  # no writer ever: open() blocks for ever
    with open(bad["truncated"], "r+b") as handle:
        handle.truncate(bad["truncated"].stat().st_size * 4 // 10)
    scenario("slow_video", bad["slow"])
    return {"clean": clean, "hostile": hostile, "bad": bad}


def scenario(*args):
    """Run a tests/lerobot_scenarios.py scenario with LeRobot's own environment."""
    done = subprocess.run([str(LEROBOT_VENV / "bin" / "python"), "-m", "tests.lerobot_scenarios", *map(str, args)],
                          cwd=REPO, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def train_command(root: Path, output_dir: Path, *extra: str) -> list[str]:
    """A tiny ACT (no pretrained backbone, small dims) for ``STEPS`` steps on the CPU."""
    return [str(LEROBOT_TRAIN), "--dataset.repo_id=local/safe_media_test", f"--dataset.root={root}",
            "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
            "--policy.pretrained_backbone_weights=null", "--policy.dim_model=32", "--policy.n_heads=2",
            "--policy.dim_feedforward=64", "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1",
            "--policy.chunk_size=5", "--policy.n_action_steps=5", f"--batch_size={BATCH}", "--num_workers=2",
            f"--steps={STEPS}", "--log_freq=5", "--save_checkpoint=false", "--eval_freq=0",
            "--wandb.enable=false", f"--output_dir={output_dir}", *extra]


def run_train(command: list[str], bound: float, env=None) -> dict:
    """Run the CLI in its own session, watching its process tree; kill it all after ``bound``."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("SWIFT_SAFE_MEDIA")}
    environment.update(OFFLINE, OMP_NUM_THREADS="1", **(env or {}))  # a small model: one thread each
    process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    seen: dict = {}  # pid -> proc_table.Process: every descendant seen while it ran
    sightings: dict[int, int] = {}  # how many polls saw it (a fork about to exec is seen once)
    deadline = time.monotonic() + bound
    while process.poll() is None and time.monotonic() < deadline:
        table = process_table()
        for pid, row in descendants(table, process.pid).items():
            # The latest sighting: a process spawned is first seen between its fork and its
            # exec, with the trainer's command line (a zombie's is empty: kept as it was).
            if row.command or pid not in seen:
                seen[pid] = row
            sightings[pid] = sightings.get(pid, 0) + 1
        time.sleep(0.2)
    hung = process.poll() is None
    if hung:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    reader.join(timeout=10)
    return {"returncode": None if hung else process.returncode, "output": "".join(output),
            "seen": seen, "sightings": sightings, "pid": process.pid}


def left_behind(seen, grace: float = 10.0) -> list[str]:
    """Processes of the run still alive after it ended (the same pid and start time)."""
    deadline = time.monotonic() + grace  # sandboxes die of their parent's death signal
    while True:
        table = process_table()
        alive = [f"{pid} {row[2]}" for pid, row in seen.items() if table.get(pid, (0, -1))[1] == row[1]]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def dataloader_workers(run) -> tuple[list[str], list[str]]:
    """(spawned workers, forked copies of the trainer) among the trainer's descendants."""
    servers = forkservers(run["seen"])
    spawned = [row[2] for pid, row in run["seen"].items()
               if "spawn_main" in row[2] or pid in servers or row.parent in servers]
    # A forked worker keeps the trainer's command line: python .../bin/lerobot-train ...
    return spawned, trainer_copies(run["seen"], str(LEROBOT_TRAIN))


def assert_every_bad_file_named(output: str, bad: dict) -> None:
    for kind, reason in (("hanging", "MediaDecodeTimeout"), ("slow", "MediaDecodeTimeout"),
                         ("truncated", "")):
        named = [line for line in output.splitlines()
                 if f"file {bad[kind]}) failed: {reason}" in line or f"file {bad[kind]}) failed: file failed" in line]
        assert named, f"the {kind} file {bad[kind]} is never named:\n{output[-4000:]}"


@pytest.mark.timeout(1200)
def test_protected_lerobot_train_trains_every_step_names_every_bad_file_in_spawned_workers(datasets, tmp_path):
    output_dir = tmp_path / "outputs"
    run = run_train(train_command(datasets["hostile"], output_dir, "--safe_media=true",
                                  f"--safe_media_timeout={TIMEOUT_S}"), bound=RUN_BOUND_S)
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert f"step:{STEPS} " in output and "End of training" in output, output[-4000:]
    assert_every_bad_file_named(output, datasets["bad"])

    # Workers come from spawn (or a clean forkserver), not from forking the trainer.
    assert "swift_safe_media: DataLoader workers use the 'forkserver' start method" in output, output[-4000:]
    spawned, forked = dataloader_workers(run)
    assert len(spawned) >= 2 and not forked, (spawned, forked)
    # The warm start held in every process: the workers' bootstrap (re-importing the
    # console script, so the whole trainer) neither started a forkserver nor a zygote of
    # its own; every sandbox came from the one zygote forked from the warm forkserver
    # (a zygote started by exec has its module on its command line).
    assert "could not start the warm forkserver" not in output, output[-4000:]
    assert not [row[2] for row in run["seen"].values() if "swift_safe_media.engine.zygote" in row[2]]
    assert not left_behind(run["seen"])

    registry = output_dir / "safe_media" / "quarantine.jsonl"
    recorded = {entry["path"] for entry in quarantine.entries(registry)}
    assert {str(datasets["bad"][kind].resolve()) for kind in ("hanging", "slow")} <= recorded, recorded
    summary = json.loads((output_dir / "safe_media" / "safe_media_summary.json").read_text())
    assert summary["step"] == STEPS and summary["ok"] > 0 and summary["timeout"] >= 2, summary
    slow_paths = [entry["path"] for entry in summary["slowest"]]
    assert len(slow_paths) == len(set(slow_paths))
    assert f"swift_safe_media summary at step {STEPS}: " in output


@pytest.mark.timeout(1200)
def test_protected_lerobot_train_with_the_pyav_backend(datasets, tmp_path):
    run = run_train(train_command(datasets["hostile"], tmp_path / "outputs", "--dataset.video_backend=pyav",
                                  "--safe_media=true", f"--safe_media_timeout={TIMEOUT_S}"), bound=RUN_BOUND_S)
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert f"step:{STEPS} " in output and "End of training" in output, output[-4000:]
    assert_every_bad_file_named(output, datasets["bad"])
    assert not left_behind(run["seen"])


STOCK_BOUND_S = 150


@pytest.mark.timeout(400)
def test_stock_lerobot_train_hangs_or_crashes_on_the_same_dataset(datasets, tmp_path):
    """The before picture: the same command without protection never finishes its steps."""
    run = run_train(train_command(datasets["hostile"], tmp_path / "outputs"), bound=STOCK_BOUND_S,
                    env={"SWIFT_SAFE_MEDIA": "0"})
    output = run["output"]
    assert "Start offline training" in output, output[-4000:]  # it got as far as drawing batches
    assert "End of training" not in output
    if run["returncode"] is not None:  # it crashed, without naming the file
        assert run["returncode"] != 0
        assert not any(str(path) in output for path in datasets["bad"].values()), output[-4000:]
    _, forked = dataloader_workers(run)
    assert forked, "stock LeRobot forks its workers"
