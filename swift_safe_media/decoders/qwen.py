"""Safe twins of ``qwen_vl_utils.fetch_video`` / ``qwen_omni_utils.fetch_video`` (the same
code in both packages) and of ``qwen_omni_utils``' audio loading (``process_audio_info``).

Frames are chosen with the stock formulas (time range, ``nframes`` or ``fps``) applied
to the frames the file really holds, decoded with torchcodec and resized exactly as stock
does (torchvision bicubic with antialias, then float), both in the sandbox: only the
model-sized tensor crosses to the caller.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from ..engine import calls as engine
from ..confinement import handed
from ..errors import MediaDecodeError, typed_entry
from . import audio, families, guards, inputs, video

# Constants of qwen_vl_utils 0.0.14 / qwen_omni_utils 0.0.9 vision_process, as shipped.
DEFAULTS = {"SPATIAL_MERGE_SIZE": 2, "VIDEO_MIN_TOKEN_NUM": 128, "VIDEO_MAX_TOKEN_NUM": 768,
            "IMAGE_MIN_TOKEN_NUM": 4, "IMAGE_MAX_TOKEN_NUM": 16384, "MAX_RATIO": 200, "FPS": 2.0,
            "FRAME_FACTOR": 2, "FPS_MIN_FRAMES": 4, "FPS_MAX_FRAMES": 768}
_STOCK_MODULES = ("qwen_vl_utils.vision_process", "qwen_omni_utils.v2_5.vision_process")
OMNI_SAMPLE_RATE = 16000


def current_settings() -> dict:
    """The constants stock ``fetch_video`` would use: those ms-swift set on the stock
    module (``patch_qwen_vl_utils`` reads ``FPS_MAX_FRAMES``, ``VIDEO_MAX_TOKEN_NUM``, ...
    from the environment), or, in a process where it has not (a spawned worker), the
    same values read from the same environment variables. Resolved in the caller: a
    sandbox's environment is the one its zygote started with."""
    for name in _STOCK_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_patch", False):
            return {key: getattr(module, key, default) for key, default in DEFAULTS.items()}
    return {key: type(default)(os.environ[key]) if os.environ.get(key) else default
            for key, default in DEFAULTS.items()}

# qwen_vl_utils' FORCE_QWENVL_VIDEO_READER -> the family that decodes (torchcodec by default,
# as stock picks it when installed; torchvision's read_video is PyAV).
_READERS = {"torchcodec": families.TORCHCODEC, "decord": families.DECORD, "torchvision": families.PYAV}


def reader_family() -> families.Family:
    """Whose stream and rotation rules stock ``fetch_video`` follows here."""
    for name in _STOCK_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "FORCE_QWENVL_VIDEO_READER", None):
            return _READERS.get(module.FORCE_QWENVL_VIDEO_READER, families.TORCHCODEC)
    return _READERS.get(os.environ.get("FORCE_QWENVL_VIDEO_READER", ""), families.TORCHCODEC)


_SAMPLING_KEYS = ("nframes", "fps", "min_frames", "max_frames", "video_start", "video_end")


def _round_to(number, factor):
    return round(number / factor) * factor


def _ceil_to(number, factor):
    return math.ceil(number / factor) * factor


def _floor_to(number, factor):
    return math.floor(number / factor) * factor


def smart_resize(height, width, factor, settings, min_pixels=None, max_pixels=None):
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect kept."""
    max_pixels = settings["IMAGE_MAX_TOKEN_NUM"] * factor ** 2 if max_pixels is None else max_pixels
    min_pixels = settings["IMAGE_MIN_TOKEN_NUM"] * factor ** 2 if min_pixels is None else min_pixels
    max_ratio = settings["MAX_RATIO"]
    if max(height, width) / min(height, width) > max_ratio:
        raise ValueError(f"absolute aspect ratio must be smaller than {max_ratio}, "
                         f"got {max(height, width) / min(height, width)}")
    h, w = max(factor, _round_to(height, factor)), max(factor, _round_to(width, factor))
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h, w = _floor_to(height / scale, factor), _floor_to(width / scale, factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = _ceil_to(height * scale, factor), _ceil_to(width * scale, factor)
    return h, w


def frame_range(ele, total_frames, fps):
    """(first, last, count) of the frames inside ele's video_start/video_end, in seconds."""
    if fps <= 0 or total_frames <= 0:
        raise ValueError("video_fps and total_frames must be positive")
    start, end = ele.get("video_start"), ele.get("video_end")
    if start is None and end is None:
        return 0, total_frames - 1, total_frames
    longest = total_frames / fps
    first = math.ceil(max(0.0, min(start, longest)) * fps) if start is not None else 0
    last = total_frames - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(end, longest)) * fps), total_frames - 1)
    if first >= last:
        raise ValueError(f"Invalid time range: start frame {first} is not before end frame {last} "
                         f"({total_frames} frames @ {fps} fps)")
    return first, last, last - first + 1


def frame_count(ele, total_frames, fps, settings):
    """How many frames to sample: ``nframes``, or ``fps`` frames per second within bounds."""
    factor = settings["FRAME_FACTOR"]
    if "fps" in ele and "nframes" in ele:
        raise ValueError("Only accept either `fps` or `nframes`")
    if "nframes" in ele:
        count = _round_to(ele["nframes"], factor)
    else:
        lowest = _ceil_to(ele.get("min_frames", settings["FPS_MIN_FRAMES"]), factor)
        highest = _floor_to(ele.get("max_frames", min(settings["FPS_MAX_FRAMES"], total_frames)), factor)
        wanted = total_frames / fps * ele.get("fps", settings["FPS"])
        count = _floor_to(min(min(max(wanted, lowest), highest), total_frames), factor)
    if not factor <= count <= total_frames:
        raise ValueError(f"nframes should in interval [{factor}, {total_frames}], but got {count}.")
    return count


def qwen_indices(info: video.VideoInfo, ele, settings):
    import torch
    first, last, total = frame_range(ele, info.num_frames, info.fps)
    count = frame_count(ele, total, info.fps, settings)
    return torch.linspace(first, last, count).round().long().tolist()


_SIZING_KEYS = ("min_pixels", "total_pixels", "max_pixels", "resized_height", "resized_width")
# Frames decoded and resized per step in the sandbox: bounds its memory on huge frames
# (one 8192x8192 frame is 200 MB) whatever the frame count; the result is the same.
_RESIZE_CHUNK_BYTES = 256 << 20


def target_size(height, width, nframes, sizing, image_patch_size, settings, seq_len):
    """Stock's pixel budget for `nframes` frames of width x height: the (height, width)
    every frame is resized to."""
    factor = image_patch_size * settings["SPATIAL_MERGE_SIZE"]
    min_pixels = sizing.get("min_pixels", settings["VIDEO_MIN_TOKEN_NUM"] * factor * factor)
    total_pixels = sizing.get("total_pixels", seq_len * factor * factor * 0.9)
    max_pixels = max(min(settings["VIDEO_MAX_TOKEN_NUM"] * factor * factor,
                         total_pixels / nframes * settings["FRAME_FACTOR"]), int(min_pixels * 1.05))
    max_pixels = min(sizing.get("max_pixels", max_pixels), max_pixels)
    if "resized_height" in sizing and "resized_width" in sizing:
        return smart_resize(sizing["resized_height"], sizing["resized_width"], factor, settings)
    return smart_resize(height, width, factor, settings, min_pixels=min_pixels, max_pixels=max_pixels)


@typed_entry
def sample_resized(source, limits: guards.Limits, url_timeout, sampling, sizing, image_patch_size, settings,
                   seq_len, family=families.TORCHCODEC):
    """Sandbox entry: stock ``fetch_video`` on a video file. Frames are chosen with the
    stock formulas, decoded and resized here (torchvision bicubic with antialias, then
    float, as stock), so only the model-sized tensor reaches the caller.

    Returns (float32 (T, C, H, W) tensor, VideoInfo, indices, frames in the time range)."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional

    label = source.label
    data = inputs.materialize(source, limits, url_timeout)

    def pick(info):
        try:
            return qwen_indices(info, sampling, settings)
        except ValueError as exc:  # stock raises these for this file: same condition, named
            raise MediaDecodeError(label, f"refused by the qwen_vl_utils sampling rules: {exc}") from None

    def deliver(reader, info, indices):
        try:
            height, width = target_size(info.height, info.width, len(indices), sizing, image_patch_size, settings,
                                        seq_len)
        except ValueError as exc:
            raise MediaDecodeError(label, f"refused by the qwen_vl_utils sampling rules: {exc}") from None
        count = len(indices)
        video.check_result(label, count, info, limits, pixel_bytes=0, input_bytes=reader.input_bytes)
        guards.check_result_bytes(label, count * 3 * height * width * 4,
                                  f"{count} frames resized to {width}x{height} as float32", limits)
        resized = torch.empty((count, 3, height, width), dtype=torch.float32)

        def resize(start, frames):
            chunk = torch.from_numpy(frames).permute(0, 3, 1, 2)
            resized[start:start + len(frames)] = functional.resize(
                chunk, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)
        reader.decode_into(indices, resize, step=max(1, _RESIZE_CHUNK_BYTES // max(1, info.height * info.width * 3)))
        return resized

    resized, info, indices = video.decode(label, data, family, pick, deliver)
    _, _, total = frame_range(sampling, info.num_frames, info.fps)
    return resized, info, indices, total


@typed_entry
def _stock_fetch_frames(ele, image_patch_size, return_video_sample_fps, return_video_metadata):
    # A video given as a list of images: stock code, run in the sandbox (no video decoder involved).
    from qwen_vl_utils import fetch_video as stock_fetch_video
    return stock_fetch_video(ele, image_patch_size, return_video_sample_fps, return_video_metadata)


def _absolute_if_local(item):
    if isinstance(item, str) and not item.startswith(("http://", "https://", "file://", "data:")) \
            and os.path.lexists(item):
        return handed.hand(os.path.abspath(item))  # opened by the caller, read by the stock code's open()
    return item


def _fetched_frames(frames):
    """Image URLs of a frame list, fetched outside the confined sandbox (see
    ``inputs.fetched``) and handed to the stock code as the data URIs it accepts."""
    import base64

    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    out = []
    for frame in frames:
        if isinstance(frame, str) and frame.startswith(("http://", "https://")):
            source = inputs.fetched(inputs.describe(frame), limits, url_timeout)
            if source.kind == "bytes":
                frame = "data:image;base64," + base64.b64encode(source.value).decode("ascii")
        out.append(frame)
    return out


def fetch_video(ele, image_patch_size=14, return_video_sample_fps=False, return_video_metadata=False):
    """float32 tensor (T, C, H, W) [, metadata dict] [, sample_fps], as qwen_vl_utils returns."""
    if not isinstance(ele["video"], str):
        # Image URLs are fetched outside the confined sandbox; relative image paths are made
        # absolute here: the sandbox does not run in this directory.
        ele = dict(ele, video=[_absolute_if_local(item) for item in _fetched_frames(ele["video"])])
        return engine.call(_stock_fetch_frames, ele, image_patch_size, return_video_sample_fps,
                           return_video_metadata, path=str(ele["video"][0]) if ele["video"] else None)
    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    source = inputs.fetched(inputs.describe(ele["video"]), limits, url_timeout)
    sampling = {key: ele[key] for key in _SAMPLING_KEYS if key in ele}
    sizing = {key: ele[key] for key in _SIZING_KEYS if key in ele}
    seq_len = int(float(os.environ.get("MODEL_SEQ_LEN", 128000)))
    resized, info, indices, total = engine.call(
        sample_resized, source, limits, url_timeout, sampling, sizing, image_patch_size,
        current_settings(), seq_len, reader_family(), path=source.label)
    sample_fps = len(indices) / max(total, 1e-6) * info.fps
    # What decoded, whatever FORCE_QWENVL_VIDEO_READER asked stock to use.
    metadata = dict(fps=info.fps, frames_indices=indices, total_num_frames=total, video_backend="torchcodec")
    result = (resized, metadata) if return_video_metadata else resized
    return (result, sample_fps) if return_video_sample_fps else result


def _omni_audio(path, start, end):
    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    source = inputs.fetched(inputs.describe(path), limits, url_timeout)
    duration = (end - start) if end is not None else None
    samples, _ = engine.call(audio.load, source, limits, url_timeout, OMNI_SAMPLE_RATE,
                             True, start, duration, libsndfile_only=audio.librosa_without_audioread(),
                             path=source.label)
    return samples


def process_audio_info(conversations, use_audio_in_video):
    """List of mono float32 arrays at 16 kHz (or None), as qwen_omni_utils returns.

    A video without an audio stream raises MediaDecodeError("no audio stream") where
    stock fails an assert."""
    audios = []
    if isinstance(conversations[0], dict):
        conversations = [conversations]
    for conversation in conversations:
        for message in conversation:
            if not isinstance(message["content"], list):
                continue
            for ele in message["content"]:
                if ele["type"] == "audio":
                    if "audio" not in ele and "audio_url" not in ele:
                        raise ValueError(f"Unknown audio {ele}")
                    path = ele.get("audio", ele.get("audio_url"))
                    start, end = ele.get("audio_start", 0.0), ele.get("audio_end", None)
                    if isinstance(path, np.ndarray):
                        if path.ndim > 1:
                            raise ValueError("Support only mono audio")
                        stop = None if end is None else int(OMNI_SAMPLE_RATE * end)
                        audios.append(path[int(OMNI_SAMPLE_RATE * start):stop])
                        continue
                    audios.append(_omni_audio(path, start, end))
                elif use_audio_in_video and ele["type"] == "video":
                    if "video" not in ele and "video_url" not in ele:
                        raise ValueError(f"Unknown video {ele}")
                    path = ele.get("video", ele.get("video_url"))
                    audios.append(_omni_audio(path, ele.get("video_start", 0.0), ele.get("video_end", None)))
    return audios or None
