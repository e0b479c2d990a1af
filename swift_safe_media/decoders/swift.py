"""Safe twins of the media loaders in ms-swift 4.6.0 ``swift/template/vision_utils.py``.

Same names, signatures and return types as stock. Decoding runs in the sandbox
(torchcodec, soundfile); PIL images and tensors are built here, in the caller, from the
numpy arrays that come back through shared memory. Frame indices follow each stock
formula applied to the frames the file really holds: see ``decoders.video``.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..engine import calls as engine, held_memory
from . import audio as _audio
from . import families, guards, inputs, video


def _env_int(name: str, default: int) -> int:
    # ms-swift's get_env_args: the upper-cased name, parsed with the type.
    value = os.environ.get(name.upper())
    return default if value is None else int(value)


def _sample(media, family, pick, *pick_args, pixel_bytes=3):
    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    source = inputs.fetched(inputs.describe(media), limits, url_timeout)
    return engine.call(video.sample, source, limits, url_timeout, pick, *pick_args,
                       pixel_bytes=pixel_bytes, family=family, path=source.label)


# Pillow keeps an RGB pixel in 32 bits: what a list of PIL frames costs its holder.
PIL_PIXEL_BYTES = 4


def _sample_pil(media, family, pick, *pick_args):
    frames, _, _ = _sample(media, family, pick, *pick_args, pixel_bytes=PIL_PIXEL_BYTES)
    return _pil_list(frames)


def _pil_list(frames):
    """PIL RGB images of uint8 (N, H, W, 3) frames, as stock's fromarray(...).convert("RGB")
    makes them. fromarray already copies RGB into an image of its own, so the convert's
    second copy is skipped, and each decoded frame's pages are given back once copied:
    the caller never holds the frames twice."""
    from PIL import Image

    images = []
    for frame in frames:
        image = Image.fromarray(frame)
        if image.mode != "RGB":
            image = image.convert("RGB")
        images.append(image)
        if not image.readonly and not engine.in_sandbox():  # a copy, not a view on the frame
            held_memory.release_pages(frame)
    return images


# --- index rules: module level so the sandbox can unpickle them by name -------------

def internvl_indices(info: video.VideoInfo, bound, num_segments):
    max_frame = info.num_frames - 1
    start, end = bound if bound else (-100000, 100000)
    start_idx = max(0, round(start * info.fps))
    end_idx = min(round(end * info.fps), max_frame)
    seg_size = float(end_idx - start_idx) / num_segments
    return [int(start_idx + seg_size / 2 + np.round(seg_size * i)) for i in range(num_segments)]


def cogvlm2_indices(info: video.VideoInfo, num_frames):
    end_frame = min(info.num_frames, int(60 * info.fps))  # stock keeps the first 60 s
    return np.linspace(0, end_frame - 1, num_frames, dtype=int)


def llava_indices(info: video.VideoInfo, num_frames):
    # Stock keeps each decoded frame whose index is in the set: duplicates collapse.
    return np.unique(np.linspace(0, info.num_frames - 1, num_frames, dtype=int))


def minicpmv_indices(info: video.VideoInfo, max_num_frames):
    step = max(1, round(info.fps))
    indices = list(range(0, info.num_frames, step))
    if len(indices) > max_num_frames:
        gap = len(indices) / max_num_frames
        indices = [indices[int(i * gap + gap / 2)] for i in range(max_num_frames)]
    return indices


def valley_indices(info: video.VideoInfo):
    return np.linspace(0, info.num_frames - 1, 8).astype(np.int_)


def _moviepy_frame_count(info: video.VideoInfo) -> int:
    # moviepy: int(fps * duration), fps being the nominal rate and duration what ffmpeg
    # prints, cut to 10 ms. At least 1: stock returns [] for a one-frame clip.
    return max(1, int(info.nominal_fps * (math.floor(info.duration * 100) / 100)))


def _moviepy_times(info: video.VideoInfo, indices) -> video.Seconds:
    # moviepy reads ffmpeg's output resampled to the nominal rate: frame k of it is the
    # source frame on screen half a frame after k / fps (ffmpeg rounds to the nearest slot).
    return video.Seconds((k + 0.5) / info.nominal_fps for k in indices)


def ovis2_indices(info: video.VideoInfo, num_frames):
    total = _moviepy_frame_count(info)
    if total <= num_frames:
        return _moviepy_times(info, range(total))
    stride = total / num_frames
    return _moviepy_times(info, [min(total - 1, int((stride * i + stride * (i + 1)) / 2)) for i in range(num_frames)])


def ovis2_5_indices(info: video.VideoInfo, num_frames):
    total = _moviepy_frame_count(info)
    return _moviepy_times(info, [int(i * total / num_frames) for i in range(num_frames)])


def all_indices(info: video.VideoInfo):
    return list(range(info.num_frames))


def vllm_indices(info: video.VideoInfo, num_frames):
    if num_frames <= 0 or num_frames > info.num_frames:
        num_frames = info.num_frames
    return np.linspace(0, info.num_frames - 1, num_frames, dtype=int)


# --- the twins ------------------------------------------------------------------------

def load_video_internvl(video, bound=None, num_segments=32):
    """list of PIL RGB images, ``num_segments`` of them, as stock (decord)."""
    return _sample_pil(video, families.DECORD, internvl_indices, bound, num_segments)


def load_video_cogvlm2(video):
    """torch.uint8 tensor (C, T, H, W); T is ``NUM_FRAMES`` (24), from the first 60 s."""
    import torch
    frames, _, _ = _sample(video, families.DECORD, cogvlm2_indices, _env_int("num_frames", 24))
    return torch.from_numpy(frames).permute(3, 0, 1, 2)


def load_video_llava(video):
    """uint8 ndarray (T, H, W, 3); T <= ``NUM_FRAMES`` (16) since repeated indices collapse."""
    frames, _, _ = _sample(video, families.PYAV, llava_indices, _env_int("num_frames", 16))
    return frames


def load_video_minicpmv_mplug_owl3(video, max_num_frames):
    """list of PIL images: one frame per second, at most ``max_num_frames``."""
    return _sample_pil(video, families.DECORD, minicpmv_indices, max_num_frames)


def load_video_valley(video):
    """list of 8 PIL RGB images, evenly spaced."""
    return _sample_pil(video, families.DECORD, valley_indices)


def load_video_ovis2(video_path, num_frames):
    """list of PIL RGB images (stock: moviepy), at most ``num_frames``, picked by time
    on the nominal frame rate as moviepy does (the same frames on constant-rate video)."""
    return _sample_pil(video_path, families.MOVIEPY, ovis2_indices, num_frames)


def load_video_ovis2_5(video_path, num_frames):
    """list of ``num_frames`` PIL RGB images (stock: moviepy)."""
    return _sample_pil(video_path, families.MOVIEPY, ovis2_5_indices, num_frames)


def load_video_hf(videos):
    """(list of uint8 (T, H, W, 3) arrays, list of transformers VideoMetadata or None).

    A video given as a list of image files becomes their stack (metadata None); a file
    is decoded whole, as transformers' ``load_video`` does without num_frames or fps."""
    from transformers.video_utils import VideoMetadata

    backend = os.environ.get("VIDEO_LOAD_BACKEND", "pyav")
    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    res, metadata = [], []
    for item in videos:
        if isinstance(item, (list, tuple)) and isinstance(item[0], str):
            sources = [inputs.fetched(inputs.describe(name), limits, url_timeout) for name in item]
            res.append(engine.call(video.load_images, sources, limits, url_timeout, path=sources[0].label))
            metadata.append(None)
            continue
        if not isinstance(item, str):  # decoded frames pass through, as in transformers
            res.append(item)
            metadata.append([None] * len(item))
            continue
        source = inputs.fetched(inputs.describe(item), limits, url_timeout)
        frames, info, indices = engine.call(video.sample, source, limits, url_timeout, all_indices,
                                            family=families.HF_BACKENDS.get(backend, families.PYAV),
                                            path=source.label)
        res.append(frames)
        metadata.append(VideoMetadata(total_num_frames=info.num_frames, fps=info.fps,
                                      duration=info.num_frames / info.fps, video_backend=backend,
                                      height=info.height, width=info.width,
                                      frames_indices=np.asarray(indices)))
    return res, metadata


def load_vllm_video(path, num_frames=-1):
    """(uint8 ndarray (T, H, W, 3), metadata dict) as stock's OpenCV reader returns."""
    frames, info, indices = _sample(path, families.OPENCV, vllm_indices, num_frames)
    return frames, {
        "total_num_frames": info.num_frames,
        "fps": info.fps,
        "duration": info.num_frames / info.fps,
        "video_backend": "opencv",
        "frames_indices": [int(i) for i in indices],
        "do_sample_frames": len(indices) == info.num_frames,
    }


def load_audio(audio, sampling_rate, return_sr=False, mono=True):
    """float32 samples (and the rate if ``return_sr``), for both ``SWIFT_AUDIO_LOAD_BACKEND`` values."""
    backend = os.environ.get("SWIFT_AUDIO_LOAD_BACKEND", "librosa")
    if backend == "librosa":
        entry = _audio.load
    elif backend == "soundfile_pyav":
        entry = _audio.load_soundfile_pyav
    else:
        raise ValueError(f"Unknown audio load backend {backend!r}. Supported: librosa, soundfile_pyav")
    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()
    source = inputs.fetched(inputs.describe(audio), limits, url_timeout)
    # librosa 1.x reads only what libsndfile opens: so does its twin.
    extra = {"libsndfile_only": _audio.librosa_without_audioread()} if entry is _audio.load else {}
    res = engine.call(entry, source, limits, url_timeout, sampling_rate, mono, path=source.label, **extra)
    return res if return_sr else res[0]
