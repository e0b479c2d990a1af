"""LeRobot adapter: bounded video decode, skip-and-substitute, spawn DataLoader workers.

- ``decode_video_frames`` (torchcodec and PyAV backends) runs in the engine's sandbox,
  where LeRobot's decoder cache (torchcodec decoders keyed by path) lives, so repeated
  frames of one episode file stay fast. ``LeRobotDataset._query_videos`` asks for every
  camera of a sample in one round trip (``engine.call_each``: each camera still has its
  own timeout and its own file in errors). torchcodec frames cross the process boundary
  as uint8 and get LeRobot's float conversion in the caller: a quarter of the bytes, and
  bit-identical to the stock result.
- ``LeRobotDataset.__getitem__``: when a sample's video fails to decode (error, timeout,
  crash), another sample is returned instead, chosen deterministically from the index,
  and one warning names the episode, camera key, file and reason. Batch counts stay equal
  across ranks; :mod:`swift_safe_media.budget` stops the run when too much fails.
- ``cycle`` (how ``lerobot-train`` iterates its DataLoader): workers use
  ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (default spawn) unless the DataLoader names a start
  method or ``TrainPipelineConfig`` has ``dataloader_multiprocessing_context``; the run
  summary is logged every ``--log_freq`` batches and at exit.
- ``--safe_media=true`` (and ``--safe_media_timeout``, ``_mp_context``, ``_max_memory_mb``,
  ``_quarantine``, ``_stall_timeout``, ``_stall_action``) on any LeRobot command line:
  taken out of ``sys.argv`` before draccus parses it and written to the
  ``SWIFT_SAFE_MEDIA*`` environment. The quarantine registry defaults to
  ``<output_dir>/safe_media/quarantine.jsonl``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import random
import sys

from .. import activation, config, engine, summary
from ..budget import process_budget
from ..errors import MediaDecodeError
from . import env_state, installed_version
from ._patching import MethodPatcher, Patcher, original_of

log = logging.getLogger("swift_safe_media")

HOST = "lerobot"
DISTRIBUTION = "lerobot"
SUPPORTED = ((0, 4, 0), (0, 5, 0))  # dataset format v3.0; tested with 0.4.4

VIDEO_UTILS = "lerobot.datasets.video_utils"
DATASET = "lerobot.datasets.lerobot_dataset"
DATASET_UTILS = "lerobot.datasets.utils"
TRAIN_CONFIG = "lerobot.configs.train"

TRIGGER_MODULES = (VIDEO_UTILS, DATASET, DATASET_UTILS)
FLAG_MODULES = ("lerobot.configs.parser",)

# Patch targets: (module, function, stand-in) and (module, class, method, stand-in).
# The stand-ins are looked up by name below.
FUNCTIONS = (
    (VIDEO_UTILS, "decode_video_frames", "safe_decode_video_frames"),
    (DATASET_UTILS, "cycle", "cycle_with_start_method"),
)
METHODS = (
    (DATASET, "LeRobotDataset", "__getitem__", "getitem_or_substitute"),
    (DATASET, "LeRobotDataset", "_query_videos", "query_videos_in_one_call"),
)

# An exception raised by a patched decode carries the video's path under this name.
VIDEO_ATTRIBUTE = engine.FAILED_PATH

_patcher = Patcher(scope=("lerobot",))
_method_patcher = MethodPatcher()


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


# -- patching -------------------------------------------------------------------------
def patch() -> None:
    """Patch whatever of the targets is loaded now; called again as more is imported."""
    # Importing LeRobot takes seconds in a fresh sandbox (one per worker, and one after
    # every kill); that must not count against a decode's own timeout.
    engine.set_up_sandboxes(import_lerobot_in_sandbox)
    # A module may be loaded but still executing (the trigger of a module it imports
    # fired): what it has not defined yet is patched by its own trigger, later.
    for module_name, name, stand_in in FUNCTIONS:
        if hasattr(sys.modules.get(module_name), name):
            _patcher.replace(module_name, name, globals()[stand_in])
    for module_name, class_name, name, stand_in in METHODS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            _method_patcher.replace(cls, name, globals()[stand_in])


def unpatch() -> None:
    _patcher.restore()
    _method_patcher.restore()


def is_patched() -> bool:
    return bool(_patcher) or bool(_method_patcher)


def _stock(module_name: str, name: str):
    current = getattr(sys.modules[module_name], name)
    return original_of(current) or current


# -- bounded decode -------------------------------------------------------------------
def safe_decode_video_frames(video_path, timestamps, tolerance_s, backend=None):
    """LeRobot's ``decode_video_frames``, run in the sandbox with a hard timeout."""
    path = str(video_path)
    (frames,) = _decode_in_sandbox([(path, list(timestamps), tolerance_s, backend)])
    return frames


def query_videos_in_one_call(stock_query_videos, dataset, query_timestamps, ep_idx):
    """``LeRobotDataset._query_videos`` with every camera decoded in one sandbox round trip."""
    episode = dataset.meta.episodes[ep_idx]
    keys, requests = [], []
    # As the stock method: each camera's query is shifted by where the episode starts in its file.
    for key, timestamps in query_timestamps.items():
        from_timestamp = episode[f"videos/{key}/from_timestamp"]
        path = str(dataset.root / dataset.meta.get_video_file_path(ep_idx, key))
        keys.append(key)
        requests.append((path, [from_timestamp + ts for ts in timestamps], dataset.tolerance_s,
                         dataset.video_backend))
    return {key: frames.squeeze(0) for key, frames in zip(keys, _decode_in_sandbox(requests))}


def _decode_in_sandbox(requests):
    """Frames for each (path, timestamps, tolerance_s, backend), decoded in the sandbox."""
    # Absolute here: the sandbox does not run in this process's working directory.
    requests = [(os.path.abspath(path), *rest) for path, *rest in requests]
    paths = [request[0] for request in requests]
    decoded = engine.call_each(frames_in_sandbox, requests, paths)  # failures carry VIDEO_ATTRIBUTE
    return [_as_lerobot_floats(frames) for frames in decoded]


def _as_lerobot_floats(frames):
    import torch

    if frames.dtype == torch.uint8:
        # The last line of LeRobot's decode_video_frames_torchcodec, moved to this side.
        return (frames / 255.0).type(torch.float32)
    return frames


def import_lerobot_in_sandbox() -> None:
    importlib.import_module(VIDEO_UTILS)


def frames_in_sandbox(video_path, timestamps, tolerance_s, backend):
    """Runs in the sandbox: LeRobot's decode, with its decoder cache (torchcodec decoders
    keyed by path) living as long as the sandbox does. torchcodec frames are returned as
    uint8, before LeRobot's float conversion."""
    from ..decoders import demuxers

    video_utils = importlib.import_module(VIDEO_UTILS)  # imported already, by the sandbox's setup
    path = str(video_path)
    cache = getattr(video_utils, "_default_decoder_cache", None)
    if backend == "torchcodec" and cache is not None:
        # LeRobot's cache hands FFmpeg an open file (fsspec), never the name; before it opens
        # one, the demuxer FFmpeg's probe picks must be one allowed for what the file is.
        if path not in getattr(cache, "_cache", {}):
            demuxers.check_path(path, path)
        return _torchcodec_uint8_frames(video_utils, video_path, timestamps, tolerance_s)
    demuxers.check_path(path, path)
    with demuxers.pinned_pyav():  # the pyav backend opens by name: pin it to the file and demuxer
        return _stock(VIDEO_UTILS, "decode_video_frames")(video_path, timestamps, tolerance_s, backend)


def _torchcodec_uint8_frames(video_utils, video_path, timestamps, tolerance_s):
    """``decode_video_frames_torchcodec`` up to its float conversion: the same cached
    decoder, frame indices and closest-frame choice. A query outside the tolerance goes to
    the stock function, which raises LeRobot's own FrameTimestampError."""
    import torch

    decoder = video_utils._default_decoder_cache.get_decoder(str(video_path))
    average_fps = decoder.metadata.average_fps
    batch = decoder.get_frames_at(indices=[round(ts * average_fps) for ts in timestamps])
    query_ts = torch.tensor(timestamps)
    loaded_ts = torch.tensor([pts.item() for pts in batch.pts_seconds])
    distance, closest = torch.cdist(query_ts[:, None], loaded_ts[:, None], p=1).min(1)
    if not (distance < tolerance_s).all():
        return video_utils.decode_video_frames_torchcodec(video_path, timestamps, tolerance_s)
    if torch.equal(closest, torch.arange(len(timestamps))):
        return batch.data  # already in query order: spare the copy
    return batch.data[closest]


# -- skip-and-substitute --------------------------------------------------------------
# Files that timed out or crashed the sandbox in this process: later samples from them
# are substituted at once instead of paying the timeout again. Per-sample errors (a
# truncated file still has good frames) do not put a file here.
_bad_files: dict[str, str] = {}


def getitem_or_substitute(stock_getitem, dataset, idx):
    """Return ``dataset[idx]``, or, if its video cannot be decoded, another sample."""
    budget = process_budget()
    failures = []
    for candidate in _candidates(dataset, idx):
        known_bad = _known_bad_video(dataset, candidate) if _bad_files else None
        if known_bad is None:
            try:
                item = stock_getitem(dataset, candidate)
            except Exception as exc:
                path = getattr(exc, VIDEO_ATTRIBUTE, None)
                if path is None:
                    raise
                reason = _describe(exc)
                if isinstance(exc, MediaDecodeError):
                    _bad_files[path] = reason
                failure = _describe_sample(dataset, candidate, path, reason)
            else:
                budget.success()
                if failures:
                    others = f" ({len(failures) - 1} other candidates failed too)" if len(failures) > 1 else ""
                    log.warning("swift_safe_media: %s; sample %d substituted by sample %d%s",
                                failures[0], idx, candidate, others)
                return item
        else:
            path = known_bad
            failure = _describe_sample(dataset, candidate, path,
                                       f"file failed earlier: {_bad_files[path]}")
        failures.append(failure)
        budget.failure(failure)


def _candidates(dataset, idx):
    """``idx``, then other indices in a fixed order drawn from ``idx`` (the same on every
    rank and run, spread over the dataset rather than the bad sample's neighbours)."""
    yield idx
    size = len(dataset)
    draw = random.Random(idx)
    while True:
        candidate = draw.randrange(size)
        if candidate != idx or size == 1:
            yield candidate


def _videos_of(dataset, idx) -> tuple[int, dict[str, str]]:
    """The episode of sample ``idx`` and its video file per camera key."""
    episode = int(dataset.hf_dataset[idx]["episode_index"])
    return episode, {key: str(dataset.root / dataset.meta.get_video_file_path(episode, key))
                     for key in dataset.meta.video_keys}


def _known_bad_video(dataset, idx) -> str | None:
    dataset._ensure_hf_dataset_loaded()
    _, videos = _videos_of(dataset, idx)
    return next((path for path in videos.values() if path in _bad_files), None)


def _describe_sample(dataset, idx, path, reason) -> str:
    try:
        episode, videos = _videos_of(dataset, idx)
        camera = next((key for key, video in videos.items() if video == path), "?")
    except Exception:  # the description must never hide the failure itself
        episode, camera = "?", "?"
    return f"sample {idx} (episode {episode}, camera {camera}, file {path}) failed: {reason}"


def _describe(exc, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(exc).__name__}: {first}"


# -- spawn and the run summary ---------------------------------------------------------
def cycle_with_start_method(iterable):
    """LeRobot's ``cycle`` (how ``lerobot-train`` draws its batches), after giving a
    multi-worker DataLoader the configured start method; the run summary goes to the log
    every ``SWIFT_SAFE_MEDIA_SUMMARY_STEPS`` batches (``--log_freq``) and at exit."""
    import torch.utils.data

    batches = _stock(DATASET_UTILS, "cycle")(iterable)
    if not isinstance(iterable, torch.utils.data.DataLoader):
        return batches
    if (iterable.num_workers > 0 and iterable.multiprocessing_context is None
            and not train_config_has_start_method()):
        method = config.mp_context()
        if method != "default":
            iterable.multiprocessing_context = method
            log.info("swift_safe_media: DataLoader workers use the %r start method", method)
    return _reporting(batches)


_batches_drawn = 0


def _reporting(batches):
    global _batches_drawn
    summary.report_at_exit(lambda: _batches_drawn)  # lerobot-train ends by exiting, mid-cycle
    every = summary.summary_steps()
    for batch in batches:
        _batches_drawn += 1
        yield batch
        if every and _batches_drawn % every == 0:
            summary.report(step=_batches_drawn)


def train_config_has_start_method(train_config_class=None) -> bool:
    """True on LeRobot versions whose TrainPipelineConfig lets the user choose (respected)."""
    if train_config_class is None:
        module = sys.modules.get(TRAIN_CONFIG)
        train_config_class = getattr(module, "TrainPipelineConfig", None)
    if train_config_class is None or not dataclasses.is_dataclass(train_config_class):
        return False
    return any(field.name == "dataloader_multiprocessing_context"
               for field in dataclasses.fields(train_config_class))


# -- flags ----------------------------------------------------------------------------
FLAGS = {
    "--safe_media": "enabled",
    "--safe_media_timeout": "timeout",
    "--safe_media_mp_context": "mp_context",
    "--safe_media_max_memory_mb": "max_memory_mb",
    "--safe_media_quarantine": "quarantine",
    "--safe_media_stall_timeout": "stall_timeout",
    "--safe_media_stall_action": "stall_action",
}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
QUARANTINE_UNDER_OUTPUT_DIR = ("safe_media", "quarantine.jsonl")


def register_flags() -> None:
    """Take our flags out of ``sys.argv`` before draccus sees them and apply them."""
    values, remaining = take_flags(sys.argv[1:])
    sys.argv[1:] = remaining
    enabled = values.pop("enabled", None)
    protected = enabled is True or (enabled is None and env_state())
    output_dir, log_freq = _argument(remaining, "--output_dir"), _argument(remaining, "--log_freq")
    if protected and output_dir and "quarantine" not in values and os.environ.get(config.QUARANTINE) is None:
        # Only named now: lerobot-train refuses an output_dir that already exists.
        values["quarantine"] = os.path.join(output_dir, *QUARANTINE_UNDER_OUTPUT_DIR)
    if protected and log_freq and summary.SUMMARY_STEPS not in os.environ:
        os.environ[summary.SUMMARY_STEPS] = log_freq  # the summary joins LeRobot's own log lines
    config.write(**values)
    if protected:
        activation.enable(hosts=[HOST])  # again if on already: the stats folder follows the registry
    elif enabled is False:
        activation.disable()


def _argument(argv: list[str], name: str) -> str | None:
    """The value of ``name`` on a LeRobot command line (``--name=value`` or ``--name value``)."""
    for position, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
        if arg == name and position + 1 < len(argv):
            return argv[position + 1]
    return None


def take_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """Split ``--safe_media=true`` / ``--safe_media true`` style flags from the rest."""
    values, remaining = {}, []
    position = 0
    while position < len(argv):
        arg = argv[position]
        position += 1
        name, has_value, value = arg.partition("=")
        if name not in FLAGS:
            remaining.append(arg)
            continue
        if not has_value:
            if position < len(argv) and not argv[position].startswith("--"):
                value = argv[position]
                position += 1
            elif name == "--safe_media":
                value = "true"  # a bare --safe_media
            else:
                raise ValueError(f"{name} needs a value")
        values[FLAGS[name]] = _flag_value(name, value)
    return values, remaining


def _flag_value(name: str, value: str):
    if name != "--safe_media":
        return value
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected true or false")
