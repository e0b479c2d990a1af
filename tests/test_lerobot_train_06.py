"""The real ``lerobot-train`` 0.6.1, end to end, in LeRobot 0.6.1's own environment.

LeRobot 0.5+ needs Python 3.12: it runs from ``.venv-lerobot-0.6/`` (built by ``make test``
from requirements-lerobot-0.6.txt, our package installed there as a user installs it). A
tiny ACT trains offline, with a held-out eval split (its eval loader, iterated with a plain
``for``, starts workers too), over a dataset recorded at test time with LeRobot 0.6's own
API: two AV1 cameras and a depth camera (12-bit HEVC, which LeRobot always decodes with
PyAV), one video file per episode, poisoned with a FIFO nobody writes (opening it blocks
for ever), a slow file (tests/lerobot_scenarios.py ``slow_video``: every frame takes
seconds of CPU), a depth file cut to 40 % in the training split and an RGB file cut in the
eval split. Processes are watched from /proc while the CLI runs (tests/test_lerobot_train.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from swift_safe_media.records import quarantine

from .proc_table import from_forkservers, trainer_copies
from .test_lerobot_train import OFFLINE, left_behind, run_train

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-lerobot-0.6"
LEROBOT_TRAIN = VENV / "bin" / "lerobot-train"

pytestmark = pytest.mark.skipif(not LEROBOT_TRAIN.exists(), reason=f"{VENV} is missing: `make test` builds it "
                                                                   "(LeRobot 0.6.1 with its own pins, Python 3.12)")

FRONT, WRIST, DEPTH = "observation.images.front", "observation.images.wrist", "observation.images.depth"
EPISODES, FRAMES = 8, 5  # eval_split 0.25: episodes 6 and 7 are held out
STEPS, BATCH, EVAL_STEPS = 10, 4, 5
FAULT_STEPS = 30  # the machine-fault run: long enough for its kill plan
TIMEOUT_S = 2
RUN_BOUND_S = 900


def video_file(root: Path, camera: str, episode: int) -> Path:
    return root / "videos" / camera / "chunk-000" / f"file-{episode:03d}.mp4"


def scenario(*args):
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "tests.lerobot_scenarios", *map(str, args)],
                          cwd=REPO, env={**os.environ, **OFFLINE, "SWIFT_SAFE_MEDIA": "0"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    clean = tmp_path_factory.mktemp("lerobot_train_06") / "clean"
    scenario("build", clean, EPISODES, FRAMES, 2, "libsvtav1", 1)
    hostile = clean.parent / "hostile"
    shutil.copytree(clean, hostile)
    bad = {"hanging": video_file(hostile, FRONT, 1), "slow": video_file(hostile, WRIST, 3),
           "cut_depth": video_file(hostile, DEPTH, 2), "cut_eval": video_file(hostile, FRONT, 6)}
    bad["hanging"].unlink()
    os.mkfifo(bad["hanging"])  # no writer ever: open() blocks for ever
    for kind in ("cut_depth", "cut_eval"):
        with open(bad[kind], "r+b") as handle:
            handle.truncate(bad[kind].stat().st_size * 4 // 10)
    scenario("slow_video", bad["slow"])
    return {"clean": clean, "hostile": hostile, "bad": bad}


def train_command(root: Path, output_dir: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """A tiny ACT for ``steps`` steps on the CPU, eval loss on the held-out split every
    ``EVAL_STEPS``; LeRobot's own start method (spawn) and worker settings otherwise."""
    return [str(LEROBOT_TRAIN), "--dataset.repo_id=local/safe_media_test", f"--dataset.root={root}",
            "--dataset.eval_split=0.25", f"--eval_steps={EVAL_STEPS}",
            "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
            "--policy.pretrained_backbone_weights=null", "--policy.dim_model=32", "--policy.n_heads=2",
            "--policy.dim_feedforward=64", "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1",
            "--policy.chunk_size=5", "--policy.n_action_steps=5", f"--batch_size={BATCH}", "--num_workers=2",
            f"--steps={steps}", "--log_freq=5", "--save_checkpoint=false", "--env_eval_freq=0",
            "--wandb.enable=false", f"--output_dir={output_dir}", *extra]


def workers(run) -> dict[str, list[str]]:
    """The trainer's descendants by how they started: spawned (``spawn_main``), from a
    forkserver, or forked copies of the trainer (they keep its command line)."""
    seen = run["seen"]
    return {"spawned": [row.command for row in seen.values() if "spawn_main" in row.command],
            # exec'd (CPython's command line) or forked from the trainer (its command line, named so)
            "forkserver": [seen[pid].command for pid in from_forkservers(seen)],
            "forked": trainer_copies(seen, str(LEROBOT_TRAIN))}


def assert_every_bad_file_named(output: str, bad: dict) -> None:
    for kind, reason in (("hanging", "MediaDecodeError"), ("slow", "MediaDecodeTimeout"), ("cut_depth", ""),
                         ("cut_eval", "")):
        named = [line for line in output.splitlines() if f"file {bad[kind]}) failed: {reason}" in line]
        assert named, f"the {kind} file {bad[kind]} is never named:\n{output[-4000:]}"


@pytest.mark.timeout(1200)
def test_protected_lerobot_train_06_trains_and_evaluates_every_step_naming_every_bad_file(datasets, tmp_path):
    """The default backend: torchcodec for RGB, PyAV for depth, three cameras at once."""
    output_dir = tmp_path / "outputs"
    run = run_train(train_command(datasets["hostile"], output_dir, "--safe_media=true",
                                  f"--safe_media_timeout={TIMEOUT_S}"), bound=RUN_BOUND_S)
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert f"step:{STEPS} " in output and "End of training" in output, output[-4000:]
    assert output.count("eval_loss=") == STEPS // EVAL_STEPS, output[-4000:]
    assert_every_bad_file_named(output, datasets["bad"])

    # LeRobot's default start method (spawn, not named by the user) gives way to the warm
    # forkserver, for the training and the eval loader alike: no worker spawned or forked.
    assert "swift_safe_media: DataLoader workers use the 'forkserver' start method" in output, output[-4000:]
    started = workers(run)
    assert len(started["forkserver"]) >= 4 and not started["spawned"] and not started["forked"], started
    assert "could not start the warm forkserver" not in output, output[-4000:]
    assert not [row[2] for row in run["seen"].values() if "swift_safe_media.engine.zygote" in row[2]]
    assert not left_behind(run["seen"])

    registry = output_dir / "safe_media" / "quarantine.jsonl"
    recorded = {entry["path"] for entry in quarantine.entries(registry)}
    assert {str(datasets["bad"][kind].resolve()) for kind in ("hanging", "slow")} <= recorded, recorded
    summary = json.loads((output_dir / "safe_media" / "safe_media_summary.json").read_text())
    assert summary["step"] == STEPS and summary["ok"] > 0 and summary["timeout"] >= 1, summary
    assert f"swift_safe_media summary at step {STEPS}: " in output


@pytest.mark.timeout(1200)
def test_protected_lerobot_train_06_with_the_pyav_backend_and_the_users_spawn(datasets, tmp_path):
    """Every camera through PyAV; the start method the user names (spawn) is kept."""
    run = run_train(train_command(datasets["hostile"], tmp_path / "outputs", "--dataset.video_backend=pyav",
                                  "--dataloader_multiprocessing_context=spawn", "--safe_media=true",
                                  f"--safe_media_timeout={TIMEOUT_S}"), bound=RUN_BOUND_S)
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert f"step:{STEPS} " in output and "End of training" in output, output[-4000:]
    assert_every_bad_file_named(output, datasets["bad"])
    started = workers(run)
    assert len(started["spawned"]) >= 4 and not started["forked"], started
    assert "start method" not in output
    assert not left_behind(run["seen"])


STOCK_BOUND_S = 150


@pytest.mark.timeout(400)
def test_stock_lerobot_train_06_hangs_or_crashes_on_the_same_dataset(datasets, tmp_path):
    """The before picture: LeRobot 0.6.1 alone (spawned workers, its default) never
    finishes its steps on the same data: it hangs, or the first cut file it meets ends
    the run (PyAV's error names a cut depth file; the FIFO and the slow file are named
    by nothing)."""
    run = run_train(train_command(datasets["hostile"], tmp_path / "outputs"), bound=STOCK_BOUND_S,
                    env={"SWIFT_SAFE_MEDIA": "0"})
    output = run["output"]
    assert "Start offline training" in output, output[-4000:]
    assert "End of training" not in output and f"step:{STEPS} " not in output
    assert run["returncode"] != 0, output[-4000:]  # None: still hanging when killed
    assert not any(str(datasets["bad"][kind]) in output for kind in ("hanging", "slow")), output[-4000:]
    assert workers(run)["spawned"], "stock LeRobot 0.6.1 spawns its workers"


@pytest.mark.serial  # its kill plan times kills against decodes in flight: alone, not beside another file
@pytest.mark.timeout(1200)
def test_protected_lerobot_train_06_under_machine_faults_loses_no_sample(datasets, tmp_path):
    """Issue 35: SIGKILLs of a DataLoader worker mid-decode, of sandboxes mid-decode, of the
    shared zygote and of the warm forkserver during a run over the clean dataset: every step and
    eval runs, the worker is replaced and its samples sent again, no sample is substituted,
    nothing is quarantined, nothing is left running. (Before, the forkserver's kill ended the
    run: its workers, starting zygotes of their own, read as dead at torch's 5 s status check.)"""
    from .fault_killer import Killer

    output_dir = tmp_path / "outputs"
    # The worker first: at the first decode every worker holds tasks the run must wait for. Hit
    # later, it may have handed in all its epoch's tasks (nothing to replace it for: the epoch's
    # end shuts the workers down), as happened on CI's faster machine. Three times the steps:
    # decodes to kill against for as long as the plan takes (the run stalls 5 s, torch's status
    # check, before the worker is found dead), on a fast machine too.
    killer = Killer(str(output_dir), ("worker", "sandbox", "zygote", "forkserver", "sandbox"), gap=2.0)
    killer.start()
    try:
        run = run_train(train_command(datasets["clean"], output_dir, "--safe_media=true", "--safe_media_timeout=60",
                                      steps=FAULT_STEPS), bound=RUN_BOUND_S)
    finally:
        killer.done.set()
        killer.join(10)
    output = run["output"]
    (tmp_path / "train.log").write_text(output)
    print(f"lerobot-train under kills {killer.killed}: {output.count('trying again in a fresh sandbox')} retried")
    assert run["returncode"] == 0, output[-4000:]
    assert f"step:{FAULT_STEPS} " in output and "End of training" in output, output[-4000:]
    assert killer.killed[:4] == ["worker", "sandbox", "zygote", "forkserver"], (killer.killed, output[-3000:])
    assert output.count("a machine fault, not the data's; replaced by pid") == 1, output[-4000:]
    assert "substituted" not in output and "no substitute" not in output, output[-4000:]
    assert quarantine.entries(output_dir / "safe_media" / "quarantine.jsonl") == []
    assert not left_behind(run["seen"])
