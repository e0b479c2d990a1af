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
  ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (default forkserver) unless the DataLoader names a start
  method or ``TrainPipelineConfig`` has ``dataloader_multiprocessing_context``. The start
  method is chosen as the workers start (:func:`worker_start_method`, asked by
  :mod:`swift_safe_media.worker_start` before its checks), on the torch DataLoader that
  really runs them: ``lerobot-train`` hands ``cycle`` the wrapper of
  ``accelerator.prepare``, which keeps attribute writes to itself. The run summary is
  logged every ``--log_freq`` batches and at exit.
- ``--safe_media=true`` (and ``--safe_media_timeout``, ``_mp_context``, ``_max_memory_mb``,
  ``_quarantine``, ``_stall_timeout``, ``_stall_action``) on any LeRobot command line:
  taken out of ``sys.argv`` before draccus parses it and written to the
  ``SWIFT_SAFE_MEDIA*`` environment. The quarantine registry defaults to
  ``<output_dir>/safe_media/quarantine.jsonl``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import logging
import os
import random
import sys

from .. import config, engine, process, quarantine, summary, transport
from ..budget import ErrorBudgetExceeded, process_budget
from ..errors import MediaDecodeError
from . import env_state, flags, installed_version
from ._patching import Patches, Target, original_of

log = logging.getLogger("swift_safe_media")

# What DataLoader workers need to unpickle a LeRobotDataset: the warm forkserver imports
# it once (see warm_start).
WORKER_PRELOAD = ("lerobot.datasets.lerobot_dataset", "lerobot.datasets.utils")
HOST = "lerobot"
DISTRIBUTION = "lerobot"
SUPPORTED = ((0, 4, 0), (0, 5, 0))  # dataset format v3.0; tested with 0.4.4

VIDEO_UTILS = "lerobot.datasets.video_utils"
DATASET = "lerobot.datasets.lerobot_dataset"
DATASET_UTILS = "lerobot.datasets.utils"
TRAIN_CONFIG = "lerobot.configs.train"

FLAG_MODULES = ("lerobot.configs.parser",)

# Patch targets; bare stand-in names are functions of this module.
TARGETS = (
    Target(VIDEO_UTILS, "decode_video_frames", "safe_decode_video_frames"),
    Target(DATASET_UTILS, "cycle", "cycle_with_start_method"),
    Target(DATASET, "LeRobotDataset.__getitem__", "getitem_or_substitute"),
    Target(DATASET, "LeRobotDataset._query_videos", "query_videos_in_one_call"),
)

# An exception raised by a patched decode carries the video's path under this name.
VIDEO_ATTRIBUTE = engine.FAILED_PATH

PATCHES = Patches(("lerobot",), TARGETS, globals())
# LeRobot's own modules only: patching LeRobot (which registers its import in every
# sandbox) must not follow an ms-swift run.
TRIGGER_MODULES = tuple(name for name in PATCHES.modules if name.startswith("lerobot."))
is_patched = PATCHES.is_patched


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


# -- patching -------------------------------------------------------------------------
def patch() -> None:
    """Patch whatever of the targets is loaded now; called again as more is imported."""
    # Importing LeRobot takes seconds in a fresh sandbox (one per worker, and one after
    # every kill); that must not count against a decode's own timeout.
    engine.set_up_sandboxes(import_lerobot_in_sandbox)
    PATCHES.patch()


def unpatch() -> None:
    PATCHES.unpatch()
    engine.forget_sandbox_setup(import_lerobot_in_sandbox)


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
    """The last line of LeRobot's ``decode_video_frames_torchcodec``
    (``(frames / 255.0).type(torch.float32)``), moved to this side, into recycled memory:
    these frames are made for every sample and dropped once the batch is collated."""
    import torch

    if frames.dtype != torch.uint8:
        return frames
    if not frames.numel():
        return (frames / 255.0).type(torch.float32)
    state = process.current()
    if state.recycled_buffers is None:
        state.recycled_buffers = transport.RecycledBuffers()
    size = frames.numel() * torch.float32.itemsize
    out = torch.frombuffer(state.recycled_buffers.buffer(size), dtype=torch.float32, count=frames.numel())
    # Converted in place, not by ``torch.div(frames, 255.0, out=out)``: that first casts the
    # uint8 frames into a fresh float temporary, whose page faults (a fresh mapping each time
    # under the workers' fixed mmap threshold) cost more than the division. The same float32
    # division either way, so the same bits.
    return out.view(frames.shape).copy_(frames).div_(255.0)


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
def failed_files() -> quarantine.Registry:
    """Files whose decode failed in this process (an in-memory quarantine registry):
    later samples from them are substituted at once instead of paying a timeout again."""
    state = process.current()
    if state.failed_files is None:
        state.failed_files = quarantine.Registry.in_memory()
    return state.failed_files


def getitem_or_substitute(stock_getitem, dataset, idx):
    """Return ``dataset[idx]``, or, if its video cannot be decoded, another sample."""
    budget = process_budget()
    failed = failed_files()
    failures = _Failures()
    for candidate in _candidates(dataset, idx):
        known_bad = _known_bad_video(dataset, candidate, failed) if len(failed) else None
        if known_bad is None:
            try:
                item = stock_getitem(dataset, candidate)
            except Exception as exc:
                path = getattr(exc, VIDEO_ATTRIBUTE, None)
                if path is None:
                    raise
                reason = _describe(exc)
                if isinstance(exc, MediaDecodeError):
                    failed.record(path, "error", reason, exc.elapsed)
                failure = _describe_sample(dataset, candidate, path, reason)
            else:
                budget.success()
                if failures:
                    log.warning("swift_safe_media: %s; sample %d substituted by sample %d",
                                failures.named(), idx, candidate)
                return item
        else:
            path, entry = known_bad
            failure = _describe_sample(dataset, candidate, path, f"file failed earlier: {entry['reason']}")
        failures.add(path, failure)
        try:
            budget.failure(failure)
        except ErrorBudgetExceeded:
            # The budget's error names the last failure: the others are named here.
            log.warning("swift_safe_media: %s; no substitute for sample %d", failures.named(), idx)
            raise


class _Failures:
    """The failed candidates of one sample, each failed file named once: a file that only
    ever fails as a substitute is named as surely as the sample's own."""

    def __init__(self):
        self.first_by_path: dict[str, str] = {}  # path: the first failure's description
        self.more_by_path: dict[str, int] = {}  # path: further candidates that failed on it

    def __bool__(self):
        return bool(self.first_by_path)

    def add(self, path: str, failure: str) -> None:
        if path in self.first_by_path:
            self.more_by_path[path] = self.more_by_path.get(path, 0) + 1
        else:
            self.first_by_path[path] = failure

    def named(self) -> str:
        def more(path):
            count = self.more_by_path.get(path, 0)
            return f" (and {count} more sample{'s' if count > 1 else ''} of this file)" if count else ""

        return "; ".join(failure + more(path) for path, failure in self.first_by_path.items())


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


def _known_bad_video(dataset, idx, failed) -> tuple[str, dict] | None:
    """(path, its record) of a video of sample ``idx`` that failed before, if any."""
    dataset._ensure_hf_dataset_loaded()
    _, videos = _videos_of(dataset, idx)
    for path in videos.values():
        entry = failed.lookup(path)
        if entry is not None:
            return path, entry
    return None


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
# True while ``cycle`` draws a batch: DataLoader workers started meanwhile are the
# training loader's, whatever wraps it (accelerate's DataLoaderShard and
# DataLoaderDispatcher start the inner loader's iterator lazily, on the first draw).
_drawing_training_batch = contextvars.ContextVar("swift_safe_media_drawing_training_batch", default=False)


def cycle_with_start_method(iterable):
    """LeRobot's ``cycle`` (how ``lerobot-train`` draws its batches): DataLoader workers
    started while it draws get the configured start method
    (:func:`worker_start_method`); the run summary goes to the log every
    ``SWIFT_SAFE_MEDIA_SUMMARY_STEPS`` batches (``--log_freq``) and at exit."""
    # Whatever ``iterable`` is (a DataLoader, accelerate's wrapper of one, anything that
    # forwards to one): only lerobot-train's training loop calls cycle in LeRobot 0.4.
    return _reporting(_stock(DATASET_UTILS, "cycle")(iterable))


def worker_start_method(loader) -> str | None:
    """The start method for ``loader``, asked as it starts its workers
    (:mod:`..worker_start`): the configured one when ``cycle`` is drawing from it, unless
    it names one or LeRobot's ``TrainPipelineConfig`` lets the user choose. ``loader`` is
    the torch DataLoader that really starts them, whatever wraps it."""
    if (not _drawing_training_batch.get() or loader.multiprocessing_context is not None
            or train_config_has_start_method()):
        return None
    method = config.mp_context()
    if method == "default":
        return None
    log.warning("swift_safe_media: DataLoader workers use the %r start method", method)
    return method


def _reporting(batches):
    state = process.current()
    summary.report_at_exit(lambda: process.current().batches_drawn)  # lerobot-train ends by exiting, mid-cycle
    every = summary.summary_steps()
    while True:
        marker = _drawing_training_batch.set(True)
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            _drawing_training_batch.reset(marker)
        state.batches_drawn += 1
        yield batch
        if every and state.batches_drawn % every == 0:
            summary.report(step=state.batches_drawn)


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
QUARANTINE_UNDER_OUTPUT_DIR = ("safe_media", "quarantine.jsonl")
take_flags = flags.take_flags


def register_flags() -> None:
    """Take our flags out of ``sys.argv`` before draccus sees them and apply them."""
    values, remaining = take_flags(sys.argv[1:])
    sys.argv[1:] = remaining
    enabled = values.get(flags.ENABLED)
    protected = enabled is True or (enabled is None and env_state())
    output_dir, log_freq = _argument(remaining, "--output_dir"), _argument(remaining, "--log_freq")
    if protected and output_dir and "quarantine" not in values and not config.is_set(config.QUARANTINE):
        # Only named now: lerobot-train refuses an output_dir that already exists.
        values["quarantine"] = os.path.join(output_dir, *QUARANTINE_UNDER_OUTPUT_DIR)
    if protected and log_freq and not config.is_set(config.SUMMARY_STEPS):
        config.put(config.SUMMARY_STEPS, log_freq)  # the summary joins LeRobot's own log lines
    if protected:
        values[flags.ENABLED] = True  # again if on already: the stats folder follows the registry
    flags.apply(values, HOST)


def _argument(argv: list[str], name: str) -> str | None:
    """The value of ``name`` on a LeRobot command line (``--name=value`` or ``--name value``)."""
    for position, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1] or None
        if arg == name and position + 1 < len(argv):
            return argv[position + 1]
    return None
