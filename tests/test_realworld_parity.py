"""Real-world parity: every file through every twin, against its stock loader.

Files: other projects' test assets (tests/data/README.md) and the cases the issue names,
made with ffmpeg at test time (tests/realworld.py). Stock loaders run in child
interpreters with a deadline per call (decord and audioread can hang); twins run here,
through the sandbox, as a user calls them.

Each file x twin has one expected outcome, declared below, and docs/media-parity.md shows
the same table (a test keeps them equal):

- identical: the same array, bit for bit (audio that stock reads through audioread's
  16-bit ffmpeg pipe: within one 16-bit step, see S16_STEP);
- a deliberate difference (``DESIGN``): the twin returns what the file holds, checked
  against an independent decode (PyAV from the first packet, the family's stream and
  rotation, the stock formula on the frames that decode);
- refused: the twin raises MediaDecodeError naming the file and the reason, where stock
  fails or hangs too (or where we refuse by design: a truncated WAV).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import realworld as rw  # noqa: E402

pytest.importorskip("swift.template.vision_utils", reason="the stock ms-swift loaders are the reference")

from swift_safe_media.decoders import audio as audio_decoder  # noqa: E402
from swift_safe_media.decoders import families  # noqa: E402
from swift_safe_media.decoders import swift as safe_swift  # noqa: E402
from swift_safe_media.decoders.video import Seconds, VideoInfo  # noqa: E402
from swift_safe_media.errors import MediaDecodeError  # noqa: E402

# One step of a 16-bit sample: stock librosa reads containers through audioread's
# ffmpeg pipe as s16; the twin decodes float. Resampling (soxr, the same in both) keeps
# the difference within about one step.
S16_STEP = 2.0 / 32768

# Deliberate differences: key -> what the twin does and why (docs/media-parity.md's table).
DESIGN = {
    "palette": "paletted video (pal8) shows its palette; stock decord, PyAV after seek(0) and torchcodec "
               "return black or grey frames (the palette comes once, with the first packet)",
    "frame-count": "indices from the frames the file holds, not the header's count (edit lists, discarded or "
                   "empty packets)",
    "stock-fails": "a valid file stock cannot read (elementary streams; containers without a frame count in "
                   "the header, for PyAV's loaders; AV1, for decord's and OpenCV's FFmpeg builds) decodes",
    "wrong-frames": "stock returns other frames than the indices it asked for (decord's seek on packed B-frames "
                    "and cut clips; torchcodec < 0.16 on a discarded leading keyframe, torchcodec on B-frames in AVI); "
                    "the twin's are the ones asked for",
    "field-coded": "field-coded interlaced video (each field its own packet, as in broadcast 1080i MPEG-TS): the "
                   "frames the decoder pairs the fields into, at the frame rate; stock counts a frame per field",
    "high-bit-depth": "10-bit video (HEVC, H.264, ProRes) is converted to 8-bit RGB by torchcodec's FFmpeg "
                      "(scale filter), not by decord's or OpenCV's own FFmpeg builds",
    "odd-height": "4:2:0 video of an odd height is converted to RGB by torchcodec's FFmpeg, not by decord's or "
                  "OpenCV's own FFmpeg builds, which round the chroma of every row differently",
    "moviepy-stream": "a file with several video streams: moviepy reads the first stream's size and the ffmpeg "
                      "command line's stream (garbled frames); the twin returns the first stream",
    "moviepy-rotation": "rotated video: moviepy reads the size before rotation and ffmpeg's rotated frames "
                        "(garbled); the twin returns the frames upright",
    "moviepy-timing": "files whose frames start late or leave gaps (packed B-frames AVI, dropped frames): the "
                      "frame on screen at each time, where moviepy's pipe may be one or two frames off",
    "audio-tracks": "several audio tracks: the one the ffmpeg command line maps, laid out right (audioread reads "
                    "the first track's channel count with the mapped track's samples)",
    "truncated-wav": "a WAV whose data ends before its header says: refused as truncated, stock returns the part",
    "decodes-more": "a valid audio file a stock loader raises on or returns empty decodes (libsndfile loses sync in "
                    "a FLAC, reads GSM 6.10 only block by block, cannot open Speex, reads nothing of a WAV whose data "
                    "size was left at 0, raises on raw GSM as on GSM in WAV; PyAV's probe without the name misses raw "
                    "G.722)",
    "int-unscaled": "integer samples PyAV decodes at the target rate (TTA): stock's soundfile_pyav casts them to "
                    "float unscaled (704.0), the twin scales them to [-1, 1] (0.0215)",
}

VIDEO_FILES = rw.SHIPPED_VIDEO + rw.SYNTHESIZED_VIDEO
AUDIO_FILES = rw.SHIPPED_AUDIO + rw.SYNTHESIZED_AUDIO + ["bigbuckbunny.mp4", "Megamind.avi"]
DECORD_CASES = ["internvl", "cogvlm2", "minicpmv", "valley"]
ALL_VIDEO_CASES = list(rw.VIDEO_CASES)
FAMILY = {**{c: families.DECORD for c in DECORD_CASES}, "llava": families.PYAV, "hf": families.PYAV,
          "vllm": families.OPENCV, "ovis2": families.MOVIEPY, "ovis2_5": families.MOVIEPY,
          "qwen": families.TORCHCODEC}

IDENTICAL, REFUSED = "identical", "refused"


def _all(cases, outcome):
    return {case: outcome for case in cases}


# Expected outcome of every file x case that is not IDENTICAL: a DESIGN key, or REFUSED.
EXPECTED = {
    "Megamind.avi": {**_all(DECORD_CASES, "wrong-frames"), "qwen": "wrong-frames", "ovis2_5": "moviepy-timing",
                     "soundfile_pyav": REFUSED},
    "tree.avi": {"minicpmv": "frame-count", "llava": "frame-count", "hf": "frame-count", "vllm": "frame-count",
                 "ovis2": "moviepy-timing"},
    "pal8_rawvideo.avi": {**_all(DECORD_CASES + ["llava", "hf", "qwen"], "palette")},
    "pal8_qtrle_gray.mov": {**_all(DECORD_CASES + ["llava", "hf", "qwen"], "palette")},
    "mpeg2_video.m2v": {**_all([c for c in ALL_VIDEO_CASES if c != "qwen"], "stock-fails"), "qwen": "wrong-frames"},
    "mpeg1_video.m1v": {**_all([c for c in ALL_VIDEO_CASES if c not in ("qwen", "ovis2_5")], "stock-fails"),
                        "qwen": "wrong-frames", "ovis2_5": "moviepy-timing"},
    "h264_annexb.h264": _all(ALL_VIDEO_CASES, "stock-fails"),
    "hevc_annexb.hevc": _all(ALL_VIDEO_CASES, "stock-fails"),
    "h264_m2ts.m2ts": _all(["llava", "hf"], "stock-fails"),
    "mpeg2_program.mpg": {**_all(DECORD_CASES, "wrong-frames"), **_all(["llava", "hf", "qwen"], "stock-fails")},
    "discarded_keyframe.mp4": {**_all(DECORD_CASES, "wrong-frames"), "qwen": "wrong-frames",
                               **_all(["llava", "hf", "vllm"], "frame-count")},
    # decord either gives up (DECORD_REWIND_RETRY_MAX) or returns frames by field, run to run.
    "interlaced_fields.ts": {**_all(DECORD_CASES + ["vllm", "ovis2", "ovis2_5"], "field-coded"),
                             **_all(["llava", "hf", "qwen"], "stock-fails")},
    "two_video_streams.mp4": _all(["ovis2", "ovis2_5"], "moviepy-stream"),
    "rotated_90.mp4": _all(["ovis2", "ovis2_5"], "moviepy-rotation"),
    "hevc_10bit.mp4": _all(DECORD_CASES + ["vllm"], "high-bit-depth"),
    # No frame count in the header (WebM, FLV, ASF, MPEG-TS): stock PyAV loaders index nothing.
    "vp8.webm": _all(["llava", "hf"], "stock-fails"),
    "flv1.flv": _all(["llava", "hf"], "stock-fails"),
    "wmv2.wmv": _all(["llava", "hf"], "stock-fails"),
    # decord's and OpenCV's own FFmpeg builds have no AV1 decoder.
    "av1.mp4": _all(DECORD_CASES + ["vllm"], "stock-fails"),
    "mpeg4_bframes.avi": {**_all(DECORD_CASES, "wrong-frames"), "qwen": "wrong-frames"},
    "h264_10bit.mp4": _all(DECORD_CASES + ["vllm"], "high-bit-depth"),
    "mpeg2_ts.ts": {**_all(DECORD_CASES, "wrong-frames"), **_all(["llava", "hf", "qwen"], "stock-fails")},
    "prores.mov": {"vllm": "high-bit-depth"},
    # torchcodec returns earlier frames than those asked for (AVI keeps no presentation times);
    # decord's seek returns, some runs, the frame before the file's last one where that is
    # asked for (cogvlm2's and valley's indices end on it).
    "h264_bframes.avi": {**_all(["cogvlm2", "valley"], "wrong-frames"), "qwen": "wrong-frames",
                         **_all(["ovis2", "ovis2_5"], "moviepy-timing")},
    # torchcodec's own test assets.
    "h265_video.mp4": {"valley": "wrong-frames"},
    "testsrc2_odd_height_vp9.mp4": _all(DECORD_CASES + ["vllm"], "odd-height"),
    "nasa_13013_rotated.mp4": _all(["ovis2", "ovis2_5"], "moviepy-rotation"),
    "testsrc2_av1_10bit.mp4": _all(DECORD_CASES + ["vllm"], "stock-fails"),
    "discard_first_keyframe.mp4": {**_all(DECORD_CASES, "wrong-frames"), "qwen": "wrong-frames",
                                   **_all(["llava", "hf", "vllm"], "frame-count")},
    "test-44100Hz-le-1ch-4bytes-early-eof.wav": _all(rw.AUDIO_CASES, "truncated-wav"),
    "variable-block.flac": {"soundfile_pyav": "decodes-more"},
    "animated.gif": _all(DECORD_CASES, "stock-fails"),
    "gsm_610.wav": _all(rw.AUDIO_CASES, "decodes-more"),
    "speex.spx": {"soundfile_pyav": "decodes-more"},
    "multiplexed.spx": {"soundfile_pyav": "decodes-more"},
    "raw.g722": {"soundfile_pyav": "decodes-more"},
    "speech.tta": {"soundfile_pyav": "int-unscaled"},
    "junk_then.mp3": {"soundfile_pyav": REFUSED},
    "junk_then_short.mp3": {"soundfile_pyav": REFUSED},
    # Asterisk's telephony prompts, headerless. G.722: PyAV's probe finds nothing. Raw GSM:
    # libsndfile opens it by its name and raises as on GSM in WAV; PyAV (soundfile_pyav's
    # fallback, given the path) finds it by its name.
    "vm-received.g722": {"soundfile_pyav": "decodes-more"},
    "hello-world.gsm": _all(["librosa", "omni"], "decodes-more"),
    "bext_unsized.bwf": _all(rw.AUDIO_CASES, "decodes-more"),
    "two_audio_tracks.mp4": _all(["librosa", "omni"], "audio-tracks"),
}


def expected(name: str, case: str) -> str:
    return EXPECTED.get(name, {}).get(case, IDENTICAL)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made = rw.synthesize(tmp_path_factory.mktemp("realworld"))
    return {**{name: str(rw.DATA / name) for name in rw.SHIPPED_VIDEO + rw.SHIPPED_AUDIO}, **made}


def _jobs(files):
    return [(f"{case}__{name}", case, files[name]) for name in VIDEO_FILES for case in ALL_VIDEO_CASES] + \
           [(f"{case}__{name}", case, files[name]) for name in AUDIO_FILES for case in rw.AUDIO_CASES]


@pytest.fixture(scope="module")
def stock(files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("realworld_stock"))
    rw.run_stock(_jobs(files), out, case_timeout=30.0, total_timeout=600.0)
    return out


# --- the independent decode that deliberate differences are checked against ---------------

@functools.lru_cache(maxsize=2)
def _truth_frames(path: str, family):
    """Every frame PyAV decodes from the first packet, of the stream `family` takes,
    turned upright where the family does; and the stream's VideoInfo."""
    import av

    with av.open(path) as container:
        videos = list(container.streams.video)
        infos = [families.StreamInfo(s.index, float(s.bit_rate or 0), s.frames or None,
                                     default=bool(s.disposition & 1)) for s in videos]
        best = next((s.index for s in videos if s.disposition & 1), videos[0].index)
        index = families.pick_video(infos, family.video_stream, best)
        stream = next(s for s in videos if s.index == index)
        frames, times = [], []
        nominal = float(stream.guessed_rate or 25)
        for frame in container.decode(stream):
            array = frame.to_ndarray(format="rgb24")
            turns = round((getattr(frame, "rotation", 0) or 0) / 90) % 4
            frames.append(np.rot90(array, k=turns) if family.rotated and turns else array)
            times.append(float(frame.time) if frame.time is not None else len(times) / nominal)
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1 / nominal
    duration = times[-1] - times[0] + step
    frames = np.stack(frames)
    return frames, VideoInfo(len(frames), len(frames) / duration, duration, frames.shape[2], frames.shape[1],
                             nominal)


RULES = {
    "internvl": lambda info: safe_swift.internvl_indices(info, None, 8),
    "cogvlm2": lambda info: safe_swift.cogvlm2_indices(info, 24),
    "minicpmv": lambda info: safe_swift.minicpmv_indices(info, 4),
    "valley": safe_swift.valley_indices,
    "llava": lambda info: safe_swift.llava_indices(info, 16),
    "hf": safe_swift.all_indices,
    "vllm": lambda info: safe_swift.vllm_indices(info, 6),
    "ovis2": lambda info: safe_swift.ovis2_indices(info, 6),
    "ovis2_5": lambda info: safe_swift.ovis2_5_indices(info, 6),
}


def _truth(path: str, case: str):
    frames, info = _truth_frames(path, FAMILY[case])
    picked = RULES[case](info)
    if isinstance(picked, Seconds):  # constant-rate clips: the frame on screen at each time
        picked = [min(len(frames) - 1, int(t * info.fps)) for t in picked]
    return frames[np.asarray(picked, dtype=int)], frames


def _deep(path: str) -> bool:
    """More than 8 bits a sample: PyAV's and torchcodec's conversions to 8-bit RGB differ."""
    import av

    with av.open(path) as container:
        name = container.streams.video[0].codec_context.pix_fmt or ""
    return any(bits in name for bits in ("p10", "p12", "p14", "p16"))


def _check_design(key: str, name: str, case: str, path: str, ours, stock_state):
    if case == "qwen":  # resized in the sandbox: the frames asked for, counted on what decodes
        truth_frames, info = _truth_frames(path, FAMILY[case])
        assert ours[1]["total_num_frames"] == info.num_frames, ours[1]
        return
    if case in rw.AUDIO_CASES:
        assert ours[0].dtype == np.float32 and ours[0].shape[-1] > 0
        if key == "audio-tracks" and stock_state[0] == "ok":  # stock: two channels read as one, twice as long
            assert stock_state[1].shape[-1] == 2 * ours[0].shape[-1]
        if key == "int-unscaled":  # the same 16-bit samples, stock's unscaled
            np.testing.assert_array_equal(ours[0] * np.float32(32768), stock_state[1])
        return
    if key in ("high-bit-depth", "odd-height") or (FAMILY[case].engine == "torchcodec" and _deep(path)):  # torchcodec's conversion: the frames of the same FFmpeg qwen's stock uses
        from torchcodec.decoders import VideoDecoder

        decoded = VideoDecoder(path, dimension_order="NHWC").get_frames_at(
            list(range(VideoDecoder(path).metadata.num_frames))).data.numpy()
        matches = [any(np.array_equal(frame, d) for d in decoded) for frame in ours[0]]
        assert all(matches), f"{name} {case}: frames that torchcodec's conversion does not give"
        return
    expected_frames, every = _truth(path, case)
    if case in ("ovis2", "ovis2_5"):  # by time: each frame is one of the file's, within two of the time's
        assert ours[0].shape == expected_frames.shape
        for frame, want in zip(ours[0], expected_frames):
            where = [i for i, f in enumerate(every) if np.array_equal(f, want)]
            near = every[max(0, where[0] - 2):where[0] + 3]
            assert any(np.array_equal(frame, f) for f in near), f"{name} {case}"
        return
    np.testing.assert_array_equal(ours[0], expected_frames, err_msg=f"{name} {case} ({key})")


def _twin(case, path):
    try:
        return "ok", *rw.run_case(False, case, path)
    except MediaDecodeError as exc:
        return REFUSED, exc


def _identical(case, name, ours, theirs):
    assert ours.shape == theirs.shape, f"{name} {case}: shape {ours.shape} != stock {theirs.shape}"
    if case in ("librosa", "omni") and name.rsplit(".", 1)[-1] not in ("wav", "flac", "oga", "ogg", "mp3", "aif"):
        difference = np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))) if ours.size else 0.0
        assert difference <= S16_STEP, f"{name} {case}: {difference} > one 16-bit step"
        return
    np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} {case}")


def _check(stock, files, name, case):
    path = files[name]
    want = expected(name, case)
    state = rw.stock_result(stock, f"{case}__{name}")
    ours = _twin(case, path)
    if (case in ("librosa", "omni") and want != REFUSED and audio_decoder.librosa_without_audioread()
            and state[0] == "error" and ours[0] == REFUSED):
        # librosa 1.x has no audioread fallback: what its libsndfile refuses, the twin refuses too
        # (what libsndfile opens and stock still fails on, the twin may read by design: below).
        assert path in str(ours[1]) and "libsndfile cannot read" in ours[1].reason, ours
        return
    if want == REFUSED:
        assert ours[0] == REFUSED, f"{name} {case}: expected a refusal, got {ours[0]}"
        assert path in str(ours[1]) and ours[1].reason
        assert state[0] in ("error", "hang"), f"{name} {case}: stock {state[0]} where the twin refuses"
        return
    if want == "truncated-wav":
        assert ours[0] == REFUSED and "truncated" in ours[1].reason, ours
        return
    assert ours[0] == "ok", f"{name} {case}: refused ({ours[1]}), expected {want}"
    if want == IDENTICAL:
        assert state[0] == "ok", f"{name} {case}: stock {state[0]}: {state[1][-300:]}"
        _identical(case, name, ours[1], state[1])
        if case in ("hf", "vllm", "qwen", "librosa", "soundfile_pyav") and state[2]:
            assert ours[2] == state[2], f"{name} {case}: metadata {ours[2]} != stock {state[2]}"
        return
    if want in ("stock-fails", "decodes-more"):
        assert state[0] in ("error", "hang") or (state[0] == "ok" and state[1].size == 0), \
            f"{name} {case}: stock {state[0]}"
    _check_design(want, name, case, path, ours[1:], state)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", VIDEO_FILES)
def test_video_file_through_every_twin(stock, files, name):
    for case in ALL_VIDEO_CASES:
        _check(stock, files, name, case)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", AUDIO_FILES)
def test_audio_file_through_every_twin(stock, files, name):
    for case in rw.AUDIO_CASES:
        _check(stock, files, name, case)


def parity_table() -> str:
    """The markdown parity table docs/media-parity.md shows, from EXPECTED."""
    def cell(name, case):
        want = expected(name, case)
        return {IDENTICAL: "identical", REFUSED: "refused"}.get(want, f"by design: {want}")

    lines = ["| file | " + " | ".join(ALL_VIDEO_CASES) + " |", "|---" * (len(ALL_VIDEO_CASES) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(name, c) for c in ALL_VIDEO_CASES) + " |" for name in VIDEO_FILES]
    lines += ["", "| file | " + " | ".join(rw.AUDIO_CASES) + " |", "|---" * (len(rw.AUDIO_CASES) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(name, c) for c in rw.AUDIO_CASES) + " |" for name in AUDIO_FILES]
    return "\n".join(lines)


def test_docs_show_this_parity_table():
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "media-parity.md")
    with open(docs) as f:
        text = f.read()
    assert parity_table() in text, "docs/media-parity.md's parity table differs from tests/test_realworld_parity.py"
    for key in DESIGN:
        assert re.search(rf"`{re.escape(key)}`", text), f"docs/media-parity.md does not explain {key}"


def test_shipped_files_are_the_listed_ones():
    import hashlib

    with open(rw.DATA / "README.md") as f:
        listed = dict(re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", f.read(), re.M))
    present = {p.name for p in rw.DATA.iterdir() if p.name != "README.md"}
    assert present == set(listed), present ^ set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((rw.DATA / name).read_bytes()).hexdigest() == digest, name
    assert set(rw.SHIPPED_VIDEO + rw.SHIPPED_AUDIO) == present


@pytest.mark.timeout(120)
def test_a_stock_loader_that_hangs_is_killed_and_the_next_case_runs(tmp_path):
    """decord blocks for ever opening a FIFO with no writer (a real hang in native code):
    that case is recorded as hung, its child killed, and a new child runs the next one."""
    fifo = tmp_path / "clip.mp4"
    os.mkfifo(fifo)
    good = str(rw.DATA / "carphone_distorted.mp4")
    out = str(tmp_path / "stock")
    rw.run_stock([("valley__fifo", "valley", str(fifo)), ("valley__good", "valley", good)], out,
                 case_timeout=10.0, total_timeout=100.0)
    assert rw.stock_result(out, "valley__fifo")[0] == "hang"
    state = rw.stock_result(out, "valley__good")
    assert state[0] == "ok" and state[1].shape == (8, 144, 176, 3)
