"""Video decoding with PyAV, run inside the sandbox, always from the first packet on.

Two uses:

- The engine of the PyAV loader family (ms-swift's llava loader, transformers' pyav
  backend): the stock library itself, so the frames are the very pixels stock returns
  (same FFmpeg build, same ``to_ndarray(format="rgb24")`` conversion).
- The fallback where torchcodec decodes a valid file wrongly or not at all (see
  ``video.open_video``): a palette that the demuxer hands over once, on the first
  packet, and that any seek loses (paletted AVI/MOV: torchcodec and decord return black
  frames, stock PyAV too after its ``seek(0)``); a discarded leading keyframe
  (torchcodec < 0.16 starts from the wrong keyframe); field-coded interlaced video,
  counted one frame per field by a packet scan; any decode error of torchcodec.

Frames are counted twice: first the stream's packets (not flagged for discard, as
torchcodec's exact scan counts them) to choose indices, then the frames that really
decode, while decoding them. When the two differ (two fields per frame), the indices are
chosen again from the decoded count and the file decoded once more.
"""

from __future__ import annotations

import math

from ..errors import MediaDecodeError, decode_failure, short_reason
from . import demuxers
from .videoinfo import VideoInfo

# Codecs whose frames can be paletted (pal8) with the palette handed over out of band
# (packet side data, from the container's header): what torchcodec versions that do not
# report a pixel format are checked against.
PALETTE_CODECS = frozenset({"rawvideo", "qtrle", "smc", "msrle", "8bps", "msvideo1", "aasc", "tscc", "cinepak",
                            "idcin", "rpza", "zmbv", "flic", "qpeg", "tmv", "rl2", "cdgraphics", "anm", "bethsoftvid",
                            "interplayvideo", "kgv1", "mszh", "zlib", "rscc", "bmp"})
# Results this large are written into the sandbox's shared memory as they decode (the
# smallest block it lends is 1 MB; smaller ones travel in the message itself).
_IN_PLACE_MIN_BYTES = 1 << 20


def _rotate(frame, degrees: float):
    """`frame` (H, W, 3) turned upright as torchcodec turns it: counter-clockwise by
    `degrees`, a multiple of 90."""
    import numpy as np

    turns = round(degrees / 90) % 4
    return np.ascontiguousarray(np.rot90(frame, k=turns)) if turns else frame


class _Frames:
    """The decoded frames, written one by one into one array (as ``np.stack`` of them
    would be) made at the first frame; in a sandbox that array is in the shared memory
    the result is sent back through, so sending it copies nothing."""

    def __init__(self, count: int):
        self.count, self.frames, self._filled = count, None, [False] * count

    def put(self, positions, array) -> None:
        if self.frames is None:
            self.frames = _result_array((self.count, *array.shape), array.dtype)
        elif array.shape != self.frames.shape[1:]:  # a new size mid-stream
            raise ValueError(f"a frame of {array.shape} after frames of {self.frames.shape[1:]}")
        for position in positions:
            self.frames[position] = array
            self._filled[position] = True

    def missing(self) -> list[int]:
        return [k for k, filled in enumerate(self._filled) if not filled]


def _result_array(shape, dtype):
    import numpy as np

    from ..engine import sandbox

    count = math.prod(shape)
    size = count * np.dtype(dtype).itemsize
    buffer = sandbox.result_buffer(size) if size >= _IN_PLACE_MIN_BYTES else None
    if buffer is None:
        return np.empty(shape, dtype)
    return np.frombuffer(buffer, dtype, count).reshape(shape)


class PyAVVideo:
    """One video stream of one input, decoded in order from its first packet."""

    def __init__(self, label, data, stream_index: int | None = None, rotated: bool = False,
                 rotation: float | None = None, threads: int = 0):
        """`rotated`: turn frames upright by the stream's display matrix (`rotation`
        degrees counter-clockwise when the caller knows it, else read from the frames)."""
        self.label, self._data, self._rotated, self._threads = label, data, rotated, threads
        self._stream_index = stream_index
        self._rotation_known = rotation is not None
        self.rotation = float(rotation or 0.0)
        self._scan()

    def _open(self):
        try:
            container = demuxers.open_pyav(self.label, self._data)
        except MediaDecodeError as exc:
            if exc.reason.startswith("cannot open with"):
                raise MediaDecodeError(self.label, f"cannot open video: {exc.reason}") from None
            raise
        videos = container.streams.video
        if not videos:
            container.close()
            raise MediaDecodeError(self.label, "no video stream")
        if self._stream_index is None:
            self._stream_index = videos[0].index
        stream = next((s for s in videos if s.index == self._stream_index), None)
        if stream is None:
            container.close()
            raise MediaDecodeError(self.label, f"no video stream at index {self._stream_index}")
        if self._threads:
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = self._threads
        return container, stream

    def _scan(self) -> None:
        """Count the stream's frames from its packets, and the times they are shown."""
        container, stream = self._open()
        try:
            base = float(stream.time_base)
            self.width, self.height = stream.codec_context.width, stream.codec_context.height
            nominal = float(stream.guessed_rate or stream.average_rate or 0) or 0.0
            times, end, clock = [], None, 0.0
            for packet in container.demux(stream):
                if packet.size == 0 or getattr(packet, "is_discard", False):
                    continue
                # Raw elementary streams (H.264, HEVC Annex B) carry no timestamps: each
                # packet is shown when the one before it ends.
                stamp = packet.pts if packet.pts is not None else packet.dts
                start = stamp * base if stamp is not None else clock
                length = (packet.duration or 0) * base or (1 / nominal if nominal else 0.0)
                clock = start + length
                times.append(start)
                end = clock if end is None else max(end, clock)
        except MediaDecodeError:
            raise
        except Exception as exc:
            raise MediaDecodeError(self.label, f"cannot read video packets: {short_reason(exc)}") from None
        finally:
            container.close()
        self.info = self._info(len(times), min(times) if times else 0.0, end, nominal)
        if self.info.num_frames <= 0:
            raise MediaDecodeError(self.label, "no decodable video frames")
        self._nominal = nominal

    def _info(self, count: int, begin: float, end: float | None, nominal: float):
        duration = (end - begin) if end is not None and end > begin else 0.0
        fps = count / duration if duration > 0 else nominal
        if not math.isfinite(fps) or fps <= 0:
            raise MediaDecodeError(self.label, "stream reports zero fps and no usable duration")
        width, height = self.width, self.height
        if self._rotated and round(self.rotation / 90) % 2:
            width, height = height, width
        return VideoInfo(count, float(fps), float(duration or count / fps), width, height, nominal or float(fps))

    def _array(self, frame):
        array = frame.to_ndarray(format="rgb24")
        return _rotate(array, self.rotation) if self._rotated else array

    def decode(self, indices=None, seconds=None) -> tuple[object, int]:
        """(uint8 array (N, H, W, 3) of the frames at `indices`, or of the frames on
        screen `seconds` after the first one, and the frames the stream really holds).
        Decodes every frame: the count is checked on the way."""
        wanted = {}
        for position, index in enumerate(indices or ()):
            wanted.setdefault(int(index), []).append(position)
        # Times in order, each answered by the last frame shown at or before it.
        timed = sorted(range(len(seconds or ())), key=lambda k: seconds[k])
        out = _Frames(len(indices) if indices is not None else len(seconds))
        container, stream = self._open()
        count, previous, start = 0, None, None
        try:
            for frame in container.decode(stream):
                if count == 0 and not self._rotation_known:
                    self.rotation = float(getattr(frame, "rotation", 0) or 0)
                    self._rotation_known = True
                if timed:
                    shown = frame.time if frame.time is not None else count / (self._nominal or 1.0)
                    start = shown if start is None else start
                    while timed and previous is not None and start + seconds[timed[0]] + 1e-9 < shown:
                        out.put([timed.pop(0)], self._array(previous))
                    previous = frame
                positions = wanted.get(count)
                if positions:
                    out.put(positions, self._array(frame))
                count += 1
            while timed and previous is not None:
                out.put([timed.pop(0)], self._array(previous))
        except MediaDecodeError:
            raise
        except Exception as exc:
            raise decode_failure(self.label, exc, "decoding with PyAV", "PyAV") from None
        finally:
            container.close()
        missing = out.missing()
        if missing and indices is not None and count > max(int(i) for i in indices):
            raise MediaDecodeError(self.label, f"frame {indices[missing[0]]} did not decode")
        return (out.frames if not missing else None), count

    def recount(self, count: int) -> None:
        """The stream holds `count` frames (what decoding found), not what its packets
        said: the rate is that count over the same duration."""
        info = self.info
        fps = count / info.duration if info.duration > 0 else info.fps
        self.info = VideoInfo(count, float(fps), info.duration, info.width, info.height, info.nominal_fps)
