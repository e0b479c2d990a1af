"""Messages between a caller and its sandbox over a Unix stream socket.

Large buffers (numpy arrays, CPU tensors, PIL pixel data) leave the pickle stream
(pickle protocol 5, out-of-band) and travel in one anonymous memfd whose descriptor
rides along with the message. The receiver maps it and rebuilds arrays as views on
that mapping: one memcpy on the sending side (none where the sandbox wrote the result
into the block itself: :meth:`SharedArena.for_result`), none on the receiving side, and
nothing named in /dev/shm that could leak if a process is killed. What the receiver
holds afterwards is :mod:`.held_memory`'s.

A sandbox lends its memfds from a :class:`SharedArena`: allocating fresh shared pages
costs about eight times the memcpy itself (68 ms against 8 ms for 88 MB here), so a
block comes back to the arena once the caller has dropped every array viewing it. The
caller keeps its mappings of recent blocks (:class:`MappedBlocks`): a block lent again
costs neither an mmap nor the page faults of a fresh mapping. Which objects travel out
of band, and how they are rebuilt, is :mod:`.pickling`'s.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import io
import itertools
import mmap
import os
import pickle
import socket
import struct
import time

from ..confinement import handed, reply_unpickler
from . import held_memory, pickling

# kind, pickle length, buffer count, memfd bytes used, arena block id (0: not lent)
_HEADER = struct.Struct("!BQIQQ")
_SPAN = struct.Struct("!QQ")
_ALIGN = 64
# Below this a buffer is cheaper to copy through the socket than to map.
_OUT_OF_BAND_MIN_BYTES = 64 * 1024

REQUEST, RESULT, ERROR, RETURN_BLOCKS, PROGRESS = 1, 2, 3, 4, 5
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Block:
    def __init__(self, capacity: int, block_id: int):
        self.capacity, self.id = capacity, block_id
        self.fd = os.memfd_create("swift-safe-media", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, capacity)
            self.mapping = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = _address(self.mapping)

    def close(self):
        try:
            self.mapping.close()
        except BufferError:  # an array still views it (a result written in place): unmapped with it
            pass
        os.close(self.fd)


class SharedArena:
    """Sandbox-side pool of memfd blocks, reused once the caller hands them back. Idle
    blocks are kept up to ``max_idle_bytes``, the ones handed back last first: a run's
    results are alike in size, so its next result fits the block its last one left
    (keeping the older ones instead, transformers' pyav read of a 1080p clip's 120
    frames after reads of other sizes paid for fresh shared pages every time: 1.26 s a
    read against 0.90 s, measured)."""

    def __init__(self, max_idle_bytes: int = 1 << 30):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[_Block] = []  # the one handed back last at the end
        self._lent: dict[int, _Block] = {}
        self._writing: list[_Block] = []  # lent to the call running now (for_result)
        self._ids = itertools.count(1)

    def lend(self, size: int) -> _Block:
        capacity = 1 << max(20, (size - 1).bit_length())
        fits = [k for k, block in enumerate(self._idle) if block.capacity == capacity]
        block = self._idle.pop(fits[-1]) if fits else _Block(capacity, next(self._ids))
        self._lent[block.id] = block
        return block

    def for_result(self, size: int) -> memoryview:
        """``size`` bytes of a block that a call writes its result into (a decode's frames):
        a reply whose large buffers all lie there is sent without being copied
        (:meth:`placed`). Whatever the reply did not take comes back at :meth:`call_ended`."""
        block = self.lend(size)
        self._writing.append(block)
        return memoryview(block.mapping)[:size]

    def placed(self, buffers) -> tuple[_Block, list, int] | None:
        """(the block, the spans in it, the bytes to map) where every buffer lies in one
        block a call wrote its result into; None otherwise."""
        for block in self._writing:
            spans = []
            for view in buffers:
                offset = _address(view) - block.address
                if not 0 <= offset <= block.capacity - view.nbytes:
                    break
                spans.append((offset, view.nbytes))
            else:
                self._writing.remove(block)
                return block, spans, max(offset + length for offset, length in spans)
        return None

    def call_ended(self) -> None:
        """The blocks written into that no reply took are idle again (the call's result is gone)."""
        writing, self._writing = self._writing, []
        self.take_back(block.id for block in writing)

    def counts(self) -> tuple[int, int]:
        """(blocks lent to the caller, idle blocks kept for reuse)"""
        return len(self._lent), len(self._idle)

    def take_back(self, ids) -> None:
        for block_id in ids:
            block = self._lent.pop(block_id, None)
            if block is not None:
                self._idle.append(block)
        while sum(block.capacity for block in self._idle) > self.max_idle_bytes:
            self._idle.pop(0).close()


def encode(kind: int, obj, arena: SharedArena | None = None) -> tuple[bytes, int, bool]:
    """Pickle ``obj``. Returns the message, a memfd holding its large buffers (or -1),
    and whether that descriptor is the caller's to close (not when the arena lent it)."""
    buffers: list[memoryview] = []

    def route(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < _OUT_OF_BAND_MIN_BYTES:
            return True
        buffers.append(view)
        return False

    stream = io.BytesIO()
    pickler = pickling.Pickler(stream, protocol=5, buffer_callback=route)
    if kind == REQUEST:
        pickler.handed = handed.Handed()  # media files handed to the sandbox
    try:
        pickler.dump(obj)
    except BaseException:
        _close_all(pickler.handed or ())
        raise
    spans, size = [], 0
    for view in buffers:
        spans.append((size, view.nbytes))
        size += -(-view.nbytes // _ALIGN) * _ALIGN
    fd, owned, block_id = -1, False, 0
    try:
        placed = arena.placed(buffers) if buffers and arena is not None else None
        if placed is not None:  # written in place: nothing to copy
            block, spans, size = placed
            fd, block_id = block.fd, block.id
        elif buffers and arena is not None:
            block = arena.lend(size)
            _copy_into(block.mapping, buffers, spans)
            fd, block_id = block.fd, block.id
        elif buffers:
            fd, owned = _fresh_memfd(buffers, spans, size), True
    except OSError as exc:
        if exc.errno not in (errno.EFBIG, errno.ENOSPC):
            raise
        # No shared memory to be had here (a file-size limit, `ulimit -f`, caps memfds too;
        # a full tmpfs): the buffers go through the socket, in the pickle stream.
        stream, spans, size = io.BytesIO(), [], 0
        pickling.Pickler(stream, protocol=5).dump(obj)
    body = stream.getvalue()
    table = b"".join(_SPAN.pack(*span) for span in spans)
    message = _HEADER.pack(kind, len(body), len(spans), size, block_id) + table + body
    if pickler.handed:
        message = _WithHanded(message)
        message.handed = pickler.handed
    return message, fd, owned


class _WithHanded(bytes):
    """A message and the media descriptors that ride with it (after the memfd, if any):
    closed once sent, or when the message is dropped unsent."""

    handed: list

    def __del__(self):
        _close_all(self.handed)


def encode_request(fn, args, kwargs):
    """:func:`encode` of a call's request, or a TypeError that says what cannot be sent."""
    try:
        return encode(REQUEST, (fn, args, kwargs))
    except (AttributeError, TypeError, ImportError, pickle.PicklingError) as exc:
        raise TypeError(f"swift_safe_media.call needs a module-level function and picklable "
                        f"arguments; cannot send {getattr(fn, '__qualname__', fn)!r}: {exc}") from exc


def _close_all(fds) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _address(buffer) -> int:
    """Where a writable buffer's memory starts (-1: read-only, so never written in place)."""
    try:
        held = ctypes.c_char.from_buffer(buffer)
    except TypeError:
        return -1
    address = ctypes.addressof(held)
    del held  # releases the buffer
    return address


def _copy_into(target, buffers, spans) -> None:
    for view, (offset, length) in zip(buffers, spans):
        target[offset:offset + length] = view


def _fresh_memfd(buffers, spans, size) -> int:
    fd = os.memfd_create("swift-safe-media", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE) as target:
            _copy_into(target, buffers, spans)
    except BaseException:
        os.close(fd)
        raise
    return fd


def send(sock: socket.socket, kind: int, obj, deadline: float | None = None,
         arena: SharedArena | None = None) -> None:
    send_encoded(sock, *encode(kind, obj, arena), deadline)


def send_encoded(sock: socket.socket, message: bytes, fd: int, owned: bool,
                 deadline: float | None = None) -> None:
    """Send what :func:`encode` made, closing ``fd`` afterwards if ``owned``."""
    handed = getattr(message, "handed", None) or []
    try:
        _set_deadline(sock, deadline)
        fds = ([fd] if fd >= 0 else []) + handed
        if not fds:
            sock.sendall(message)
            return
        sent = socket.send_fds(sock, [message], fds)
        if sent < len(message):
            sock.sendall(memoryview(message)[sent:])
    finally:
        _close_all(handed)
        if owned:
            os.close(fd)


def receive(sock: socket.socket, deadline: float | None = None, unpickler=reply_unpickler.ReplyUnpickler,
            blocks: MappedBlocks | None = None):
    """Return ``(kind, obj)``. EOFError when the peer is gone, TimeoutError past the deadline.
    A peer's bytes are unpickled with the allow-list of :mod:`.reply_unpickler` (a refused
    message raises its RefusedReply) unless the receiver trusts the peer and says so.

    Buffers lent from the peer's arena are viewed through ``blocks``, which learns when
    nothing views them any more."""
    _set_deadline(sock, deadline)
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1 + handed.MAX_HANDED)
    kept: set[int] = set()
    try:
        if not head:
            raise EOFError("peer closed the connection")
        head += receive_exactly(sock, _HEADER.size - len(head), deadline)
        kind, body_size, count, memfd_size, block_id = _HEADER.unpack(head)
        rest = receive_exactly(sock, count * _SPAN.size + body_size, deadline)
        if count and not fds:
            raise EOFError("message announced shared buffers but carried no descriptor")
        buffers = []
        if count:
            if block_id and blocks is not None:
                whole = blocks.view(fds[0], block_id, memfd_size)
            else:
                whole = memoryview(mmap.mmap(fds[0], memfd_size, flags=mmap.MAP_SHARED))
            for index in range(count):
                offset, length = _SPAN.unpack_from(rest, index * _SPAN.size)
                buffers.append(whole[offset:offset + length])
        body = memoryview(rest)[count * _SPAN.size:]
        handed.receiving(fds[1:] if count else fds)
        try:
            return kind, unpickler(io.BytesIO(body), buffers=buffers).load()
        finally:
            kept = set(handed.taken())
            handed.receiving(None)
    finally:
        for fd in fds:
            if fd not in kept:
                os.close(fd)


class MappedBlocks:
    """Caller side: mappings of the arena blocks a sandbox lent lately, and the ids of
    those the caller has dropped every view of (``returned``), to hand back."""

    def __init__(self, keep: int = 4, max_block_bytes: int = 64 << 20):
        self.keep, self.max_block_bytes = keep, max_block_bytes
        self._mappings: collections.OrderedDict[int, mmap.mmap] = collections.OrderedDict()
        self.returned: list[int] = []

    def view(self, fd: int, block_id: int, size: int) -> memoryview:
        mapping = self._mappings.get(block_id)
        if mapping is None:
            capacity = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
            if capacity <= self.max_block_bytes:
                self._mappings[block_id] = mapping
                while len(self._mappings) > self.keep:
                    self._mappings.popitem(last=False)  # views still alive keep it mapped
        else:
            self._mappings.move_to_end(block_id)
        return held_memory.view_until_released(mapping, size, self.returned.append, block_id)


def payload_bytes(obj, depth: int = 0) -> int:
    """Bytes of array data in `obj` (numpy arrays, tensors, PIL images, bytes), looking
    into lists, tuples, dicts and dataclass-like objects: the size of a result, for errors."""
    if depth > 8:
        return 0
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    module = type(obj).__module__
    if module.startswith("torch") and hasattr(obj, "element_size"):
        return obj.element_size() * obj.nelement()
    if module.startswith("PIL.") and hasattr(obj, "size") and hasattr(obj, "getbands"):
        return obj.size[0] * obj.size[1] * len(obj.getbands())
    if isinstance(obj, dict):
        return sum(payload_bytes(value, depth + 1) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(value, depth + 1) for value in obj)
    return 0


def receive_exactly(sock, size: int, deadline=None) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        _set_deadline(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("peer closed the connection mid-message")
        got += n
    return data


def _set_deadline(sock, deadline) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)
