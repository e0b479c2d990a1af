"""LLaMA-Factory's preprocessing map processes (``preprocessing_num_workers: 2``) start from
the warm forkserver under protection (swift_safe_media/hosts/llamafactory/map.py),
in the real ``llamafactory-cli train``: no copy of the trainer is forked for the map, the
bad rows are dropped and named as before, and the processed dataset (saved with
``tokenized_path``) is the one the stock forked pool makes."""

from __future__ import annotations

import json
import subprocess

import pytest

from swift_safe_media.process import FORKSERVER_NAME

from . import llamafactory_scenario as scenario
from .proc_table import forkservers, trainer_copies
from .test_lerobot_train import left_behind
from .test_llamafactory_train import CLI, REPO, TIMEOUT_S, VENV, bad_files, built, steps_done, train  # noqa: F401

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{VENV} is missing: `make test` builds it")

WARM = "swift_safe_media: LLaMA-Factory's preprocessing map processes use the 'forkserver' start method"


def forked_trainers(run) -> list[str]:
    """Copies of the trainer forked by its own code that lived a while (proc_table)."""
    return trainer_copies(run["seen"], str(CLI), run["sightings"])


def forkserver_children(run) -> list[str]:
    servers = forkservers(run["seen"])
    return [row.command for row in run["seen"].values() if row.parent in servers]


def protected_map_run(built, tmp_path, name: str, env=None) -> dict:
    saved = tmp_path / f"{name}_tokenized"
    run = train(built, tmp_path / name, env=env, extra={
        "safe_media": True, "safe_media_timeout": TIMEOUT_S, "preprocessing_num_workers": 2,
        "tokenized_path": str(saved)})
    output = run["output"]
    assert run["returncode"] == 0, output[-4000:]
    assert steps_done(output) == int(built["good_rows"]), output[-4000:]
    for path in bad_files(built).values():  # dropped and named as with one process
        assert f"swift_safe_media: dropped 1 row from the dataset: {path}: " in output, (path, output[-4000:])
    assert not left_behind(run["seen"])
    run["saved"] = str(saved)
    return run


def rows_of(saved: str) -> list:
    done = subprocess.run([str(VENV / "bin" / "python"), "-c",
                           "import datasets, json, sys; d = datasets.load_from_disk(sys.argv[1])['train'];"
                           "print(json.dumps(d.to_list()))", saved],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**scenario.OFFLINE, "SWIFT_SAFE_MEDIA": "0", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.timeout(1500)
def test_map_processes_start_from_the_warm_forkserver_and_make_stocks_dataset(built, tmp_path):
    warm = protected_map_run(built, tmp_path, "warm")
    assert WARM in warm["output"], warm["output"][-4000:]
    assert not forked_trainers(warm), forked_trainers(warm)
    # The YAML's `safe_media: true`, read as LLaMA-Factory began importing: the warm forkserver
    # is a fork of the trainer from then (it shares its torch), named so.
    assert {warm["seen"][pid].name for pid in forkservers(warm["seen"])} == {FORKSERVER_NAME}
    # The zygote, the map's two processes and its queue's manager, two DataLoader workers.
    assert len(forkserver_children(warm)) >= 6, forkserver_children(warm)

    # The stock pool, as a named start method keeps it: its processes are forks of the trainer.
    stock = protected_map_run(built, tmp_path, "stock", env={"SWIFT_SAFE_MEDIA_MP_CONTEXT": "fork"})
    assert WARM not in stock["output"] and "map processes fork from the trainer" not in stock["output"]
    assert len(forked_trainers(stock)) >= 2, stock["seen"]

    rows = rows_of(warm["saved"])
    assert len(rows) == int(built["good_rows"]) and rows == rows_of(stock["saved"])

    # The run summary counts every decode of either pool's processes: a pool ends its workers
    # with SIGTERM, which runs no exit hook (before, the forked ones' last second was lost).
    counted = [{key: value for key, value in json.loads(
        (tmp_path / name / "safe_media" / "safe_media_summary.json").read_text()).items()
        if key in ("decodes", "ok", "timeout", "error", "crash")} for name in ("warm", "stock")]
    assert counted[0] == counted[1] and counted[0]["timeout"] + counted[0]["error"] == len(bad_files(built)), counted
    for name in ("warm", "stock"):
        assert not list((tmp_path / name).rglob("pending-*")), name


DATASETS_5_2 = VENV / "test-extras" / "datasets-5.2.0"


@pytest.mark.timeout(900)
@pytest.mark.skipif(not DATASETS_5_2.exists(), reason=f"{DATASETS_5_2} is missing: `make test` puts it there")
def test_map_of_datasets_5_2_starts_from_the_warm_forkserver_too(built, tmp_path):
    """datasets 4.8 on call multiprocess's Pool as ``mp.Pool``, not by the name 4.0-4.7
    copied into arrow_dataset (issue 44): the map is protected all the same, nothing forks
    the trainer, and no target is named as moved (py_utils' Manager is absent by design)."""
    run = protected_map_run(built, tmp_path, "datasets52", env={"PYTHONPATH": str(DATASETS_5_2)})
    output = run["output"]
    assert "datasets 5.2.0" in subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import datasets; print('datasets', datasets.__version__)"],
        env={"PYTHONPATH": str(DATASETS_5_2), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True).stdout
    assert WARM in output, output[-4000:]
    assert not forked_trainers(run), forked_trainers(run)
    assert "is missing" not in output and "no patch target covers" not in output, output[-4000:]
