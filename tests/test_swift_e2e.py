"""A real `swift sft` (ms-swift, CPU, a tiny random Qwen2.5-Omni built here, two DataLoader
workers) over clips of which some hang ms-swift's stock loaders for real.

Stock, the run stalls and is killed by the test; with `--safe_media true` (or the same in
a YAML config, or SWIFT_SAFE_MEDIA=1) it finishes its epoch, the log names each bad clip,
the quarantine registry lists them and the run summary counts them. With too many bad
clips the error budget stops the run; under torchrun the ranks stay in step. The stock
run goes in a subprocess killed after a bound, never in this process."""

import json
import os
import re
import socket

import pytest

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

from . import swift_scenario as scenario  # noqa: E402

GOOD_ROWS = scenario.GOOD_CLIPS + 1          # the edit-list clip is good data
ROWS = GOOD_ROWS + len(scenario.REFUSED)
RUN_TIMEOUT = 420                            # a protected run takes 1-3 min on 2 busy cores


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scenario.build(tmp_path_factory.mktemp("swift_e2e"))


def assert_protected_run(code, log, *, planned):
    assert code == 0, log[-4000:]
    assert scenario.steps(log) == (planned, planned), log[-4000:]
    skipped = scenario.skipped(log)
    assert set(skipped) == set(scenario.REFUSED), skipped
    assert "playlist" in skipped["playlist.mp4"] and "FIFO" in skipped["fifo.wav"]


def assert_registry_and_summary(folder, log, *, steps, refused=scenario.REFUSED):
    """The registry in ``folder`` lists the refused clips; the summary next to it, and the
    last summary line of the log, count them, and the decodes of the good ones."""
    entries = scenario.registry_entries(folder / "quarantine.jsonl")
    assert sorted(os.path.basename(entry["path"]) for entry in entries) == sorted(refused), entries
    written = json.loads((folder / "safe_media_summary.json").read_text())
    assert written["step"] == steps and written["steps_by_rank"] == {"0": steps}
    assert written["ok"] > 0 and written["error"] + written["timeout"] + written["crash"] >= len(refused)
    assert written["quarantined"] > 0  # ms-swift's own retries of a failed row are refused at once
    assert written["decodes"] == sum(written[kind] for kind in ("ok", "error", "timeout", "crash", "quarantined"))
    lines = scenario.summaries(log)
    assert [line["step"] for line in lines] == list(range(1, steps + 1)), lines  # logging_steps 1, and the end
    assert (lines[-1]["decodes"], lines[-1]["ok"], lines[-1]["errors"]) == \
        (written["decodes"], written["ok"], written["error"]), (lines[-1], written)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_with_the_flag_the_run_finishes_names_quarantines_and_counts_each_bad_clip(built, tmp_path):
    """Also: the registry's default place under the run's versioned output_dir, the run
    summary every logging step and at the end, and the stall flags accepted."""
    args = scenario.sft_args(built, str(tmp_path / "out")) + [
        "--safe_media", "true", "--safe_media_timeout", "5",
        "--safe_media_stall_timeout", "300", "--safe_media_stall_action", "log"]
    code, elapsed, log = scenario.run_sft(args, timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"),
                                          env={"SWIFT_SAFE_MEDIA_LOG_LEVEL": "DEBUG"})
    print(f"protected swift sft: {elapsed:.1f} s")
    # LazyLLMDataset resamples a failed row: the epoch keeps one step per row.
    assert_protected_run(code, log, planned=ROWS)
    assert "dataloader_multiprocessing_context=forkserver" in log  # workers come from the warm forkserver
    # Forked from the training process as ms-swift began importing, while it had one thread;
    # not in the `swift` command, which runs the training script in a child.
    forks = re.findall(r"template of the warm forkserver forked \(pid \d+, the trainer had (\d+) thread\)", log)
    assert forks == ["1"], log[-4000:]
    folder = scenario.run_folder(str(tmp_path / "out"))
    assert_registry_and_summary(folder, log, steps=ROWS)
    assert os.listdir(folder / "swift_safe_media_stats")  # the stats sit next to the registry


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_without_the_flag_the_run_is_stuck(built, tmp_path):
    stall = 45  # s without a step once training runs; a stock step over good clips takes a few seconds
    code, elapsed, log = scenario.run_sft(scenario.sft_args(built, str(tmp_path / "out")), timeout=RUN_TIMEOUT,
                                          stall_timeout=stall, log_path=str(tmp_path / "sft.log"))
    print(f"stock swift sft: killed after {elapsed:.1f} s, {scenario.steps(log)[0]} of {ROWS} steps done, "
          f"no step in the last {stall} s")
    assert code is None, "the stock run was expected to hang on the bad clips"
    assert scenario.TRAIN_STARTED in log and scenario.steps(log)[0] < ROWS
    assert "swift_safe_media: skipped" not in log


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_from_a_yaml_config(built, tmp_path):
    args = scenario.sft_args(built, str(tmp_path / "out"))
    registry = tmp_path / "registry" / "quarantine.jsonl"
    config = scenario.yaml_config(args, str(tmp_path / "sft.yaml"),
                                  extra={"safe_media": "true", "safe_media_timeout": "5",
                                         "safe_media_quarantine": str(registry), "safe_media_stall_timeout": "300",
                                         "safe_media_stall_action": "abort"})
    code, elapsed, log = scenario.run_sft([config], timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"protected swift sft from YAML: {elapsed:.1f} s")
    assert_protected_run(code, log, planned=ROWS)
    assert_registry_and_summary(registry.parent, log, steps=ROWS)  # the given registry, not the default
    assert not (scenario.run_folder(str(tmp_path / "out"))).exists()


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_with_SWIFT_SAFE_MEDIA_1_and_pre_tokenised_rows_are_dropped(built, tmp_path):
    """No flag: the environment turns protection on in the CLI's child. Without lazy
    tokenisation ms-swift's `map` drops the failed rows, with a warning. (Decoding runs
    in the main process here, so no workers: the flag test covers them.)"""
    args = scenario.sft_args(built, str(tmp_path / "out"), lazy=False, workers=0)
    code, elapsed, log = scenario.run_sft(args, env={"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "5"},
                                          timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"protected swift sft via SWIFT_SAFE_MEDIA=1, pre-tokenised: {elapsed:.1f} s")
    assert_protected_run(code, log, planned=GOOD_ROWS)
    assert "the data will be deleted" in log
    # The registry's default needs no flag either.
    entries = scenario.registry_entries(scenario.run_folder(str(tmp_path / "out")) / "quarantine.jsonl")
    assert sorted(os.path.basename(entry["path"]) for entry in entries) == sorted(scenario.REFUSED)
    # Counted by the `datasets.map` process that pre-tokenised them (its pool is killed, not ended).
    assert scenario.summaries(log)[-1]["errors"] == len(scenario.REFUSED)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_the_error_budget_stops_a_run_of_substitutes_from_a_worker(built, tmp_path):
    """One good row among bad ones: each failed row is resampled, so the run would train on
    the good row alone. With a budget of 3 consecutive failures the first DataLoader worker
    to fetch a bad row stops it: ErrorBudgetExceeded crosses ms-swift's resample loop and
    the worker boundary, and `swift sft` exits non-zero, long before its timeout."""
    broken = scenario.build_broken(tmp_path / "media")
    clips = {"good_0.mp4": built["good_0.mp4"], **broken, **{name: built[name] for name in scenario.REFUSED}}
    dataset = scenario.build_dataset(tmp_path, clips, "budget.jsonl")
    # Rows in file order, so the main process's first encode (ms-swift shows row 0) is the good row.
    args = scenario.sft_args(built, str(tmp_path / "out"), dataset=dataset) + [
        "--dataset_shuffle", "false", "--safe_media", "true", "--safe_media_timeout", "5"]
    code, elapsed, log = scenario.run_sft(args, env={"SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "3"},
                                          timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"swift sft over bad clips, error budget 3: stopped after {elapsed:.1f} s")
    assert code not in (0, None), log[-4000:]
    # torch re-raises the worker's exception in the trainer: "<type>: Caught <type> in DataLoader
    # worker process N." Python writes the type and the message separately, and another
    # process's log line may land between them (seen in CI), so each is matched on its own.
    assert "swift_safe_media.records.budget.ErrorBudgetExceeded: " in log, log[-4000:]
    assert "Caught ErrorBudgetExceeded in DataLoader worker process" in log, log[-4000:]
    assert ("ErrorBudgetExceeded: swift_safe_media: 3 consecutive samples failed to decode "
            "(limit 3, SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES)") in log
    assert "Failed to retrieve the dataset" not in log  # not ms-swift's own give-up after 10 tries
    assert scenario.steps(log)[0] < len(clips)
    # Training died before its first step, so the trainer never reported: the summary comes at exit.
    at_exit = re.search(r"swift_safe_media summary: (\d+) decodes, (\d+) ok, .* (\d+) quarantined, (\d+) errors", log)
    assert at_exit, log[-3000:]
    decodes, ok, quarantined, errors = map(int, at_exit.groups())
    assert quarantined + errors >= 3 and ok < decodes, at_exit.group(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_under_torchrun_the_ranks_stay_in_step_around_a_bad_clip(built, tmp_path):
    """The real `NPROC_PER_NODE=2 swift sft` (torchrun, gloo on CPU, a spawned worker per
    rank) over six rows, one of them a bad clip, which only one rank's sampler gets. That
    rank resamples it, so both ranks run 3 steps and the run exits 0. Each rank records
    the step it reached in the run's stats; the clip is named in the log whichever rank
    skips it (ms-swift mutes warnings on other ranks than 0) and quarantined once."""
    clips = {name: built[name] for name in ("good_0.mp4", "good_1.mp4", "good_2.mp4", "good_3.mp4",
                                            "edit_list_cut.mp4", "fifo.wav")}
    dataset = scenario.build_dataset(tmp_path, clips, "ddp.jsonl")
    args = scenario.sft_args(built, str(tmp_path / "out"), workers=1, dataset=dataset) + [
        "--ddp_backend", "gloo", "--safe_media", "true", "--safe_media_timeout", "5"]
    code, elapsed, log = scenario.run_sft(args, env={"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())},
                                          timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"swift sft on 2 ranks: {elapsed:.1f} s")
    assert code == 0, log[-4000:]
    assert "torch.distributed.run --nproc_per_node 2" in log
    assert scenario.steps(log) == (3, 3), log[-4000:]
    assert set(scenario.skipped(log)) == {"fifo.wav"}
    folder = scenario.run_folder(str(tmp_path / "out"))  # one versioned output_dir for both ranks
    [entry] = scenario.registry_entries(folder / "quarantine.jsonl")
    # With seed 42 rank 1's sampler gets the clip: the rank whose warnings ms-swift mutes.
    assert os.path.basename(entry["path"]) == "fifo.wav" and entry["rank"] == 1
    from swift_safe_media.records import summary
    assert summary.collect(str(folder / "swift_safe_media_stats"))["steps_by_rank"] == {"0": 3, "1": 3}


def test_scenario_media_is_what_it_claims(built):
    assert os.path.getsize(built["edit_list_cut.mp4"]) > 0
    import stat
    assert stat.S_ISFIFO(os.stat(built["fifo.wav"]).st_mode)
    assert open(built["playlist.mp4"]).read().startswith("#EXTM3U")
