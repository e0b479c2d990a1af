"""Holding servers: a loader's dataset and ``collate_fn`` unpickled once, by a process its
workers fork from; both ends of the protocol (when one is used: :mod:`.hold_ahead`).

Workers started from the warm forkserver receive the dataset and ``collate_fn`` pickled, and
each unpickles them before its first sample: LLaMA-Factory's collator (a 3.9 MB tokenizer and
the modules of its classes) took 0.2 s a worker, where workers forked from the trainer inherit
it. A *holding server* (:class:`HoldingServer`, the trainer's end; :func:`serve_holding`, its
life) is a process started from the warm forkserver (it shares the forkserver's pages), given
the two objects' bytes as the loader is made. It unpickles them once, leaves them out of its
children's garbage collections (``gc.freeze``), checks that it still has one thread, says so,
and serves as a forkserver itself: CPython's ``multiprocessing.forkserver.main`` on a socket of
its own, which queues the requests that come while it unpickles.

A worker's launch sent to it carries references in place of the two objects
(:func:`in_place_of_held`, :class:`HeldPart`): the worker, a fork of the server, takes the
server's objects, which is what unpickling the same bytes gives (the launch uses a server only
for the bytes it holds). The launch keeps a second pickle whose references carry the bytes: a
launch that cannot reach the server (gone), or that the server does not fork (it ended first,
or forked nothing within the start-up timeout), goes to the warm forkserver instead with those
(:mod:`.forkserver_launch`), and the worker unpickles the bytes.

A server unpickles with the environment the trainer had when the loader was made (a worker
adopts the trainer's as it starts, as before), and lives until the trainer ends (its end of a
pipe closes, or multiprocessing ends it as a daemon) or its objects change: the workers it
forked watch the trainer, not it (:mod:`.trainer_watchdog`).
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import multiprocessing
import os
import pickle
import socket
import uuid
from multiprocessing import connection, context, forkserver, popen_forkserver, reduction, resource_tracker

from .. import process
from . import spawn_guard

log = logging.getLogger("swift_safe_media")

SERVER_NAME = process.HOLDING_NAME  # its process's name: prepared without the main script (workers.forkserver)

# In a holding server and what it forks: key -> the (dataset, collate_fn) it unpickled. A
# worker launched elsewhere with a reference puts what it unpickled here.
_HELD: dict = {}


class HeldPart:
    """Pickled in a worker's launch in place of the dataset (0) or ``collate_fn`` (1): with the
    objects' bytes (``carried``), for a launch that may go elsewhere; without, for the bytes its
    server forks (its workers have the objects, and a small launch is written at once)."""

    def __init__(self, key: str, index: int, data: bytes):
        self.key, self.index, self.data = key, index, data
        self.carried = True

    def __reduce__(self):  # the one bytes object is written once
        return held_part, (self.key, self.index, self.data if self.carried else None)


def held_part(key: str, index: int, data: bytes | None):
    """In a worker: the held object, else (launched from elsewhere) what its bytes unpickle to."""
    unit = _HELD.get(key)
    if unit is None:
        if data is None:  # only a server's own forks are sent references without the bytes
            raise RuntimeError("a DataLoader worker's launch without its dataset's bytes reached a process "
                               "that does not hold them")
        unit = _HELD[key] = pickle.loads(data)
    return unit[index]


class _CollectingPopen:
    """Stands in for a launch's ``Popen`` while a fingerprint is taken: counts descriptors."""

    DupFd = popen_forkserver._DupFd

    def __init__(self):
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1


def fingerprint(unit, reducers: dict | None = None) -> bytes | None:
    """The bytes a worker's launch writes for ``unit`` (``reducers``: more entries of the
    pickler's dispatch table); None where they hand descriptors over."""
    buffer, popen = io.BytesIO(), _CollectingPopen()
    before = context.get_spawning_popen()
    context.set_spawning_popen(popen)
    try:
        pickler = reduction.ForkingPickler(buffer)
        pickler.dispatch_table.update(reducers or {})
        pickler.dump(unit)
    finally:
        context.set_spawning_popen(before)
    return None if popen.fds else buffer.getvalue()


class _Fd:
    """A descriptor handed to a process started from the forkserver (it gets a duplicate)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detached, (reduction.DupFd(self.fd),)


def _detached(duplicate) -> int:
    return duplicate.detach()


class HoldingServer:
    """The trainer's end of one holding server (started by ``context``, the warm forkserver's;
    forked from ``parent``, another holding server, where given: :mod:`.loaded_ahead`)."""

    def __init__(self, unit: tuple, data: bytes, context, main: str | None = None, parent=None):
        self.unit, self.data, self.key = unit, data, uuid.uuid4().hex
        self.why_not: str | None = None  # once it has answered: None (serving) or why it does not
        self._answered = False
        self.address = connection.arbitrary_address("AF_UNIX")
        listener = socket.socket(socket.AF_UNIX)
        ready_r, ready_w = multiprocessing.Pipe(duplex=False)
        alive_r, self._alive_w = os.pipe()
        try:
            listener.bind(self.address)
            os.chmod(self.address, 0o600)
            listener.listen()
            self.process = context.Process(
                target=serve_holding, args=(self.key, data, main, ready_w, listener, _Fd(alive_r)),
                name=SERVER_NAME, daemon=True)
            state = process.current()
            state.holding_parent = parent  # the launch asks it to fork this server (forkserver_launch)
            try:
                self.process.start()
            finally:
                state.holding_parent = None
        except BaseException:
            ready_r.close()
            os.close(self._alive_w)
            raise
        finally:
            listener.close()
            ready_w.close()
            os.close(alive_r)
        self._ready = ready_r

    def may_serve(self) -> bool:
        """False once it has said it does not serve (or ended before it said it does)."""
        if not self._answered:
            # Sent to a holding server that died before it forked this one: sent on to the warm
            # forkserver now (reading the pid does), not once a worker's launch has waited the start-up timeout.
            self.process.is_alive()
        if not self._answered and self._ready.poll(0):
            try:
                message = self._ready.recv_bytes()
            except (EOFError, OSError):
                message = b"it ended before it had unpickled them"
            self._answered, self.why_not = True, message.decode(errors="replace") or None
            self._ready.close()
            if self.why_not:  # kept in the list as a refusal for these objects; the bytes are let go
                self.data = None
                self.process.join(5)
                log.info("swift_safe_media: a loader's workers unpickle their dataset themselves: %s", self.why_not)
        return self.why_not is None

    def end(self, why: str) -> None:
        """It forks nothing more (what it forked watches the trainer, not it) and is forgotten."""
        self.why_not = why
        with contextlib.suppress(ValueError):
            process.current().holding_servers.remove(self)
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        if self._alive_w >= 0:
            with contextlib.suppress(OSError):
                os.close(self._alive_w)
            self._alive_w = -1
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def connect(self, fds: list[int]) -> tuple[int, int]:
        """CPython's request for a new process (``ForkServer.connect_to_new_process``), sent to
        this server: queued until it has unpickled. ``ConnectionError`` where it is gone."""
        if len(fds) + 4 >= forkserver.MAXFDS_TO_SEND:
            raise ValueError("too many fds")
        client = socket.socket(socket.AF_UNIX)
        try:
            client.connect(self.address)
        except OSError as exc:
            client.close()
            self.why_not = f"its server is gone ({exc})"
            raise ConnectionError(self.why_not) from exc
        with client:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            alive = forkserver._forkserver._forkserver_alive_fd
            try:
                reduction.sendfds(client, [child_r, child_w, alive, resource_tracker.getfd(), *fds])
                return parent_r, parent_w
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                os.close(child_r)
                os.close(child_w)


def serve_holding(key: str, data: bytes, main: str | None, ready, listener: socket.socket, alive_r: int) -> None:
    """The holding server's life: unpickle, say so, then serve as a forkserver until the
    trainer's end of ``alive_r`` closes. The warm forkserver prepares it without the trainer's
    main script; it imports ``main`` (as a worker would) only where the objects need it
    (:func:`.hold_ahead._main_for_server`), and its workers then find it imported."""
    before = process.name()
    process.set_name(process.HOLDING_NAME)
    os.register_at_fork(after_in_child=lambda: process.set_name(before))  # its workers: the name they had
    try:
        spawn_guard.import_main(main)
        _HELD[key] = pickle.loads(data)
        del data
        multiprocessing.current_process()._args = ()  # the bytes are not kept
        gc.collect()
        gc.freeze()  # forked workers' collections leave these pages unwritten
        threads = process.thread_names()
        if len(threads) > 1:
            raise RuntimeError(f"{len(threads)} threads after its imports and unpickling them ({', '.join(threads)})")
    except BaseException as exc:  # the trainer's workers unpickle for themselves
        with contextlib.suppress(OSError):  # the trainer ended this server meanwhile
            ready.send_bytes(f"its server could not hold them: {exc!r}"[:500].encode())
        return
    with contextlib.suppress(OSError):
        ready.send_bytes(b"")
    ready.close()
    forkserver.main(listener.detach(), alive_r, [])


@contextlib.contextmanager
def in_place_of_held(process_obj, bound):
    """While ``process_obj`` is pickled for its launch (``bound``: its arguments bound to torch's
    ``_worker_loop``, or None): references in place of the objects this start's server holds, if
    any. Yields (that server, the references), or (None, ())."""
    server = process.current().held_for_start
    bound = bound if server is not None and not server.why_not else None
    arguments = bound.arguments if bound is not None else {}
    holder = arguments.get("dataset_holder")  # torch 2.14 hands the dataset over in a list of one
    if holder is not None:
        held = type(holder) is list and len(holder) == 1 and holder[0] is server.unit[0]
    else:
        held = "dataset" in arguments and arguments["dataset"] is server.unit[0]
    if not held or arguments.get("collate_fn") is not server.unit[1]:
        yield None, ()
        return
    saved = process_obj._args, process_obj._kwargs
    dataset = HeldPart(server.key, 0, server.data)
    if holder is not None:
        arguments["dataset_holder"] = [dataset]
    else:
        arguments["dataset"] = dataset
    arguments["collate_fn"] = collate_fn = HeldPart(server.key, 1, server.data)
    process_obj._args, process_obj._kwargs = bound.args, bound.kwargs
    try:
        yield server, (dataset, collate_fn)
    finally:
        process_obj._args, process_obj._kwargs = saved
