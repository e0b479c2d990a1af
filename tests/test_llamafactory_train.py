"""The real ``llamafactory-cli train``, end to end, in LLaMA-Factory 0.9.5's own environment.

LLaMA-Factory pins transformers <= 5.6 and datasets <= 4.0: it runs from
``.venv-llamafactory/`` (built by ``make test`` from requirements-llamafactory.txt, our
package installed there as a user installs it). A tiny random Qwen2.5-Omni, made at test
time, is LoRA-tuned with the ``qwen2_omni`` template on the CPU over video and audio rows
among which a FIFO (stock ``torchaudio.load`` blocks on it for ever), an HLS playlist
posing as a video and a cut file (tests/llamafactory_scenario.py). With ``safe_media:
true`` in the YAML every step runs and each bad file is named; stock hangs on the same
data. A second scenario changes files after preprocessing (``tokenized_path``), so the
collator's decode fails in the DataLoader workers: the samples are substituted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from swift_safe_media.records import quarantine

from . import llamafactory_scenario as scenario
from .proc_table import trainer_copies
from .test_lerobot_train import left_behind, run_train

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-llamafactory"
CLI = VENV / "bin" / "llamafactory-cli"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{VENV} is missing: `make test` builds it "
                                                         "(LLaMA-Factory 0.9.5 with its own pins)")

TIMEOUT_S = 5
RUN_BOUND_S = 600  # a run takes about 25 s on a busy 2-core machine
STOCK_BOUND_S = 60  # stock blocks on the FIFO during preprocessing, seconds after it starts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamafactory_train")
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "tests.llamafactory_scenario", str(root)], cwd=REPO,
                          env={**os.environ, **scenario.OFFLINE, "SWIFT_SAFE_MEDIA": "0"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(built, output_dir: Path, *overrides: str, bound=RUN_BOUND_S, env=None, **settings) -> dict:
    config = output_dir.parent / f"{output_dir.name}.yaml"
    config.write_text(scenario.yaml_text(built["model"], built["dataset_dir"], str(output_dir), **settings))
    return run_train([str(CLI), "train", str(config), *overrides], bound=bound, env={**scenario.OFFLINE, **(env or {})})


def steps_done(output: str) -> int:
    total = re.search(r"Total optimization steps = (\d+)", output)
    return int(total.group(1)) if total and "Training completed" in output else -1


def bad_files(built) -> dict[str, str]:
    return {name: built[f"media:{name}"] for name in scenario.BAD}


@pytest.mark.timeout(900)
def test_protected_llamafactory_train_drops_every_bad_row_and_names_it(built, tmp_path):
    output_dir = tmp_path / "out"
    run = train(built, output_dir, extra={"safe_media": True, "safe_media_timeout": TIMEOUT_S})
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    # One step per good row (batch size 1): the three bad rows are gone, every other trained.
    assert steps_done(output) == int(built["good_rows"]), output[-4000:]
    for name, path in bad_files(built).items():
        assert f"swift_safe_media: dropped 1 row from the dataset: {path}: " in output, (name, output[-4000:])
    # Read in a confined sandbox per call, which reads only regular files: named before it starts.
    assert f"dropped 1 row from the dataset: {built['media:fifo.wav']}: not a regular file (FIFO)" in output
    # The workers come from the warm forkserver (the Omni collator's model travels as a meta
    # copy), not from forking the trainer; nothing of the run outlives it.
    assert "swift_safe_media: DataLoader workers use the 'forkserver' start method" in output, output[-4000:]
    forked = trainer_copies(run["seen"], str(CLI), run["sightings"])
    assert not forked, forked
    assert not left_behind(run["seen"])

    registry = output_dir / "safe_media" / "quarantine.jsonl"
    assert {entry["path"] for entry in quarantine.entries(registry)} == set(bad_files(built).values())
    summary = json.loads((output_dir / "safe_media" / "safe_media_summary.json").read_text())
    assert summary["step"] == int(built["good_rows"]) and summary["timeout"] == 0 and summary["error"] == 3, summary
    assert summary["ok"] > 0 and summary["processes"] >= 2, summary  # the trainer and its DataLoader workers


@pytest.mark.timeout(400)
def test_stock_llamafactory_train_hangs_or_crashes_on_the_same_dataset(built, tmp_path):
    """The before picture: the same YAML without protection never trains."""
    run = train(built, tmp_path / "out", bound=STOCK_BOUND_S, env={"SWIFT_SAFE_MEDIA": "0"})
    output = run["output"]
    assert f"Loading dataset {scenario.DATASET}.json" in output, output[-4000:]  # it got as far as the data
    assert "Training completed" not in output and "Total optimization steps" not in output, output[-4000:]
    assert run["returncode"] != 0  # None: it hung, and was killed at the bound


@pytest.mark.timeout(900)
def test_files_that_fail_at_collation_are_substituted_in_the_workers(built, tmp_path):
    """Preprocessed while good (``tokenized_path``), then one file becomes a FIFO and one is
    cut: the collator's decodes in the DataLoader workers fail, and each sample is
    replaced, so every step still runs. ``safe_media`` is given on the command line here, and the
    training run goes through LLaMA-Factory's torchrun re-launch."""
    media = tmp_path / "media"
    media.mkdir()
    good = [shutil.copy(built[f"media:{name}"], media) for name in ("good_0.mp4", "good_1.mp4", "good_2.mp4",
                                                                     "tone_0.wav")]
    scenario.build_dataset(Path(built["dataset_dir"]), good, "late")
    tokenized = tmp_path / "tokenized"
    settings = {"dataset": "late", "extra": {"tokenized_path": str(tokenized)}}
    first = train(built, tmp_path / "preprocess", "safe_media=true", "max_steps=1", **settings)
    assert first["returncode"] == 0 and (tokenized / "dataset_dict.json").exists(), first["output"][-4000:]

    fifo, cut = Path(good[1]), Path(good[2])
    fifo.unlink()
    os.mkfifo(fifo)
    cut.write_bytes(Path(built["media:good_0.mp4"]).read_bytes()[:20000])
    # Under torchrun, as a multi-GPU run re-launches itself (one rank, gloo, on the CPU): the
    # settings given after the YAML reach the rank.
    torchrun = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1", "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    run = train(built, tmp_path / "out", "safe_media=true", f"safe_media_timeout={TIMEOUT_S}", env=torchrun,
                dataset="late", extra={"tokenized_path": str(tokenized), "ddp_backend": "gloo"})
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert "distributed training: True" in output, output[-4000:]
    assert steps_done(output) == len(good), output[-4000:]
    for path in (fifo, cut):
        assert re.search(rf"swift_safe_media: .*{re.escape(str(path))}: .*substituted by", output), (path, output[-4000:])
    # A video: read in a confined sandbox per call, which reads only regular files.
    assert f"{fifo}: not a regular file (FIFO)" in output, output[-4000:]
    assert not left_behind(run["seen"])


@pytest.mark.timeout(900)
def test_an_exploited_pyav_inside_a_real_run_reaches_nothing(built, tmp_path):
    """Issue 42: LLaMA-Factory's reader opens the file by name with PyAV; with PyAV's opener
    taken over (tests/exploit_standin.py) every attack of the issue runs in the confined
    sandbox of that one call: a loopback listener, /bin/sh, a write, a token under $HOME,
    /etc/shadow, the trainer's environment. Each is refused, the row is dropped and named,
    the others train, and the token's value never reaches the log."""
    import socket

    from . import exploit_standin

    exploit = tmp_path / "exploit.mp4"
    shutil.copy(built["media:good_0.mp4"], exploit)
    scenario.build_dataset(Path(built["dataset_dir"]), [built["media:good_1.mp4"], str(exploit),
                                                        built["media:tone_0.wav"]], "exploit")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    home, folder = tmp_path / "home", tmp_path / "target"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_SECRET_TOKEN_FILE")
    folder.mkdir()
    standin = exploit_standin.write_pyav_standin(str(tmp_path / "standin"))
    env = {"PYTHONPATH": os.pathsep.join([standin, str(REPO)]), "HF_TOKEN": "hf_SECRET_ENV",
           "EXPLOIT_PORT": str(listener.getsockname()[1]), "EXPLOIT_FOLDER": str(folder),
           "EXPLOIT_HOME": str(home), "EXPLOIT_TRAINER": "1",
           "SWIFT_SAFE_MEDIA_SANDBOX_ENV": "EXPLOIT_PORT,EXPLOIT_FOLDER,EXPLOIT_HOME,EXPLOIT_TRAINER"}
    try:
        run = train(built, tmp_path / "out", env=env, dataset="exploit",
                    extra={"safe_media": True, "safe_media_timeout": 30})
        connected = True
        try:
            listener.accept()[0].close()
        except OSError:
            connected = False
    finally:
        listener.close()
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert steps_done(output) == 2, output[-4000:]
    [dropped] = [line for line in output.splitlines()
                 if f"dropped 1 row from the dataset: {exploit}: " in line and "EXPLOIT RAN" in line]
    assert "EXPLOIT RAN RRRRRRR:" in dropped or dropped.rstrip().endswith("EXPLOIT RAN RRRRRRR"), dropped
    assert not connected and os.listdir(folder) == []
    assert "hf_SECRET" not in output
