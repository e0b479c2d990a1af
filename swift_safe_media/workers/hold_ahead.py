"""When a loader's dataset and ``collate_fn`` are handed to a holding server ahead, and when its
workers fork from it (the server and the references: :mod:`.held_arguments`).

- **As a DataLoader is made** (after torch's ``DataLoader.__init__``, a row of
  :mod:`..patching.torch_dataloader`): where its workers will start from the warm forkserver
  (as far as can be told before the start decides), its dataset and ``collate_fn`` are pickled
  together and a server is started on the bytes. The same two objects made into another
  loader (accelerate's prepared copy) share it.
- **As the loader starts its workers** (:func:`serving_for`, asked by the start's checks, whose
  own pickle of them it spares; :func:`used_by_launches`, around torch's start): they are
  pickled again; the same bytes, and the launches use the server, even while it is still
  unpickling (the requests wait in its queue: torch asks for the workers' pids as it starts
  them, so the start waits for the server as it would for the workers' own unpickling).
  Other bytes, and the server is ended. A server that said it cannot hold them stays as that
  answer (its bytes let go): the same objects are neither pickled again nor tried again.

Not held: no workers; a loader with a ``multiprocessing_context`` of its own; objects that hand
file descriptors over (torch's shared tensors) or pickle to more than :data:`MAX_HELD_BYTES`; a
``worker_init_fn`` that could share objects with them (only none, a function, or a
``functools.partial`` of one over plain values is taken); a Python whose launch
:mod:`.forkserver_launch` has not read; beyond :data:`MAX_SERVERS` servers a process;
``SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD=0``. Every decision fails open: the workers then
unpickle what they are sent, as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

from .. import process
from . import held_arguments, loaded_ahead
from .forkserver_launch import warm_context

log = logging.getLogger("swift_safe_media")

MAX_SERVERS = 4  # a process making loaders without end holds the first ones' objects only
MAX_HELD_BYTES = 256 << 20  # the trainer keeps the bytes for the server's life (launches carry them)


def _plain(value) -> bool:
    """Pickled by reference or as a value alone: shares no object with a dataset."""
    if value is None or isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return True
    if isinstance(value, functools.partial):
        values = (*value.args, *value.keywords.values())
        return _plain(value.func) and all(isinstance(v, (int, float, str, bytes, bool, type(None))) for v in values)
    return False


def _servers() -> list:
    return process.current().holding_servers


def loader_init_holding_ahead(stock_init, self, *args, **kwargs):
    """torch's ``DataLoader.__init__``, then its dataset and ``collate_fn`` handed ahead."""
    stock_init(self, *args, **kwargs)
    try:
        hold_ahead(self.dataset, self.collate_fn, self.worker_init_fn, self.num_workers,
                   self.multiprocessing_context)
    except Exception:  # fail open: its workers unpickle them, as before
        log.debug("swift_safe_media: a loader's dataset was not held ahead", exc_info=True)


def hold_ahead(dataset, collate_fn, worker_init_fn, num_workers: int, mp_context) -> held_arguments.HoldingServer | None:
    """Start a holding server for ``dataset`` and ``collate_fn`` where the workers of a loader of
    them will start from the warm forkserver (as far as can be told before they start)."""
    if (num_workers <= 0 or mp_context is not None or collate_fn is None or not _plain(worker_init_fn)
            or not loaded_ahead.may_hold_here()):
        return None
    servers = _servers()
    for server in servers:
        if server.unit[0] is dataset and server.unit[1] is collate_fn:
            return server  # the same objects (accelerate's loader made again): checked at the start
    if len(servers) >= MAX_SERVERS:
        return None
    unit = (dataset, collate_fn)
    data = held_arguments.fingerprint(unit, loaded_ahead.references())
    if data is None or len(data) > MAX_HELD_BYTES:
        return None
    server = held_arguments.HoldingServer(unit, data, warm_context(), _main_for_server(data),
                                          loaded_ahead.newest())
    servers.append(server)
    return server


def _main_for_server(data: bytes) -> str | None:
    """The main module the server imports before it unpickles (as CPython tells a child), where
    the objects may need something of it and a worker could import it (as the start checks:
    the statement running is guarded, the module is a file); else None, and it runs nothing of
    the script. Where the warm forkserver imported it, the server has it and skips the import.
    Only the bytes are searched (:func:`.spawn_guard.may_name_main`): reading the names they
    need would cost a pass over every object, here in the trainer. A class the script
    defines only under its main guard then costs the server one import of the script before it
    says it cannot hold them (the start forks that loader's workers: the server is not used)."""
    from . import spawn_guard

    if not spawn_guard.may_name_main(data) or spawn_guard.unguarded_main_statement() is not None:
        return None
    main = spawn_guard.main_as_told()
    if main is None or spawn_guard.main_unreachable(lambda: data, frozenset) is not None:
        return None
    return main


def serving_for(loader) -> held_arguments.HoldingServer | None:
    """The server holding ``loader``'s dataset and ``collate_fn`` as they pickle now, if any;
    one holding them as they were is ended."""
    if not _plain(loader.worker_init_fn):
        return None
    for server in _servers():
        if server.unit[0] is loader.dataset and server.unit[1] is loader.collate_fn:
            if not server.may_serve():  # it said it cannot hold them: asked first, so never pickled again
                return None
            if held_arguments.fingerprint(server.unit, loaded_ahead.references()) != server.data:
                server.end("its dataset or collate_fn changed after the loader was made")
                return None
            return server  # still unpickling: the requests wait in its queue, as workers would unpickle
    return None


@contextlib.contextmanager
def used_by_launches(inputs, method: str):
    """While a loader starts its workers by ``method``: the holding server its launches use
    (``inputs``: the start's :class:`.start_method.StartInputs`, which found it)."""
    state = process.current()
    try:
        from .forkserver import FORKSERVER

        state.held_for_start = inputs.held if method == FORKSERVER and inputs.loader.num_workers > 0 else None
    except Exception:
        log.debug("swift_safe_media: a loader's held dataset was not checked", exc_info=True)
        state.held_for_start = None
    try:
        yield
    finally:
        state.held_for_start = None
