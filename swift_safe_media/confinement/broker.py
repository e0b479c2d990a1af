"""Opens by name, brokered by the caller: one confined sandbox serves many calls of code that
opens its media by name (stock's loaders, LLaMA-Factory's readers).

Landlock cannot widen a sandbox's reads once it is confined, so such code used to get a sandbox
per call, confined for that call's files: 20-40 ms a call, mostly the first use of a fresh
process. A brokered sandbox is confined as a pooled one is (no media readable), and its
``open``/``openat``/``openat2`` system calls wait on a seccomp user notification (Linux >= 5.14)
that its caller answers while it waits for the call's reply (:meth:`Broker.answer`):

- the caller reads the name from the sandbox's memory. Only a name ending as one the call's
  files go by (the name handed, where a symlink leads) or naming one of the sandbox's own
  descriptors is looked up: ``stat``, as the sandbox would resolve it (its working folder, its
  ``dirfd``, its ``/proc/self``), never an open of a name the sandbox gave. Any other name (a
  font, a config file on a network mount that hangs) never holds the caller;
- a read-only open of a regular file handed with the call (same device and inode) gets a
  descriptor of the caller's own copy of that file, opened anew (an offset of its own), put
  into the sandbox as the open's result (``SECCOMP_ADDFD_FLAG_SEND``);
- any other open goes on as the sandbox's own (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``), which
  Landlock and the seccomp filter decide as before. So the broker only ever adds the call's own
  files: what a sandbox per call was allowed, no file more (a hard link by another name, less).

Between calls nobody answers: an open then waits for the next call (a decoder does not open
files between calls). Both ends are here: the sandbox's (:func:`listen`, :func:`send_listener`)
and the caller's (:func:`available`, :func:`receive_listener`, :class:`Broker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import socket
import stat
import struct
import time

from .. import config
from . import kernel

SCMP_ACT_NOTIFY = 0x7FC00000
SECCOMP_FILTER_FLAG_NEW_LISTENER, SECCOMP_FILTER_FLAG_TSYNC_ESRCH = 1 << 3, 1 << 4
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
SECCOMP_ADDFD_FLAG_SEND = 1 << 1
PR_SET_PTRACER = 0x59616D61  # Yama: who may read this process's memory
AT_FDCWD = -100
_NOTICE = struct.Struct("=QII iI Q 6Q")  # struct seccomp_notif (with its seccomp_data)
_RESPONSE = struct.Struct("=QqiI")  # struct seccomp_notif_resp
_ADDFD = struct.Struct("=QIIII")  # struct seccomp_notif_addfd


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("!") << 8) | number


_OPEN_HOW = struct.Struct("=QQQ")  # openat2's struct open_how: flags, mode, resolve
_RECV, _SEND, _ADD_FD = _ioc(3, 0, _NOTICE.size), _ioc(3, 1, _RESPONSE.size), _ioc(1, 3, _ADDFD.size)
# Flags of an open the broker never answers: not of a file to read (a folder, a path handle, a new file).
_NOT_BROKERED = os.O_CREAT | os.O_TRUNC | os.O_DIRECTORY | getattr(os, "O_PATH", 0) | getattr(os, "O_TMPFILE", 0)
_LISTENING, _NO_LISTENER = b"L", b"N"


@functools.lru_cache(maxsize=1)
def _opens() -> dict[str, int]:
    """This architecture's numbers of the opens by name that are brokered (``open`` where it exists)."""
    return kernel.syscall_numbers(("open", "openat", "openat2"))


@functools.lru_cache(maxsize=1)
def kernel_can() -> str | None:
    """None where this kernel and libseccomp can broker opens, else why not."""
    problem = kernel.seccomp_available()
    if problem:
        return problem
    release = tuple(int(part) for part in (os.uname().release.split("-")[0].split(".") + ["0"])[:2]
                    if part.isdigit())
    if release < (5, 14):
        return f"Linux {os.uname().release} cannot add a descriptor as a system call's result (5.14 can)"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as scope:
            if int(scope.read()) >= 2:
                return "Yama's ptrace_scope keeps a caller from reading its sandbox's memory"
    except (OSError, ValueError):
        pass  # no Yama: the same user may read a process it could signal
    return None


def why_not() -> str | None:
    """None where a caller here answers the opens by name of a pooled sandbox, else why not
    (code that opens its media by name then gets a sandbox per call)."""
    return kernel_can() if config.open_broker() else "SWIFT_SAFE_MEDIA_OPEN_BROKER=0"


def available() -> bool:
    return why_not() is None


# -- sandbox side --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _program() -> tuple:
    """(the buffer, the filter as the kernel takes it, the number of ``seccomp``)."""
    with kernel.SeccompFilter(kernel.SCMP_ACT_ALLOW) as program:
        for number in _opens().values():
            program.add(SCMP_ACT_NOTIFY, number)
        return *kernel.filter_program(program.export_bpf()), kernel.syscall_numbers(("seccomp",))["seccomp"]


def listen(caller: int) -> int:
    """In a confined sandbox: from now on every open by name waits for ``caller`` to answer it.
    Returns the listener, to be sent to the caller (and closed here)."""
    kernel.libc.prctl(PR_SET_PTRACER, caller, 0, 0, 0)  # Yama's scope 1: the caller may read the names
    _, fprog, seccomp_number = _program()
    return kernel.install_seccomp_filter(seccomp_number, fprog, kernel.SECCOMP_FILTER_FLAG_TSYNC
                                         | SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_TSYNC_ESRCH)


def send_listener(conn: socket.socket, caller: int) -> None:
    """The sandbox's first message: its listener, or that it has none (the caller then starts
    sandboxes per call instead)."""
    try:
        listener = listen(caller)
    except Exception:  # noqa: BLE001  (libseccomp without notifications, a listener above us: the caller falls back)
        conn.sendall(_NO_LISTENER)
        return
    try:
        socket.send_fds(conn, [_LISTENING], [listener])
    finally:
        os.close(listener)  # only the caller may answer


# -- caller side ---------------------------------------------------------------------------

class NoListener(OSError):
    """A brokered sandbox could not listen for its opens (an older kernel than it looked)."""


def receive_listener(conn: socket.socket, pid: int, deadline: float) -> int:
    """The listener a sandbox sent first; NoListener where it has none, or where this process
    may not read that sandbox's memory (so could not tell what it opens)."""
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    message, fds, _, _ = socket.recv_fds(conn, 1, 1)
    conn.settimeout(None)
    if message == _LISTENING and len(fds) == 1:
        if can_read_memory_of(pid):
            return fds[0]
        os.close(fds[0])
        raise NoListener(f"this process may not read the memory of its sandbox (pid {pid}) to tell what it opens")
    for fd in fds:
        os.close(fd)
    if message == _NO_LISTENER:
        raise NoListener("the sandbox could not listen for its opens")
    raise EOFError("the sandbox ended before it listened for its opens")


class Broker:
    """The caller's side of one sandbox's opens during one call: the files handed with the
    call, as the caller's own copies (``handed``: descriptors, duplicated here, and the names
    they were opened by, ``handed.names``)."""

    def __init__(self, listener: int, handed=()):
        self.listener = listener
        self.granted: dict[tuple[int, int], int] = {}
        # The last parts of the names a granted file goes by: the name it was handed by, and
        # where that name leads. Only a name ending so is looked up: one elsewhere (a font, a
        # config file on a network mount that hangs) is the sandbox's own to open.
        self.last_parts = {os.fsencode(os.path.basename(name)) for name in getattr(handed, "names", ())}
        for fd in handed:
            found = os.fstat(fd)
            if stat.S_ISREG(found.st_mode) and (found.st_dev, found.st_ino) not in self.granted:
                self.granted[(found.st_dev, found.st_ino)] = os.dup(fd)
                self.last_parts.add(os.fsencode(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    def close(self) -> None:
        while self.granted:
            os.close(self.granted.popitem()[1])

    def answer(self) -> None:
        """Answer the open waiting on the listener (call when it is readable)."""
        notice = bytearray(_NOTICE.size)
        try:
            fcntl.ioctl(self.listener, _RECV, notice)
        except OSError:  # the opener is gone (killed), or the call was interrupted: nothing to answer
            return
        notice_id, tid, _, number, _, _, *args = _NOTICE.unpack(notice)
        ours, flags = self._granted(tid, number, args)
        failed = 0
        if ours is not None:
            try:
                failed = self._hand(notice_id, ours, flags)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return  # the opener is gone
                failed = exc.errno  # the sandbox's descriptors are used up (EMFILE), say: its open fails so
            if not failed:
                return
        response = _RESPONSE.pack(notice_id, 0, -failed, 0) if failed else \
            _RESPONSE.pack(notice_id, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        try:
            fcntl.ioctl(self.listener, _SEND, response)
        except OSError:
            pass  # the opener is gone

    def _hand(self, notice_id: int, ours: int, flags: int) -> int:
        """Put a fresh descriptor of our copy ``ours`` into the sandbox as its open's result;
        an errno where our copy cannot be opened again (the sandbox's open then fails so)."""
        try:
            copy = os.open(f"/proc/self/fd/{ours}", os.O_RDONLY | os.O_CLOEXEC | (flags & os.O_NONBLOCK))
        except OSError as exc:
            return exc.errno or errno.EACCES
        try:
            fcntl.ioctl(self.listener, _ADD_FD, _ADDFD.pack(notice_id, SECCOMP_ADDFD_FLAG_SEND, copy, 0,
                                                          flags & os.O_CLOEXEC))
            return 0
        finally:
            os.close(copy)

    def _granted(self, tid: int, number: int, args) -> tuple[int | None, int]:
        """Our copy of the file this open names, if it is one handed with the call; and its flags."""
        opens, dirfd, flags = _opens(), ctypes.c_int32(args[0] & 0xFFFFFFFF).value, None
        if number == opens.get("openat"):
            address, flags = args[1], args[2] & 0xFFFFFFFF
        elif number == opens.get("open"):
            dirfd, address, flags = AT_FDCWD, args[0], args[1] & 0xFFFFFFFF
        elif number == opens.get("openat2") and args[3] >= _OPEN_HOW.size:
            address = args[1]  # its flags are in memory
        else:
            return None, 0
        if not self.granted or (flags is not None and not _answered(flags)):
            return None, 0
        with _memory_of(tid) as memory:
            if flags is None:
                how = _read(memory, args[2], _OPEN_HOW.size)
                flags, _, resolve = _OPEN_HOW.unpack(how) if how else (0, 0, 1)
                if resolve or not _answered(flags):  # a resolution of its own: the sandbox's to make
                    return None, 0
            name = _read_name(memory, address)
        if not name or not (name.rsplit(b"/", 1)[-1] in self.last_parts or _names_a_descriptor(name, tid)):
            return None, flags
        name = _as_seen_by(tid, dirfd, name)
        try:
            found = os.stat(name, follow_symlinks=not flags & os.O_NOFOLLOW)
        except (OSError, ValueError):
            return None, flags
        if not stat.S_ISREG(found.st_mode):
            return None, flags
        return self.granted.get((found.st_dev, found.st_ino)), flags


_OWN = (b"/proc/self/", b"/proc/thread-self/", b"/dev/fd/")  # resolved in the opener, not here


def _as_seen_by(tid: int, dirfd: int, name: bytes) -> bytes:
    """``name`` as this process can resolve it the way thread ``tid`` would: relative to its
    working folder or its ``dirfd``, and its own ``/proc/self`` and ``/dev/fd``, not ours."""
    if not name.startswith(b"/"):
        return (f"/proc/{tid}/cwd/" if dirfd == AT_FDCWD else f"/proc/{tid}/fd/{dirfd}/").encode() + name
    for own in _OWN:
        if name.startswith(own):
            return f"/proc/{tid}/{'fd/' if own == b'/dev/fd/' else ''}".encode() + name[len(own):]
    return name


def _names_a_descriptor(name: bytes, tid: int) -> bool:
    """Whether ``name`` is one of the opener's own descriptors (``/proc/self/fd/7``, ``/dev/fd/7``)."""
    for prefix in (b"/proc/self/fd/", b"/proc/thread-self/fd/", b"/dev/fd/", f"/proc/{tid}/fd/".encode()):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return True
    return False


def _answered(flags: int) -> bool:
    """Whether an open with these flags is one the broker answers: read-only, of a file."""
    return flags & os.O_ACCMODE == os.O_RDONLY and not flags & _NOT_BROKERED


@contextlib.contextmanager
def _memory_of(tid: int):
    """The memory of thread ``tid``, open for reading (-1 where this process may not read it)."""
    try:
        memory = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield -1
        return
    try:
        yield memory
    finally:
        os.close(memory)


def _read(memory: int, address: int, size: int) -> bytes | None:
    """``size`` bytes at ``address`` (None: unreadable)."""
    try:
        data = os.pread(memory, size, address)
    except (OSError, OverflowError):
        return None
    return data if len(data) == size else None


def _read_name(memory: int, address: int, most: int = 4096) -> bytes | None:
    """The NUL-terminated name at ``address``, read a page at a time."""
    name = b""
    while len(name) < most:
        try:
            chunk = os.pread(memory, 4096 - (address + len(name)) % 4096, address + len(name))
        except (OSError, OverflowError):
            return None
        end = chunk.find(b"\0")
        if end >= 0:
            return name + chunk[:end]
        if not chunk:
            return None
        name += chunk
    return None


def can_read_memory_of(pid: int) -> bool:
    """Whether this process may read the names a sandbox opens (Yama, a container's policy)."""
    with _memory_of(pid) as memory:
        return memory >= 0
