"""Megatron-SWIFT (``megatron sft`` / ``pt`` / ``rlhf``) with ``--safe_media true``, on the
CPU, up to the first step that needs a GPU (building the model).

Real: megatron-core 0.16.1 and mcore-bridge 1.6.5 (requirements-test.txt), ms-swift's
``megatron`` CLI, its argument classes, ``MegatronSft``'s dataset, the trainer's own
DataLoader builders (``_prepare_dataloader`` / ``_create_dataloader``,
``build_streaming_dataloader``) and its ``call_event``. Not run: NVIDIA Transformer Engine
(its PyTorch extension builds only with CUDA's compiler; ``tests/megatron_shim.py`` lets
its name import), CUDA's and torch.distributed's set-up for Megatron
(``--skip_megatron_init true``, Megatron-SWIFT's own switch; one process on gloo stands in
for the data-parallel group), the model, the forward and backward passes."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from . import megatron_shim
from . import swift_scenario as scenario
from .fresh import ROOT, clean_environment

# Found, not imported: mcore-bridge imports Transformer Engine as it loads (see the shim).
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mcore_bridge") is None:
    pytest.skip("megatron-core and mcore-bridge are in requirements-test.txt", allow_module_level=True)

MEGATRON = os.path.join(os.path.dirname(sys.executable), "megatron")
GOOD_ROWS = scenario.GOOD_CLIPS + 1  # the edit-list clip is good data
ROWS = GOOD_ROWS + len(scenario.REFUSED)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron")
    return {**scenario.build(folder), "shim": megatron_shim.write(str(folder / "te_shim"))}


def environment(built, extra=None, warm_start=False):
    return clean_environment({**scenario.RUN_ENV, **(extra or {})}, pythonpath=[built["shim"], ROOT],
                             warm_start=warm_start)


def base_args(built, out):
    return ["--model", built["model"], "--model_type", "qwen2_5_omni", "--dataset", built["dataset"],
            "--output_dir", str(out), "--skip_megatron_init", "true", "--torch_dtype", "float32",
            "--micro_batch_size", "1", "--global_batch_size", "1", "--max_length", "4096",
            "--split_dataset_ratio", "0"]


def program(built, mode, argv, env=None, warm_start=False, timeout=300):
    done = subprocess.run([sys.executable, "-m", "tests.programs.megatron_swift", mode, *argv], cwd=ROOT,
                          env=environment(built, env, warm_start), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


@pytest.mark.timeout(300)
def test_flags_parse_for_sft_pt_and_rlhf_and_workers_get_the_protected_start_method(built, tmp_path):
    results, _ = program(built, "parse", base_args(built, tmp_path / "out") + [
        "--safe_media", "true", "--safe_media_timeout", "9", "--dataloader_num_workers", "2"])
    assert [result["class"] for result in results] == [
        "MegatronSftArguments", "MegatronPretrainArguments", "MegatronRLHFArguments"]
    for result in results:
        assert result["remaining"] == [] and result["enabled"]
        assert result["dataloader_multiprocessing_context"] == "forkserver"
        assert result["dataloader_persistent_workers"] is True  # Megatron-SWIFT's default, kept
        assert result["quarantine"] == f"{tmp_path}/out/safe_media/quarantine.jsonl"
    # SWIFT_SAFE_MEDIA=1 alone; a start method the user names is kept.
    results, _ = program(built, "parse", base_args(built, tmp_path / "env") + [
        "--dataloader_multiprocessing_context", "spawn"], env={"SWIFT_SAFE_MEDIA": "1"})
    for result in results:
        assert result["enabled"] and result["dataloader_multiprocessing_context"] == "spawn"
        assert result["quarantine"] == f"{tmp_path}/env/safe_media/quarantine.jsonl"


@pytest.mark.timeout(300)
def test_megatron_sft_cli_from_a_yaml_config_runs_protected_up_to_the_model(built, tmp_path):
    """The real `megatron sft CONFIG.yaml`: flags from the YAML file, the pipeline's dataset
    (it encodes one row as it starts: that decode is counted), then the model, where CPU
    CI stops; the summary of a run that died is written all the same."""
    out = tmp_path / "out"
    config = scenario.yaml_config(base_args(built, out), str(tmp_path / "sft.yaml"),
                                  extra={"safe_media": "true", "safe_media_timeout": "7"})
    done = subprocess.run([MEGATRON, "sft", config], cwd=str(tmp_path), env=environment(built, warm_start=True),
                          capture_output=True, text=True, timeout=280)
    log = done.stdout + done.stderr
    assert done.returncode != 0 and "prepare_model" in log, log[-4000:]  # where the GPU step begins
    saved = json.loads((out / "args.json").read_text())
    assert saved["dataloader_multiprocessing_context"] == "forkserver"
    assert "safe_media" not in saved and "safe_media_timeout" not in saved
    summary = json.loads((out / "safe_media" / "safe_media_summary.json").read_text())
    assert summary["decodes"] >= 1 and summary["ok"] >= 1


@pytest.mark.timeout(400)
def test_megatron_dataloaders_decode_in_sandboxes_skip_bad_clips_and_report(built, tmp_path):
    out = tmp_path / "out"
    results, log = program(built, "loaders", base_args(built, out) + [
        "--safe_media", "true", "--safe_media_timeout", "5", "--dataloader_num_workers", "2"], warm_start=True)
    [found] = results
    for name in ("map_style", "streaming"):  # LazyLLMDataset resamples a failed row: one batch per row
        assert found["loaders"][name] == {"start_method": "forkserver", "batches": ROWS, "workers": 2}, found
    assert found["quarantine"] == f"{out}/safe_media/quarantine.jsonl"
    skipped = scenario.skipped(log)
    assert set(skipped) == set(scenario.REFUSED), skipped
    entries = scenario.registry_entries(out / "safe_media" / "quarantine.jsonl")
    assert sorted(os.path.basename(entry["path"]) for entry in entries) == sorted(scenario.REFUSED)
    summary = json.loads((out / "safe_media" / "safe_media_summary.json").read_text())
    assert summary["step"] == found["steps"] == 2 * ROWS and summary["steps_by_rank"] == {"0": 2 * ROWS}
    assert summary["ok"] > 0 and summary["error"] + summary["quarantined"] >= len(scenario.REFUSED)
    lines = scenario.summaries(log)
    assert [line["step"] for line in lines][:2 * ROWS] == list(range(1, 2 * ROWS + 1)), lines
