"""A real `swift sft` (ms-swift, CPU, a tiny random Qwen2.5-Omni built here, two DataLoader
workers) over clips of which some hang ms-swift's stock loaders for real.

Stock, the run stalls and is killed by the test; with `--safe_media true` (or the same in
a YAML config, or SWIFT_SAFE_MEDIA=1) it finishes its epoch, and the log names each bad
clip. The stock run goes in a subprocess killed after a bound, never in this process."""

import os

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


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_with_the_flag_the_run_finishes_and_names_each_bad_clip(built, tmp_path):
    args = scenario.sft_args(built, str(tmp_path / "out")) + ["--safe_media", "true", "--safe_media_timeout", "5"]
    code, elapsed, log = scenario.run_sft(args, timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"protected swift sft: {elapsed:.1f} s")
    # LazyLLMDataset resamples a failed row: the epoch keeps one step per row.
    assert_protected_run(code, log, planned=ROWS)
    assert "dataloader_multiprocessing_context=spawn" in log  # workers are spawned, not forked


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_without_the_flag_the_run_is_stuck(built, tmp_path):
    stall = 90  # s without a step once training runs; a stock step over good clips takes a few seconds
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
    config = scenario.yaml_config(args, str(tmp_path / "sft.yaml"),
                                  extra={"safe_media": "true", "safe_media_timeout": "5"})
    code, elapsed, log = scenario.run_sft([config], timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    print(f"protected swift sft from YAML: {elapsed:.1f} s")
    assert_protected_run(code, log, planned=ROWS)


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


def test_scenario_media_is_what_it_claims(built):
    assert os.path.getsize(built["edit_list_cut.mp4"]) > 0
    import stat
    assert stat.S_ISFIFO(os.stat(built["fifo.wav"]).st_mode)
    assert open(built["playlist.mp4"]).read().startswith("#EXTM3U")
