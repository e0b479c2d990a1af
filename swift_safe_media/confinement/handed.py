"""Media files handed to a decode as open descriptors: a confined sandbox opens nothing by name.

A confined sandbox may read only what decoding needs (:mod:`.reads`), and the
media is not among it: the caller, who may read it anyway, opens each file it hands to
a decode and sends the descriptor with the request, as Android's media extractor gets
its input. A path the caller means to hand is a :class:`HandedPath` (a ``str``: code
that takes a path takes it unchanged); pickled in the caller it opens the file
(regular files only, ``O_NONBLOCK``: a FIFO never blocks the caller) and travels as
that descriptor (:func:`hand_over`, used by :mod:`..engine.pickling`; the descriptors ride with
the message, see :mod:`..engine.transport`). In the sandbox it comes back as the same path,
whose descriptor is kept for the request (:func:`received`, :func:`release`).

Sandbox side, every reader of a media path asks here: :func:`open_fd` and :func:`stat`
(our decoders and guards), :func:`open_reader`, and ``open()`` itself
(:func:`install_open_hook`) for code we do not own that opens the path by name
(LeRobot's fsspec, PIL under qwen_vl_utils). Each reader gets its own position
(``pread``), so two readers of one file never move each other's offset. A path that
was not handed is opened by name, as before: it works where the sandbox may read it.
"""

from __future__ import annotations

import builtins
import io
import os
import stat as stat_module

# At most this many descriptors ride with one request (the kernel's SCM_MAX_FD is 253):
# a longer frame list hands its first files; the rest are opened by name.
MAX_HANDED = 240


class HandedPath(str):
    """A local media path whose file the caller opens and hands to the sandbox."""

    __slots__ = ()


def special_kind(mode: int) -> str:
    """What a file that is neither regular nor a folder is, in an error's words."""
    if stat_module.S_ISFIFO(mode):
        return "FIFO"
    if stat_module.S_ISSOCK(mode):
        return "socket"
    return "device" if stat_module.S_ISCHR(mode) or stat_module.S_ISBLK(mode) else "special file"


class Handed(list):
    """The descriptors a request hands (sent as they are) and the names they were opened by."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []


def hand(path):
    """``path`` marked to be handed (a ``str``; anything else as it is)."""
    return HandedPath(path) if isinstance(path, str) and not isinstance(path, HandedPath) else path


# -- caller side ---------------------------------------------------------------------------

def hand_media(args: tuple, kwargs: dict, media) -> tuple[tuple, dict]:
    """The arguments of a call of the engine with the one naming its media (``media``,
    the call's path) marked to be handed: ``call(fn, clip)`` lets ``fn`` read ``clip``."""
    if not isinstance(media, str):
        return args, kwargs
    mark = lambda value: hand(value) if type(value) is str and value == media else value  # noqa: E731
    return tuple(mark(value) for value in args), {name: mark(value) for name, value in kwargs.items()}


def hand_over(path: str, handed: Handed) -> tuple:
    """The pickle reduction of a HandedPath: the file opened and its descriptor appended
    to ``handed``; a file that cannot be opened, or is not a regular file, travels as its
    name only (the sandbox's own checks then say what is wrong with it)."""
    fd = -1
    if len(handed) < MAX_HANDED:
        try:
            if stat_module.S_ISREG(os.stat(path).st_mode):  # a device is never opened here
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                if not stat_module.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    fd = -1
        except OSError:
            fd = -1
    if fd < 0:
        return HandedPath, (str(path),)
    handed.append(fd)
    handed.names.append(str(path))
    return received, (str(path), len(handed) - 1)


# -- sandbox side --------------------------------------------------------------------------

_table: dict[str, int] = {}  # path -> descriptor, for the request being served
_arriving: list[int] | None = None  # the descriptors of the message being unpickled
_taken: set[int] = set()


def receiving(fds: list[int] | None) -> None:
    """The descriptors that came with the message about to be unpickled (None after)."""
    global _arriving
    _arriving = fds
    _taken.clear()


def taken() -> set[int]:
    """Descriptors of the last message now kept for the request (not to be closed)."""
    return _taken


def received(path: str, index: int) -> HandedPath:
    """Unpickling: the path, its descriptor kept for the request."""
    if _arriving is not None and index < len(_arriving):
        fd = _arriving[index]
        previous = _table.get(path)
        if previous is not None and previous != fd:
            os.close(previous)
        _table[path] = fd
        _taken.add(fd)
    return HandedPath(path)


def release() -> None:
    """After a request: its descriptors are closed (readers opened from them keep theirs)."""
    while _table:
        os.close(_table.popitem()[1])


def handed_fds() -> list[int]:
    """The descriptors of every file handed with the request being served."""
    return list(_table.values())


def handed_fd(path) -> int | None:
    try:
        return _table.get(os.fspath(path))
    except TypeError:
        return None


def open_fd(path) -> int:
    """A descriptor of ``path`` for reading, of its own: the handed file's, or opened by name."""
    fd = handed_fd(path)
    if fd is not None:
        return os.dup(fd)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def stat(path) -> os.stat_result:
    fd = handed_fd(path)
    return os.stat(path) if fd is None else os.fstat(fd)


class PreadFile(io.RawIOBase):
    """A read-only file object over a descriptor, with a position of its own (``pread``)."""

    def __init__(self, fd: int, size: int | None = None, name=None):
        super().__init__()
        self._fd, self._pos = fd, 0
        self._size = os.fstat(fd).st_size if size is None else size
        if name is not None:
            self.name = name

    def readable(self):
        return True

    def seekable(self):
        return True

    def fileno(self):
        return self._fd

    def _read_at(self, position: int, length: int) -> bytes:
        return os.pread(self._fd, length, position)

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        chunk = self._read_at(self._pos, len(view))
        view[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def seek(self, offset, whence=io.SEEK_SET):
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        elif whence == io.SEEK_END:
            self._pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if self._pos < 0:
            raise ValueError("negative seek position")
        return self._pos

    def tell(self):
        return self._pos

    def close(self):
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def open_reader(path):
    """A buffered binary file object reading ``path``: over the handed descriptor if it
    was handed, else ``open(path, "rb")``."""
    fd = handed_fd(path)
    if fd is None:
        return _stock_open(path, "rb")
    return io.BufferedReader(PreadFile(os.dup(fd), name=os.fspath(path)))


_stock_open = builtins.open


def _open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None):
    if isinstance(file, (str, os.PathLike)) and set(mode) <= set("rbt") and opener is None and _table:
        fd = handed_fd(file)
        if fd is not None:
            binary = io.BufferedReader(PreadFile(os.dup(fd), name=os.fspath(file)))
            return binary if "b" in mode else io.TextIOWrapper(binary, encoding, errors, newline)
    return _stock_open(file, mode, buffering, encoding, errors, newline, closefd, opener)


def install_open_hook() -> None:
    """In a sandbox: ``open()`` of a handed path for reading reads the handed descriptor."""
    builtins.open = _open
