"""Video decoding with torchcodec, run inside the sandbox.

How frames are counted and indexed, for every loader
-----------------------------------------------------
Stock loaders take the frame count from the container header (decord, PyAV's
``stream.frames``, OpenCV) and then ask for frames by index. When the container lies
(an edit list after a stream-copy cut at a non-keyframe, a frame flagged for discard,
a truncated file), the header promises frames that never decode, and decord spins
forever looking for them (decord #373).

Here the count is what torchcodec's exact scan finds: the number of frames that the
file really holds (``num_frames_from_content``). The frame rate is that count divided by
the scanned stream duration (torchcodec's ``average_fps``), which equals the header's
average frame rate (decord's ``get_avg_fps()``) whenever the header is right. Each
loader then applies the stock sampling formula to that count and rate, so on an honest
file the indices are the stock ones, and on a lying file they are the ones stock
would pick if the header were right. Index ``i`` is the ``i``-th decodable frame in
presentation order, as in decord.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import config
from ..errors import MediaDecodeError, is_out_of_memory
from . import demuxers, guards, inputs


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int
    fps: float
    duration: float
    width: int
    height: int
    nominal_fps: float = 0.0  # the stream's r_frame_rate; what moviepy calls fps


class Seconds(list):
    """Sample times, returned by index rules of loaders that pick frames by time
    (moviepy). Each time gets the frame shown at that moment."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def decode_failure(label, exc: BaseException, what: str) -> BaseException:
    """The error for a decoder call that raised `exc`: a MemoryError when it was an
    allocation failure (so the caller reports the memory cap and replaces the sandbox),
    else MediaDecodeError("decode failed: ...")."""
    if is_out_of_memory(exc):
        return MemoryError(f"{what}: {_reason(exc)}")
    return MediaDecodeError(label, f"decode failed: {_reason(exc)}")


def open_video(label, data):
    """A torchcodec decoder over `data` (guarded path or bytes), and what the file holds.
    FFmpeg gets the file opened here, never its name, and only after its own probe picked
    an allowed demuxer (``demuxers.for_torchcodec``)."""
    from torchcodec.decoders import VideoDecoder

    pinned = demuxers.for_torchcodec(label, data)
    try:
        decoder = VideoDecoder(pinned, seek_mode="exact", dimension_order="NHWC",
                               num_ffmpeg_threads=config.decoder_threads())
    except Exception as exc:
        if is_out_of_memory(exc):
            raise MemoryError(f"opening the video: {_reason(exc)}") from None
        raise MediaDecodeError(label, f"cannot open video: {_reason(exc)}") from None
    meta = decoder.metadata
    num_frames = meta.num_frames_from_content or 0
    if num_frames <= 0:
        raise MediaDecodeError(label, "no decodable video frames")
    duration = meta.duration_seconds or 0.0
    fps = meta.average_fps or 0.0
    if not math.isfinite(fps) or fps <= 0:
        fps = meta.average_fps_from_header or 0.0
    if not math.isfinite(fps) or fps <= 0:
        raise MediaDecodeError(label, "stream reports zero fps and no usable duration")
    if not math.isfinite(duration) or duration <= 0:
        duration = num_frames / fps
    nominal = meta.average_fps_from_header
    nominal = float(nominal) if nominal and math.isfinite(nominal) and nominal > 0 else float(fps)
    return decoder, VideoInfo(num_frames, float(fps), float(duration), meta.width, meta.height, nominal)


def check_result(label, count: int, info: VideoInfo, limits: guards.Limits, pixel_bytes: int) -> None:
    """The caps on `count` frames before they are decoded: decoded pixels, and the bytes
    the caller will hold when each pixel costs it `pixel_bytes` (3 for an RGB array, 4
    for a PIL RGB image, which Pillow stores in 32 bits; 0: the caller gets something
    else, checked by whoever makes it)."""
    guards.check_pixels(label, count, info.height, info.width, limits)
    if pixel_bytes:
        guards.check_result_bytes(label, count * info.height * info.width * pixel_bytes,
                                  f"{count} frames of {info.width}x{info.height} at {pixel_bytes} bytes per pixel",
                                  limits)


def frames_at(label, decoder, info: VideoInfo, indices, limits: guards.Limits, pixel_bytes: int = 3):
    """uint8 array (N, H, W, 3) of the frames at `indices`, after the caps."""
    indices = [int(i) for i in indices]
    check_result(label, len(indices), info, limits, pixel_bytes)
    if not indices:
        raise MediaDecodeError(label, "no frames selected")
    bad = [i for i in indices if not 0 <= i < info.num_frames]
    if bad:
        raise MediaDecodeError(label, f"frame index {bad[0]} outside the {info.num_frames} decodable frames")
    try:
        batch = decoder.get_frames_at(indices)
    except Exception as exc:
        raise decode_failure(label, exc, f"decoding {len(indices)} frames of {info.width}x{info.height}") from None
    return batch.data.numpy()


def frames_played_at(label, decoder, info: VideoInfo, seconds, limits: guards.Limits, pixel_bytes: int = 3):
    """uint8 array (N, H, W, 3) of the frames shown at `seconds`, after the caps."""
    check_result(label, len(seconds), info, limits, pixel_bytes)
    if not seconds:
        raise MediaDecodeError(label, "no frames selected")
    meta = decoder.metadata
    first, last = meta.begin_stream_seconds or 0.0, meta.end_stream_seconds or info.duration
    seconds = [min(max(float(t), first), math.nextafter(last, first)) for t in seconds]
    try:
        batch = decoder.get_frames_played_at(seconds)
    except Exception as exc:
        raise decode_failure(label, exc, f"decoding {len(seconds)} frames of {info.width}x{info.height}") from None
    return batch.data.numpy()


def sample(source: inputs.Source, limits: guards.Limits, url_timeout, pick, *pick_args, pixel_bytes: int = 3):
    """Sandbox entry: open, choose frames with ``pick(info, *pick_args)``, decode them.

    `pick` returns frame indices, or `Seconds`. Returns (frames uint8 (N, H, W, 3),
    VideoInfo, the indices or times as a list). `pixel_bytes`: see ``check_result``."""
    data = inputs.materialize(source, limits, url_timeout)
    decoder, info = open_video(source.label, data)
    picked = pick(info, *pick_args)
    if isinstance(picked, Seconds):
        return frames_played_at(source.label, decoder, info, picked, limits, pixel_bytes), info, list(picked)
    indices = [int(i) for i in picked]
    return frames_at(source.label, decoder, info, indices, limits, pixel_bytes), info, indices


def load_images(sources, limits: guards.Limits, url_timeout):
    """Sandbox entry: a list of image inputs (a video given as frames) as one uint8 array."""
    import io

    import numpy as np
    from PIL import Image

    frames, held = [], 0
    for source in sources:
        if source.kind == "path":
            guards.check_regular(source.label, source.value)
        data = inputs.download(source.value, limits, url_timeout) if source.kind == "url" else source.value
        try:
            with Image.open(data if isinstance(data, str) else io.BytesIO(data)) as image:
                guards.check_pixels(source.label, len(sources), image.height, image.width, limits)
                held += image.height * image.width * 3
                guards.check_result_bytes(source.label, held, f"{len(frames) + 1} frames so far", limits)
                frames.append(np.asarray(image.convert("RGB")))
        except MediaDecodeError:
            raise
        except Exception as exc:
            raise MediaDecodeError(source.label, f"cannot load image: {_reason(exc)}") from None
    return np.stack(frames)
