"""LeRobot's video decoding, bounded: every decode of the training path runs in the
engine's sandbox with the timeout, for every layout (:mod:`.layouts`).

- ``decode_video_frames`` (torchcodec and PyAV, RGB and depth) runs in the sandbox, where
  LeRobot's decoder cache (torchcodec decoders keyed by path) lives, so repeated frames of
  one episode file stay fast.
- A sample's cameras cost one round trip: ``LeRobotDataset._query_videos`` (0.4 - 0.5.0),
  ``DatasetReader._query_videos`` (0.5.1 on) and ``StreamingLeRobotDataset._query_videos``
  hand every camera to one ``engine.call_each`` (each camera keeps its own timeout, and an
  error names its own file). Where LeRobot decodes the cameras on threads (0.6), so does
  the sandbox (``parallel``): one sandbox per process never serialises what stock runs
  at once.
- RGB frames cross the process boundary as uint8 (a quarter of the bytes) and get
  LeRobot's float conversion here, unless the dataset asked for uint8 (``return_uint8``,
  as ``lerobot-train`` 0.6 does); depth maps come back as LeRobot's PyAV decode makes them
  (uint16) and are dequantized here, as LeRobot's reader does. Bit-identical to stock.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import threading

from ...engine import calls as engine, held_memory
from ...confinement import handed
from ... import process
from ...records import quarantine
from ...errors import MediaQuarantined
from . import layouts
from ...patching.targets import original_of


# -- the caller's side ----------------------------------------------------------------------
def decode_video_frames(video_path, timestamps, tolerance_s, backend=None, return_uint8=False, is_depth=False):
    """LeRobot's ``decode_video_frames``, run in the sandbox with a hard timeout (0.4 - 0.5
    call it with four arguments: the last two keep their defaults)."""
    (frames,) = decode_in_sandbox([(video_path, timestamps, tolerance_s, backend, return_uint8, is_depth)])
    return frames


def dataset_query_videos(stock_query_videos, dataset, query_timestamps, ep_idx):
    """``LeRobotDataset._query_videos`` (0.4 - 0.5.0): every camera in one round trip."""
    episode = dataset.meta.episodes[ep_idx]
    keys, requests = [], []
    # As the stock method: each camera's query is shifted by where the episode starts in its file.
    for key, timestamps in query_timestamps.items():
        path = dataset.root / dataset.meta.get_video_file_path(ep_idx, key)
        shifted = [episode[f"videos/{key}/from_timestamp"] + ts for ts in timestamps]
        keys.append(key)
        requests.append((path, shifted, dataset.tolerance_s, dataset.video_backend, False, False))
    return {key: frames.squeeze(0) for key, frames in zip(keys, decode_in_sandbox(requests))}


def reader_query_videos(stock_query_videos, reader, query_timestamps, ep_idx):
    """``DatasetReader._query_videos`` (0.5.1 on): every camera in one round trip, decoded
    at once in the sandbox where LeRobot decodes them on threads; depth maps dequantized
    here with LeRobot's own function and the reader's settings."""
    meta = reader._meta
    episode = meta.episodes[ep_idx]
    depth_keys = set(getattr(meta, "depth_keys", ()))
    keys, requests = [], []
    for key, timestamps in query_timestamps.items():
        path = reader.root / meta.get_video_file_path(ep_idx, key)
        shifted = [episode[f"videos/{key}/from_timestamp"] + ts for ts in timestamps]
        keys.append(key)
        requests.append((path, shifted, reader._tolerance_s, reader._video_backend,
                         getattr(reader, "_return_uint8", False), key in depth_keys))
    decoded = decode_in_sandbox(requests, parallel=layouts.installed().cameras_on_threads)
    frames_of = {}
    for key, frames in zip(keys, decoded):
        if key in depth_keys:
            frames = _dequantized(stock_query_videos, reader._depth_encoder_configs[key], frames,
                                  reader._depth_output_unit)
        frames_of[key] = frames.squeeze(0)
    return frames_of


def streaming_query_videos(stock_query_videos, dataset, query_timestamps, ep_idx):
    """``StreamingLeRobotDataset._query_videos``: every camera in one round trip. RGB through
    torchcodec (LeRobot calls ``decode_video_frames_torchcodec`` itself here), depth through
    PyAV, dequantized here (0.6)."""
    root = dataset.meta.url_root if dataset.streaming and not dataset.streaming_from_local else dataset.root
    depth_keys = set(getattr(dataset.meta, "depth_keys", ()))
    keys, requests = [], []
    for key, timestamps in query_timestamps.items():
        path = f"{root}/{dataset.meta.get_video_file_path(ep_idx, key)}"
        depth = key in depth_keys
        keys.append(key)
        requests.append((path, list(timestamps), dataset.tolerance_s, "pyav" if depth else "torchcodec",
                         getattr(dataset, "_return_uint8", False), depth))
    frames_of = {}
    for key, frames in zip(keys, decode_in_sandbox(requests)):
        if key in depth_keys:
            frames = _dequantized(stock_query_videos, dataset._depth_encoder_configs[key], frames,
                                  dataset._depth_output_unit)
        frames_of[key] = frames.squeeze(0) if len(query_timestamps[key]) == 1 else frames
    return frames_of


def _dequantized(stock_method, encoder, frames, output_unit):
    """LeRobot's ``dequantize_depth``, the very function its reader calls, as it calls it."""
    dequantize_depth = stock_method.__globals__["dequantize_depth"]
    return dequantize_depth(frames, depth_min=encoder.depth_min, depth_max=encoder.depth_max,
                            shift=encoder.shift, use_log=encoder.use_log, output_unit=output_unit)


def decode_in_sandbox(requests, parallel: bool = False) -> list:
    """Frames for each (path, timestamps, tolerance_s, backend, return_uint8, is_depth),
    decoded in the sandbox (at once, on threads there, with ``parallel``)."""
    # Absolute here: the sandbox does not run in this process's working directory.
    # Local files are handed to the sandbox open (handed): it reads nothing else by name.
    requests = [(path if is_remote(path) else handed.hand(os.path.abspath(path)), [float(ts) for ts in timestamps],
                 tolerance_s,
                 backend, return_uint8, depth)
                for path, timestamps, tolerance_s, backend, return_uint8, depth in requests]
    paths = [request[0] for request in requests]
    _refuse_known_bad(paths)
    # A dataset streamed from the Hub is read over the network: a download's sandbox (it may
    # connect out; no reads by name, writes, exec or secrets), still with the timeout.
    confine = engine.NETWORK if any(is_remote(path) for path in paths) else True
    decoded = engine.call_each(frames_in_sandbox, requests, paths, parallel=parallel, confine=confine)
    return [frames if return_uint8 or depth else _as_lerobot_floats(frames)
            for frames, (*_, return_uint8, depth) in zip(decoded, requests)]


def failed_files() -> quarantine.Registry:
    """Files whose decode failed in this process (an in-memory quarantine registry): later
    samples from them are refused at once instead of paying a timeout again."""
    state = process.current()
    if state.failed_files is None:
        state.failed_files = quarantine.Registry.in_memory()
    return state.failed_files


def _refuse_known_bad(paths) -> None:
    failed = failed_files()
    if not len(failed):
        return
    for path in paths:
        entry = failed.lookup(path)
        if entry is not None:
            exc = MediaQuarantined(path, f"file failed earlier: {entry['reason']}")
            setattr(exc, engine.FAILED_PATH, path)
            raise exc


def is_remote(path) -> bool:
    """A URL (a dataset streamed from the Hub: ``hf://...``), not a local file."""
    return "://" in str(path)


def _as_lerobot_floats(frames):
    """LeRobot's float conversion of RGB frames (``frames / 255.0`` as float32), moved to
    this side, into recycled memory: these frames are made for every sample and dropped
    once the batch is collated."""
    import torch

    if frames.dtype != torch.uint8:
        return frames
    if not frames.numel():
        return (frames / 255.0).type(torch.float32)
    state = process.current()
    if state.recycled_buffers is None:
        state.recycled_buffers = held_memory.RecycledBuffers()
    size = frames.numel() * torch.float32.itemsize
    out = torch.frombuffer(state.recycled_buffers.buffer(size), dtype=torch.float32, count=frames.numel())
    # Converted in place, not by ``torch.div(frames, 255.0, out=out)``: that first casts the
    # uint8 frames into a fresh float temporary, whose page faults (a fresh mapping each time
    # under the workers' fixed mmap threshold) cost more than the division. The same float32
    # division either way (PyAV's ``frames.float() / 255`` too), so the same bits.
    return out.view(frames.shape).copy_(frames).div_(255.0)


# -- the sandbox's side ---------------------------------------------------------------------
def import_lerobot_in_sandbox() -> None:
    """The sandbox's setup: LeRobot's video module imported, and torch on one thread.
    LeRobot's decode does its glue with torch (stacking a few frames, matching timestamps),
    as stock does in DataLoader workers, where torch runs one thread; a pool of threads
    costs more than such an op (measured: 3-5 ms of CPU a call with two, 0.1 ms with one)."""
    importlib.import_module(layouts.VIDEO_UTILS)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def frames_in_sandbox(video_path, timestamps, tolerance_s, backend, return_uint8, is_depth):
    """Runs in the sandbox: LeRobot's own decode, with its decoder cache living as long as
    the sandbox does. RGB frames are returned as uint8, before LeRobot's float conversion."""
    from ...decoders import demuxers

    video_utils = importlib.import_module(layouts.VIDEO_UTILS)  # imported already, by the sandbox's setup
    stock = original_of(video_utils.decode_video_frames) or video_utils.decode_video_frames
    backend = backend or _default_backend(video_utils)
    cache = getattr(video_utils, "_default_decoder_cache", None)
    local = not is_remote(video_path)
    if backend == "torchcodec" and not is_depth and cache is not None:
        # LeRobot's cache hands FFmpeg an open file (fsspec), never the name; before it opens
        # one, the demuxer FFmpeg's probe picks must be one allowed for what the file is.
        if local and video_path not in getattr(cache, "_cache", {}):
            demuxers.check_path(video_path, video_path)
        if _takes_return_uint8(stock):
            return stock(video_path, timestamps, tolerance_s, backend, return_uint8=True)
        return _torchcodec_uint8_frames(video_utils, video_path, timestamps, tolerance_s)
    if local:
        demuxers.check_path(video_path, video_path)
    # PyAV opens by name: pin it to the file and its demuxer.
    with _pinned_pyav() if local else contextlib.nullcontext():
        if _takes_return_uint8(stock):
            return stock(video_path, timestamps, tolerance_s, backend, return_uint8=True, is_depth=is_depth)
        return stock(video_path, timestamps, tolerance_s, backend)


def _default_backend(video_utils) -> str:
    choose = getattr(video_utils, "get_safe_default_video_backend", None)
    return choose() if choose is not None else "torchcodec"


@functools.lru_cache(maxsize=8)
def _takes_return_uint8(function) -> bool:
    try:
        return "return_uint8" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


_pins = {"count": 0, "pin": None}
_pins_lock = threading.Lock()


@contextlib.contextmanager
def _pinned_pyav():
    """``demuxers.pinned_pyav`` for the threads of one call_each batch: the first to enter
    pins ``av.open``, the last to leave unpins it (it is one module attribute)."""
    from ...decoders import demuxers

    with _pins_lock:
        if not _pins["count"]:
            _pins["pin"] = demuxers.pinned_pyav()
            _pins["pin"].__enter__()
        _pins["count"] += 1
    try:
        yield
    finally:
        with _pins_lock:
            _pins["count"] -= 1
            if not _pins["count"]:
                _pins["pin"].__exit__(None, None, None)


def _torchcodec_uint8_frames(video_utils, video_path, timestamps, tolerance_s):
    """0.4 - 0.5: ``decode_video_frames_torchcodec`` up to its float conversion (it has no
    ``return_uint8``): the same cached decoder, frame indices and closest-frame choice. A
    query outside the tolerance goes to the stock function, which raises LeRobot's own
    FrameTimestampError."""
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
