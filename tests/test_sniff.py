"""The sniffer knows the containers and elementary streams FFmpeg's allow-listed demuxers
read, made here by ffmpeg, and FFmpeg's own probe agrees on an allowed demuxer for each;
playlists and lists of other inputs stay refused whatever they are named."""

from __future__ import annotations

import subprocess

import pytest

from swift_safe_media.decoders import demuxers, guards, sniff
from swift_safe_media.errors import MediaDecodeError
from tests.realworld import junk, qcp, sphere

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


# --- formats people train on that FFmpeg reads by their bytes (issue 34) -----------------

SPEECH = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=1"]
# name -> (ffmpeg arguments, sniffed kind)
TRAINED_ON = {
    "animated.gif": (SRC + ["-f", "gif"], "gif"),
    "speech.tta": (SPEECH + ["-f", "tta"], "tta"),
    "speech.au": (SPEECH + ["-f", "au"], "amr/au/wavpack/ape"),
    "speech.wv": (SPEECH + ["-c:a", "wavpack"], "amr/au/wavpack/ape"),
    "speech.spx": (SPEECH + ["-c:a", "libspeex"], "ogg"),
    "speech.voc": (SPEECH + ["-f", "voc"], "voc"),
    # Broadcast WAV: a bext chunk between fmt and data.
    "broadcast.bwf": (SPEECH + ["-write_bext", "1", "-f", "wav"], "wav"),
    "tagged.aac": (SPEECH + ["-c:a", "aac", "-f", "adts", "-write_id3v2", "1", "-metadata", "title=x"], "mp3/aac"),
    "gsm.wav": (["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=8000:duration=1", "-c:a", "libgsm_ms"], "wav"),
}
LONG_TONE = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100:duration=20"]


def ffprobe_format(path) -> str:
    """The demuxer the ffmpeg command line picks for `path` (its name and bytes)."""
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "format=format_name", "-of", "csv=p=0",
                          str(path)], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().split(",")[0]


def pinned_demuxer(path) -> str:
    """The demuxer we pin for `path`: chosen from its bytes (with its name where FFmpeg's
    probe needs the name: raw G.722 and GSM, a short MP3 behind junk), as ``open_pyav``."""
    data = path.read_bytes()
    kind = guards.check_file(str(path), str(path))
    return demuxers.pyav_format(str(path), kind, data[:demuxers.PROBE_MAX], len(data), str(path))


def _trained_on(tmp_path, name):
    if name == "junk_then.mp3":
        path = tmp_path / name
        path.write_bytes(junk() + _make(tmp_path, "_long.mp3", LONG_TONE + ["-c:a", "libmp3lame"]).read_bytes())
        return path, "mp3/aac"
    if name == "junk_then.aac":
        path = tmp_path / name
        path.write_bytes(junk() + _make(tmp_path, "_long.aac", LONG_TONE + ["-c:a", "aac", "-f", "adts"]).read_bytes())
        return path, "mp3/aac"
    if name == "speech.sph":
        path = tmp_path / name
        path.write_bytes(sphere(_make(tmp_path, "_pcm.raw", SPEECH + ["-f", "s16le"]).read_bytes()))
        return path, "nistsphere"
    if name == "speech.g722":
        return _make(tmp_path, name, SPEECH + ["-c:a", "g722", "-f", "g722"]), "g722"
    args, kind = TRAINED_ON[name]
    return _make(tmp_path, name, args), kind


@pytest.mark.parametrize("name", [*TRAINED_ON, "junk_then.mp3", "junk_then.aac", "speech.sph", "speech.g722"])
def test_formats_people_train_on_are_sniffed_as_ffmpeg_reads_them(tmp_path, name):
    path, kind = _trained_on(tmp_path, name)
    assert guards.check_file(str(path), str(path)) == kind
    assert pinned_demuxer(path) == ffprobe_format(path)


@pytest.mark.parametrize("name", list(CASES))
def test_every_pinned_demuxer_is_the_one_the_command_line_picks(tmp_path, name):
    path = _make(tmp_path, name, CASES[name][0])
    assert pinned_demuxer(path) == ffprobe_format(path)


def test_qcp_is_sniffed_and_ffmpeg_agrees(tmp_path):
    path = tmp_path / "memo.qcp"
    path.write_bytes(qcp())  # its header: what the sniffer and FFmpeg's probe read
    assert guards.check_file(str(path), str(path)) == "qcp"
    data = path.read_bytes()
    assert demuxers.probe(data, len(data)) == "qcp" == ffprobe_format(path)


def test_raw_g722_is_taken_by_its_name_only(tmp_path):
    """Headerless: FFmpeg's probe never picks G.722 (without the name it may take the bytes
    for MP3 frames); the same bytes without the name are never read as G.722, and
    torchcodec (which cannot be told a demuxer) never gets them."""
    path, _ = _trained_on(tmp_path, "speech.g722")
    data = path.read_bytes()
    assert demuxers.probe(data, len(data)) != "g722"  # its demuxer has no probe: any bytes are G.722
    renamed = tmp_path / "speech"  # no extension: the command line judges the bytes alone
    renamed.write_bytes(data)
    try:  # nameless: never G.722 (here FFmpeg's probe takes it for MP3, which then fails to decode)
        assert pinned_demuxer(renamed) != "g722"
    except MediaDecodeError as exc:
        assert "not a known media container" in exc.reason or "demuxer mismatch" in exc.reason
    with pytest.raises(MediaDecodeError, match="torchcodec cannot be told its demuxer"):
        demuxers.for_torchcodec(str(path), str(path))


def test_junk_alone_and_a_playlist_behind_junk_stay_refused():
    with pytest.raises(MediaDecodeError, match="not a known media container"):
        guards.check_bytes("noise.mp3", junk(300 * 1024))
    with pytest.raises(MediaDecodeError, match="HLS"):
        guards.check_bytes("list.mp3", b"#EXTM3U\n" + junk())


def test_a_short_mp3_behind_junk_is_read_as_ffmpeg_reads_it_by_its_name(tmp_path):
    """One second of MP3 after 100 kB of junk: FFmpeg's probe finds it only with the file's
    name (the command line reads `short.mp3`, not the same bytes as `short.bin`). Named
    .mp3 it is pinned to the mp3 demuxer, read by PyAV; nameless (bytes, another name)
    it stays refused, and torchcodec (which probes without a name) never gets it."""
    data = junk() + _make(tmp_path, "_short.mp3", SPEECH + ["-c:a", "libmp3lame"]).read_bytes()
    assert sniff.container_of(data[:sniff.SCAN_BYTES]) == "mp3/aac"
    named, other = tmp_path / "short.mp3", tmp_path / "short.bin"
    named.write_bytes(data)
    other.write_bytes(data)
    assert pinned_demuxer(named) == ffprobe_format(named) == "mp3"
    assert demuxers.picked_by_name(str(named))
    assert ffprobe_format(other) == ""
    with pytest.raises(MediaDecodeError, match="recognises no format"):
        pinned_demuxer(other)
    with pytest.raises(MediaDecodeError, match="recognises no format"):
        demuxers.check("short.mp3", data[:demuxers.PROBE_MAX], len(data))
    with pytest.raises(MediaDecodeError, match="recognises no format"):
        demuxers.for_torchcodec(str(named), str(named))


def test_raw_gsm_is_taken_by_its_name_as_ffmpeg_takes_it():
    """Asterisk's telephony prompts: raw GSM 6.10 frames, no header; FFmpeg's gsm demuxer
    has no probe and is chosen by the `.gsm` name, as here."""
    from tests.realworld import DATA

    path = DATA / "hello-world.gsm"
    assert guards.check_file(str(path), str(path)) == "gsm"
    assert pinned_demuxer(path) == ffprobe_format(path) == "gsm"
    with pytest.raises(MediaDecodeError, match="torchcodec cannot be told its demuxer"):
        demuxers.for_torchcodec(str(path), str(path))

