"""held_memory.RecycledBuffers: memory handed out again only once nothing views it; the
sandbox's SharedArena: the blocks handed back last are the ones kept, and a result written
into a block is sent from it."""
from __future__ import annotations

import gc
import threading

import numpy as np
import torch

from swift_safe_media.engine import transport
from swift_safe_media.engine.held_memory import RecycledBuffers


def _address(view) -> int:
    array = np.frombuffer(view, dtype=np.uint8)
    address = array.ctypes.data
    del array
    return address


def test_a_buffer_is_reused_only_after_every_view_is_gone():
    buffers = RecycledBuffers()
    first = buffers.buffer(1 << 20)
    first_address = _address(first)
    first[:] = b"\x01" * (1 << 20)
    second = buffers.buffer(1 << 20)  # `first` is alive: other memory
    assert _address(second) != first_address
    second[:] = b"\x02" * (1 << 20)
    assert bytes(first[:4]) == b"\x01" * 4
    del first
    gc.collect()
    assert buffers.idle_bytes() == 1 << 20
    third = buffers.buffer(1 << 20)
    assert _address(third) == first_address
    assert buffers.idle_bytes() == 0
    assert bytes(second[:4]) == b"\x02" * 4


def test_a_tensor_made_on_a_buffer_keeps_it_until_the_tensor_goes():
    buffers = RecycledBuffers()
    tensor = torch.frombuffer(buffers.buffer(4 * 1000), dtype=torch.float32).view(10, 100)
    torch.div(torch.arange(1000, dtype=torch.uint8).view(10, 100), 255.0, out=tensor)
    expected = torch.arange(1000, dtype=torch.uint8).view(10, 100) / 255.0
    view = tensor[3]  # a view of the tensor keeps the memory too
    del tensor
    gc.collect()
    assert buffers.idle_bytes() == 0
    other = torch.frombuffer(buffers.buffer(4 * 1000), dtype=torch.float32)
    other.fill_(-1.0)
    assert torch.equal(view, expected[3])
    del view
    gc.collect()
    assert buffers.idle_bytes() == 4 * 1000
    del other
    gc.collect()
    assert buffers.idle_bytes() == 2 * 4 * 1000


def test_idle_memory_is_capped_and_sizes_do_not_mix():
    buffers = RecycledBuffers(max_idle_bytes=3 << 20)
    views = [buffers.buffer(1 << 20) for _ in range(5)]
    small = buffers.buffer(4096)
    del views
    gc.collect()
    assert buffers.idle_bytes() == 3 << 20  # two of the five were unmapped
    del small
    gc.collect()
    assert buffers.idle_bytes() == 3 << 20  # no room left for it
    kept = [buffers.buffer(1 << 20) for _ in range(3)]
    assert buffers.idle_bytes() == 0 and len({_address(view) for view in kept}) == 3


def test_views_may_be_dropped_in_other_threads():
    buffers = RecycledBuffers()
    views = [buffers.buffer(8192) for _ in range(64)]

    def drop(chunk):
        for view in chunk:
            view.release()

    threads = [threading.Thread(target=drop, args=(views[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del views
    gc.collect()
    assert buffers.idle_bytes() == 64 * 8192
    handed = [buffers.buffer(8192) for _ in range(64)]
    assert len({_address(view) for view in handed}) == 64 and buffers.idle_bytes() == 0


def test_the_arena_keeps_the_blocks_handed_back_last():
    arena = transport.SharedArena(max_idle_bytes=2 << 20)
    small = arena.lend(1 << 20)
    arena.take_back([small.id])
    big = arena.lend(3 << 19)  # 2 MB: with the small one idle, over the budget
    arena.take_back([big.id])
    assert arena.counts() == (0, 1)
    assert arena.lend(3 << 19).id == big.id  # the next result of that size reuses it
    assert arena.lend(1 << 20).id not in (small.id, big.id)


def test_a_result_written_into_a_block_is_encoded_from_it_without_a_copy():
    arena = transport.SharedArena()
    frames = np.frombuffer(arena.for_result(4 << 20), np.uint8)
    frames[:] = 7
    message, fd, owned = transport.encode(transport.RESULT, frames, arena)
    [block] = arena._lent.values()
    assert fd == block.fd and not owned and arena.counts() == (1, 0)
    frames[0] = 9  # the block itself travels: what is written now is what the caller sees
    assert block.mapping[0] == 9 and block.mapping[1] == 7
    elsewhere = np.full(4 << 20, 3, np.uint8)  # not written in place: copied into another block
    arena.for_result(4 << 20)
    message, fd, owned = transport.encode(transport.RESULT, elsewhere, arena)
    assert fd != block.fd and arena.counts() == (3, 0)  # the first, the one written, the copy
    arena.call_ended()  # the block written but not sent is idle again
    assert arena.counts() == (2, 1)
