"""Which stream a stock loader decodes, and whether it shows rotated video upright:
one rule per loader family, the same for every twin of that family.

Stock loaders differ on files with several video or audio streams and on a rotation
flag (the display matrix a phone writes instead of turning the pixels), and each twin
does what its own stock loader does:

=========== ========================================== =============================== =======
family      stock loaders                              video stream                    rotated
=========== ========================================== =============================== =======
decord      internvl, cogvlm2, minicpmv, valley;       FFmpeg 4.1's best stream (what  yes
            qwen with FORCE_QWENVL_VIDEO_READER=decord decord bundles): highest bit
                                                       rate, dispositions ignored
pyav        llava, hf (VIDEO_LOAD_BACKEND pyav or      the first video stream          no
            torchvision)
opencv      vllm; hf with opencv                       the first video stream          yes
moviepy     ovis2, ovis2_5                             the first video stream (whose   yes
                                                       size and rate moviepy reads)
torchcodec  qwen_vl_utils / qwen_omni_utils (default), FFmpeg's best stream (default    yes
            hf with torchcodec                         disposition first)
=========== ========================================== =============================== =======

Audio: librosa reads a container through audioread's ``ffmpeg`` pipe, which takes the
stream the ffmpeg command line maps (default disposition first, then the most
channels); ms-swift's soundfile_pyav backend takes the first audio stream.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST, BEST, HIGHEST_BITRATE, COMMAND_LINE = "first", "best", "highest-bitrate", "command-line"


@dataclass(frozen=True)
class Family:
    name: str
    video_stream: str  # FIRST, BEST or HIGHEST_BITRATE
    rotated: bool  # frames turned upright by the stream's display matrix, as stock returns them
    engine: str  # "torchcodec", or "pyav": the stock library itself, for bit-identical frames
    # The frame rate stock reads: the header's average rate (decord's get_avg_fps, OpenCV's
    # CAP_PROP_FPS, moviepy's and PyAV's stream rate), or torchcodec's own average_fps, which
    # it measures from the frames' timestamps.
    header_rate: bool = True


DECORD = Family("decord", HIGHEST_BITRATE, True, "torchcodec")
PYAV = Family("pyav", FIRST, False, "pyav")
OPENCV = Family("opencv", FIRST, True, "torchcodec")
MOVIEPY = Family("moviepy", FIRST, True, "torchcodec")
TORCHCODEC = Family("torchcodec", BEST, True, "torchcodec", header_rate=False)

# transformers' load_video backends (ms-swift's VIDEO_LOAD_BACKEND) -> the family that decodes.
HF_BACKENDS = {"pyav": PYAV, "torchvision": PYAV, "decord": DECORD, "opencv": OPENCV, "torchcodec": TORCHCODEC}


@dataclass(frozen=True)
class StreamInfo:
    """What a rule needs to know of one stream of the wanted type."""
    index: int  # the stream's index in the container
    bit_rate: float = 0.0
    frames: int | None = None  # frames the header promises (video), None if it does not say
    channels: int = 0  # audio
    default: bool | None = None  # disposition flag, None where unknown


def pick_video(streams: list[StreamInfo], rule: str, best: int | None) -> int | None:
    """The container index of the video stream `rule` takes among `streams` (video
    streams in container order); `best` is FFmpeg's own best stream. None: no stream."""
    if not streams:
        return None
    if rule == FIRST:
        return streams[0].index
    if rule == HIGHEST_BITRATE:
        # FFmpeg 4.1's av_find_best_stream: a stream with at least 5 frames seen while
        # probing beats one with fewer (a cover picture), then the higher bit rate, then
        # the first. Frames seen while probing are estimated from the header's count.
        def rank(item):
            position, stream = item
            frames = 5 if stream.frames is None else min(5, stream.frames)
            return frames, stream.bit_rate or 0.0, -position
        return max(enumerate(streams), key=rank)[1].index
    return best if best is not None else streams[0].index


def pick_audio(streams: list[StreamInfo], rule: str, best: int | None) -> int | None:
    """The container index of the audio stream `rule` takes: FIRST (PyAV's
    ``streams.audio[0]``), COMMAND_LINE (what ``ffmpeg -i`` maps: the default
    disposition, then the most channels, then the first), or BEST (FFmpeg's)."""
    if not streams:
        return None
    if rule == FIRST:
        return streams[0].index
    if rule == COMMAND_LINE:
        return max(enumerate(streams),
                   key=lambda item: (bool(item[1].default), item[1].channels, -item[0]))[1].index
    return best if best is not None else streams[0].index
