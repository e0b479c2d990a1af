"""What a confined sandbox prints: captured, never the trainer's log.

An exploited decoder must not write into the trainer's log (which runs ship to experiment
trackers), nor flood it. A confined sandbox's fds 1 and 2 (Python's prints and native
code's alike, FFmpeg's ``av_log``) go into a pipe of its own (:func:`capture`), drained
after each call (:func:`take`): what a failed call printed comes back inside its error,
escaped and cut to ``OUTPUT_KEPT_BYTES`` (:func:`add_to_error`); what a successful one
printed is dropped. The pipe's write end does not block: once it is full, further output
is lost, never waited on. The stall watchdog's stack dumps of a sandbox land there too,
where the watchdog reads them (:func:`read_from`).
"""

from __future__ import annotations

import io
import logging
import os
import stat
import sys

from .. import errors

OUTPUT_KEPT_BYTES = 4096
_output_fd = -1  # the pipe's read end


class _DroppingWriter(io.TextIOBase):
    """sys.stdout / sys.stderr over a descriptor that may refuse: what does not fit is lost."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def writable(self):
        return True

    def fileno(self):
        return self._fd

    def write(self, text):
        try:
            os.write(self._fd, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass
        return len(text)


_handlers: list | None = None  # the log handlers writing to stdout or stderr, found by prepare()


def prepare() -> None:
    """In the zygote, once: find the log handlers that write to stdout or stderr (walking
    every logger after the fork would copy the pages of hundreds of logger objects)."""
    global _handlers
    _handlers = _stream_handlers()


def capture() -> None:
    global _output_fd
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    for fd in (1, 2):
        os.dup2(write_end, fd)
    os.close(write_end)
    _output_fd = read_end
    out, err = _DroppingWriter(1), _DroppingWriter(2)
    for handler in _handlers if _handlers is not None else _stream_handlers():
        new = err if handler.stream in (sys.stderr, sys.__stderr__) else \
            out if handler.stream in (sys.stdout, sys.__stdout__) else None
        if new is not None:
            try:
                handler.setStream(new)
            except (OSError, AttributeError):  # one that follows sys.stderr by itself (logs.py)
                pass
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = err


def _stream_handlers():
    loggers = [logging.getLogger(), *[item for item in logging.Logger.manager.loggerDict.values()
                                      if isinstance(item, logging.Logger)]]
    return [handler for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler)]


def take() -> bytes:
    """What the sandbox printed since the last call (the pipe is then empty)."""
    if _output_fd < 0:
        return b""
    return drain(_output_fd)


def drain(fd: int, keep: int = OUTPUT_KEPT_BYTES) -> bytes:
    """Read a non-blocking descriptor empty (a pipe holds 64 KiB); the first ``keep``
    bytes, and a last byte past them if there was more."""
    kept = bytearray()
    for _ in range(64):  # bounded: a thread still writing must not keep the reader here
        try:
            chunk = os.read(fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        if len(kept) <= keep:
            kept += chunk[:keep + 1 - len(kept)]
    return bytes(kept)


def escaped(output: bytes, keep: int = OUTPUT_KEPT_BYTES) -> str:
    """``output`` as one line of printable text (control characters, newlines and escape
    sequences written out as ``\\n``, ``\\x1b``), cut to ``keep`` bytes."""
    text = output[:keep].decode("utf-8", "backslashreplace")
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text + (" ...(cut)" if len(output) > keep else "")


def add_to_error(exc: BaseException, output: bytes) -> None:
    """Add what the failed call printed to its error: in the reason of a MediaDecodeError
    (so in its message), as a note of any other exception."""
    note = f"sandbox output: {escaped(output)}"
    if isinstance(exc, errors.MediaDecodeError):
        exc.reason = f"{exc.reason}; {note}"
        exc.args = (exc._message(),)
    elif hasattr(exc, "add_note"):
        exc.add_note(note)


def read_from(pid: int, keep: int = 16384) -> bytes | None:
    """Another process reading what sandbox ``pid`` printed and nobody took yet (the
    watchdog, after a stack dump): None when its stderr is not a capture pipe (an
    unconfined sandbox writes to the stderr it inherited, which must not be drained)."""
    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        try:
            ours = os.fstat(2)
        except OSError:
            ours = None
        if not stat.S_ISFIFO(found.st_mode) or (ours is not None and (ours.st_dev, ours.st_ino)
                                                 == (found.st_dev, found.st_ino)):
            return None
        return drain(fd, keep)
    finally:
        os.close(fd)
