"""DataLoader workers of a script with no host (``swift_safe_media.enable()`` in a plain
PyTorch training script): they start from the warm forkserver, and bound the media
libraries' entry points in each worker.

A DataLoader whose start method nobody named (neither the loader, nor the user's
``multiprocessing.set_start_method``, nor a host's adapter) gets
``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (the warm forkserver by default): its workers never
inherit the trainer's threads and locks (OpenCV's thread pool in a forked worker, a
CUDA context), at about fork's speed. Such workers receive the dataset pickled; a
dataset that cannot be pickled (a lambda, an open file, a generator) forks, as stock
PyTorch does on Linux, with one warning saying why. A start method set globally to
the platform's own default (``fork`` on Linux) cannot be told from no choice at all
and counts as none.

Workers that do not fork have none of their parent's patches: each one bounds the
media libraries (:mod:`.integrations.media`) before the user's ``worker_init_fn`` runs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle

from .. import config
from . import spawn_guard

log = logging.getLogger("swift_safe_media")

_warned: set[str] = set()  # dataset types named in a warning


def _named_globally() -> bool:
    method = multiprocessing.get_start_method(allow_none=True)
    return method is not None and method != multiprocessing.get_all_start_methods()[0]


def choose_start_method(loader) -> None:
    """Give an unnamed ``loader`` the configured start method (see the module's doc)."""
    if loader.num_workers <= 0 or loader.multiprocessing_context is not None or _named_globally():
        return
    method = config.mp_context()
    if method in ("default", "fork"):
        return
    try:
        pickle.dumps((loader.dataset, loader.collate_fn, loader.worker_init_fn))
    except Exception as exc:
        loader.multiprocessing_context = "fork"
        name = type(loader.dataset).__qualname__
        if name not in _warned:
            _warned.add(name)
            log.warning(f"swift_safe_media: the DataLoader's dataset ({name}) cannot be pickled "
                        f"({type(exc).__name__}: {exc}), so its workers fork from this process, as stock "
                        f"PyTorch's do, instead of starting from the {method} (decodes are still bounded)")
        return
    loader.multiprocessing_context = method


class _BoundingLibraries:
    """A ``worker_init_fn`` that bounds the media libraries in the worker, then runs the
    user's own (picklable, so it reaches a worker started by spawn or a forkserver)."""

    def __init__(self, init_fn):
        self.init_fn = init_fn

    def __call__(self, worker_id):
        try:
            from ..patching import media_libraries as media

            media.enable()
        except Exception:  # fail open: the worker runs as stock
            log.exception("swift_safe_media: could not bound the media libraries in a DataLoader worker")
        if self.init_fn is not None:
            return self.init_fn(worker_id)


@contextlib.contextmanager
def workers_bound_libraries(loader, method: str | None):
    """While ``loader`` starts workers that do not fork: each bounds the media libraries."""
    if method is None or method not in spawn_guard.RERUN_BY_CHILDREN or loader.num_workers <= 0:
        yield
        return
    init_fn = loader.worker_init_fn
    loader.worker_init_fn = _BoundingLibraries(init_fn)
    try:
        yield
    finally:
        loader.worker_init_fn = init_fn
