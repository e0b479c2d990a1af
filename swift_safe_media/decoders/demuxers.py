"""Which FFmpeg demuxer may read an input: the one we chose from its first bytes, and
nothing that opens other files or URLs.

The sniffing in ``guards`` looks at a few bytes; FFmpeg's own probe looks at up to a
megabyte, skips ID3 tags and scores every demuxer it has. A playlist (HLS, DASH,
ffconcat) behind bytes that pass the sniffing would be read by FFmpeg as a playlist and
make it open the files and URLs it names. So FFmpeg is pinned, not only sniffed around:

- FFmpeg never gets a name. Files are opened here and handed over as a file object, so
  no name is parsed (no ``%d`` image-sequence patterns, no protocol prefix, no
  extension-based guess), and the first megabyte FFmpeg probes is served from the
  very bytes checked here (``PinnedFile``).
- The demuxer is ours. PyAV takes it explicitly (``open_pyav``: ``format=``, no protocol
  at all, MOV data references off). torchcodec has no way to name a format or pass
  options, so before it opens an input, FFmpeg's own probe is run here on the same
  bytes, in the same libavformat that torchcodec loaded (``probe``): the demuxer it
  picks must be one allowed for the sniffed container, else the input is refused.
  The probe is deterministic, so torchcodec's open picks that same demuxer.

None of the allowed demuxers opens another input (MOV data references are off by
default, and nothing here turns them on).
"""

from __future__ import annotations

import ctypes
import io
import os

from ..confinement import handed
from ..errors import MediaDecodeError
from . import guards

# FFmpeg demuxers allowed for each container that ``sniff.container_of`` names. Never
# hls, dash, concat, image2, or any other demuxer that reads a list of other inputs.
ALLOWED = {
    "mp4/mov": ("mov,mp4,m4a,3gp,3g2,mj2",),
    "matroska/webm": ("matroska,webm",),
    "wav": ("wav", "w64"),
    "w64": ("w64",),
    "avi": ("avi",),
    "flac": ("flac",),
    "ogg": ("ogg",),
    # An ID3v2 tag is skipped by FFmpeg's probe; what follows may be MPEG audio, ADTS AAC or FLAC.
    "mp3/aac": ("mp3", "aac", "flac"),
    "mp3": ("mp3",),
    "aac": ("aac",),
    "ac3": ("ac3", "eac3"),
    "aiff": ("aiff",),
    "caf": ("caf",),
    "asf/wmv": ("asf",),
    "flv": ("flv",),
    "mpeg-ps": ("mpeg",),
    "mpeg-ts": ("mpegts",),  # 188-byte packets, M2TS (192) and 204-byte ones alike
    # Elementary streams behind an MPEG start code: MPEG-1/2 video, MPEG-4 Part 2,
    # H.264 and HEVC Annex B (what camera dumps, ``-f h264`` and broadcast tools write).
    "video-es": ("mpegvideo", "m4v", "h264", "hevc"),
    "ivf": ("ivf",),
    "y4m": ("yuv4mpegpipe",),
    "nut": ("nut",),
    "voc": ("voc",),
    "musepack": ("mpc", "mpc8"),
    "amr/au/wavpack/ape": ("amr", "au", "wv", "ape"),
    "swf": ("swf",),
    "gif": ("gif",),  # never gif_pipe (image2pipe's family) or image2
    "nistsphere": ("nistsphere",),
    "qcp": ("qcp",),
    "tta": ("tta",),
    "tak": ("tak",),
    "dsf": ("dsf",),
    # Headerless: FFmpeg's probe finds nothing and never picks it; chosen by the name
    # (``guards.raw_by_name``) and read by PyAV only, its demuxer named (``open_pyav``).
    "g722": (),
    "gsm": (),
}
# Kinds only PyAV reads (it can be told the demuxer; torchcodec cannot).
PYAV_ONLY = {"g722", "gsm"}

# What PyAV is told to use (format=...) for a container of one demuxer: FFmpeg's short
# names. Kinds with several allowed demuxers (an elementary stream, a tagged MP3 or AAC)
# use the one FFmpeg's probe picks among them (``pyav_format``).
PYAV_FORMAT = {
    "mp4/mov": "mov", "matroska/webm": "matroska", "wav": "wav", "w64": "w64", "avi": "avi", "flac": "flac",
    "ogg": "ogg", "mp3": "mp3", "aac": "aac", "aiff": "aiff", "caf": "caf", "asf/wmv": "asf", "flv": "flv",
    "mpeg-ps": "mpeg", "mpeg-ts": "mpegts", "ivf": "ivf", "y4m": "yuv4mpegpipe", "nut": "nut", "voc": "voc",
    "swf": "swf", "gif": "gif", "nistsphere": "nistsphere", "qcp": "qcp", "tta": "tta", "tak": "tak", "dsf": "dsf",
    "g722": "g722", "gsm": "gsm",
}

# FFmpeg's av_probe_input_buffer2: buffers from 2 KiB doubling to 1 MiB; a demuxer is
# taken once it scores above 25 (AVPROBE_SCORE_RETRY), or above 0 once the input ends.
PROBE_MIN, PROBE_MAX = 2048, 1 << 20
_SCORE_RETRY = 25
_PADDING = 64  # AVPROBE_PADDING_SIZE is 32: zeroed bytes past the buffer
SNAPSHOT_BYTES = PROBE_MAX

# A protocol list that names no protocol: inputs are handed over open, so FFmpeg needs none.
NO_PROTOCOL = "none"


class _ProbeData(ctypes.Structure):
    _fields_ = [("filename", ctypes.c_char_p), ("buf", ctypes.c_void_p), ("buf_size", ctypes.c_int),
                ("mime_type", ctypes.c_char_p)]


_libavformat = None


def _loaded_libavformat():
    """The libavformat torchcodec decodes with (the one already mapped in this process)."""
    global _libavformat
    if _libavformat is None:
        import torchcodec.decoders  # noqa: F401  (loads torchcodec's core and its FFmpeg)

        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libavformat.so" in line]
        if not paths:
            raise OSError("torchcodec's libavformat is not loaded")
        lib = ctypes.CDLL(paths[0])
        lib.av_probe_input_format2.restype = ctypes.c_void_p
        lib.av_probe_input_format2.argtypes = [ctypes.POINTER(_ProbeData), ctypes.c_int,
                                               ctypes.POINTER(ctypes.c_int)]
        _libavformat = lib
    return _libavformat


def probe(head: bytes, size: int, name: str | None = None) -> str | None:
    """Name of the demuxer FFmpeg's probe picks for an input of `size` bytes starting with
    `head` (at least its first ``PROBE_MAX`` bytes), handed over without a name or, given
    `name`, under that file name's extension; None if none."""
    return _probe(head, size, name)[0]


def _probe(head: bytes, size: int, name: str | None = None) -> tuple[str | None, int]:
    """(demuxer name or None, how many leading bytes FFmpeg's probe reads to decide)."""
    lib = _loaded_libavformat()
    # Only the extension: what FFmpeg's demuxers match a file name on (av_match_ext).
    filename = ("probe" + os.path.splitext(name)[1]).encode("ascii", "replace") if name else b""
    probe_size, previous = PROBE_MIN, -1
    while True:
        available = min(probe_size, size, len(head))
        at_end = available == previous  # FFmpeg's read hit the end: any score will do
        buffer = ctypes.create_string_buffer(head[:available], available + _PADDING)
        data = _ProbeData(filename, ctypes.cast(buffer, ctypes.c_void_p), available, None)
        score = ctypes.c_int(0 if at_end or probe_size >= PROBE_MAX else _SCORE_RETRY)
        found = lib.av_probe_input_format2(ctypes.byref(data), 1, ctypes.byref(score))
        if found:
            # AVInputFormat starts with `const char *name`.
            return ctypes.cast(found, ctypes.POINTER(ctypes.c_char_p))[0].decode(), available
        if at_end or probe_size >= PROBE_MAX:
            return None, available
        previous = available
        probe_size = min(probe_size << 1, PROBE_MAX)


def check(label, head: bytes, size: int) -> int:
    """How many leading bytes FFmpeg's probe reads, after it agreed to read this input with
    a demuxer allowed for the sniffed container; raise MediaDecodeError naming it otherwise."""
    return _check(label, head, size)[0]


def _check(label, head: bytes, size: int, name: str | None = None) -> tuple[int, str]:
    """``check``, also returning the demuxer FFmpeg's probe picked. Given the local file's
    `name`, a probe that finds nothing without it is tried again with it, as the ffmpeg
    command line probes a file (``picked_by_name``)."""
    kind = guards.container_of(head)
    allowed = ALLOWED.get(kind, ())
    try:
        picked, probed = _probe(head, size)
        if picked is None and name:
            picked, probed = _probe(head, size, name)
    except OSError as exc:  # fail closed: no check, no FFmpeg
        raise MediaDecodeError(label, f"cannot check which FFmpeg demuxer would read it: {exc}") from None
    if picked not in allowed:
        found = f"FFmpeg would read it as {picked!r}" if picked else "FFmpeg recognises no format"
        raise MediaDecodeError(label, f"demuxer mismatch: sniffed {kind or 'unknown'}, {found}; refused")
    return probed, picked


def pyav_format(label, kind: str, head: bytes, size: int, name: str | None = None) -> str:
    """The FFmpeg short name PyAV is told to use for `kind`: the container's own demuxer,
    or, for a kind several demuxers read, the allowed one FFmpeg's probe picks (with the
    local file's `name` where it finds nothing without)."""
    fmt = PYAV_FORMAT.get(kind)
    if fmt is not None:
        return fmt
    if kind not in ALLOWED:
        raise MediaDecodeError(label, f"no pinned PyAV demuxer for {kind}")
    picked = _check(label, head, size, name)[1]
    # The probe names a demuxer by its list of names ("mov,mp4,..."); PyAV takes the first.
    return picked.split(",")[0]


class PinnedFile(handed.PreadFile):
    """A read-only file object over an open descriptor whose first bytes come from a
    snapshot: what FFmpeg probes is exactly what ``check`` saw, even if the file
    changes meanwhile."""

    def __init__(self, fd: int, snapshot: bytes, size: int):
        super().__init__(fd, size)
        self._snapshot = snapshot

    def keep_snapshot(self, length: int) -> None:
        """Serve only the first `length` bytes from the snapshot: all that FFmpeg probes."""
        self._snapshot = self._snapshot[:length]

    def _read_at(self, position: int, length: int) -> bytes:
        if position < len(self._snapshot):
            return self._snapshot[position:position + length]
        return os.pread(self._fd, length, position)


def _open_path(label, path: str):
    guards.check_regular(label, path)
    try:
        fd = handed.open_fd(path)  # the descriptor the caller handed, if it did
    except OSError as exc:
        raise MediaDecodeError(label, f"cannot open: {exc.strerror}") from None
    info = os.fstat(fd)
    snapshot = os.pread(fd, SNAPSHOT_BYTES, 0)
    return PinnedFile(fd, snapshot, info.st_size), snapshot, info.st_size


def for_torchcodec(label, data):
    """What to give torchcodec for `data` (a guarded path or bytes): the path opened here
    as a ``PinnedFile``, or the bytes; only after FFmpeg's probe agreed (``check``)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        check(label, data[:SNAPSHOT_BYTES], len(data))
        return data
    handle, snapshot, size = _open_path(label, data)
    try:
        kind = guards.raw_by_name(data)
        if kind in PYAV_ONLY and guards.container_of(snapshot[:guards.HEAD_BYTES]) is None:
            raise MediaDecodeError(label, f"raw {kind} (known by its name only): torchcodec cannot be told its demuxer")
        handle.keep_snapshot(check(label, snapshot, size))
    except BaseException:
        handle.close()
        raise
    return handle


def picked_by_name(data) -> bool:
    """Whether FFmpeg's probe finds the local file `data` (a guarded path) only with its
    name: MPEG audio behind junk, too short for the probe without a name to score it
    (the ffmpeg command line, which probes with the name, reads it). Only PyAV, told the
    demuxer, reads such a file; torchcodec probes without a name."""
    if not isinstance(data, str):
        return False
    with open(data, "rb") as f:
        if guards.container_of(f.read(guards.HEAD_BYTES)):
            return False  # a container at the start (every usual file): nothing more is read
        f.seek(0)
        snapshot = f.read(SNAPSHOT_BYTES)
    if not guards.container_of(snapshot):
        return False  # no frames behind junk either: the usual checks refuse it
    return _probe(snapshot, handed.stat(data).st_size)[0] is None


def pyav_options(kind: str) -> dict:
    """Format options for PyAV: no protocol may be opened, no MOV data reference followed."""
    options = {"protocol_whitelist": NO_PROTOCOL}
    if kind == "mp4/mov":
        options["enable_drefs"] = "0"
    return options


def open_pyav(label, data, **kwargs):
    """``av.open`` pinned: the file opened here and handed over, the demuxer named from
    the sniffed container, no protocol and no data reference. `data`: path or bytes."""
    import av

    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        kind = guards.check_bytes(label, data)
        handle = io.BytesIO(data)
    else:
        handle, snapshot, size = _open_path(label, data)
        try:
            kind = guards.check_head(label, snapshot, size, data)
            handle.keep_snapshot(0)  # the demuxer is named: nothing is probed
        except BaseException:
            handle.close()
            raise
    try:
        if isinstance(data, bytes):
            fmt = pyav_format(label, kind, data[:SNAPSHOT_BYTES], len(data))
        else:
            fmt = pyav_format(label, kind, snapshot, size, data)
    except BaseException:
        handle.close()
        raise
    options = dict(kwargs.pop("options", None) or {}, **pyav_options(kind))
    try:
        return av.open(handle, mode="r", format=fmt, options=options, **kwargs)
    except Exception as exc:
        handle.close()
        raise MediaDecodeError(label, f"cannot open with the {fmt} demuxer: {type(exc).__name__}: {exc}") from None


def check_path(label, path: str) -> None:
    """For decoders that open `path` themselves (LeRobot's): the guards, then FFmpeg's probe."""
    guards.check_file(label, path)
    handle, snapshot, size = _open_path(label, path)
    handle.close()
    check(label, snapshot, size)


class pinned_pyav:
    """While active, every ``av.open`` of a local path for reading in this process is
    ``open_pyav``: for code we do not own that calls PyAV by name (torchvision's
    VideoReader under LeRobot's pyav backend). Used in the sandbox only."""

    def __enter__(self):
        import av

        self._av, self._stock = av, av.open

        def open_pinned(file, mode="r", format=None, options=None, **kwargs):
            if mode == "r" and isinstance(file, (str, os.PathLike)):
                path = os.fspath(file)
                return open_pyav(path, path, options=options, **kwargs)
            return self._stock(file, mode, format=format, options=options, **kwargs)

        av.open = open_pinned
        return self

    def __exit__(self, *exc_info):
        self._av.open = self._stock
