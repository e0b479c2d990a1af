"""Damaged and hostile media (issue 12, sections 2-4): partial files refused by name from
their index, ADTS AAC sniffed and decoded, errors that say what happened (memory cap,
results that cannot come back, Qwen's own rules), caps on what the caller holds.

Every file is made here with ffmpeg and byte surgery (tests/damaged_media.py); every
call goes through the real loader twins, the real sandbox and torchcodec/soundfile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import damaged_media, media_corpus, sandboxed

import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeError, call
from swift_safe_media.engine import calls as engine
from .fresh import ROOT
from .loaders import VIDEO_LOADERS

pytestmark = pytest.mark.timeout(120)


def load_audio_with(backend):
    def load(path):
        previous = os.environ.get("SWIFT_AUDIO_LOAD_BACKEND")
        os.environ["SWIFT_AUDIO_LOAD_BACKEND"] = backend
        try:
            return safe.load_audio(path, 16000)
        finally:
            if previous is None:
                os.environ.pop("SWIFT_AUDIO_LOAD_BACKEND")
            else:
                os.environ["SWIFT_AUDIO_LOAD_BACKEND"] = previous
    return load


AUDIO_LOADERS = {
    "librosa": load_audio_with("librosa"),
    "soundfile_pyav": load_audio_with("soundfile_pyav"),
    "omni": lambda p: safe.process_audio_info([{"role": "user", "content": [{"type": "audio", "audio": p}]}], False),
}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return {name: str(path) for name, path in damaged_media.build(tmp_path_factory.mktemp("damaged")).items()}


def refused(load, path, *reason_parts):
    with pytest.raises(MediaDecodeError) as caught:
        load(path)
    error = caught.value
    assert error.path == path and path in str(error), str(error)
    for part in reason_parts:
        assert part in error.reason, error.reason
    return error


# --- section 2: partial files -------------------------------------------------------------

@pytest.mark.parametrize("loader", VIDEO_LOADERS)
def test_every_video_loader_refuses_a_cut_faststart_mp4(media, loader):
    # 200 frames promised, about a third of the file held. internvl and minicpmv used to
    # return the frames that exist, with no error.
    error = refused(VIDEO_LOADERS[loader], media["cut_faststart.mp4"], "truncated: index promises 200 frames")
    held = int(error.reason.split("file holds ")[1].split()[0])
    assert 0 < held < 200


@pytest.mark.parametrize("loader", AUDIO_LOADERS)
def test_every_audio_loader_refuses_a_cut_mp4(media, loader):
    refused(AUDIO_LOADERS[loader], media["cut_faststart.mp4"], "truncated: index promises")


def test_audio_in_a_cut_video_is_refused(media):
    path = media["cut_faststart.mp4"]
    conversation = [{"role": "user", "content": [{"type": "video", "video": path}]}]
    refused(lambda p: safe.process_audio_info(conversation, True), path, "truncated")


@pytest.mark.parametrize("name, detail", [
    ("cut_co64.mp4", "200 frames"),                       # 64-bit chunk offsets
    ("cut_faststart.mov", "90 frames"),                   # QuickTime
    ("cut_multitrack.mp4", "90 frames"),                  # two video tracks and audio
    ("cut_mdat_before_moov.mp4", "120 frames"),           # index after the data
    # Fragments list their own frames: the index seen so far is what is promised.
    ("cut_fragmented.mp4", "(fragmented mp4)"),           # moof/trun, default-base-is-moof
    ("cut_fragmented_plain_base.mp4", "(fragmented mp4)"),  # moof/trun, base from the previous traf
])
@pytest.mark.parametrize("loader", ["vllm", "internvl", "qwen"])
def test_index_variants_of_a_cut_mp4_are_refused(media, name, detail, loader):
    refused(VIDEO_LOADERS[loader], media[name], "truncated: index promises", detail)


@pytest.mark.parametrize("name", ["whole_faststart.mp4", "whole_co64.mp4", "whole.mov", "whole_multitrack.mp4",
                                  "whole_moov_last.mp4", "whole_fragmented.mp4", "whole_fragmented_plain_base.mp4"])
def test_whole_files_of_each_index_variant_decode(media, name):
    frames, meta = safe.load_vllm_video(media[name], 4)
    assert frames.shape[0] == 4 and meta["total_num_frames"] >= 90


def test_co64_file_decodes_the_same_frames_as_its_stco_original(media):
    original, _ = safe.load_vllm_video(media["whole_faststart.mp4"], 6)
    rewritten, _ = safe.load_vllm_video(media["whole_co64.mp4"], 6)
    np.testing.assert_array_equal(original, rewritten)


def test_an_edit_list_cut_is_not_damaged(tmp_path_factory):
    # The header over-counts frames the edit list discards: all of them are in the file.
    corpus = media_corpus.session_corpus(tmp_path_factory)
    for loader in ("internvl", "minicpmv", "vllm", "qwen"):
        VIDEO_LOADERS[loader](corpus[media_corpus.LYING_CLIP])


@pytest.mark.parametrize("loader", AUDIO_LOADERS)
@pytest.mark.parametrize("name", ["cut_extra_chunks.wav", "cut_rf64.wav", "cut_audio_only.m4a"])
def test_cut_audio_files_are_refused(media, loader, name):
    refused(AUDIO_LOADERS[loader], media[name], "truncated: index promises")


@pytest.mark.parametrize("loader", AUDIO_LOADERS)
def test_wav_claiming_4_gb_with_no_payload(media, loader):
    refused(AUDIO_LOADERS[loader], media["claims_4gb.wav"], "truncated: index promises 2147483640 frames, file holds 0")
    # A streaming writer's "size unknown" promises nothing: with nothing behind it, the
    # empty decode is the error (the soundfile path used to return an empty array).
    refused(AUDIO_LOADERS[loader], media["streamed_no_payload.wav"], "no audio samples decoded")


@pytest.mark.parametrize("loader", ["librosa", "soundfile_pyav"])
def test_whole_wavs_with_extra_chunks_or_streamed_sizes_decode_like_the_plain_one(media, loader):
    plain = AUDIO_LOADERS[loader](media["whole.wav"])
    assert plain.shape == (48000,)
    for name in ("whole_extra_chunks.wav", "whole_streamed.wav", "whole_rf64.wav"):
        np.testing.assert_array_equal(AUDIO_LOADERS[loader](media[name]), plain)


# --- ADTS AAC -----------------------------------------------------------------------------

@pytest.mark.parametrize("loader", AUDIO_LOADERS)
def test_adts_aac_decodes(media, loader):
    result = AUDIO_LOADERS[loader](media["whole.aac"])
    samples = result[0] if isinstance(result, list) else result
    # 3 s of ffmpeg's sine source (440 Hz, amplitude 1/8) at 16 kHz, give or take the
    # AAC encoder's priming frames.
    assert samples.dtype == np.float32 and 47000 <= samples.shape[-1] <= 50000
    assert 0.1 < float(np.abs(samples[8000:40000]).max()) < 0.16


@pytest.mark.parametrize("name, reason", [("adts_bad_rate_alone.aac", "not a known media container"),
                                          ("adts_one_header.aac", "not a known media container")])
def test_bytes_that_only_look_like_adts_are_refused(media, name, reason):
    refused(AUDIO_LOADERS["librosa"], media[name], reason)


def test_adts_behind_a_broken_first_header_decodes_as_ffmpeg_decodes_it(media):
    """The frames after a header with a reserved sample rate are ADTS behind 7 bytes of junk:
    found where FFmpeg's probe finds them (issue 34), decoded as the command line does."""
    samples = AUDIO_LOADERS["librosa"](media["adts_bad_rate.aac"])
    pcm = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", str(media["adts_bad_rate.aac"]), "-f", "f32le",
                          "-ac", "1", "-ar", "16000", "-"], capture_output=True, check=True, timeout=60).stdout
    assert abs(samples.shape[-1] - len(pcm) // 4) <= 1024 * 16000 // 44100  # at most the frame it lost


def test_adts_is_told_from_mpeg_audio():
    from swift_safe_media.decoders import guards

    mp3 = bytes([0xFF, 0xFB, 0x90, 0x64]) + bytes(60)       # MPEG-1 layer III, 128 kb/s, 44.1 kHz
    adts = bytes([0xFF, 0xF1, 0x50, 0x80, 0x2E, 0x7F, 0xFC]) + bytes(57)  # AAC LC, 44.1 kHz, stereo
    assert guards.container_of(mp3) == "mp3" and guards.container_of(adts) == "aac"
    assert guards.container_of(bytes([0xFF, 0xF9, 0x3C, 0x80, 0x2E, 0x7F, 0xFC]) + bytes(57)) is None  # rate index 15
    assert guards.container_of(bytes([0xFF, 0xFB, 0xF0, 0x64]) + bytes(60)) is None  # bitrate index 1111


# --- section 3: errors that say what happened ---------------------------------------------

@pytest.fixture
def qwen_clips(tmp_path):
    one = tmp_path / "one_frame.mp4"
    damaged_media.ffmpeg(*damaged_media.video_src(1), *damaged_media.H264, "-frames:v", "1", str(one))
    thin = tmp_path / "thin_800x2.avi"
    damaged_media.ffmpeg(*damaged_media.video_src(1, size="800x2"), "-c:v", "rawvideo", "-pix_fmt", "rgb24", str(thin))
    return str(one), str(thin)


def test_qwen_rules_rejecting_a_file_name_it(qwen_clips):
    one_frame, thin = qwen_clips
    refused(lambda p: safe.fetch_video({"video": p}), one_frame, "qwen_vl_utils sampling rules", "nframes")
    refused(lambda p: safe.fetch_video({"video": p}), thin, "qwen_vl_utils sampling rules", "aspect ratio")


def test_qwen_metadata_names_the_backend_that_decoded(media, monkeypatch):
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "decord")
    _, metadata = safe.fetch_video({"video": media["whole_faststart.mp4"], "nframes": 4}, return_video_metadata=True)
    assert metadata["video_backend"] == "torchcodec"


def test_memory_cap_hit_inside_a_decoder_is_named_and_the_sandbox_replaced(media, monkeypatch, fresh_engine):
    # 200 frames of 160x120 decoded at once need ~11 MB more than this cap leaves.
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", "8")
    first = call(sandboxed.sandbox_pid)
    error = refused(lambda p: safe.load_video_hf([p]), media["whole_faststart.mp4"], "memory limit of 8 MB exceeded")
    assert "RuntimeError" in error.reason or "MemoryError" in error.reason
    assert call(sandboxed.sandbox_pid) != first, "a sandbox that hit its cap must not be reused"


def test_a_changed_memory_cap_reaches_the_next_sandbox(media, monkeypatch, fresh_engine):
    path = media["whole_faststart.mp4"]
    assert len(safe.load_video_hf([path])[0][0]) == 200  # the sandbox starts with the default cap
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", "8")
    refused(lambda p: safe.load_video_hf([p]), path, "memory limit of 8 MB exceeded")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", "0")
    assert len(safe.load_video_hf([path])[0][0]) == 200


def test_a_result_that_cannot_come_back_names_the_file_size_and_reason(monkeypatch, fresh_engine):
    # The sandbox can make the frames but not the shared copy that carries them back.
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", "300")
    with pytest.raises(MediaDecodeError) as caught:
        call(sandboxed.big_frames, 1400, 1400, 40, path="/data/huge.mp4")  # 224 MiB
    error = caught.value
    assert error.path == "/data/huge.mp4"
    assert "cannot be sent back to the caller" in error.reason and "224 MB" in error.reason
    assert "Cannot allocate memory" in error.reason


# --- section 4: caps on what the caller holds ----------------------------------------------

def test_result_cap_refuses_by_name_before_decoding(media, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_RESULT_MB", "1")
    # 8 PIL frames of 160x120 at Pillow's 4 bytes per pixel: 0.6 MB, fits; 32 do not.
    assert len(safe.load_video_valley(media["whole_faststart.mp4"])) == 8
    refused(lambda p: safe.load_video_internvl(p, num_segments=32), media["whole_faststart.mp4"],
            "result size cap exceeded: 32 frames of 160x120 at 4 bytes per pixel", "SWIFT_SAFE_MEDIA_MAX_RESULT_MB")
    refused(lambda p: safe.fetch_video({"video": p, "nframes": 8}), media["whole_faststart.mp4"],
            "result size cap exceeded", "as float32")


@pytest.fixture(scope="module")
def large_frames(tmp_path_factory):
    """Lossless clips of identical PNG frames (small on disk, huge decoded): 14 of
    8192x8192 (0.94e9 pixels, within the pixel cap) and 8 of 4096x4096."""
    folder = tmp_path_factory.mktemp("large")
    clips = {}
    for name, size, rate, pattern in (("8k", 8192, 14, "color=c=0x336699:"), ("4k", 4096, 8, "testsrc2=")):
        frame, clip = folder / f"{name}.png", folder / f"{name}.mkv"
        damaged_media.ffmpeg("-f", "lavfi", "-i", f"{pattern}size={size}x{size}", "-frames:v", "1", str(frame))
        damaged_media.ffmpeg("-loop", "1", "-framerate", str(rate), "-i", str(frame), "-t", "1", "-c:v", "copy",
                             str(clip))
        clips[name] = str(clip)
    tiny = folder / "2x2.mp4"  # 120 frames of 2x2 that Qwen's rules upscale to 336x336 floats
    damaged_media.ffmpeg(*damaged_media.video_src(60, size="2x2", rate=30), "-c:v", "libx264rgb", "-qp", "0",
                         "-preset", "ultrafast", str(tiny))
    clips["2x2"] = str(tiny)
    return clips


@pytest.fixture(scope="module")
def caller_growth(large_frames, media):
    """Peak growth of a real caller process per loader call, next to what it returned."""
    jobs = [f"internvl14:{large_frames['8k']}", f"valley:{large_frames['4k']}", f"valley:{large_frames['4k']}:64",
            f"fetch_video:{large_frames['2x2']}", f"fetch_video:{large_frames['2x2']}:64"]
    done = subprocess.run([sys.executable, "-m", "tests.caller_memory", media["whole.mov"], *jobs], cwd=ROOT,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {report["job"]: report for report in reports}


@pytest.mark.timeout(600)
def test_8k_frames_within_the_pixel_cap_are_refused_by_the_result_cap(caller_growth, large_frames):
    # 14 frames of 8192x8192: 0.94e9 pixels, under the pixel cap; as PIL images 3.5 GiB.
    report = caller_growth[f"internvl14:{large_frames['8k']}"]
    assert large_frames["8k"] in report["error"] and "result size cap exceeded" in report["error"]
    assert report["growth_mb"] < 64  # refused before anything was decoded


@pytest.mark.parametrize("loader, clip", [("valley", "4k"), ("fetch_video", "2x2")])
def test_the_caller_holds_the_result_once(caller_growth, large_frames, loader, clip):
    # Before: PIL frames made beside the decoded ones (1.9x the result), Qwen's resize
    # and float copy in the caller (2.2x). Now the caller grows by about the result.
    report = caller_growth[f"{loader}:{large_frames[clip]}"]
    assert report["error"] is None and report["result_mb"] > 100
    assert report["growth_mb"] < 1.2 * report["result_mb"] + 32, report
    refusal = caller_growth[f"{loader}:{large_frames[clip]}:64"]
    assert large_frames[clip] in refusal["error"] and "result size cap exceeded" in refusal["error"]
    assert refusal["growth_mb"] < 32, refusal


def test_engine_still_serves_after_all_this():
    assert call(sandboxed.sandbox_pid) != os.getpid()
    assert engine.get_engine() is not None
