"""Damaged and hostile media for tests/test_damaged_media.py and tests/test_scan.py, made at
test time with ffmpeg and byte surgery: partial files (an interrupted download or copy),
index variants (co64, fragments, several tracks, mdat before moov), WAVs with extra
chunks, streamed sizes and 4 GB claims, ADTS AAC and disguises of it."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path


def ffmpeg(*args) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True, timeout=120,
                   stdin=subprocess.DEVNULL)


def video_src(seconds, size="160x120", rate=30):
    return ["-f", "lavfi", "-i", f"testsrc2=size={size}:rate={rate}:duration={seconds}"]


def tone(seconds, rate=44100):
    return ["-f", "lavfi", "-i", f"sine=frequency=440:sample_rate={rate}:duration={seconds}"]


H264 = ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]


def cut(source: Path, destination: Path, fraction: float) -> Path:
    """The first `fraction` of `source`: what an interrupted download leaves."""
    data = source.read_bytes()
    destination.write_bytes(data[:int(len(data) * fraction)])
    return destination


# --- MP4 byte surgery -------------------------------------------------------------------

def _boxes(data, start, end):
    offset = start
    while offset + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, offset)
        header = 8
        if size == 1:
            size, header = struct.unpack_from(">Q", data, offset + 8)[0], 16
        elif size == 0:
            size = end - offset
        yield kind, offset, header, size
        offset += size


_PATH_TO_CHUNK_OFFSETS = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


def stco_to_co64(data: bytes) -> bytes:
    """The same file with every 32-bit chunk offset table (stco) rewritten as 64-bit
    (co64), the form files over 4 GB use. The boxes holding it grow; when moov comes
    before the media data, every offset moves by that growth."""
    top = list(_boxes(data, 0, len(data)))
    moov_at = next(offset for kind, offset, _, _ in top if kind == b"moov")
    mdat_at = next(offset for kind, offset, _, _ in top if kind == b"mdat")
    growth = 0
    for kind, offset, header, size in _walk(data, moov_at):
        if kind == b"stco":
            growth += struct.unpack_from(">I", data, offset + header + 4)[0] * 4
    shift = growth if moov_at < mdat_at else 0

    def rebuild(start, header, size, depth):
        kind = data[start + 4:start + 8]
        if kind == b"stco":
            count = struct.unpack_from(">I", data, start + header + 4)[0]
            offsets = struct.unpack_from(f">{count}I", data, start + header + 8)
            body = data[start + header:start + header + 8] + struct.pack(f">{count}Q", *(o + shift for o in offsets))
            return struct.pack(">I4s", 8 + len(body), b"co64") + body
        if depth < len(_PATH_TO_CHUNK_OFFSETS) and kind == _PATH_TO_CHUNK_OFFSETS[depth]:
            children = b"".join(rebuild(offset, child_header, child_size, depth + 1)
                                for _, offset, child_header, child_size in _boxes(data, start + header, start + size))
            return struct.pack(">I4s", 8 + len(children), kind) + children
        return data[start:start + size]

    out = b""
    for kind, offset, header, size in top:
        out += rebuild(offset, header, size, 0) if kind == b"moov" else data[offset:offset + size]
    return out


def _walk(data, moov_at):
    """Every box under moov down to the chunk offset tables."""
    size = struct.unpack_from(">I", data, moov_at)[0]
    stack = [(moov_at + 8, moov_at + size, 1)]
    while stack:
        start, end, depth = stack.pop()
        for kind, offset, header, child_size in _boxes(data, start, end):
            yield kind, offset, header, child_size
            if depth < len(_PATH_TO_CHUNK_OFFSETS) and kind == _PATH_TO_CHUNK_OFFSETS[depth]:
                stack.append((offset + header, offset + child_size, depth + 1))


def mdat_cut_before_moov(source: Path, destination: Path, keep: float) -> Path:
    """[ftyp][mdat][moov] with the mdat cut to `keep` of its data (its size field made to
    match) and the moov kept whole at the end: the index points past the file's end."""
    data = source.read_bytes()
    parts = []
    for kind, offset, header, size in _boxes(data, 0, len(data)):
        if kind == b"mdat":
            kept = int((size - header) * keep)
            parts.append(struct.pack(">I4s", 8 + kept, b"mdat") + data[offset + header:offset + header + kept])
        else:
            parts.append(data[offset:offset + size])
    assert [data[o + 4:o + 8] for _, o, _, _ in _boxes(data, 0, len(data))].index(b"mdat") < \
        [data[o + 4:o + 8] for _, o, _, _ in _boxes(data, 0, len(data))].index(b"moov"), "needs mdat before moov"
    destination.write_bytes(b"".join(parts))
    return destination


# --- WAV byte surgery -------------------------------------------------------------------

def wav_with_extra_chunks(source: Path, destination: Path) -> Path:
    """A WAV with JUNK, LIST and bext chunks (one of odd size, so padded) before its data
    and a LIST after it, as broadcast and editing tools write them."""
    data = source.read_bytes()
    chunks, offset = [], 12
    while offset + 8 <= len(data):
        name, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        chunks.append((name, data[offset + 8:offset + 8 + size]))
        offset += 8 + size + (size & 1)
    extra = [(b"JUNK", bytes(28)), (b"bext", b"made by a test" + bytes(3)), (b"LIST", b"INFOISFT\x06\x00\x00\x00tests\x00")]
    ordered = [c for c in chunks if c[0] == b"fmt "] + extra + [c for c in chunks if c[0] == b"data"] + \
        [(b"LIST", b"INFOICMT\x04\x00\x00\x00end\x00")]
    body = b"WAVE" + b"".join(name + struct.pack("<I", len(payload)) + payload + bytes(len(payload) & 1)
                              for name, payload in ordered)
    destination.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return destination


def wav_header_claiming(source: Path, destination: Path, data_size: int) -> Path:
    """`source`'s header up to its data chunk, the data chunk claiming `data_size` bytes
    and holding none."""
    data = source.read_bytes()
    at = data.index(b"data")
    destination.write_bytes(data[:at + 4] + struct.pack("<I", data_size))
    return destination


# --- the set used by the tests ----------------------------------------------------------

def build(folder: Path) -> dict[str, Path]:
    """name -> path. `whole_*` decode; everything else is damaged or hostile."""
    folder.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}

    def make(name, *args):
        ffmpeg(*args, str(folder / name))
        made[name] = folder / name
        return folder / name

    # Index at the front (faststart): 200 frames promised, about a third held once cut.
    faststart = make("whole_faststart.mp4", *video_src(200 / 30), *tone(200 / 30), *H264, "-g", "30",
                     "-c:a", "aac", "-shortest", "-movflags", "+faststart")
    made["cut_faststart.mp4"] = cut(faststart, folder / "cut_faststart.mp4", 0.35)
    # QuickTime flavour, audio only in an MP4 (m4a), 64-bit chunk offsets.
    made["cut_faststart.mov"] = cut(make("whole.mov", *video_src(3), *H264, "-movflags", "+faststart"),
                                    folder / "cut_faststart.mov", 0.5)
    made["cut_audio_only.m4a"] = cut(make("whole_audio.m4a", *tone(4), "-c:a", "aac", "-movflags", "+faststart"),
                                     folder / "cut_audio_only.m4a", 0.5)
    co64 = folder / "whole_co64.mp4"
    co64.write_bytes(stco_to_co64(faststart.read_bytes()))
    made["whole_co64.mp4"] = co64
    made["cut_co64.mp4"] = cut(co64, folder / "cut_co64.mp4", 0.4)
    # Fragmented: an empty moov, then moof+mdat pairs; with and without default-base-is-moof.
    for flags, name in (("frag_keyframe+empty_moov+default_base_moof", "fragmented"),
                        ("frag_keyframe+empty_moov", "fragmented_plain_base")):
        whole = make(f"whole_{name}.mp4", *video_src(4), *tone(4), *H264, "-g", "30", "-c:a", "aac", "-shortest",
                     "-movflags", flags)
        made[f"cut_{name}.mp4"] = cut(whole, folder / f"cut_{name}.mp4", 0.6)
    # Two video tracks and an audio track, interleaved.
    multi = make("whole_multitrack.mp4", *video_src(3), *video_src(3, size="96x64"), *tone(3),
                 "-map", "0", "-map", "1", "-map", "2", *H264, "-c:a", "aac", "-movflags", "+faststart")
    made["cut_multitrack.mp4"] = cut(multi, folder / "cut_multitrack.mp4", 0.5)
    # Media data first, index last (ffmpeg's default layout), the data cut short.
    moov_last = make("whole_moov_last.mp4", *video_src(4), *H264, "-g", "30")
    made["cut_mdat_before_moov.mp4"] = mdat_cut_before_moov(moov_last, folder / "cut_mdat_before_moov.mp4", 0.4)

    # WAV: plain, with extra chunks, RF64; cut in the data.
    wav = make("whole.wav", *tone(3, 16000), "-c:a", "pcm_s16le")
    made["whole_extra_chunks.wav"] = wav_with_extra_chunks(wav, folder / "whole_extra_chunks.wav")
    made["cut_extra_chunks.wav"] = cut(made["whole_extra_chunks.wav"], folder / "cut_extra_chunks.wav", 0.5)
    made["cut_rf64.wav"] = cut(make("whole_rf64.wav", *tone(3, 16000), "-c:a", "pcm_s16le", "-rf64", "always"),
                               folder / "cut_rf64.wav", 0.5)
    made["claims_4gb.wav"] = wav_header_claiming(wav, folder / "claims_4gb.wav", 0xFFFFFFF0)
    made["streamed_no_payload.wav"] = wav_header_claiming(wav, folder / "streamed_no_payload.wav", 0xFFFFFFFF)
    with open(folder / "whole_streamed.wav", "wb") as out:  # written to a pipe: sizes left at 0xFFFFFFFF
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", *tone(3, 16000), "-c:a", "pcm_s16le", "-f", "wav", "-"],
                       stdout=out, check=True, timeout=60)
    made["whole_streamed.wav"] = folder / "whole_streamed.wav"

    # ADTS AAC, and bytes that only look like it.
    adts = make("whole.aac", *tone(3, 44100), "-c:a", "aac", "-b:a", "96k")
    head = bytearray(adts.read_bytes())
    bad_rate = bytearray(head)
    bad_rate[2] = (bad_rate[2] & 0xC3) | (13 << 2)  # sample rate index 13 is reserved
    (folder / "adts_bad_rate.aac").write_bytes(bad_rate)
    made["adts_bad_rate.aac"] = folder / "adts_bad_rate.aac"
    # The same broken header with nothing behind it that FFmpeg could find a sync in.
    (folder / "adts_bad_rate_alone.aac").write_bytes(bytes(bad_rate[:7]) + bytes(4000))
    made["adts_bad_rate_alone.aac"] = folder / "adts_bad_rate_alone.aac"
    # A valid first ADTS header, then no second frame where it says the first one ends.
    length = (head[3] & 0x03) << 11 | head[4] << 3 | head[5] >> 5
    (folder / "adts_one_header.aac").write_bytes(bytes(head[:length]) + b"#EXTM3U\n" + bytes(4000))
    made["adts_one_header.aac"] = folder / "adts_one_header.aac"
    return made
