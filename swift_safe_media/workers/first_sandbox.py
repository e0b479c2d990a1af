"""A DataLoader worker's first sandbox, asked for as the worker begins.

A worker started from the warm forkserver first reads its arguments: the dataset,
``collate_fn`` and ``worker_init_fn``, unpickled (a tokenizer or a processor: 0.1-0.2 s).
Its first decode then waited for a sandbox: the shared zygote forks one, which starts up
and answers (15-30 ms measured). Under fork, stock's worker has neither wait. So the
worker asks the zygote for its sandbox before it unpickles and takes it at its first
decode: the zygote forks it while the worker unpickles. No thread: the request is sent
and its reply read later (:meth:`.Zygote.spawn_ahead`, as a sandbox per call does for the
next call).

How it begins that early: the trainer's launch (:mod:`.forkserver_launch`) puts a
:class:`FirstSandbox` among the worker's preparation data, which the worker unpickles
before its arguments; unpickling it calls :func:`ask`. (CPython's ``spawn.prepare``
ignores a key it does not know.) A sandbox takes its caller's environment when it is
forked, so the request carries what the worker's will be at its first decode: the trainer's
environment (which the worker otherwise adopts in its ``worker_init_fn``) and the thread
budget of a worker of this loader. The first decode takes the sandbox only if one asked for
then would be the same (zygote, memory cap, environment, imports); else it is ended.

Which sandboxes: one of each pooled kind the trainer has used itself (LLaMA-Factory's
preprocessing reads by name; a download's is left to the first download), else, where a
host is patched (imported with protection on), a confined one (what the twins decode in);
none where no host is and the trainer has not decoded (a script's own ``Dataset``: its
workers may never call a sandbox). A worker that never decodes keeps one idle sandbox (a
fork of the zygote) for its life;
``SWIFT_SAFE_MEDIA_WORKER_FIRST_SANDBOX=0`` leaves the first sandbox to the first decode.
Nothing here may fail a worker: on any error the first decode starts its own.
"""

from __future__ import annotations

import logging
import os

from .. import config, process
from ..patching import host_adapters

log = logging.getLogger("swift_safe_media")


class FirstSandbox:
    """What the trainer puts in a worker's preparation data: unpickled, it asks for the sandboxes."""

    def __init__(self, kinds: tuple, threads: int, changed: dict, removed: list):
        self.kinds, self.threads, self.changed, self.removed = kinds, threads, changed, removed

    def __reduce__(self):
        return ask, (self.kinds, self.threads, self.changed, self.removed)


def for_launch(arguments) -> FirstSandbox | None:
    """In the trainer, as a worker is launched with ``arguments`` (bound to torch's
    ``_worker_loop``, or None for another target): what it should ask for, or None."""
    try:
        if not config.get(config.ZYGOTE) or not config.get(config.WORKER_FIRST_SANDBOX):
            return None
        workers = _loader_workers(arguments)
        if workers is None:
            return None
        from .forkserver import environment_changes

        threads = config.get(config.THREADS) if config.is_set(config.THREADS) else config.decode_thread_budget(workers)
        used = tuple(kind for kind, pool in process.current().engines.items() if not (pool.per_call or pool.network))
        if not used and not host_adapters.patched_hosts():
            return None  # your own code, nothing decoded here: its workers may never decode
        return FirstSandbox(used or (True,), threads, *environment_changes())
    except Exception:  # fail open: the worker starts as it would without
        log.debug("swift_safe_media: no first sandbox for a worker", exc_info=True)
        return None


def _loader_workers(arguments) -> int | None:
    """The ``num_workers`` torch's ``_worker_loop`` is started with, or None (another target)."""
    try:
        return int(arguments.arguments["num_workers"])
    except (AttributeError, TypeError, ValueError, KeyError):
        return None


def ask(kinds: tuple, threads: int, changed: dict, removed: list) -> None:
    """In the worker, before it unpickles its arguments: its parent's environment, then a
    sandbox of each kind asked for, with the thread budget the worker will have."""
    try:
        from ..engine.pool import get_engine
        from .forkserver import adopt_environment

        adopt_environment(changed, removed)
        explicit = os.environ.get(config.THREADS)
        os.environ[config.THREADS] = str(threads)
        try:
            for kind in kinds:
                get_engine(kind).ask_ahead()
        finally:
            if explicit is None:
                os.environ.pop(config.THREADS, None)
            else:
                os.environ[config.THREADS] = explicit
    except Exception:
        log.debug("swift_safe_media: a worker's first sandbox was not asked for", exc_info=True)
