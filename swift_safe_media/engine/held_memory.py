"""Memory a process holds after a message: views of shared or recycled memory that hand
it back once the last array made on them is gone, and pages released once copied.

- :func:`view_until_released`: one object per lend that every array made on it keeps
  alive (the caller's views of a sandbox's arena blocks, :class:`.transport.MappedBlocks`);
- :class:`RecycledBuffers`: anonymous mappings for arrays a worker makes per sample;
- :func:`release_pages`: the pages of a received array the caller has copied elsewhere.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref


def view_until_released(mapping: mmap.mmap, size: int, on_release, *args) -> memoryview:
    """The first ``size`` bytes of ``mapping`` as one object per lend, which every array
    made on the returned view keeps alive: when the last of them goes, ``on_release(*args)``
    runs (in whichever thread dropped it), and the memory can be handed out again."""
    lent = (ctypes.c_ubyte * size).from_buffer(mapping)
    weakref.finalize(lent, on_release, *args)
    return memoryview(lent).cast("B")


class RecycledBuffers:
    """Memory for arrays a process makes for every sample and drops after the batch
    (LeRobot's float frames, made from the uint8 ones a sandbox sends): anonymous
    mappings handed out again once nothing views them. Under the fixed mmap threshold of
    DataLoader workers (``config.WORKER_MMAP_THRESHOLD_KB``) each such block would be a
    fresh mapping whose page faults are paid for every sample (measured: up to a tenth
    of LeRobot's throughput); under glibc's sliding threshold it would come from the
    heap, which keeps the freed pages."""

    def __init__(self, max_idle_bytes: int = 256 << 20):
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()  # views may die in any thread

    def buffer(self, size: int) -> memoryview:
        """``size`` bytes, given back when every view of them is gone."""
        with self._lock:
            idle = self._idle.get(size)
            mapping = idle.pop() if idle else None
            if mapping is not None:
                self._idle_bytes -= size
        if mapping is None:
            mapping = mmap.mmap(-1, max(size, 1))
        return view_until_released(mapping, size, self._give_back, size, mapping)

    def _give_back(self, size: int, mapping: mmap.mmap) -> None:
        with self._lock:
            if self._idle_bytes + size <= self.max_idle_bytes:
                self._idle[size].append(mapping)
                self._idle_bytes += size
        # otherwise the mapping goes with its last reference

    def idle_bytes(self) -> int:
        return self._idle_bytes


_MADV_REMOVE = 9
_PAGE = mmap.PAGESIZE


def release_pages(array) -> None:
    """Free the memory behind part of a received array that the caller has copied and
    will not read again (PIL frames made from decoded ones, say), so the caller never
    holds both. Only whole pages inside the array go: they are punched out of the shared
    memfd (MADV_REMOVE; reading them again gives zeros). Memory that is not a shared
    mapping refuses the advice, and is left as it is."""
    start = array.__array_interface__["data"][0]
    first = -(-start // _PAGE) * _PAGE
    last = (start + array.nbytes) // _PAGE * _PAGE
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_REMOVE)


_LIBC = []


def _libc():
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]
