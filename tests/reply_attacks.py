"""Crafted replies, as an exploited decoder would send them: a function run in a sandbox
writes a pickle of its own making straight to the sandbox's reply socket, in the
transport's framing, and then waits (for the caller to kill it). Each pickle, unpickled
the plain way, creates ``marker`` in the caller (see ``payload``)."""

from __future__ import annotations

import os
import pickle
import struct
import time

RESULT, ERROR = 2, 3  # transport's message kinds
_HEADER = struct.Struct("!BQIQQ")  # transport's: kind, pickle length, buffers, memfd bytes, block


def _global(module: str, name: str) -> bytes:
    """A pickle opcode sequence pushing ``module.name`` (protocol 4 allows dotted names)."""
    return b"".join(b"\x8c" + bytes([len(part)]) + part for part in (module.encode(), name.encode())) + b"\x93"


def _call(module: str, name: str, *args) -> bytes:
    """The pickle of ``module.name(*args)``."""
    return b"\x80\x04" + _global(module, name) + pickle.dumps(args, protocol=4)[2:-1] + b"R."


def payload(how: str, marker: str) -> bytes:
    """A pickle that creates ``marker`` when a plain unpickler loads it."""
    shell = f"touch {marker}"
    if how == "os.system":
        return _call("os", "system", shell)
    if how == "posix.system":
        return _call("posix", "system", shell)
    if how == "subprocess.Popen":
        return _call("subprocess", "Popen", ["touch", marker])
    if how == "builtins.eval":
        return _call("builtins", "eval", f"__import__('os').system({shell!r})")
    if how == "an allowed module's pickle.loads":  # swift_safe_media.engine.pickling imports pickle
        return _call("swift_safe_media.engine.pickling", "pickle.loads", _call("os", "system", shell))
    if how == "an allowed module's os.system":  # swift_safe_media.confinement.handed imports os
        return _call("swift_safe_media.confinement.handed", "os.system", shell)
    if how == "an error reply's exception":  # (exception, details), as a failed call's reply
        return b"\x80\x04" + _call("os", "system", shell)[2:-1] + pickle.dumps({}, protocol=4)[2:-1] + b"\x86."
    raise ValueError(how)


ATTACKS = ("os.system", "posix.system", "subprocess.Popen", "builtins.eval", "an allowed module's pickle.loads",
           "an allowed module's os.system", "an error reply's exception")


def send_crafted_reply(how: str, marker: str) -> None:
    """Runs in the sandbox: the crafted reply goes out on the reply socket itself."""
    from swift_safe_media import sandbox

    body = payload(how, marker)
    message = _HEADER.pack(ERROR if how == "an error reply's exception" else RESULT, len(body), 0, 0, 0) + body
    fd = sandbox._caller.fileno()
    while message:
        message = message[os.write(fd, message):]
    time.sleep(120)  # the caller kills this sandbox; the call's own result never goes out


class Verdict:
    """A type of the user's own that a function returns (allowed only when named in
    SWIFT_SAFE_MEDIA_REPLY_GLOBALS)."""

    def __init__(self, frames: int):
        self.frames = frames


def judge(frames: int) -> Verdict:
    return Verdict(frames)


class PickyError(Exception):
    """An error of the user's own whose ``__init__`` must not run in the caller: it says so
    (a plain unpickler would run it there)."""

    def __init__(self, message, frames=None):
        from swift_safe_media.sandbox import in_sandbox

        if not in_sandbox():
            raise AssertionError("PickyError.__init__ ran in the caller")
        super().__init__(message)
        self.frames = frames


def fail_picky(path, frames):
    raise PickyError(f"{path}: {frames} frames is too few", frames)
