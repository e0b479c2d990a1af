"""Video decoding, run inside the sandbox: torchcodec, or PyAV where that is what stock
uses or where torchcodec cannot decode a file right.

How frames are counted and indexed, for every loader
-----------------------------------------------------
Stock loaders take the frame count from the container header (decord, PyAV's
``stream.frames``, OpenCV) and then ask for frames by index. When the container lies
(an edit list after a stream-copy cut at a non-keyframe, a frame flagged for discard,
a truncated file), the header promises frames that never decode, and decord spins
forever looking for them (decord #373).

Here the count is what the file really holds: torchcodec's exact scan
(``num_frames_from_content``), or, with PyAV, the frames that decode. The frame rate is
the header's average rate where it holds for that count (what decord's ``get_avg_fps()``,
OpenCV and moviepy read), else that count divided by the scanned stream duration; the
torchcodec family keeps torchcodec's own measured ``average_fps``, as its stock does. Each loader then
applies the stock sampling formula to that count and rate, so on an honest file the
indices are the stock ones, and on a lying file they are the ones stock would pick if
the header were right. Index ``i`` is the ``i``-th decodable frame in presentation order.

Which stream, and whether rotated video is turned upright, follows the loader's family
(``families``). Wrong pixels never pass silently: a file torchcodec is known to decode
wrongly (a palette, a discarded leading keyframe) goes to PyAV before any frame is
decoded, and a torchcodec error or frames whose timestamps do not match the indices
asked for send the same call to PyAV, inside the same sandbox and timeout.
"""

from __future__ import annotations

import math

from .. import config
from ..errors import MediaDecodeError, is_out_of_memory, short_reason, typed_entry
from . import demuxers, families, guards, inputs
from .families import Family
from .pyav_video import PALETTE_CODECS, PyAVVideo
from .videoinfo import Seconds, VideoInfo  # noqa: F401  (the names loaders and tests use)


class Untrusted(Exception):
    """torchcodec cannot decode this file right; the message says why. Carries the
    stream torchcodec chose and its rotation, for the fallback to decode the same."""

    def __init__(self, reason: str, stream_index: int | None = None, rotation: float | None = None):
        super().__init__(reason)
        self.stream_index, self.rotation = stream_index, rotation


class Recounted(Exception):
    """Decoding found another frame count than the packets promised: choose again."""


def _check_indices(label, indices, num_frames: int) -> None:
    bad = [i for i in indices if not 0 <= i < num_frames]
    if bad:
        raise MediaDecodeError(label, f"frame index {bad[0]} outside the {num_frames} decodable frames")


def _torchcodec_version() -> tuple[int, int]:
    import torchcodec

    try:
        major, minor = torchcodec.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return (0, 0)


# torchcodec 0.16 seeks right when the first keyframe is flagged for discard (#1504);
# before it, frames up to the next keyframe come back as that keyframe, silently.
_SEEKS_FROM_DISCARDED_KEYFRAME = (0, 16)


def _video_streams(decoder) -> tuple[list[families.StreamInfo], int | None]:
    """(the input's video streams, FFmpeg's best one) from torchcodec's container
    metadata; ([], None) where this torchcodec does not tell."""
    try:
        from torchcodec import _core

        container = _core.get_container_metadata(decoder._decoder)
    except Exception:
        return [], None
    streams = [families.StreamInfo(s.stream_index, float(s.bit_rate or 0), s.num_frames_from_header)
               for s in container.streams if type(s).__name__ == "VideoStreamMetadata"]
    return streams, container.best_video_stream_index


class TorchcodecVideo:
    """One video stream decoded by torchcodec, with the checks that keep it honest."""

    def __init__(self, label, data, family: Family):
        self.label, self.family = label, family
        self.input_bytes = guards.input_size(data)  # for the decompression cap
        decoder = self._decoder(data, None)
        streams, best = _video_streams(decoder)
        wanted = families.pick_video(streams, family.video_stream, best)
        if wanted is not None and wanted != decoder.stream_index:
            decoder = self._decoder(data, wanted)
        self.decoder, meta = decoder, decoder.metadata
        self.stream_index = decoder.stream_index
        self.rotation = getattr(meta, "rotation", None)  # None: this torchcodec does not rotate
        self._check_trusted(meta)
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
        if family.header_rate and nominal != fps and abs(num_frames / nominal - duration) <= 1.001 / nominal:
            # The header's rate holds for the frames the file has: what stock reads. Where a
            # container keeps no frame durations (FLV, ASF), the scanned duration ends where
            # the last frame starts, one frame short, and count / duration would be off
            # (30 frames at 25 fps measured as 25.86): minicpmv's step and moviepy's count moved.
            fps, duration = nominal, num_frames / nominal
        width, height = meta.width, meta.height
        if self._unturn() % 2:
            width, height = height, width
        self.info = VideoInfo(num_frames, float(fps), float(duration), width, height, nominal)
        self._begin = meta.begin_stream_seconds_from_content

    def _decoder(self, data, stream_index):
        from torchcodec.decoders import VideoDecoder

        pinned = demuxers.for_torchcodec(self.label, data)
        try:
            return VideoDecoder(pinned, stream_index=stream_index, seek_mode="exact", dimension_order="NHWC",
                                num_ffmpeg_threads=config.decoder_threads())
        except Exception as exc:
            if is_out_of_memory(exc):
                raise MemoryError(f"opening the video: {short_reason(exc)}") from None
            # A valid file torchcodec cannot open (a raw H.264 stream it cannot seek in):
            # PyAV reads it from the start, or says why it cannot either.
            raise Untrusted(f"cannot open video: {short_reason(exc)}", stream_index) from None

    def _check_trusted(self, meta) -> None:
        pixel_format = getattr(meta, "pixel_format", None)
        if pixel_format == "pal8" or (pixel_format is None and meta.codec in PALETTE_CODECS):
            raise Untrusted(f"paletted video ({meta.codec}, {pixel_format or 'pixel format unknown'}): torchcodec "
                            "loses a palette the container hands over once", self.stream_index, self.rotation)
        if _torchcodec_version() < _SEEKS_FROM_DISCARDED_KEYFRAME:
            try:
                from torchcodec import _core

                keyframes = _core._get_key_frame_indices(self.decoder._decoder)
            except Exception:
                keyframes = None
            if keyframes is not None and len(keyframes) and int(keyframes[0]) != 0:
                raise Untrusted("the first keyframe is flagged for discard (a stream-copy cut): this torchcodec "
                                "returns a later keyframe for the frames before it", self.stream_index, self.rotation)

    def _unturn(self) -> int:
        """Quarter turns clockwise that undo torchcodec's rotation, for a family that
        returns frames as stored (0 when the family rotates, or nothing was rotated)."""
        if self.family.rotated or not self.rotation:
            return 0
        return round(self.rotation / 90) % 4

    def decode_into(self, picked, consume, step: int | None = None) -> None:
        """Decode the frames at `picked` (indices, or ``Seconds``), `step` at a time,
        and hand each batch to ``consume(first position, uint8 (n, H, W, 3))``."""
        import numpy as np

        by_time = isinstance(picked, Seconds)
        picked = [float(t) for t in picked] if by_time else [int(i) for i in picked]
        if not by_time:
            _check_indices(self.label, picked, self.info.num_frames)
        step = step or max(1, len(picked))
        for start in range(0, len(picked), step):
            chunk, probe = picked[start:start + step], False
            try:
                if by_time:
                    # moviepy's times count from the stream's start (ffmpeg -ss), not from 0:
                    # an MPEG-TS or program stream starts later.
                    meta = self.decoder.metadata
                    first, last = meta.begin_stream_seconds or 0.0, meta.end_stream_seconds or self.info.duration
                    times = [min(max(first + float(t), first), math.nextafter(last, first)) for t in chunk]
                    batch = self.decoder.get_frames_played_at(times)
                else:
                    # Index 0 is always asked for too, once: the frame that comes back for it
                    # must be the stream's first, or every index is off (``_check_times``).
                    probe = start == 0 and 0 not in chunk and self._begin is not None
                    batch = self.decoder.get_frames_at([0, *chunk] if probe else chunk)
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise MemoryError(f"decoding {len(chunk)} frames of {self.info.width}x{self.info.height}: "
                                      f"{short_reason(exc)}") from None
                raise Untrusted(f"torchcodec failed: {short_reason(exc)}", self.stream_index, self.rotation) from None
            frames = batch.data.numpy()
            if by_time:
                self._check_played(times, batch.pts_seconds.tolist(), batch.duration_seconds.tolist())
            elif probe:
                self._check_times([0, *chunk], batch.pts_seconds.tolist())
                frames = frames[1:]
            else:
                self._check_times(chunk, batch.pts_seconds.tolist())
            turns = self._unturn()
            if turns:
                frames = np.ascontiguousarray(np.rot90(frames, k=-turns, axes=(1, 2)))
            consume(start, frames)

    def _check_played(self, wanted, times, durations) -> None:
        """Each frame that came back for a time must be on screen at that time."""
        for at, start, length in zip(wanted, times, durations):
            if not start - 1e-6 <= at < start + max(length, 0.0) + 1e-6:
                raise Untrusted(f"torchcodec returned the frame shown from {start:.3f} s for the time {at:.3f} s",
                                self.stream_index, self.rotation)

    def _check_times(self, indices, times) -> None:
        """The frames that came back must be the ones asked for: a later index shows a
        later frame, and index 0 the first one."""
        order = sorted(range(len(indices)), key=lambda k: indices[k])
        for a, b in zip(order, order[1:]):
            if indices[b] > indices[a] and not times[b] > times[a]:
                raise Untrusted(f"torchcodec returned the same or an earlier frame (at {times[b]:.3f} s) for index "
                                f"{indices[b]} than for index {indices[a]} (at {times[a]:.3f} s)",
                                self.stream_index, self.rotation)
        if self._begin is not None and 0 in indices and abs(times[indices.index(0)] - self._begin) > 1e-6:
            raise Untrusted(f"torchcodec returned the frame at {times[indices.index(0)]:.3f} s for index 0, "
                            f"which is shown at {self._begin:.3f} s", self.stream_index, self.rotation)


class PyAVReader:
    """``pyav_video.PyAVVideo`` behind the same ``decode_into`` as ``TorchcodecVideo``."""

    def __init__(self, label, data, family: Family, stream_index=None, rotation=None, why: str | None = None):
        try:
            import av  # noqa: F401
        except ImportError:
            need = f"{why}; decoding it needs PyAV" if why else f"the {family.name} loaders decode with PyAV"
            raise MediaDecodeError(label, f"{need}, which is not installed (pip install av)") from None
        self.label, self.family, self.why = label, family, why
        self.input_bytes = guards.input_size(data)
        try:
            self.video = PyAVVideo(label, data, stream_index, rotated=family.rotated, rotation=rotation,
                                   threads=config.decoder_threads())
        except MediaDecodeError as exc:
            raise self._failed(exc) from None
        self.info = self.video.info

    def _failed(self, exc: MediaDecodeError) -> MediaDecodeError:
        """A fallback that fails too: the reason torchcodec was left, then PyAV's."""
        if not self.why:
            return exc
        return MediaDecodeError(self.label, f"{self.why}; PyAV could not decode it either: {exc.reason}")

    def decode_into(self, picked, consume, step: int | None = None) -> None:
        indices = seconds = None
        if isinstance(picked, Seconds):
            seconds = [float(t) for t in picked]
        else:
            indices = [int(i) for i in picked]
            _check_indices(self.label, indices, self.info.num_frames)
        try:
            frames, count = self.video.decode(indices, seconds)
        except MediaDecodeError as exc:
            raise self._failed(exc) from None
        if count != self.info.num_frames:
            if count <= 0:
                raise MediaDecodeError(self.label, "no decodable video frames")
            self.video.recount(count)
            self.info = self.video.info
            raise Recounted()
        step = step or max(1, len(frames))
        for start in range(0, len(frames), step):
            consume(start, frames[start:start + step])


def open_video(label, data, family: Family = families.TORCHCODEC):
    """A reader over `data` (guarded path or bytes) for `family`: torchcodec, or PyAV
    where the family decodes with it or torchcodec cannot decode this file right.
    FFmpeg gets the file opened here, never its name, and only after its own probe
    picked an allowed demuxer (``demuxers``)."""
    if family.engine == "pyav":
        try:
            return PyAVReader(label, data, family)
        except MediaDecodeError as exc:
            if "not installed" not in exc.reason:
                raise
            # No PyAV: torchcodec, the first stream, frames as stored (what PyAV returns).
    try:
        return TorchcodecVideo(label, data, family)
    except Untrusted as exc:
        return _fallback(label, data, family, exc)


def _fallback(label, data, family: Family, exc: Untrusted):
    return PyAVReader(label, data, family, stream_index=exc.stream_index, rotation=exc.rotation, why=str(exc))


def decode(label, data, family: Family, pick, deliver, reader=None):
    """Choose frames with ``pick(info)`` and decode them with ``deliver(reader, info,
    picked)``; on a torchcodec that cannot be trusted with this file, the same with
    PyAV; when decoding finds another frame count, the choice again. Returns
    (deliver's result, info, picked)."""
    reader = reader or open_video(label, data, family)
    for _ in range(3):
        info = reader.info
        picked = pick(info)
        try:
            return deliver(reader, info, picked), info, picked
        except Untrusted as exc:
            reader = _fallback(label, data, family, exc)
        except Recounted:
            continue
    raise MediaDecodeError(label, "frame count kept changing while decoding")


def check_result(label, count: int, info: VideoInfo, limits: guards.Limits, pixel_bytes: int,
                 input_bytes: int | None = None) -> None:
    """The caps on `count` frames before they are decoded: decoded pixels, their RGB bytes
    against the `input_bytes` they come from (``guards.check_expansion``), and the bytes
    the caller will hold when each pixel costs it `pixel_bytes` (3 for an RGB array, 4
    for a PIL RGB image, which Pillow stores in 32 bits; 0: the caller gets something
    else, checked by whoever makes it)."""
    guards.check_pixels(label, count, info.height, info.width, limits)
    guards.check_expansion(label, count * info.height * info.width * 3,
                           f"{count} frames of {info.width}x{info.height} as RGB", input_bytes, limits)
    if pixel_bytes:
        guards.check_result_bytes(label, count * info.height * info.width * pixel_bytes,
                                  f"{count} frames of {info.width}x{info.height} at {pixel_bytes} bytes per pixel",
                                  limits)


def _gather(label, limits, pixel_bytes):
    """A ``deliver`` that checks the caps and returns the frames as one uint8 array."""
    import numpy as np

    def deliver(reader, info, picked):
        check_result(label, len(picked), info, limits, pixel_bytes, reader.input_bytes)
        if not len(picked):
            raise MediaDecodeError(label, "no frames selected")
        parts = []
        reader.decode_into(picked, lambda start, frames: parts.append(frames))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    return deliver


@typed_entry
def sample(source: inputs.Source, limits: guards.Limits, url_timeout, pick, *pick_args, pixel_bytes: int = 3,
           family: Family = families.TORCHCODEC):
    """Sandbox entry: open, choose frames with ``pick(info, *pick_args)``, decode them.

    `pick` returns frame indices, or `Seconds`. Returns (frames uint8 (N, H, W, 3),
    VideoInfo, the indices or times as a list). `pixel_bytes`: see ``check_result``;
    `family`: whose stream and rotation rules apply (``families``)."""
    data = inputs.materialize(source, limits, url_timeout)
    frames, info, picked = decode(source.label, data, family, lambda info: pick(info, *pick_args),
                                  _gather(source.label, limits, pixel_bytes))
    if isinstance(picked, Seconds):
        return frames, info, list(picked)
    return frames, info, [int(i) for i in picked]


@typed_entry
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
            raise MediaDecodeError(source.label, f"cannot load image: {short_reason(exc)}") from None
    return np.stack(frames)
