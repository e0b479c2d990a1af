"""Machine faults during a real `swift sft` (ms-swift, CPU, a tiny random Qwen2.5-Omni, two
DataLoader workers from the warm forkserver, the rank's shared zygote), over valid clips
only, while the test SIGKILLs its sandboxes mid-decode, its shared zygote, a DataLoader
worker mid-decode and its warm forkserver: every step finishes, no sample is skipped or
substituted (the killed worker is replaced and its samples sent again), nothing is
quarantined, the summary counts the machine faults, and nothing is left running."""

import pytest

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

from . import swift_scenario as scenario  # noqa: E402
from . import tiny_models  # noqa: E402
from .conftest import wait_until_dead  # noqa: E402
from .fault_killer import Killer  # noqa: E402

CLIPS = 3
COPIES = 4
ROWS = COPIES * CLIPS
RUN_TIMEOUT = 420
# What the killer hits, in order, GAP s apart, each while a sandbox decodes. The decodes of
# this run bunch in its first seconds (the workers prefetch), so a fast machine may end the
# run before the plan does: the first MUST_HIT kills must land, the rest as time allows.
# A worker killed after the forkserver would be one the new forkserver started for a
# replacement, if any: the old ones are orphans, no longer the run's descendants.
PLAN = ("sandbox", "zygote", "worker", "forkserver", "sandbox", "worker", "sandbox")
MUST_HIT = 4
GAP = 0.3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny model and clips that take a while to decode (720p, 6 s, with audio)."""
    folder = tmp_path_factory.mktemp("swift_faults")
    clips = {}
    for index in range(CLIPS):
        path = folder / f"valid_{index}.mp4"
        scenario._ffmpeg(*scenario._av_source(6, "1280x720"), "-c:v", "libx264", "-preset", "ultrafast",
                         "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(path))
        clips[path.name] = str(path)
    rows = {f"{name}#{copy}": path for copy in range(COPIES) for name, path in clips.items()}
    return {"model": tiny_models.build(str(folder / "tiny_qwen2_5_omni")),
            "dataset": scenario.build_dataset(folder, rows, "valid.jsonl")}


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_kills_of_sandboxes_the_shared_zygote_and_the_forkserver_cost_no_sample(built, tmp_path):
    output_dir = str(tmp_path / "out")
    args = scenario.sft_args(built, output_dir, dataset=built["dataset"]) + [
        "--safe_media", "true", "--safe_media_timeout", "60"]
    killer = Killer(output_dir, PLAN, gap=GAP)
    killer.start()
    try:
        code, elapsed, log = scenario.run_sft(args, timeout=RUN_TIMEOUT, log_path=str(tmp_path / "sft.log"))
    finally:
        killer.done.set()
        killer.join(10)
    retried = log.count("trying again in a fresh sandbox")
    print(f"swift sft under kills {killer.killed}: {elapsed:.1f} s, {retried} decodes retried")
    assert code == 0, log[-4000:]
    assert scenario.steps(log) == (ROWS, ROWS), log[-4000:]
    assert killer.killed[:MUST_HIT] == list(PLAN[:MUST_HIT]), (killer.killed, log[-3000:])
    # Each worker killed was replaced, its outstanding samples sent to the new one.
    assert log.count("a machine fault, not the data's; replaced by pid") == killer.killed.count("worker"), log[-4000:]
    assert scenario.skipped(log) == {}, scenario.skipped(log)  # every sample decoded, none substituted
    folder = scenario.run_folder(output_dir)
    assert scenario.registry_entries(folder / "quarantine.jsonl") == []
    last = scenario.summaries(log)[-1]
    assert last["samples"] == 0 and last["quarantined"] == 0 and last["errors"] == 0, last
    assert wait_until_dead(killer.seen, within=10) == {}
