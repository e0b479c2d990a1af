"""A DataLoader worker killed from outside is replaced, and its samples are sent again.

torch ends the run when a worker dies ("DataLoader worker (pid X) is killed by signal:
Killed" from its SIGCHLD handler, "exited unexpectedly" from ``_try_get_data``). With
protection on, a worker of a map-style dataset killed by a signal swift_safe_media did not
send (the OOM killer, an operator) is replaced: a new process with the same worker id,
target and arguments (so the same start method, warm forkserver included, and
``worker_init_fn``), a new index queue (the dead one may hold the old one's lock), and the
dead worker's outstanding tasks sent again in order, so batches keep their order and
content; second answers to a task are dropped. Bounded by
``SWIFT_SAFE_MEDIA_WORKER_RESTARTS`` per iterator; past it, for a crash signal of the
worker's own, a worker that exited by itself or an ``IterableDataset`` (a new worker
cannot resume its stream), torch's error stands after one log line saying why.

A forkserver's workers are its children: their exit status reaches the trainer through
it, so a killed forkserver made each of them look dead (exit code 255) at torch's next
status check. Their liveness is read from a pidfd instead (:mod:`.liveness`).
See docs/never-silent.md#dataloader-workers-killed-from-outside (and its residual risk).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import weakref

from .. import config
from ..engine import faults
from ..patching import torch_dataloader
from ..records import summary
from . import decode_deadline, liveness
from .queues import UNREADABLE, SentIndices, Unreadable, release_lock_left_held

log = logging.getLogger("swift_safe_media")

STATE = "_swift_safe_media_replacing"  # the iterator's attribute holding its Replacing
# torch's _worker_loop parameters (2.10..2.14), and where the iterator keeps each value it
# passed (multiprocessing drops a Process's arguments once it starts, so they are rebuilt).
WORKER_ARGS = {"dataset_kind": "_dataset_kind", "dataset": "_dataset", "dataset_holder": "_dataset",
               "index_queue": None, "data_queue": "_worker_result_queue", "done_event": "_workers_done_event",
               "auto_collation": "_auto_collation", "collate_fn": "_collate_fn", "drop_last": "_drop_last",
               "base_seed": "_base_seed", "init_fn": "_worker_init_fn", "worker_id": None,
               "num_workers": "_num_workers", "persistent_workers": "_persistent_workers",
               "shared_seed": "_shared_seed"}

_iterators: weakref.WeakSet = weakref.WeakSet()  # iterators whose killed workers are replaced
_said: set[str] = set()  # reasons logged once per process


def install() -> None:
    """Replace killed workers in this process's DataLoaders (now, or once torch's DataLoader
    is imported): the ``worker restart`` rows of :mod:`..patching.torch_dataloader`."""
    torch_dataloader.patch("worker restart")


def uninstall() -> None:
    torch_dataloader.unpatch("worker restart")


def _say_once(key: str, level: int, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


def _unknown_internals(iterator, worker_loop) -> str | None:
    """Why this iterator's internals are not the ones this module knows, or None."""
    import inspect

    parameters = list(inspect.signature(worker_loop).parameters)
    unknown = [name for name in parameters if name not in WORKER_ARGS]
    if unknown or len(parameters) != 14:
        return f"its workers' _worker_loop takes {parameters}"
    for name in ("_workers", "_index_queues", "_shutdown", *filter(None, WORKER_ARGS.values())):
        if not hasattr(iterator, name):
            return f"it has no {name}"
    return None


def _worker_args(iterator, parameters, worker_id: int, queue) -> tuple:
    """The arguments torch gave worker ``worker_id``, with ``queue`` as its index queue."""
    given = {"index_queue": queue, "worker_id": worker_id, "dataset_holder": [iterator._dataset]}  # 2.14: emptied
    return tuple(given[name] if name in given else getattr(iterator, WORKER_ARGS[name]) for name in parameters)


class Replacing:
    """One iterator's replacements: what is left of the bound, the tasks sent again."""

    def __init__(self, iterator, loader, parameters):
        self.parameters = parameters
        context = loader.multiprocessing_context
        if context is None:
            import torch.multiprocessing as context
        elif isinstance(context, str):
            context = multiprocessing.get_context(context)
        self.context = context
        self.left = config.get(config.WORKER_RESTARTS)
        self.oom_before = faults.oom_kills()
        self.killed: dict[int, int] = {}  # worker id: pid, found killed from outside by the SIGCHLD handler
        self.resent: set[int] = set()  # task indices sent twice: the second answer is dropped
        self.resuming = False  # inside _reset's wait for every worker's _ResumeIteration
        self.replaced = self.unreadable = 0  # workers replaced; their results that could not be read
        from torch.utils.data.dataloader import _DatasetKind

        self.iterable = iterator._dataset_kind == _DatasetKind.Iterable
        self.deadlines = decode_deadline.deadlines()  # the user's decodes in its workers, bounded
        self.deadline_kills: set[int] = set()  # pids killed at a hung decode (decode_deadline)
        self.hung: dict[int, tuple] = {}  # task index: the decode_deadline.Hung notes it is sent again with

    def verdict(self, iterator, worker_id: int, signal_number: int | None) -> str | None:
        """Why worker ``worker_id`` (killed by ``signal_number``; None: exit status unknown)
        is a machine fault that may be replaced; None if torch's rule stands (logged)."""
        worker = iterator._workers[worker_id]
        how = _how_it_died(-signal_number if signal_number else None)
        what = f"DataLoader worker {worker_id} (pid {worker.pid}) {how}"
        if signal_number is None:
            why = "its exit status is unknown: the forkserver that started it is gone too"
        elif signal_number == 0:
            log.warning("swift_safe_media: %s: it exited by itself (exit code %s); not replaced (torch's rule)",
                        what, worker.exitcode)
            return None
        else:
            fault, _, why = faults.crash_verdict(signal_number, faults.risen(self.oom_before, faults.oom_kills()))
            if fault != faults.MACHINE:
                log.warning("swift_safe_media: %s, a crash of its own; not replaced (torch's rule)", what)
                return None
        if self.iterable:
            _say_once("iterable", logging.WARNING, "swift_safe_media: %s (%s); not replaced: a new worker "
                      "cannot resume an IterableDataset's stream, so torch's rule stands", what, why)
            return None
        if iterator._shutdown:
            return None
        if self.left <= 0:
            log.error("swift_safe_media: %s (%s), a machine fault; not replaced: this DataLoader has "
                      "replaced %d workers, all that %s allows, so torch ends the run", what, why,
                      self.replaced, config.WORKER_RESTARTS)
            return None
        return why

    def replace(self, iterator, worker_id: int, why: str, hung=None) -> None:
        """Start worker ``worker_id``'s replacement and send it the dead one's tasks (a worker
        killed at a hung decode, ``hung``, is not counted against the bound: the data's, and
        its task is sent again with a note that ends it, so it cannot recur)."""
        from torch.utils.data import _utils

        dead = iterator._workers[worker_id]
        old_queue = iterator._index_queues[worker_id]
        queue = self.context.Queue()
        queue.cancel_join_thread()  # as torch does: exiting never waits on a worker's queue
        worker_loop = _utils.worker._worker_loop
        args = _worker_args(iterator, self.parameters, worker_id, queue)
        for attempt in (1, 2):
            worker = self.context.Process(target=worker_loop, args=args)
            worker.daemon = True
            try:
                worker.start()
                liveness.outlives_its_forkserver(worker)  # reads the pid (forkserver_launch): EOFError here too
                break
            except (EOFError, ConnectionError):  # the forkserver was killed as it started this one
                if attempt == 2:
                    raise
        self.left -= hung is None
        self.replaced += 1
        resend = SentIndices(queue, iterator)
        if self.resuming:
            resend.put(_utils.worker._ResumeIteration(iterator._shared_seed))
        samples = 0
        for task, index in getattr(old_queue, "pending", ()):
            if len(iterator._task_info.get(task, ())) == 1:  # still outstanding on the dead worker
                resend.put((task, decode_deadline.Retried(index, self.hung[task]) if task in self.hung else index))
                self.resent.add(task)
                samples += len(index) if isinstance(index, (list, tuple)) else 1
        iterator._workers[worker_id] = worker
        iterator._index_queues[worker_id] = resend
        iterator._workers_status[worker_id] = True
        self.free_result_queue(iterator)
        try:
            old_queue.cancel_join_thread()
            old_queue.close()
        except Exception:
            pass
        if iterator._persistent_workers and getattr(iterator, "_pin_memory", False) \
                and hasattr(type(iterator), "_clean_up_worker"):  # torch 2.10/2.11 join each worker at exit
            import atexit

            atexit.register(type(iterator)._clean_up_worker, worker)
        _utils.signal_handling._remove_worker_pids(id(iterator))
        _utils.signal_handling._set_worker_pids(id(iterator), tuple(w.pid for w in iterator._workers))
        if hung is not None:
            log.warning("swift_safe_media: %s: %s; replaced by pid %d, %d samples sent to it again, where this "
                        "decode raises MediaDecodeTimeout", hung.media, why, worker.pid, samples)
        else:
            log.warning("swift_safe_media: DataLoader worker %d (pid %d) %s (%s), a machine fault, not the data's; "
                        "replaced by pid %d, %d samples sent to it again (%d of %d replacements left)", worker_id,
                        dead.pid, _how_it_died(dead.exitcode), why, worker.pid, samples, self.left,
                        self.left + self.replaced)
        recorder = summary.recorder()
        if recorder is not None:
            recorder.note_worker_replaced()

    def free_result_queue(self, iterator) -> None:
        """The dead worker may have been killed holding the shared result queue's write lock."""
        if release_lock_left_held(iterator._worker_result_queue):
            log.warning("swift_safe_media: a killed DataLoader worker had left the lock of the workers' result queue "
                        "held (killed while it sent a result); released, so the other workers' results go through")

    def replace_dead(self, iterator, was_active) -> bool:
        """After torch found workers dead: replace each, if every one of them may be."""
        dead = [worker_id for worker_id, worker in enumerate(iterator._workers)
                if was_active[worker_id] and not worker.is_alive()]
        verdicts = {worker_id: self.verdict(iterator, worker_id, _killed_by(iterator._workers[worker_id]))
                    for worker_id in dead}
        if not dead or None in verdicts.values():
            return False
        return all(self.replace_failing_open(iterator, worker_id, why) for worker_id, why in verdicts.items())

    def replace_failing_open(self, iterator, worker_id: int, why: str, hung=None) -> bool:
        try:
            self.replace(iterator, worker_id, why, hung)
            return True
        except Exception:  # torch's own error stands
            log.exception("swift_safe_media: could not replace DataLoader worker %d", worker_id)
            return False

    def lost_result(self, iterator, was_active) -> bool:
        """After a result could not be read: whether it was a killed worker's (each had at most
        ``prefetch_factor`` tasks, all sent again to its replacement)."""
        if self.replace_dead(iterator, was_active):
            return True
        if self.unreadable < self.replaced * iterator._prefetch_factor:
            self.unreadable += 1
            return True
        # A dying worker's files (the connection its result needed) close some time before it
        # can be waited for (its memory is torn down first).
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if self.replace_dead(iterator, was_active):
                return True
        return False

    def stale(self, iterator, data) -> bool:
        """Whether ``data`` (task index, result) is a second answer to a task sent again, or a
        replaced worker's acknowledgement of a resume already counted."""
        task = data[0]
        if type(task) is int:
            if task not in self.resent:
                return False
            return len(iterator._task_info.get(task, ())) != 1
        return not self.resuming  # a _ResumeIteration acknowledged after _reset stopped counting


def _killed_by(worker) -> int | None:
    """The signal that killed ``worker`` (0 if it exited by itself; None: unknown)."""
    popen = getattr(worker, "_popen", None)
    if getattr(popen, "status_unknown", False):
        return None
    code = worker.exitcode
    return -code if code is not None and code < 0 else 0


def _how_it_died(exitcode) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return "died"


def reset_remembering_indices(original, iterator, loader, *args, **kwargs):
    """``_MultiProcessingDataLoaderIter._reset``: at the first, the iterator's index queues
    learn to remember what they send; later ones (persistent workers) note the resume."""
    state = getattr(iterator, STATE, None)
    first = kwargs.get("first_iter", args[0] if args else False)
    if state is None and first:
        try:
            from torch.utils.data import _utils

            import inspect

            problem = _unknown_internals(iterator, _utils.worker._worker_loop)
            if problem is None:
                state = Replacing(iterator, loader, list(inspect.signature(_utils.worker._worker_loop).parameters))
                iterator._index_queues = [SentIndices(queue, iterator) for queue in iterator._index_queues]
                setattr(iterator, STATE, state)
                _iterators.add(iterator)
            else:
                import torch

                _say_once("internals", logging.WARNING, "swift_safe_media: torch %s's DataLoader is not the one "
                          "swift_safe_media knows (%s); a DataLoader worker killed from outside ends the run, as "
                          "in stock torch", torch.__version__, problem)
            for worker in iterator._workers:
                liveness.outlives_its_forkserver(worker)
        except Exception:  # fail open: torch's own behaviour
            log.warning("swift_safe_media: DataLoader workers killed from outside will not be replaced",
                        exc_info=True)
            state = None
    if state is None:
        return original(iterator, loader, *args, **kwargs)
    if first:
        reset = original(iterator, loader, *args, **kwargs)
        if not (hasattr(iterator, "_workers_status") and hasattr(iterator, "_task_info")):  # set by _reset
            delattr(iterator, STATE)
            _say_once("internals", logging.WARNING, "swift_safe_media: this torch's DataLoader keeps no "
                      "_workers_status or _task_info; a worker killed from outside ends the run, as in stock torch")
        return reset
    state.resuming = True
    try:
        return original(iterator, loader, *args, **kwargs)
    finally:
        state.resuming = False


def get_data_replacing_workers(original, iterator, timeout=None):
    """``_MultiProcessingDataLoaderIter._try_get_data``: workers killed from outside are
    replaced (before torch sees them, where the SIGCHLD handler found them; else once torch
    has), and second answers to tasks sent again are dropped."""
    state = getattr(iterator, STATE, None)
    if timeout is None:
        from torch.utils.data import _utils

        timeout = _utils.MP_STATUS_CHECK_INTERVAL
    if state is None:
        return _read(original(iterator, timeout))
    deadline = time.monotonic() + timeout
    while True:
        while state.killed:
            worker_id, pid = state.killed.popitem()
            worker = iterator._workers[worker_id]
            if worker.pid == pid and worker.exitcode is not None:  # not replaced yet
                why = state.verdict(iterator, worker_id, _killed_by(worker))
                if why is not None:
                    state.replace_failing_open(iterator, worker_id, why)  # else torch finds it dead
        wait = max(0.0, deadline - time.monotonic())
        if state.deadlines is not None:  # looks at the workers' decodes every REWRITE_AFTER_S
            if state.deadlines.anything_marked():
                decode_deadline.end_overdue(iterator, state, state.deadlines)  # raises for a stream's hung decode
            wait = min(wait, decode_deadline.REWRITE_AFTER_S)
        was_active = list(iterator._workers_status)
        try:
            got, data = _read(original(iterator, wait))
        except RuntimeError:
            if not state.replace_dead(iterator, was_active):
                raise
            got, data = False, None
        except UNREADABLE:
            if not state.lost_result(iterator, was_active):
                raise
            got, data = False, None
        else:
            if not got and state.replaced:  # nothing for a while: a lock held there since a kill?
                state.free_result_queue(iterator)
            if got and not (state.replaced and state.stale(iterator, data)):
                return got, data
        if time.monotonic() >= deadline:
            return False, None


def _read(answer):
    got, data = answer
    if got and type(data[1]) is Unreadable:
        raise data[1].error
    return answer


def error_if_a_worker_failed_for_good():
    """torch's ``_error_if_any_worker_fails`` (run by its SIGCHLD handler): a worker that
    will be replaced is reaped here and noted, so torch's check does not see it."""
    import torch

    for iterator in list(_iterators):
        try:
            _note_killed(iterator, getattr(iterator, STATE))
        except Exception:  # fail open: torch's check below decides
            log.debug("swift_safe_media: could not check the DataLoader's workers", exc_info=True)
    torch._C._error_if_any_worker_fails()


def _note_killed(iterator, state) -> None:
    for worker_id, worker in enumerate(iterator._workers):
        if not iterator._workers_status[worker_id] or worker_id in state.killed or worker.pid is None:
            continue
        if worker.pid in state.deadline_kills:  # killed at a hung decode: reaped, replaced by end_overdue
            worker._popen.poll(os.WNOHANG)
            continue
        try:
            info = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # not our child (started by a forkserver): _try_get_data finds it
            continue
        if info is None or info.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
            continue
        if state.verdict(iterator, worker_id, info.si_status) is not None:
            worker._popen.poll(os.WNOHANG)  # reaped (its returncode set): torch's check skips it
            state.killed[worker_id] = worker.pid  # replaced at the next _try_get_data
