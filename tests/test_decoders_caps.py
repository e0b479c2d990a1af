"""Caps and typed errors on every twin (issue 34).

- A decompression bomb (8 frames of 8192x8192 FFV1, one a second, in a 134 KB file; half an hour of
  silence in FLAC blocks of 65535 samples) is refused through each loader, before
  decoding, with a cap's message (the decompression cap's, unless another is hit
  first), and the caller does not grow.
- Inputs that make soundfile, PyAV, torchcodec, PIL and soxr raise their own exceptions
  (each one checked against the library itself first) come out of every twin as a
  decode or a MediaDecodeError naming the file: never another type.
"""

from __future__ import annotations

import os
import random
import resource
import struct
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import realworld as rw  # noqa: E402

import swift_safe_media.decoders as safe  # noqa: E402
from swift_safe_media.errors import MediaDecodeError, typed_entry  # noqa: E402

VIDEO_TWINS = list(rw.VIDEO_CASES)
AUDIO_TWINS = rw.AUDIO_CASES


def ffmpeg(*args):
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True, timeout=300)


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bombs")
    video, flac_in_mkv, flac = folder / "ffv1_8k.mkv", folder / "silence.mka", folder / "silence.flac"
    ffmpeg("-f", "lavfi", "-i", "color=c=0x336699:size=8192x8192:rate=1", "-frames:v", "8", "-c:v", "ffv1",
           str(video))
    silence = ["-f", "lavfi", "-i", "anullsrc=r=48000:cl=stereo", "-t", "1800", "-c:a", "flac", "-frame_size", "65535"]
    ffmpeg(*silence, str(flac))
    ffmpeg(*silence, str(flac_in_mkv))  # Matroska: torchcodec's path, not libsndfile's
    small = {"small.mp4": ["-f", "lavfi", "-i", "testsrc2=size=64x48:rate=10:duration=1", "-c:v", "libx264"],
             "small.mka": ["-f", "lavfi", "-i", "sine=sample_rate=16000:duration=0.5", "-c:a", "flac"]}
    for name, args in small.items():
        ffmpeg(*args, str(folder / name))
    return {"video": str(video), "flac": str(flac), "mka": str(flac_in_mkv), "small.mp4": str(folder / "small.mp4"),
            "small.mka": str(folder / "small.mka")}


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _refused_as_a_bomb(case, path, warm_up):
    rw.run_case(False, case, warm_up)  # the loader's imports (torch, transformers) are not the bomb's
    before = _peak_kib()
    with pytest.raises(MediaDecodeError) as caught:
        rw.run_case(False, case, path)
    assert path in str(caught.value)
    # The decompression cap, or one that is hit first (cogvlm2's 24 frames: the pixel cap).
    assert "cap exceeded" in caught.value.reason and "(SWIFT_SAFE_MEDIA_MAX_" in caught.value.reason, \
        caught.value.reason
    assert (_peak_kib() - before) < 64 << 10  # refused before anything reached the caller


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", VIDEO_TWINS)
def test_a_video_bomb_is_refused_by_every_video_twin(bombs, case):
    assert os.path.getsize(bombs["video"]) < 200_000
    _refused_as_a_bomb(case, bombs["video"], bombs["small.mp4"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("container", ["flac", "mka"])
@pytest.mark.parametrize("case", AUDIO_TWINS)
def test_an_audio_bomb_is_refused_by_every_audio_twin(bombs, case, container):
    # 30 minutes (under the duration cap) of stereo 48 kHz: 691 MB as float32, from ~40 KB.
    _refused_as_a_bomb(case, bombs[container], bombs["small.mka"])


def test_the_expansion_cap_can_be_raised(bombs, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_EXPANSION", "0")
    y = safe.load_audio(bombs["flac"], 16000)
    assert y.shape == (1800 * 16000,) and not np.any(y)


# --- every library's own exceptions, typed ----------------------------------------------

def _noise(length: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.getrandbits(8) for _ in range(length))


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """name -> path of inputs each of which makes a decoding library raise its own error."""
    folder = tmp_path_factory.mktemp("broken")
    tone = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=1"]
    clip = ["-f", "lavfi", "-i", "testsrc2=size=64x48:rate=10:duration=1"]
    ffmpeg(*tone, str(folder / "tone.flac"))
    ffmpeg(*tone, str(folder / "tone.wav"))
    ffmpeg(*clip, "-c:v", "libx264", "-pix_fmt", "yuv420p", str(folder / "clip.mp4"))
    ffmpeg(*clip, "-f", "gif", str(folder / "clip.gif"))
    made = {}
    flac = (folder / "tone.flac").read_bytes()
    made["noise_frames.flac"] = flac[:200] + _noise(20000, 1)  # STREAMINFO kept, frames noise
    mp4 = (folder / "clip.mp4").read_bytes()
    at = mp4.find(b"mdat") + 4
    made["noise_payload.mp4"] = mp4[:at] + _noise(len(mp4) - at, 2)
    gif = (folder / "clip.gif").read_bytes()
    made["cut.gif"] = gif[:len(gif) // 3]
    wav = bytearray((folder / "tone.wav").read_bytes())
    wav[20:22] = struct.pack("<H", 0x31)  # says GSM 6.10, holds PCM
    made["gsm_tag_on_pcm.wav"] = bytes(wav)
    wav[20:24] = struct.pack("<HH", 1, 0)  # PCM with zero channels
    made["zero_channels.wav"] = bytes(wav)
    paths = {}
    for name, data in made.items():
        (folder / name).write_bytes(data)
        paths[name] = str(folder / name)
    return paths


def _soundfile(path):
    import soundfile

    soundfile.read(path)


def _pyav(path):
    import av

    with av.open(path) as container:
        for _ in container.decode():
            pass


def _torchcodec(path):
    from torchcodec.decoders import AudioDecoder, VideoDecoder

    try:
        decoder = VideoDecoder(path)
        decoder.get_frames_at(list(range(decoder.metadata.num_frames)))
    except ValueError:  # no video stream: the audio decoder's error then
        AudioDecoder(path).get_all_samples()


def _pil(path):
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        for frame in ImageSequence.Iterator(image):
            frame.convert("RGB")


# input -> the libraries that raise their own exception types on it.
RAISES = {
    "noise_frames.flac": [_soundfile, _torchcodec],
    "noise_payload.mp4": [_soundfile, _pyav, _torchcodec, _pil],
    "cut.gif": [_soundfile, _torchcodec, _pil],
    "gsm_tag_on_pcm.wav": [_soundfile, _pyav, _torchcodec],
    "zero_channels.wav": [_soundfile, _pyav, _torchcodec],
}


def _typed_or_decoded(case, path):
    try:
        rw.run_case(False, case, path)
    except MediaDecodeError as exc:
        assert path in str(exc) and exc.reason, exc
    # Any other exception type fails the test as it propagates.


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RAISES))
def test_every_twin_types_what_each_library_raises(broken, name):
    path = broken[name]
    for library in RAISES[name]:
        with pytest.raises(Exception) as raised:  # the library itself, stock's way
            library(path)
        assert not isinstance(raised.value, MediaDecodeError)
    for case in VIDEO_TWINS + AUDIO_TWINS:
        _typed_or_decoded(case, path)


def test_pil_errors_in_a_list_of_frames_are_typed(broken):
    """A video given as image files (a GIF cut short): PIL raises OSError in stock."""
    frames = [broken["cut.gif"], broken["cut.gif"]]
    with pytest.raises(OSError):
        _pil(broken["cut.gif"])
    for load in (lambda: safe.load_video_hf([frames]), lambda: safe.fetch_video({"video": frames})):
        with pytest.raises(MediaDecodeError) as caught:
            load()
        assert broken["cut.gif"] in str(caught.value)


class _Input:
    label = "/data/clip.wav"


def test_soxr_errors_are_typed():
    """No file reaches soxr's own refusals (rates are positive integers, a WAV holds at
    most 65535 channels, soxr takes 65536): the twins' resampling step, under the same
    wrapper as every sandbox entry, with an input that makes soxr raise."""
    from swift_safe_media.decoders import audio

    too_many_channels = np.zeros((70000, 2), np.float32)  # (channels, samples), as the twins hold audio
    with pytest.raises(ValueError, match="Channel num"):
        audio.resample(too_many_channels, 8000, 16000)
    entry = typed_entry(lambda source: audio.resample(too_many_channels, 8000, 16000))
    with pytest.raises(MediaDecodeError, match="decode failed: ValueError: Channel num") as caught:
        entry(_Input())
    assert caught.value.path == "/data/clip.wav"
