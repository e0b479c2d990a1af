"""The queues between a DataLoader and its workers, as replacing a killed worker needs them
(:mod:`.respawn`): index queues that remember the tasks they sent and the worker has
not answered yet, and results that could not be read handed on instead of ending torch's
pin-memory thread."""

from __future__ import annotations

import collections
import pickle
import weakref

from ..patching.targets import original_of


# A result of a worker killed after it sent it: its tensors' file descriptors, fetched
# from the sender as the result is read, are gone with it (or half a message was sent).
UNREADABLE = (OSError, EOFError, pickle.UnpicklingError)


class Unreadable:
    """What torch's pin-memory thread hands on, instead of dying, for a result it could not
    read: the trainer decides (a killed worker's task, sent again; else the error)."""

    def __init__(self, error):
        self.error = error


class ReadableResults:
    """The workers' result queue as the pin-memory thread reads it."""

    def __init__(self, queue):
        self.queue = queue

    def get(self, *args, **kwargs):
        try:
            return self.queue.get(*args, **kwargs)
        except UNREADABLE as error:
            return None, Unreadable(error)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def pin_memory_loop_handing_on_unreadable_results(in_queue, *args, **kwargs):
    from torch.utils.data._utils import pin_memory

    loop = pin_memory._pin_memory_loop
    return (original_of(loop) or loop)(ReadableResults(in_queue), *args, **kwargs)


class SentIndices:
    """An index queue whose ``put`` remembers the tasks it sent and the worker has not
    answered yet (``pending``), to send them again to the worker's replacement."""

    def __init__(self, queue, iterator):
        self.queue, self._iterator = queue, weakref.ref(iterator)  # no cycle: torch shuts workers down in __del__
        self.pending: collections.deque = collections.deque()  # (task index, sampler index), in order

    def put(self, item, *args, **kwargs):
        if type(item) is tuple:  # a task: (send_idx, index); None and _ResumeIteration are not
            iterator = self._iterator()
            if iterator is not None:
                answered = iterator._task_info
                while self.pending and len(answered.get(self.pending[0][0], ())) != 1:
                    self.pending.popleft()  # its result arrived
            self.pending.append(item)
        return self.queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.queue, name)


# How long the result queue's write lock must stay held, with nothing in its pipe, before it
# counts as left held by a dead worker. A live worker holds it only while it writes one
# message of a few hundred bytes into the pipe, which cannot block on an empty pipe.
LOCK_LEFT_HELD_S = 2.0


def release_lock_left_held(result_queue, wait: float = LOCK_LEFT_HELD_S) -> bool:
    """Release the write lock of the workers' shared ``result_queue`` if a killed worker left it
    held (killed by SIGKILL between its feeder thread's acquire and release): every other
    worker's feeder thread would wait on it for ever, and the trainer for their results.
    Whether it did. Not decided while the pipe holds data (a live worker may be blocked
    writing to a full pipe, the lock held, until the trainer reads)."""
    lock, reader = getattr(result_queue, "_wlock", None), getattr(result_queue, "_reader", None)
    if lock is None or reader is None:
        return False
    if lock.acquire(timeout=wait):
        lock.release()
        return False
    if reader.poll(0):
        return False
    try:
        lock.release()  # a multiprocessing Lock has no owner: any process may release it
    except ValueError:  # released meanwhile after all
        return False
    return True
