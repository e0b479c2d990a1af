"""What a video stream holds, as the index rules of the loaders see it."""

from __future__ import annotations

from dataclasses import dataclass


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
