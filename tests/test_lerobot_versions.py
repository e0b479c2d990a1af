"""One adapter for every LeRobot line, against the real code of each: LeRobot 0.6.1 in its
own environment (``.venv-lerobot-0.6``: Python 3.12, LeRobot 0.6.1's own pins, built by
``make test``), and the packages of LeRobot 0.5.0, 0.5.1 and 0.6.0 run on those pins
(``make test`` puts each release's code beside the venv, without its dependencies).

For each release: the layout the adapter picks from what that LeRobot has, every target
of it patched and restored in either import order, none missing; the frames of every way
of reading it offers, bit-identical to stock (two AV1 cameras and, on 0.6, a depth camera:
torchcodec and PyAV, float and ``return_uint8``, ``MultiLeRobotDataset``,
``StreamingLeRobotDataset``). A sample whose file hangs or is cut, on 0.6.1, is
substituted and named; a stream whose file hangs stops with the file named (stock: for
ever). Every case runs in a fresh interpreter of that environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .fresh import ROOT, clean_environment

REPO = Path(ROOT)
VENV = REPO / ".venv-lerobot-0.6"
PYTHON = VENV / "bin" / "python"
RELEASES = VENV / "lerobot-releases"

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason=f"{VENV} is missing: `make test` builds it "
                                                            "(LeRobot 0.6.1 with its own pins, Python 3.12)")

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
# The layout each release must get, and the targets that layout patches.
LAYOUT_OF = {"0.5.0": "0.4", "0.5.1": "0.5.1", "0.6.0": "0.6.0", "0.6.1": "0.6.1"}
COMMON = ["lerobot.datasets.video_utils.decode_video_frames", "lerobot.datasets.lerobot_dataset.LeRobotDataset.__getitem__",
          "lerobot.datasets.streaming_dataset.StreamingLeRobotDataset._query_videos",
          "lerobot.datasets.streaming_dataset.StreamingLeRobotDataset.make_frame"]
TARGETS = {
    "0.4": [*COMMON, "lerobot.datasets.utils.cycle", "lerobot.datasets.lerobot_dataset.LeRobotDataset._query_videos"],
    "0.5.1": [*COMMON, "lerobot.datasets.utils.cycle", "lerobot.datasets.dataset_reader.DatasetReader._query_videos"],
    "0.6.0": [*COMMON, "lerobot.utils.utils.cycle", "lerobot.datasets.dataset_reader.DatasetReader._query_videos"],
}
TARGETS["0.6.1"] = [*TARGETS["0.6.0"], "lerobot.scripts.lerobot_train._dataloader_worker_kwargs"]
FRONT, WRIST, DEPTH = "observation.images.front", "observation.images.wrist", "observation.images.depth"


def environment(release: str, extra: dict | None = None) -> dict:
    """A case's environment: LeRobot ``release`` (its code before 0.6.1's), no settings of ours."""
    env = clean_environment({**OFFLINE, **(extra or {})})
    if release != "0.6.1":
        env["PYTHONPATH"] = str(RELEASES / release) if release in LAYOUT_OF else release
    else:
        env.pop("PYTHONPATH", None)
    return env


def run(release: str, *args, env=None, bound: float = 300) -> tuple[int | None, dict | None, str]:
    """``python -m ARGS`` (or ``python -c CODE``) in the 0.6 environment with LeRobot
    ``release`` (a release's name, or a folder holding a LeRobot): (exit code, the JSON
    of its last line, stderr); killed with its process group after ``bound``."""
    program = list(map(str, args)) if args[0] == "-c" else ["-m", *map(str, args)]
    process = subprocess.Popen([str(PYTHON), *program], cwd=REPO, env=environment(release, env),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return None, None, stderr
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # workers and sandboxes too
        except ProcessLookupError:
            pass
    lines = stdout.strip().splitlines()
    return process.returncode, (json.loads(lines[-1]) if process.returncode == 0 and lines else None), stderr


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Recorded with LeRobot 0.6.1's API: two AV1 cameras and a depth camera; one video
    file per episode, and (for streaming, which needs it) LeRobot's default of one file."""
    folder = tmp_path_factory.mktemp("lerobot_versions")
    built = {}
    # LeRobot 0.5 reads no depth camera (its torchcodec path cannot seek 12-bit HEVC): an RGB one for it.
    for name, depth, per_episode in (("per_episode", 1, 1), ("one_file", 1, 0), ("rgb", 0, 1)):
        code, result, stderr = run("0.6.1", "tests.lerobot_scenarios", "build", folder / name, 4, 6, 2, "libsvtav1",
                                   depth, per_episode, bound=240)
        assert code == 0, stderr[-3000:]
        built[name] = folder / name
    return built


@pytest.mark.timeout(400)
@pytest.mark.parametrize("release, order", [("0.6.1", "enable_first"), ("0.6.1", "import_first"),
                                            ("0.6.0", "import_first"), ("0.5.1", "enable_first"),
                                            ("0.5.0", "import_first")])
def test_each_release_gets_its_layout_every_target_patched_and_restored(release, order):
    code, steps, stderr = run(release, "tests.programs.adapter_order", "lerobot", order)
    assert code == 0, stderr[-3000:]
    enabled, twice, disabled, again = steps
    assert sorted(enabled["targets"]) == sorted(TARGETS[LAYOUT_OF[release]]), enabled["targets"]
    assert all(enabled["targets"].values()) and not enabled["missing"], enabled
    assert twice == {**enabled, "step": "enabled twice"}
    assert not any(disabled["targets"].values()) and not disabled["is_patched"]
    assert again == {**enabled, "step": "enabled again"}
    assert "leaving it untouched" not in stderr and "could not patch" not in stderr, stderr[-3000:]


WORKER_CONTEXT = """
import dataclasses, json
import swift_safe_media
swift_safe_media.enable(hosts=["lerobot"])
from lerobot.configs.train import TrainPipelineConfig
from lerobot.scripts import lerobot_train

default = {field.name: field.default for field in dataclasses.fields(TrainPipelineConfig)}
cfg = object.__new__(TrainPipelineConfig)  # only what _dataloader_worker_kwargs reads
for name, value in {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": False,
                    "dataloader_multiprocessing_context": default["dataloader_multiprocessing_context"]}.items():
    object.__setattr__(cfg, name, value)
context = lerobot_train._dataloader_worker_kwargs(cfg)["multiprocessing_context"]
print(json.dumps({"default": default["dataloader_multiprocessing_context"], "type": type(context).__name__,
                  "method": context.get_start_method()}))
"""


@pytest.mark.timeout(300)
def test_lerobot_061s_default_start_method_gives_way_to_our_launch():
    """LeRobot 0.6.1's loaders name a start method (spawn, its default): ours takes its place
    as the context object our workers launch by (arguments written by a thread, the first
    sandbox asked for as a worker begins), not as the name "forkserver", which gave CPython's
    launch (a worker's arguments read one worker after another) and no first sandbox."""
    code, found, stderr = run("0.6.1", "-c", WORKER_CONTEXT)
    assert code == 0, stderr[-3000:]
    assert found == {"default": "spawn", "type": "WarmForkServerContext", "method": "forkserver"}, found


UNKNOWN = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
import lerobot.datasets.lerobot_dataset, lerobot.datasets.dataset_reader as reader, lerobot.datasets.video_utils as video
from swift_safe_media.patching import targets as _patching
from swift_safe_media.hosts.lerobot import adapter
print(json.dumps({"is_patched": adapter.is_patched(), "decode": _patching.original_of(video.decode_video_frames) is not None,
                  "getitem": _patching.original_of(lerobot.datasets.lerobot_dataset.LeRobotDataset.__getitem__) is not None}))
"""


@pytest.mark.timeout(300)
def test_a_lerobot_of_no_known_layout_gets_one_warning_and_no_patch(tmp_path):
    """LeRobot 0.6.0's code with ``DatasetReader._query_videos`` renamed, as a release that
    moved it would be: inside the supported versions, but no layout matches. Nothing is
    patched, not even what still matches (the decode function), and one warning says what
    is missing."""
    shutil.copytree(RELEASES / "0.6.0", tmp_path / "moved")
    reader = tmp_path / "moved" / "lerobot" / "datasets" / "dataset_reader.py"
    reader.write_text(reader.read_text().replace("_query_videos(", "_decode_videos("))
    code, state, stderr = run(str(tmp_path / "moved"), "-c", UNKNOWN, env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    assert state == {"is_patched": False, "decode": False, "getitem": False}
    warnings = [line for line in stderr.splitlines() if "leaving it untouched" in line]
    assert len(warnings) == 1 and "lerobot 0.6.0: no known layout" in warnings[0], stderr[-3000:]
    assert "dataset_reader.DatasetReader._query_videos" in warnings[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", ["0.6.1", "0.6.0", "0.5.1", "0.5.0"])
def test_frames_are_bit_identical_to_stock_in_every_way_of_reading(release, datasets):
    root = datasets["rgb" if release.startswith("0.5") else "per_episode"]
    # 0.6.0 reads as 0.6.1 does (the same video_utils and dataset_reader): its default way only.
    args = ("tests.lerobot_scenarios", "all_digests", root, datasets["one_file"], int(release == "0.6.1"))
    code, stock, stderr = run(release, *args, env={"SWIFT_SAFE_MEDIA": "0"})
    assert code == 0 and not stock["patched"], stderr[-3000:]
    code, ours, stderr = run(release, *args, env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0 and ours["patched"], stderr[-3000:]
    expected = {"torchcodec"} if release != "0.6.1" else \
        {"torchcodec", "pyav", "uint8", "pyav_uint8", "multi", "streaming_uint8"}
    assert set(ours["digests"]) == expected
    for variant, digests in stock["digests"].items():
        assert digests and ours["digests"][variant] == digests, variant
    if release == "0.6.1":
        assert DEPTH in ours["keys"]
        depth = [line for line in ours["digests"]["torchcodec"] if line.startswith(DEPTH)]
        assert depth and all("torch.float32" in line for line in depth)  # dequantized, as stock
        assert all("torch.uint8" in line for line in ours["digests"]["uint8"] if not line.startswith(DEPTH))


def poisoned(dataset: Path, into: Path, hanging=(), truncated=()) -> Path:
    shutil.copytree(dataset, into)
    for camera, episode in hanging:
        path = into / "videos" / camera / "chunk-000" / f"file-{episode:03d}.mp4"
        path.unlink()
        os.mkfifo(path)  # no writer ever: open() blocks for ever
    for camera, episode in truncated:
        path = into / "videos" / camera / "chunk-000" / f"file-{episode:03d}.mp4"
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size * 4 // 10)
    return into


PROTECTED = {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "3", "SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION": "0.9"}


@pytest.mark.timeout(400)
def test_a_hanging_rgb_file_and_a_cut_depth_file_are_substituted_and_named(datasets, tmp_path):
    """LeRobot 0.6.1, three cameras decoded at once: the FIFO (torchcodec) and the cut
    depth file (PyAV) of two episodes; the epoch keeps its batch count, every item from a
    good episode, each bad file named with its episode and camera."""
    root = poisoned(datasets["per_episode"], tmp_path / "hostile", hanging=[(WRIST, 1)], truncated=[(DEPTH, 2)])
    started = time.monotonic()
    code, result, stderr = run("0.6.1", "tests.lerobot_scenarios", "epoch", root, "spawn", 2, env=PROTECTED)
    assert code == 0, stderr[-3000:]
    assert result["batches"] == result["expected_batches"] and result["samples"] == 24
    assert {int(episode) for episode, _ in result["states"]} <= {0, 3}
    for camera, episode, reason in ((WRIST, 1, "not a regular file (FIFO)"), (DEPTH, 2, "")):
        path = root / "videos" / camera / "chunk-000" / f"file-{episode:03d}.mp4"
        named = [line for line in stderr.splitlines()
                 if f"(episode {episode}, camera {camera}, file {path}) failed: " in line and reason in line]
        assert named and "substituted by sample" in named[0], stderr[-3000:]
    assert time.monotonic() - started < 300


@pytest.mark.timeout(400)
def test_a_stream_whose_file_hangs_stops_naming_it(datasets, tmp_path):
    """StreamingLeRobotDataset decodes with torchcodec directly (its failures were silent
    or fatal upstream); its one wrist file is a FIFO: protected, every sample is refused
    at once (the file failed earlier) and the error budget stops the stream naming the
    file; stock, the stream never yields."""
    root = poisoned(datasets["one_file"], tmp_path / "hostile_stream", hanging=[(WRIST, 0)])
    env = {**PROTECTED, "SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES": "5"}
    code, _, stderr = run("0.6.1", "tests.lerobot_scenarios", "stream", root, env=env, bound=200)
    assert code not in (0, None), stderr[-3000:]
    path = root / "videos" / WRIST / "chunk-000" / "file-000.mp4"
    assert "ErrorBudgetExceeded" in stderr and f"file {path}) failed" in stderr, stderr[-3000:]
    code, _, stderr = run("0.6.1", "tests.lerobot_scenarios", "stream", root, env={"SWIFT_SAFE_MEDIA": "0"}, bound=30)
    assert code is None, f"stock streaming ended (exit {code}): {stderr[-2000:]}"


@pytest.mark.timeout(300)
def test_a_remote_video_is_decoded_in_a_downloads_sandbox_with_the_same_frames(datasets):
    """A dataset streamed from the Hub is read over the network, which the twins' sandboxes
    refuse: its videos go to a download's (confined but for connecting out; here over a local
    HTTP server), pooled, so the next sample's read finds it started."""
    code, result, stderr = run("0.6.1", "tests.lerobot_scenarios", "remote_frames", datasets["one_file"],
                               env={"SWIFT_SAFE_MEDIA": "1"})
    assert code == 0, stderr[-3000:]
    assert result == {"equal": True, "shape": [2, 3, 64, 96], "network_calls": 2, "network_sandboxes": 1,
                      "unconfined_calls": 0, "confined_calls": 1}, result
