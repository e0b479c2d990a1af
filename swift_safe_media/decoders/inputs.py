"""Every input form the stock loaders accept, turned into a local path or bytes.

`describe()` runs in the caller and does only string work and stat() (cheap, never
blocks on a FIFO). A decode sandbox is confined (no network), so `fetched()` has a URL
downloaded first in an unconfined sandbox of its own, under the byte cap and timeouts,
and only the bytes reach the decoder. `materialize()` runs in the decode sandbox: it
runs the guards (and downloads URLs itself when confinement is off), so nothing slow
or hostile happens in the caller.
"""

from __future__ import annotations

import base64
import binascii
import collections
import os
import re
import time
from dataclasses import dataclass

from .. import config
from ..confinement import handed
from ..engine.calls import SharedTimeout
from ..errors import MediaDecodeError
from . import guards

# Same heuristic as stock: a longer string is never tried as a path.
_MAX_PATH_LENGTH = 2000
_DATA_URI = re.compile(r"data:(.+?);base64,(.+)", re.DOTALL)


@dataclass(frozen=True)
class Source(SharedTimeout):
    kind: str            # "path", "url" or "bytes"
    value: str | bytes
    label: str           # names the input in error messages
    # A URL's bytes: the decode ends by the deadline of the timeout its download began
    # (engine.SharedTimeout): one timeout for the download and the decode together
    deadline: float | None = None
    timeout: float | None = None

    def __repr__(self):
        return f"Source({self.kind}, {self.label})"


def _abbreviate(text: str) -> str:
    return text if len(text) <= 80 else text[:60] + f"...<{len(text)} chars>"


def _local_path(text: str) -> str | None:
    """The existing file `text` names, directly or under ROOT_IMAGE_DIR (as stock), else None."""
    if len(text) > _MAX_PATH_LENGTH:
        return None
    if os.path.lexists(text):
        return os.path.abspath(text)
    root = os.environ.get("ROOT_IMAGE_DIR")
    candidate = os.path.abspath(os.path.expanduser(os.path.join(root, text) if root else text))
    return candidate if os.path.lexists(candidate) else None


def _check_inline_size(label: str, payload: str) -> None:
    """Refuse base64 text that would decode to more than the inline cap, before decoding it
    (here, in the caller, where no timeout or memory cap applies)."""
    cap = guards.Limits.from_env().max_inline_bytes
    if len(payload) // 4 * 3 > cap:
        raise MediaDecodeError(label, f"inline media cap exceeded: {len(payload)} characters of base64 "
                                      f"decode to more than {cap} bytes ({guards.MAX_INLINE_BYTES})")


def _decode_base64(label: str, payload: str) -> bytes:
    _check_inline_size(label, payload)
    try:
        return base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise MediaDecodeError(label, "malformed base64 payload") from None


def describe(media) -> Source:
    """Classify one input as stock `load_file` would, without reading media content."""
    if isinstance(media, (bytes, bytearray, memoryview)):
        return Source("bytes", bytes(media), f"<{len(media)} bytes>")
    if hasattr(media, "getvalue"):  # BytesIO
        data = media.getvalue()
        return Source("bytes", data, f"<BytesIO of {len(data)} bytes>")
    if hasattr(media, "read"):
        data = media.read()
        return Source("bytes", data, f"<file object of {len(data)} bytes>")
    if isinstance(media, os.PathLike):
        media = os.fspath(media)
    if not isinstance(media, str):
        raise TypeError(f"unsupported media input of type {type(media).__name__}")
    if len(media) > _MAX_PATH_LENGTH:  # only a data: URI or base64 text is this long: check before any copy
        kind = "data: URI" if media[:64].lstrip().startswith("data:") else "base64 string"
        _check_inline_size(f"<{kind} of {len(media)} chars>", media)
    text = media.strip()
    if text.startswith(("http://", "https://")):
        return Source("url", text, text)
    if text.startswith("file://"):
        path = text[len("file://"):]
        return Source("path", handed.hand(os.path.abspath(path)), path)
    local = _local_path(text)
    if local is not None:
        return Source("path", handed.hand(local), text)
    if text.startswith("data:"):
        match = _DATA_URI.match(text)
        if match is None:
            raise MediaDecodeError(_abbreviate(text), "malformed data: URI")
        data = _decode_base64(f"<data: URI of {len(text)} chars>", match.group(2))
        return Source("bytes", data, f"<data: URI of {len(data)} bytes>")
    # Stock tries base64 on any string that is not a file; we also want the payload to
    # start a media container, so a mistyped path is reported as a missing file.
    try:
        data = base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        data = None
    if data and (len(text) > _MAX_PATH_LENGTH or guards.container_of(data[:guards.HEAD_BYTES])):
        return Source("bytes", data, f"<base64 of {len(data)} bytes>")
    # A path that does not exist: the guard in the sandbox says so, naming it.
    return Source("path", handed.hand(os.path.abspath(os.path.expanduser(text))), _abbreviate(text))


def url_timeout() -> float | None:
    """Stock `SWIFT_TIMEOUT` (seconds per network operation, default 20; <= 0 means none)."""
    value = float(os.environ.get("SWIFT_TIMEOUT", "20"))
    return value if value > 0 else None


def download(url: str, limits: guards.Limits, timeout: float | None) -> bytes:
    """GET `url`, refusing bodies over the byte cap before and while reading."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > limits.max_url_bytes:
                raise MediaDecodeError(url, f"URL bytes cap exceeded: Content-Length {declared} > "
                                            f"{limits.max_url_bytes} ({guards.MAX_URL_BYTES})")
            chunks, received = [], 0
            while chunk := response.read(1 << 20):
                received += len(chunk)
                if received > limits.max_url_bytes:
                    raise MediaDecodeError(url, f"URL bytes cap exceeded: more than {limits.max_url_bytes} "
                                                f"bytes ({guards.MAX_URL_BYTES})")
                chunks.append(chunk)
    except urllib.error.HTTPError as exc:
        raise MediaDecodeError(url, f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MediaDecodeError(url, f"download failed: {reason}") from None
    return b"".join(chunks)


# Files a host downloaded from a URL before asking for their decode (`swift deploy` writes
# a request's media URL to a file first): path -> (the URL, the file's identity, seconds of
# the timeout the download left, that timeout). Their decode gets what the download left.
_DOWNLOADED: collections.OrderedDict = collections.OrderedDict()
_DOWNLOADED_KEPT = 256


def note_download(path: str, url: str, left: float, timeout: float) -> None:
    """``path`` holds what ``url`` served, downloaded within ``timeout`` with ``left``
    seconds of it to spare: its decode runs for what is left and names the URL. (The time
    the file waits between the two, in a server's queue, is nobody's download or decode.)"""
    stat = os.stat(path)
    _DOWNLOADED[os.path.abspath(path)] = (url, (stat.st_dev, stat.st_ino), left, timeout)
    _DOWNLOADED.move_to_end(os.path.abspath(path))
    while len(_DOWNLOADED) > _DOWNLOADED_KEPT:
        _DOWNLOADED.popitem(last=False)


def _downloaded_before(source: Source) -> Source:
    """A path source as the end of its URL's download, if the host noted one (the same
    file still: a temporary name may be reused)."""
    url, identity, left, timeout = _DOWNLOADED.get(source.value, (None, None, 0.0, None))
    try:
        stat = os.stat(source.value)
    except OSError:
        return source
    if url is None or (stat.st_dev, stat.st_ino) != identity:
        return source
    return Source("path", source.value, url, time.monotonic() + left, timeout)


def fetched(source: Source, limits: guards.Limits, url_timeout: float | None) -> Source:
    """Caller side: a URL source as the bytes it serves, downloaded in an unconfined
    sandbox (a confined decode cannot reach the network); a file the host downloaded
    itself with the rest of its download's timeout; any other source as is."""
    if source.kind == "path" and _DOWNLOADED:
        return _downloaded_before(source)
    if source.kind != "url" or not config.confine():
        return source
    from ..engine import calls as engine

    data, deadline, shared = engine.fetch(download, source.value, limits, url_timeout, path=source.label)
    return Source("bytes", data, source.label, deadline, shared)


def materialize(source: Source, limits: guards.Limits, url_timeout: float | None) -> str | bytes:
    """Sandbox side: a guarded local path, or guarded bytes, ready for a decoder."""
    if source.kind == "path":
        guards.check_file(source.label, source.value)
        return source.value
    data = download(source.value, limits, url_timeout) if source.kind == "url" else source.value
    guards.check_bytes(source.label, data)
    return data
