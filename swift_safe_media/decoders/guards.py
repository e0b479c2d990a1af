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
from ..confinement import handed
from ..config import MAX_AUDIO_SECONDS, MAX_EXPANSION, MAX_INLINE_BYTES, MAX_PIXELS, MAX_RESULT_MB, MAX_URL_BYTES
from ..errors import MediaDecodeError
from . import integrity
from .sniff import HEAD_BYTES, RAW_BY_EXTENSION, SCAN_BYTES, adts_frame_length, container_of  # noqa: F401


@dataclass(frozen=True)
class Limits:
    """Caps for one loader call. Read in the caller, so a changed environment applies at once."""
    max_pixels: int = config.SETTINGS[MAX_PIXELS].default
    max_audio_seconds: float = config.SETTINGS[MAX_AUDIO_SECONDS].default
    max_url_bytes: int = config.SETTINGS[MAX_URL_BYTES].default
    max_result_bytes: int = config.SETTINGS[MAX_RESULT_MB].default << 20
    max_inline_bytes: int = config.SETTINGS[MAX_INLINE_BYTES].default
    max_expansion: int = config.SETTINGS[MAX_EXPANSION].default

    @classmethod
    def from_env(cls) -> "Limits":
        return cls(config.get(MAX_PIXELS), config.get(MAX_AUDIO_SECONDS), config.get(MAX_URL_BYTES),
                   config.get(MAX_RESULT_MB) << 20, config.get(MAX_INLINE_BYTES), config.get(MAX_EXPANSION))


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


# Below this many decoded bytes the expansion is never checked: a short clip or a second
# of sound may decode to any multiple of its few kilobytes.
EXPANSION_FLOOR_BYTES = 256 << 20


def check_expansion(label, nbytes: float, what: str, input_bytes: int | None, limits: Limits) -> None:
    """Refuse a decompression bomb: `nbytes` decoded (RGB frames, float32 samples at the
    native rate) from an input of `input_bytes`, over ``max_expansion`` times its size.
    Checked from the header, before decoding, in the sandbox."""
    if not limits.max_expansion or not input_bytes or nbytes <= EXPANSION_FLOOR_BYTES:
        return
    if nbytes > limits.max_expansion * input_bytes:
        raise MediaDecodeError(label, f"decompression cap exceeded: {what} = {_megabytes(nbytes)} from a "
                                      f"{input_bytes / 1024:.0f} KB file, {nbytes / input_bytes:.0f} times its size "
                                      f"> {limits.max_expansion} ({MAX_EXPANSION})")


def input_size(data) -> int | None:
    """Bytes of a materialized input (a guarded path, or bytes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return len(data)
    try:
        return handed.stat(data).st_size  # the descriptor the caller handed, if it did
    except (OSError, TypeError):
        return None


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


def check_head(label, head: bytes, size: int, name: str | None = None) -> str:
    """Raise unless `head` (the first bytes of a `size`-byte input: ``HEAD_BYTES``, or up
    to ``SCAN_BYTES`` to find audio frames behind junk) starts a media container. A
    headerless format FFmpeg knows by its file name only (raw G.722) is taken by `name`'s
    extension, and only where the bytes start nothing else."""
    if size == 0:
        raise MediaDecodeError(label, "zero-byte file")
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    for magic, reason in _INDIRECTIONS:
        if stripped[:len(magic)].lower() == magic.lower():
            raise MediaDecodeError(label, reason)
    # The name's headerless format before frames looked for behind junk: G.722's bytes
    # are anything, MPEG audio frames now and then among them.
    kind = container_of(head[:HEAD_BYTES]) or raw_by_name(name) or container_of(head)
    if kind is None:
        raise MediaDecodeError(label, f"not a known media container (first bytes {head[:12]!r})")
    return kind


def raw_by_name(name) -> str | None:
    """The headerless format (``RAW_BY_EXTENSION``) a local file's name says it holds."""
    return RAW_BY_EXTENSION.get(os.path.splitext(name)[1].lower()) if isinstance(name, str) else None


def _second_frame_synced(kind: str, head: bytes, read_at, size: int) -> bool:
    """For ADTS, known by a sync pattern only, the next frame must start where the
    first one says it ends, when the input reaches that far. (MPEG-TS packets are
    checked in ``container_of``: the head holds four of them.)"""
    if kind == "aac":
        length = adts_frame_length(head)
        return length + 7 > size or adts_frame_length(read_at(length, 7)) > 0
    return True


def check_regular(label, path: str) -> os.stat_result:
    """Raise unless `path` is an existing, non-empty regular file (never opens it)."""
    try:
        info = handed.stat(path)  # the descriptor the caller handed, if it did
    except FileNotFoundError:
        raise MediaDecodeError(label, "no such file") from None
    except OSError as exc:
        raise MediaDecodeError(label, f"cannot stat: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaDecodeError(label, "is a directory, not a media file")
    if not stat.S_ISREG(info.st_mode):
        raise MediaDecodeError(label, f"not a regular file ({handed.special_kind(info.st_mode)})")
    if info.st_size == 0:
        raise MediaDecodeError(label, "zero-byte file")
    return info


def check_file(label, path: str) -> str:
    """Raise unless `path` is a regular non-empty file holding an allowed container whose
    index (if it has one) promises no more than the file holds."""
    info = check_regular(label, path)
    # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open() must not wait.
    try:
        fd = handed.open_fd(path)
    except OSError as exc:
        raise MediaDecodeError(label, f"cannot open: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MediaDecodeError(label, "not a regular file")
        head = os.pread(fd, HEAD_BYTES, 0)
        if container_of(head) is None and info.st_size > HEAD_BYTES:  # audio frames behind junk?
            head = os.pread(fd, SCAN_BYTES, 0)
        kind = check_head(label, head, info.st_size, path)
        if not _second_frame_synced(kind, head, lambda off, n: os.pread(fd, n, off), info.st_size):
            raise MediaDecodeError(label, f"not a known media container (first bytes {head[:12]!r})")
        integrity.check_complete(label, kind, integrity.Reader(fd=fd, size=info.st_size))
    finally:
        os.close(fd)
    return kind


def check_bytes(label, data: bytes) -> str:
    kind = check_head(label, data[:SCAN_BYTES], len(data))
    if not _second_frame_synced(kind, data[:HEAD_BYTES], lambda off, n: data[off:off + n], len(data)):
        raise MediaDecodeError(label, f"not a known media container (first bytes {data[:12]!r})")
    integrity.check_complete(label, kind, integrity.Reader(data=data))
    return kind
