"""Checks that run before FFmpeg, libsndfile or torchcodec touch a file, and the caps.

FFmpeg follows playlists (HLS, concat, ...) to other paths, and an open() of a FIFO
blocks forever; so a file must be a regular, non-empty file whose first bytes are a
known media container before anything decodes it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .. import config
from ..config import MAX_AUDIO_SECONDS, MAX_INLINE_BYTES, MAX_PIXELS, MAX_RESULT_MB, MAX_URL_BYTES
from ..errors import MediaDecodeError
from . import integrity

HEAD_BYTES = 64


@dataclass(frozen=True)
class Limits:
    """Caps for one loader call. Read in the caller, so a changed environment applies at once."""
    max_pixels: int = config.SETTINGS[MAX_PIXELS].default
    max_audio_seconds: float = config.SETTINGS[MAX_AUDIO_SECONDS].default
    max_url_bytes: int = config.SETTINGS[MAX_URL_BYTES].default
    max_result_bytes: int = config.SETTINGS[MAX_RESULT_MB].default << 20
    max_inline_bytes: int = config.SETTINGS[MAX_INLINE_BYTES].default

    @classmethod
    def from_env(cls) -> "Limits":
        return cls(config.get(MAX_PIXELS), config.get(MAX_AUDIO_SECONDS), config.get(MAX_URL_BYTES),
                   config.get(MAX_RESULT_MB) << 20, config.get(MAX_INLINE_BYTES))


def check_pixels(label, frames: int, height: int, width: int, limits: Limits) -> None:
    total = frames * height * width
    if total > limits.max_pixels:
        raise MediaDecodeError(label, f"decoded pixels cap exceeded: {frames} frames of {width}x{height} = "
                                      f"{total} > {limits.max_pixels} ({MAX_PIXELS})")


def check_result_bytes(label, nbytes: int, what: str, limits: Limits) -> None:
    """Refuse a result larger than the caller may be handed; checked before decoding
    whenever its size is known in advance."""
    if nbytes > limits.max_result_bytes:
        raise MediaDecodeError(label, f"result size cap exceeded: {what} = {_megabytes(nbytes)} > "
                                      f"{_megabytes(limits.max_result_bytes)} ({MAX_RESULT_MB})")


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MB"


def check_audio_seconds(label, seconds: float, limits: Limits) -> None:
    if seconds > limits.max_audio_seconds:
        raise MediaDecodeError(label, f"audio duration cap exceeded: {seconds:.1f} s > "
                                      f"{limits.max_audio_seconds:.1f} s ({MAX_AUDIO_SECONDS})")


# Text formats that make FFmpeg open other files or URLs. All are refused by the
# allow-list anyway; these get a reason that says what was found.
_INDIRECTIONS = (
    (b"#EXTM3U", "HLS playlist refused"),
    (b"#EXT-X-", "HLS playlist refused"),
    (b"ffconcat", "ffconcat playlist refused"),
    (b"[playlist]", "PLS playlist refused"),
    (b"<?xml", "XML document refused (DASH manifest, SMIL or similar)"),
    (b"<MPD", "DASH manifest refused"),
    (b"<smil", "SMIL playlist refused"),
    (b"file ", "concat list refused"),
)


def _is_mp3_frame(head: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, a version other than the reserved 01, a
    layer (00 is reserved: that is ADTS), a bitrate index other than 1111 and a sample
    rate index other than 11."""
    return (len(head) >= 4 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x18 != 0x08
            and head[1] & 0x06 != 0 and head[2] & 0xF0 != 0xF0 and head[2] & 0x0C != 0x0C)


def adts_frame_length(head: bytes) -> int:
    """Length of the ADTS AAC frame these bytes start (its header's own field), or 0 if
    they do not start one: 12 sync bits, layer 00, a sample rate index below 13 and a
    frame long enough for its header (7 bytes, 9 with a CRC)."""
    if len(head) < 7 or head[0] != 0xFF or head[1] & 0xF6 != 0xF0 or (head[2] >> 2) & 0x0F > 12:
        return 0
    length = (head[3] & 0x03) << 11 | head[4] << 3 | head[5] >> 5
    return length if length >= (7 if head[1] & 0x01 else 9) else 0


def container_of(head: bytes) -> str | None:
    """Name of the media container these first bytes start, or None if not an allowed one."""
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"):
        return "mp4/mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska/webm"
    if head.startswith((b"RIFF", b"RIFX", b"RF64")) and head[8:12] in (b"WAVE", b"AVI ", b"AVIX"):
        return "wav" if head[8:12] == b"WAVE" else "avi"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3"):
        return "mp3/aac"  # a tag before MPEG audio or ADTS frames
    if _is_mp3_frame(head):
        return "mp3"
    if adts_frame_length(head):
        return "aac"
    if head.startswith(b"FORM") and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head.startswith(b"caff"):
        return "caf"
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return "asf/wmv"
    if head.startswith(b"FLV\x01"):
        return "flv"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg-ps"
    if head[:1] == b"G":
        return "mpeg-ts"  # the 0x47 sync byte; the second packet is checked by check_head
    if head.startswith((b"#!AMR", b".snd", b"wvpk", b"MAC ")):
        return "amr/au/wavpack/ape"
    return None


def check_head(label, head: bytes, size: int) -> str:
    """Raise unless `head` (the first bytes of a `size`-byte input) starts a media container."""
    if size == 0:
        raise MediaDecodeError(label, "zero-byte file")
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    for magic, reason in _INDIRECTIONS:
        if stripped[:len(magic)].lower() == magic.lower():
            raise MediaDecodeError(label, reason)
    kind = container_of(head)
    if kind is None:
        raise MediaDecodeError(label, f"not a known media container (first bytes {head[:12]!r})")
    return kind


def _second_frame_synced(kind: str, head: bytes, read_at, size: int) -> bool:
    """For containers known by a sync pattern only (MPEG-TS, ADTS), the next packet or
    frame must start where the first one says it ends, when the input reaches that far."""
    if kind == "mpeg-ts":
        return size >= 189 and read_at(188, 1) == b"G"
    if kind == "aac":
        length = adts_frame_length(head)
        return length + 7 > size or adts_frame_length(read_at(length, 7)) > 0
    return True


def check_regular(label, path: str) -> os.stat_result:
    """Raise unless `path` is an existing, non-empty regular file (never opens it)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise MediaDecodeError(label, "no such file") from None
    except OSError as exc:
        raise MediaDecodeError(label, f"cannot stat: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaDecodeError(label, "is a directory, not a media file")
    if not stat.S_ISREG(info.st_mode):
        kind = "FIFO" if stat.S_ISFIFO(info.st_mode) else "socket" if stat.S_ISSOCK(info.st_mode) \
            else "device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "special file"
        raise MediaDecodeError(label, f"not a regular file ({kind})")
    if info.st_size == 0:
        raise MediaDecodeError(label, "zero-byte file")
    return info


def check_file(label, path: str) -> str:
    """Raise unless `path` is a regular non-empty file holding an allowed container whose
    index (if it has one) promises no more than the file holds."""
    info = check_regular(label, path)
    # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open() must not wait.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise MediaDecodeError(label, f"cannot open: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MediaDecodeError(label, "not a regular file")
        head = os.pread(fd, HEAD_BYTES, 0)
        kind = check_head(label, head, info.st_size)
        if not _second_frame_synced(kind, head, lambda off, n: os.pread(fd, n, off), info.st_size):
            raise MediaDecodeError(label, f"not a known media container (first bytes {head[:12]!r})")
        integrity.check_complete(label, kind, integrity.Reader(fd=fd, size=info.st_size))
    finally:
        os.close(fd)
    return kind


def check_bytes(label, data: bytes) -> str:
    kind = check_head(label, data[:HEAD_BYTES], len(data))
    if not _second_frame_synced(kind, data[:HEAD_BYTES], lambda off, n: data[off:off + n], len(data)):
        raise MediaDecodeError(label, f"not a known media container (first bytes {data[:12]!r})")
    integrity.check_complete(label, kind, integrity.Reader(data=data))
    return kind
