"""Hostile media: FFmpeg must read only the named input, with a demuxer we allow.

A hostile corpus is built at test time: playlists (ffconcat, HLS, DASH) hidden behind
bytes our sniffing accepts (an ID3v2 tag FFmpeg skips while probing, an MP4-box-looking
prefix, an XML comment whose bytes look like a box), a file name holding an
image-sequence pattern next to files matching it, and the same playlists as bytes
(data: URI, base64, the body of a URL on a live loopback server). Each goes through
the real loaders with protection on; the test asserts the refusal names the input, that
no other file was opened (inotify on the decoys' folder, which sees the sandbox too) and
that a second loopback port saw no connection. Good files must still decode.
"""

from __future__ import annotations

import base64
import ctypes
import http.server
import os
import select
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeError
from swift_safe_media.decoders import audio, demuxers
from .fresh import run_python
from .loaders import VIDEO_LOADERS, audio_reason
from .loaders import AUDIO_LOADERS as _PLAIN_AUDIO_LOADERS

pytestmark = pytest.mark.timeout(120)

FFMPEG = os.environ.get("FFMPEG", "ffmpeg")


AUDIO_LOADERS = {
    **_PLAIN_AUDIO_LOADERS,
    "omni_video_audio": lambda p: safe.process_audio_info(
        [{"role": "user", "content": [{"type": "video", "video": p}]}], True),
}
ALL_LOADERS = {**VIDEO_LOADERS, **AUDIO_LOADERS}


# --- watching: inotify on a folder, a loopback port that must stay silent ------------

class FolderWatch:
    """Every file opened or read in one folder, by any process (the sandbox included)."""
    IN_ACCESS, IN_OPEN, IN_ISDIR = 0x1, 0x20, 0x40000000

    def __init__(self, folder):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), self.IN_ACCESS | self.IN_OPEN)
        assert wd >= 0, os.strerror(ctypes.get_errno())

    def names(self) -> set[str]:
        seen = set()
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return seen
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
                if not mask & self.IN_ISDIR:  # a directory listed (imports scan sys.path) is no file read
                    seen.add(name)
                offset += 16 + length

    def close(self):
        os.close(self.fd)


class Trap:
    """A listening loopback port nothing may connect to."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def was_contacted(self) -> bool:
        readable, _, _ = select.select([self.sock], [], [], 0.2)
        return bool(readable)

    def close(self):
        self.sock.close()


# --- the corpus -----------------------------------------------------------------------

def _ffmpeg(*args):
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def id3_tag(padding: int) -> bytes:
    """An ID3v2.4 tag of `padding` zero bytes: FFmpeg's probe skips it, our sniffing says mp3."""
    size = bytes((padding >> shift) & 0x7F for shift in (21, 14, 7, 0))
    return b"ID3\x04\x00\x00" + size + b"\0" * padding


def hls(*entries: str) -> bytes:
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", "#EXT-X-TARGETDURATION:2", "#EXT-X-MEDIA-SEQUENCE:0"]
    for entry in entries:
        lines += ["#EXTINF:1.0,", entry]
    return ("\n".join(lines + ["#EXT-X-ENDLIST", ""])).encode()


def ffconcat(*entries: str) -> bytes:
    return ("ffconcat version 1.0\n" + "".join(f"file '{entry}'\n" for entry in entries)).encode()


def mpd(base_url: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<MPD xmlns="urn:mpeg:dash:schema:mpd:2011" '
            f'profiles="urn:mpeg:dash:profile:isoff-on-demand:2011" type="static" '
            f'mediaPresentationDuration="PT1S" minBufferTime="PT1S"><Period><AdaptationSet '
            f'mimeType="video/mp4" segmentAlignment="true"><Representation id="v" bandwidth="100000" '
            f'codecs="avc1.64000d" width="64" height="48"><BaseURL>{base_url}</BaseURL>'
            f'<SegmentBase indexRange="0-0"/></Representation></AdaptationSet></Period></MPD>\n').encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """good/ holds honest clips; decoys/ the files playlists point at (watched); hostile/ the rest."""
    root = tmp_path_factory.mktemp("hostile")
    good, decoys, hostile = root / "good", root / "decoys", root / "hostile"
    for folder in (good, decoys, hostile):
        folder.mkdir()
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=64x48:rate=10:duration=1", "-f", "lavfi", "-i",
            "sine=frequency=440:sample_rate=16000:duration=1", "-c:v", "libx264", "-preset", "ultrafast",
            "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(good / "clip.mp4"))
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=660:sample_rate=16000:duration=1", str(good / "tone.wav"))
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=660:sample_rate=16000:duration=1", str(good / "tone.mp3"))
    # Decoys: real media a playlist could pass off as the named clip's content.
    _ffmpeg("-f", "lavfi", "-i", "testsrc=size=64x48:rate=10:duration=1", "-f", "lavfi", "-i",
            "sine=frequency=1000:sample_rate=16000:duration=1", "-c:v", "libx264", "-preset", "ultrafast",
            "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(decoys / "decoy.mp4"))
    _ffmpeg("-i", str(decoys / "decoy.mp4"), "-c", "copy", "-f", "mpegts", str(decoys / "decoy.ts"))
    for index in range(3):
        _ffmpeg("-f", "lavfi", "-i", "color=c=red:size=64x48:duration=0.1", "-frames:v", "1",
                str(decoys / f"shot{index}.png"))
    return {"root": root, "good": good, "decoys": decoys, "hostile": hostile}


@pytest.fixture
def trap():
    listener = Trap()
    yield listener
    listener.close()


def hostile_files(corpus, trap_port: int) -> dict[str, bytes]:
    """name -> content: playlists behind bytes the sniffing accepts, several disguises each."""
    decoys = corpus["decoys"]
    absolute, relative = str(decoys / "decoy.mp4"), os.path.relpath(decoys / "decoy.ts", corpus["hostile"])
    remote = f"http://127.0.0.1:{trap_port}/segment.ts"
    return {
        "id3_hls.mp3": id3_tag(32) + hls(absolute, relative, remote),
        "id3_hls_big_tag.mp4": id3_tag(6000) + hls(str(decoys / "decoy.ts"), remote),
        "id3_ffconcat.mp3": id3_tag(10) + ffconcat(relative),
        "id3_ffconcat_absolute.wav": id3_tag(100) + ffconcat(absolute),
        "id3_dash.mp4": id3_tag(16) + mpd(absolute),
        "id3_dash_remote.m4a": id3_tag(16) + mpd(remote),
        "box_hls.mp4": struct.pack(">I", 8) + b"free" + hls(absolute, remote),
        "box_ffconcat.mov": struct.pack(">I", 8) + b"skip" + ffconcat(relative),
        "xml_comment_dash.mp4": b"<!--ftypisom-->" + mpd(absolute),
        "xml_comment_hls.mkv": b"<!--moov-->\n" + hls(absolute),
    }


def refused_quietly(load, media, label, corpus, allowed_names=()):
    """load(media) raises MediaDecodeError naming `label`, and nothing in decoys/ was opened.
    (Each test checks its trap port once, at the end: a connection stays queued there.)"""
    watch = FolderWatch(corpus["decoys"])
    try:
        with pytest.raises(MediaDecodeError) as caught:
            load(media)
        opened = watch.names() - set(allowed_names)
    finally:
        watch.close()
    assert label in str(caught.value), str(caught.value)
    assert opened == set(), f"{label}: other files opened: {opened}"
    return caught.value


# --- path inputs ----------------------------------------------------------------------

# Every loader on two disguises; on the others, one loader per decode path (torchcodec
# video, soundfile-then-torchcodec audio, torchcodec audio of a video): the loaders of a
# path share its open.
EVERY_LOADER_ON = ("id3_hls.mp3", "xml_comment_dash.mp4")
ONE_PER_PATH = ("llava", "qwen", "load_audio", "omni_video_audio")


def test_playlists_behind_accepted_bytes_are_refused_by_every_loader(corpus, trap):
    for name, content in hostile_files(corpus, trap.port).items():
        (corpus["hostile"] / name).write_bytes(content)
    for name in hostile_files(corpus, trap.port):
        path = str(corpus["hostile"] / name)
        loaders = ALL_LOADERS if name in EVERY_LOADER_ON else {key: ALL_LOADERS[key] for key in ONE_PER_PATH}
        for loader_name, load in loaders.items():
            error = refused_quietly(load, path, path, corpus)
            assert error.path == path, (loader_name, error.path)
    assert not trap.was_contacted(), "a request reached the trap port"


def test_refusal_says_which_demuxer_ffmpeg_would_have_used(corpus, trap):
    path = corpus["hostile"] / "says_hls.mp3"
    path.write_bytes(id3_tag(8) + hls(str(corpus["decoys"] / "decoy.mp4")))
    error = refused_quietly(safe.load_video_llava, str(path), str(path), corpus)
    assert not trap.was_contacted()
    assert "hls" in error.reason and "mp3" in error.reason, error.reason


def test_image_sequence_pattern_in_a_name_reads_only_that_file(corpus, trap):
    """A clip named like an image-sequence pattern, next to files matching the pattern:
    the clip itself is decoded, frame for frame, and no sibling is opened."""
    folder = corpus["decoys"]
    patterned = folder / "shot%d.png"
    plain = corpus["good"] / "clip.mp4"
    patterned.write_bytes(plain.read_bytes())
    watch = FolderWatch(folder)
    try:
        frames = safe.load_video_llava(str(patterned))
        opened = watch.names()
    finally:
        watch.close()
    assert opened <= {patterned.name}, f"siblings opened: {opened - {patterned.name}}"
    np.testing.assert_array_equal(frames, safe.load_video_llava(str(plain)))


def test_relative_playlist_entries_never_reach_the_callers_directory(corpus, trap, monkeypatch, fresh_engine):
    """Bytes have no folder: a relative entry would resolve against the working directory.
    The caller sits in decoys/ when the sandboxes start; the playlist names decoy.mp4 relatively."""
    monkeypatch.chdir(corpus["decoys"])
    remote = f"http://127.0.0.1:{trap.port}/segment.ts"
    for content in (id3_tag(20) + ffconcat("decoy.mp4"), id3_tag(20) + hls("decoy.mp4", remote)):
        refused_quietly(safe.load_video_llava, content, f"<{len(content)} bytes>", corpus)
    assert not trap.was_contacted()


# --- bytes inputs ---------------------------------------------------------------------

class _Playlists(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.server.bodies.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "audio/mpeg")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def playlist_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Playlists)
    server.bodies = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_playlists_as_bytes_data_uri_base64_and_url_are_refused(corpus, trap, playlist_server):
    decoys = corpus["decoys"]
    remote = f"http://127.0.0.1:{trap.port}/segment.ts"
    bodies = {
        "/id3_hls.mp3": id3_tag(40) + hls(str(decoys / "decoy.mp4"), "decoy.ts", remote),
        "/id3_ffconcat.mp3": id3_tag(40) + ffconcat("decoys/decoy.mp4"),
        "/box_hls.mp4": struct.pack(">I", 8) + b"wide" + hls(remote),
        "/id3_dash.mp4": id3_tag(12) + mpd(remote),
    }
    playlist_server.bodies.update(bodies)
    base = f"http://127.0.0.1:{playlist_server.server_address[1]}"
    for route, body in bodies.items():
        encoded = base64.b64encode(body).decode()
        inputs = [(f"data:audio/mpeg;base64,{encoded}", "<data: URI of"),
                  (encoded + " " * 2000, "<base64 of"),  # long enough never to be tried as a path
                  (base + route, base + route)]
        for media, label in inputs:
            for loader_name in ("llava", "qwen", "load_audio", "omni"):
                refused_quietly(ALL_LOADERS[loader_name], media, label, corpus)
        for loader_name in ("llava", "load_audio"):  # raw bytes: the loaders whose stock takes them
            refused_quietly(ALL_LOADERS[loader_name], body, f"<{len(body)} bytes>", corpus)
    assert not trap.was_contacted(), "a request reached the trap port"


# --- PyAV, pinned ---------------------------------------------------------------------

def test_pyav_is_pinned_to_the_file_and_the_sniffed_demuxer(corpus, trap):
    import av

    good = str(corpus["good"] / "clip.mp4")
    with demuxers.open_pyav(good, good) as container:
        assert container.format.name.startswith("mov")
        pinned = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    with av.open(good) as container:
        stock = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(pinned) == len(stock) > 0
    for ours, theirs in zip(pinned, stock):
        np.testing.assert_array_equal(ours, theirs)
    for name, content in hostile_files(corpus, trap.port).items():
        path = corpus["hostile"] / name
        path.write_bytes(content)

        def open_and_decode(target):
            with demuxers.pinned_pyav(), av.open(target) as container:  # as torchvision's VideoReader
                for _ in container.decode():
                    pass
            raise MediaDecodeError(target, "opened")  # never read another file, whatever it returned

        watch = FolderWatch(corpus["decoys"])
        try:
            with pytest.raises(MediaDecodeError):
                open_and_decode(str(path))
            assert watch.names() == set(), name
        finally:
            watch.close()
    assert not trap.was_contacted()


# --- good files still decode ----------------------------------------------------------

def test_good_files_still_decode_as_path_and_bytes(corpus):
    clip, wav, mp3 = (str(corpus["good"] / name) for name in ("clip.mp4", "tone.wav", "tone.mp3"))
    for name, load in VIDEO_LOADERS.items():
        assert load(clip) is not None, name
    from_path = safe.load_video_llava(clip)
    with open(clip, "rb") as f:
        np.testing.assert_array_equal(safe.load_video_llava(f.read()), from_path)
    for path in (wav, mp3, clip):
        if path == clip and audio.librosa_without_audioread():  # its libsndfile refuses an MP4, as stock's
            for load in (lambda p: safe.load_audio(p, 16000), AUDIO_LOADERS["omni_video_audio"]):
                with pytest.raises(MediaDecodeError, match=audio_reason("")):
                    load(clip)
            return
        samples = safe.load_audio(path, 16000)
        assert samples.dtype == np.float32 and samples.size > 8000, path
    audios = AUDIO_LOADERS["omni_video_audio"](clip)
    assert audios[0].size > 8000


def test_demuxer_probe_agrees_with_ffmpeg_on_honest_containers(corpus):
    """The probe run before torchcodec opens names the demuxer FFmpeg itself reports."""
    for name in ("clip.mp4", "tone.wav", "tone.mp3"):
        path = corpus["good"] / name
        data = path.read_bytes()
        reported = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "format=format_name", "-of",
                                   "default=nw=1:nk=1", str(path)], capture_output=True, text=True,
                                  check=True).stdout.strip()
        assert demuxers.probe(data[:demuxers.PROBE_MAX], len(data)) == reported, name


# --- caller-side bounds: inline payloads and temporary folders --------------------------

def test_huge_data_uri_and_base64_are_refused_by_size_before_decoding():
    import tracemalloc

    payload = "A" * (120 << 20)  # 90 MiB once decoded: over the 64 MiB default cap
    for media, label in ((f"data:video/mp4;base64,{payload}", "data: URI"), (payload, "base64 string")):
        tracemalloc.start()
        start = time.monotonic()
        try:
            with pytest.raises(MediaDecodeError) as caught:
                safe.load_video_llava(media)
            elapsed = time.monotonic() - start
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert label in str(caught.value) and "SWIFT_SAFE_MEDIA_MAX_INLINE_BYTES" in caught.value.reason
        assert elapsed < 2.0, f"{elapsed:.1f} s"
        assert peak < 8 << 20, f"the caller allocated {peak >> 20} MiB"
    del payload


def test_inline_cap_is_a_setting(corpus, monkeypatch):
    clip = (corpus["good"] / "clip.mp4").read_bytes()
    uri = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_INLINE_BYTES", str(len(clip) // 2))
    with pytest.raises(MediaDecodeError, match="inline media cap"):
        safe.load_video_llava(uri)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_INLINE_BYTES", str(len(clip) * 2))
    assert safe.load_video_llava(uri).shape[0] > 0


def test_enabling_protection_leaves_nothing_in_the_temp_dir(corpus, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    clip = str(corpus["good"] / "clip.mp4")
    env = dict(os.environ, TMPDIR=str(temp))
    env.pop("SWIFT_SAFE_MEDIA_STATS_DIR", None)
    env.pop("SWIFT_SAFE_MEDIA_QUARANTINE", None)
    run_python(module="tests.programs.protected_decode", args=[clip], env=env, timeout=120)
    # torch's inductor cache folder (torchinductor_<user>), which importing torchcodec makes in
    # TMPDIR on some machines, is torch's, not ours.
    left = set(os.listdir(temp))
    assert sorted(name for name in left if not name.startswith("torchinductor_")) == []


def test_lerobot_decode_checks_the_demuxer_before_its_own_decoders_open(corpus, trap):
    """LeRobot's frame decode (run in the sandbox by our adapter) with both its backends."""
    from swift_safe_media.engine import calls as engine
    from swift_safe_media.hosts.lerobot import decode as lerobot_decode

    good = str(corpus["good"] / "clip.mp4")
    frames = engine.call(lerobot_decode.frames_in_sandbox, good, [0.0, 0.5], 0.05, "torchcodec", False, False,
                         path=good)
    assert tuple(frames.shape[:2]) == (2, 3)
    for name in ("id3_hls.mp3", "xml_comment_dash.mp4", "id3_ffconcat.mp3"):
        path = corpus["hostile"] / name
        path.write_bytes(hostile_files(corpus, trap.port)[name])
        for backend in ("torchcodec", "pyav"):
            refused_quietly(lambda p: engine.call(lerobot_decode.frames_in_sandbox, p, [0.0], 0.05, backend, False,
                                                  False, path=p),
                            str(path), str(path), corpus)
    assert not trap.was_contacted()


# --- stock code in its confined sandbox per call (issue 42) ------------------------------

def _stock_entry_points():
    from swift_safe_media.decoders import stock

    return {
        "transformers load_video pyav": lambda p: stock.load_video(p, num_frames=4, backend="pyav"),
        "transformers load_video decord": lambda p: stock.load_video(p, num_frames=4, backend="decord"),
        "transformers load_video opencv": lambda p: stock.load_video(p, num_frames=4, backend="opencv"),
        "transformers load_audio": lambda p: stock.load_audio(p, sampling_rate=16000),
        "keye_vl_utils.fetch_video": lambda p: stock.keye_fetch_video({"video": p}),
        "soundfile.read": lambda p: stock.soundfile_read(p),
        # The sandbox of these may run ffmpeg: the program is confined as the sandbox is.
        "whisper.load_audio": lambda p: stock.whisper_load_audio(p),
        "librosa.load (audioread's ffmpeg)": lambda p: stock.librosa_load(p, sr=16000),
    }


def test_playlists_reach_nothing_through_the_stock_entry_points(corpus, trap):
    """Stock's own decoders follow playlists (no guard of ours runs before them): in their
    confined sandbox of one call, which may read only the named file, each hostile file
    fails naming itself, no decoy is opened and the trap port hears nothing. A good file
    still decodes through each."""
    for name, content in hostile_files(corpus, trap.port).items():
        (corpus["hostile"] / name).write_bytes(content)
    for loader_name, load in _stock_entry_points().items():
        for name in hostile_files(corpus, trap.port):
            path = str(corpus["hostile"] / name)
            watch = FolderWatch(corpus["decoys"])
            try:
                with pytest.raises(MediaDecodeError) as caught:
                    load(path)
                opened = watch.names()
            finally:
                watch.close()
            assert caught.value.path == path, (loader_name, name, str(caught.value))
            assert opened == set(), (loader_name, name, opened)
        audio = any(word in loader_name for word in ("audio", "soundfile", "librosa"))
        good = corpus["good"] / ("tone.wav" if audio else "clip.mp4")
        assert load(str(good)) is not None, loader_name
    assert not trap.was_contacted(), "a request reached the trap port"
