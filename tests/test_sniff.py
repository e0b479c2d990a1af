"""The sniffer knows the containers and elementary streams FFmpeg's allow-listed demuxers
read, made here by ffmpeg, and FFmpeg's own probe agrees on an allowed demuxer for each;
playlists and lists of other inputs stay refused whatever they are named."""

from __future__ import annotations

import subprocess

import pytest

from swift_safe_media.decoders import demuxers, guards, sniff
from swift_safe_media.errors import MediaDecodeError

SRC = ["-f", "lavfi", "-i", "testsrc2=size=64x48:rate=25:duration=0.4"]
TONE = ["-f", "lavfi", "-i", "sine=sample_rate=48000:duration=0.3"]
X264 = ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]

# name -> (ffmpeg arguments, sniffed kind, the demuxer FFmpeg's probe must pick)
CASES = {
    "mpeg1.m1v": (SRC + ["-c:v", "mpeg1video", "-f", "mpeg1video"], "video-es", "mpegvideo"),
    "mpeg2.m2v": (SRC + ["-c:v", "mpeg2video", "-f", "mpeg2video"], "video-es", "mpegvideo"),
    "mpeg4.m4v": (SRC + ["-c:v", "mpeg4", "-f", "m4v"], "video-es", "m4v"),
    "annexb.h264": (SRC + X264 + ["-f", "h264"], "video-es", "h264"),
    "annexb.hevc": (SRC + ["-c:v", "libx265", "-x265-params", "log-level=error", "-f", "hevc"], "video-es", "hevc"),
    "plain.ts": (SRC + X264 + ["-f", "mpegts"], "mpeg-ts", "mpegts"),
    "bluray.m2ts": (SRC + X264 + ["-f", "mpegts", "-mpegts_m2ts_mode", "1"], "mpeg-ts", "mpegts"),
    "program.mpg": (SRC + ["-c:v", "mpeg2video", "-f", "mpeg"], "mpeg-ps", "mpeg"),
    "vp8.ivf": (SRC + ["-c:v", "libvpx", "-f", "ivf"], "ivf", "ivf"),
    "raw.y4m": (SRC + ["-pix_fmt", "yuv420p", "-f", "yuv4mpegpipe"], "y4m", "yuv4mpegpipe"),
    "clip.nut": (SRC + ["-c:v", "mpeg4", "-f", "nut"], "nut", "nut"),
    "sound.w64": (TONE + ["-f", "w64"], "w64", "w64"),
    "sound.voc": (TONE + ["-ar", "22050", "-f", "voc"], "voc", "voc"),
    "sound.ac3": (TONE + ["-c:a", "ac3", "-f", "ac3"], "ac3", "ac3"),
    "sound.eac3": (TONE + ["-c:a", "eac3", "-f", "eac3"], "ac3", "eac3"),
}


def _make(tmp_path, name, args):
    path = tmp_path / name
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args, str(path)], check=True, timeout=60)
    return path


@pytest.mark.parametrize("name", CASES)
def test_known_to_the_sniffer_and_to_ffmpeg(tmp_path, name):
    args, kind, demuxer = CASES[name]
    path = _make(tmp_path, name, args)
    assert guards.check_file(str(path), str(path)) == kind
    data = path.read_bytes()
    assert demuxers.probe(data[:demuxers.PROBE_MAX], len(data)) == demuxer
    demuxers.check(str(path), data[:demuxers.PROBE_MAX], len(data))


def test_ts_with_204_byte_packets(tmp_path):
    """DVB captures keep 16 bytes of parity after each 188-byte packet."""
    data = _make(tmp_path, "plain.ts", CASES["plain.ts"][0]).read_bytes()
    padded = b"".join(data[i:i + 188] + bytes(16) for i in range(0, len(data), 188))
    assert sniff.ts_layout(padded[:sniff.HEAD_BYTES]) == (0, 204)
    assert guards.check_bytes("dvb.ts", padded) == "mpeg-ts"
    assert demuxers.probe(padded[:demuxers.PROBE_MAX], len(padded)) == "mpegts"


def test_m2ts_layout_and_a_lone_sync_byte():
    m2ts = b"".join(bytes(4) + b"G" + bytes(187) for _ in range(4))
    assert sniff.ts_layout(m2ts) == (4, 192)
    assert sniff.container_of(b"G" + bytes(300)) is None  # one sync byte, no second packet


@pytest.mark.parametrize("text, reason", [
    (b"#EXTM3U\n#EXT-X-TARGETDURATION:1\nseg.ts\n", "HLS"),
    (b"ffconcat version 1.0\nfile a.mp4\n", "ffconcat"),
    (b"<?xml version='1.0'?><MPD></MPD>", "XML"),
    (b"file '/etc/passwd'\n", "concat"),
])
def test_playlists_stay_refused(text, reason):
    with pytest.raises(MediaDecodeError, match=reason):
        guards.check_bytes("list.ts", text)


def test_a_start_code_ffmpeg_reads_as_nothing_allowed_is_refused():
    """00 00 01 passes the first filter; FFmpeg's probe must still name an allowed demuxer."""
    junk = b"\x00\x00\x01\xb3" + bytes(range(256)) * 8
    assert sniff.container_of(junk) == "video-es"
    with pytest.raises(MediaDecodeError, match="demuxer mismatch|recognises no format"):
        demuxers.check("junk.m2v", junk, len(junk))
