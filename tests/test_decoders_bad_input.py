"""Bad input to the safe loaders: a MediaDecodeError naming the file and the reason,
within the timeout, never a hang. Real files made with ffmpeg, real FIFOs, a real
HTTP server on 127.0.0.1; nothing mocked."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

try:
    from tests import media_corpus
except ImportError:
    import media_corpus

import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeError, MediaDecodeTimeout
from .loaders import ALL_LOADERS, AUDIO_LOADERS, VIDEO_LOADERS, audio_reason

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return media_corpus.session_corpus(tmp_path_factory)


def refuses(load, path, *reason_parts, within=10.0):
    """Assert that load(path) raises MediaDecodeError naming `path`, with every reason part."""
    start = time.monotonic()
    with pytest.raises(MediaDecodeError) as caught:
        load(path)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"took {elapsed:.1f} s"
    assert str(path) in str(caught.value), str(caught.value)
    for part in reason_parts:
        assert part in caught.value.reason, caught.value.reason
    return caught.value


@pytest.fixture
def hls_with_fifo_segment(tmp_path):
    """An HLS playlist saved as clip.mp4 whose segment is a FIFO with no writer: opening
    the segment blocks forever (measured: decord, librosa and torchcodec all do)."""
    os.mkfifo(tmp_path / "segment0.ts")
    playlist = tmp_path / "clip.mp4"
    playlist.write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n"
                        "#EXTINF:10.0,\nsegment0.ts\n#EXT-X-ENDLIST\n")
    return str(playlist)


@pytest.mark.parametrize("loader", ALL_LOADERS)
def test_hls_playlist_is_refused_before_opening(hls_with_fifo_segment, loader):
    refuses(ALL_LOADERS[loader], hls_with_fifo_segment, "HLS playlist refused")


@pytest.mark.parametrize("text,reason", [
    ("ffconcat version 1.0\nfile 'segment0.ts'\n", "ffconcat playlist refused"),
    ("file '/etc/hostname'\n", "concat list refused"),
    ("[playlist]\nFile1=segment0.ts\n", "PLS playlist refused"),
    ('<?xml version="1.0"?><MPD></MPD>', "XML document refused"),
    ("just some notes, renamed to .mp4\n", "not a known media container"),
])
@pytest.mark.parametrize("loader", ["vllm", "load_audio"])
def test_text_files_are_refused(tmp_path, text, reason, loader):
    path = tmp_path / "clip.mp4"
    path.write_text(text)
    refuses(ALL_LOADERS[loader], str(path), reason)


@pytest.mark.parametrize("loader", ALL_LOADERS)
def test_fifo_named_like_a_clip_is_refused(tmp_path, loader):
    path = tmp_path / "clip.mp4"
    os.mkfifo(path)
    refuses(ALL_LOADERS[loader], str(path), "not a regular file (FIFO)")


@pytest.mark.parametrize("loader", ["cogvlm2", "qwen", "load_audio"])
def test_directory_named_like_a_clip_is_refused(tmp_path, loader):
    path = tmp_path / "clip.mp4"
    path.mkdir()
    refuses(ALL_LOADERS[loader], str(path), "is a directory")


@pytest.mark.parametrize("loader", ALL_LOADERS)
def test_zero_byte_file_is_refused(tmp_path, loader):
    path = tmp_path / "clip.mp4"
    path.touch()
    refuses(ALL_LOADERS[loader], str(path), "zero-byte file")


def test_missing_file_is_reported(tmp_path):
    refuses(safe.load_video_llava, str(tmp_path / "nope.mp4"), "no such file")


def test_fifo_frame_in_an_image_list_is_refused(tmp_path):
    os.mkfifo(tmp_path / "0.png")
    refuses(lambda p: safe.load_video_hf([[p]]), str(tmp_path / "0.png"), "not a regular file (FIFO)")


def _truncate(source, destination, keep):
    with open(source, "rb") as f:
        data = f.read()
    with open(destination, "wb") as f:
        f.write(data[:keep(len(data))])
    return str(destination)


def test_truncated_mp4_without_index_is_refused(corpus, tmp_path):
    # moov at the end: half the file has no index at all.
    path = _truncate(corpus["h264_noaudio.mp4"], tmp_path / "half.mp4", lambda n: n // 2)
    for loader in VIDEO_LOADERS.values():
        refuses(loader, path, "cannot open video")


def test_truncated_faststart_mp4_fails_cleanly(tmp_path):
    # moov first: the index promises frames whose data was cut off.
    full = tmp_path / "full.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "testsrc2=size=160x120:rate=30:duration=2",
                    *media_corpus.H264, "-movflags", "+faststart", str(full)], check=True, timeout=60)
    path = _truncate(full, tmp_path / "cut.mp4", lambda n: n // 2)
    refuses(safe.load_video_cogvlm2, path, "truncated: index promises 60 frames, file holds")


def test_truncated_webm_decodes_the_frames_it_holds(corpus, tmp_path):
    path = _truncate(corpus["vp9.webm"], tmp_path / "cut.webm", lambda n: n // 3)
    frames, meta = safe.load_vllm_video(path, 4)
    assert 0 < meta["total_num_frames"] < 60
    assert frames.shape == (4, 120, 160, 3)


def test_truncated_audio(corpus, tmp_path):
    header_only = _truncate(corpus["pcm_16k_stereo.wav"], tmp_path / "header.wav", lambda n: 44)
    refuses(AUDIO_LOADERS["load_audio"], header_only)
    # The header says 96000 frames; about half of them are there. Stock decodes that half
    # silently; a partial file is refused (issue 12; tests/test_damaged_media.py has more).
    half = _truncate(corpus["pcm_48k_stereo.wav"], tmp_path / "half.wav", lambda n: n // 2)
    refuses(AUDIO_LOADERS["load_audio"], half, "truncated: index promises 96000 frames, file holds")


def test_garbage_behind_mp4_magic_is_refused(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"\x00\x00\x00\x18ftypisom" + os.urandom(4096))
    for loader in ("vllm", "qwen", "load_audio"):
        refuses(ALL_LOADERS[loader], str(path), audio_reason("cannot open") if loader == "load_audio" else "cannot open")


@pytest.mark.parametrize("loader", AUDIO_LOADERS)
def test_video_without_audio_stream(corpus, loader):
    refuses(AUDIO_LOADERS[loader], corpus["h264_noaudio.mp4"], audio_reason("no audio stream"))


def test_audio_in_video_without_audio_stream(corpus):
    conversation = [{"role": "user", "content": [{"type": "video", "video": corpus["h264_noaudio.mp4"]}]}]
    refuses(lambda p: safe.process_audio_info(conversation, True), corpus["h264_noaudio.mp4"],
            audio_reason("no audio stream"))


def test_lying_container_returns_without_hanging(corpus):
    # decord counts 435 frames here and spins forever on the 135 that never decode.
    start = time.monotonic()
    video = safe.load_video_cogvlm2(corpus[media_corpus.LYING_CLIP])
    frames = safe.load_video_valley(corpus[media_corpus.LYING_CLIP])
    assert tuple(video.shape) == (3, 24, 120, 160) and len(frames) == 8
    assert time.monotonic() - start < 10


def test_zero_fps_header_decodes_with_the_rate_ffmpeg_derives(corpus, tmp_path):
    data = bytearray(open(corpus["mjpeg.avi"], "rb").read())
    avih, strh = data.index(b"avih"), data.index(b"strh")
    data[avih + 8:avih + 12] = struct.pack("<I", 0)                    # microseconds per frame
    data[strh + 28:strh + 36] = struct.pack("<II", 0, 0)               # scale, rate
    path = tmp_path / "zero_fps.avi"
    path.write_bytes(data)
    frames, meta = safe.load_vllm_video(str(path), 4)
    reference, _ = safe.load_vllm_video(corpus["mjpeg.avi"], 4)
    assert meta["fps"] > 0
    np.testing.assert_array_equal(frames, reference)


def test_stream_without_duration_in_header_decodes(tmp_path):
    path = tmp_path / "streamed.mkv"
    with open(path, "wb") as out:  # written to a pipe: Matroska leaves the duration out
        subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=160x120:rate=30:duration=1",
                        "-c:v", "mjpeg", "-f", "matroska", "-"], stdout=out, check=True, timeout=60)
    frames, meta = safe.load_vllm_video(str(path), 4)
    assert meta["total_num_frames"] == 30 and meta["fps"] == pytest.approx(30.0)
    assert frames.shape == (4, 120, 160, 3)


def test_decoded_pixel_cap(corpus, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_PIXELS", str(160 * 120 * 10))
    refuses(safe.load_video_cogvlm2, corpus["h264_noaudio.mp4"], "decoded pixels cap exceeded")
    refuses(lambda p: safe.load_video_hf([p]), corpus["h264_noaudio.mp4"], "decoded pixels cap exceeded")
    assert len(safe.load_video_valley(corpus["h264_noaudio.mp4"])) == 8  # 8 frames fit


@pytest.mark.parametrize("name", ["flac_48k_stereo.flac", "aac_44k_stereo.m4a", "h264_aac_bframes.mp4"])
def test_audio_duration_cap(corpus, monkeypatch, name):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_AUDIO_SECONDS", "1.5")
    reason = "audio duration cap exceeded"
    refuses(AUDIO_LOADERS["load_audio"], corpus[name], reason if name.endswith(".flac") else audio_reason(reason))


@pytest.mark.timeout(120)
def test_hours_of_silent_flac_are_refused_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "silence.flac"
    subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "anullsrc=r=8000:cl=mono", "-t", "7200",
                    "-c:a", "flac", str(path)], check=True, timeout=100)
    assert path.stat().st_size < 5_000_000  # tiny on disk, 230 MB as float32
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_AUDIO_SECONDS", "3600")
    refuses(AUDIO_LOADERS["load_audio"], str(path), "audio duration cap exceeded", within=3.0)


# --- URLs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_root(corpus):
    directory = os.path.dirname(corpus["vfr.mp4"])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_server():
    """Accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/clip.mp4"
    listener.close()


def test_url_matches_local_file(corpus, http_root):
    np.testing.assert_array_equal(safe.load_video_llava(f"{http_root}/h264_noaudio.mp4"),
                                  safe.load_video_llava(corpus["h264_noaudio.mp4"]))
    np.testing.assert_array_equal(safe.load_audio(f"{http_root}/mp3_44k_stereo.mp3", 16000),
                                  safe.load_audio(corpus["mp3_44k_stereo.mp3"], 16000))


def test_url_byte_cap(http_root, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_URL_BYTES", "10000")
    refuses(safe.load_video_llava, f"{http_root}/h264_noaudio.mp4", "URL bytes cap exceeded")


def test_url_http_error(http_root):
    refuses(safe.load_video_llava, f"{http_root}/missing.mp4", "HTTP 404")


def test_url_honours_swift_timeout(silent_server, monkeypatch):
    monkeypatch.setenv("SWIFT_TIMEOUT", "1")
    refuses(safe.load_video_llava, silent_server, "timed out", within=5.0)


def test_url_without_socket_timeout_is_stopped_by_the_sandbox(corpus, silent_server, monkeypatch):
    monkeypatch.setenv("SWIFT_TIMEOUT", "0")          # stock: no timeout at all
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_TIMEOUT", "2")
    start = time.monotonic()
    with pytest.raises(MediaDecodeTimeout) as caught:
        safe.load_audio(silent_server, 16000)
    assert time.monotonic() - start < 2 + 1.5
    assert silent_server in str(caught.value)
    # The engine stays usable after the kill.
    assert safe.load_audio(corpus["pcm_16k_stereo.wav"], 16000).shape == (32000,)
