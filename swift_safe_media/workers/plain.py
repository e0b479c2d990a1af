"""DataLoader workers of a script with no host (``swift_safe_media.enable()`` in a plain
PyTorch training script): they start from the warm forkserver, and bound the media
libraries' entry points in each worker.

A DataLoader whose start method nobody named (neither the loader, nor the user's
``multiprocessing.set_start_method``, nor a host's adapter) gets
``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (the warm forkserver by default): its workers never
inherit the trainer's threads and locks (OpenCV's thread pool in a forked worker, a
CUDA context), at about fork's speed. Such workers receive the dataset pickled; a
dataset that cannot be pickled (a lambda, an open file, a generator) forks, as stock
PyTorch does on Linux, with one warning saying why. That choice is rows 2-5 of the
decision in :mod:`.start_method`.

Workers that do not fork have none of their parent's patches: each one bounds the
media libraries (:mod:`..patching.media_libraries`) and marks the media openers
(:mod:`..patching.media_openers`) before the user's ``worker_init_fn`` runs.
"""

from __future__ import annotations

import contextlib
import logging

from . import spawn_guard

log = logging.getLogger("swift_safe_media")


class _BoundingLibraries:
    """A ``worker_init_fn`` that bounds the media libraries in the worker, then runs the
    user's own (picklable, so it reaches a worker started by spawn or a forkserver)."""

    def __init__(self, init_fn):
        self.init_fn = init_fn

    def __call__(self, worker_id):
        try:
            from ..patching import media_libraries as media

            media.enable()
            patch_workers_tasks()
        except Exception:  # fail open: the worker runs as stock
            log.exception("swift_safe_media: could not bound the media libraries in a DataLoader worker")
        if self.init_fn is not None:
            return self.init_fn(worker_id)


def patch_workers_tasks() -> None:
    """What a worker's tasks need patched: a ``MediaDecodeError`` reaches the trainer as
    itself (:mod:`.typed_errors`); the media openers' calls are marked and a task's marks
    cleared as it ends (:mod:`.decode_deadline`), unless ``SWIFT_SAFE_MEDIA_BOUND_OPENERS=0``."""
    from .. import config
    from ..patching import media_openers, torch_dataloader

    torch_dataloader.patch("typed errors")  # whatever the switch: a MediaDecodeError reaches the trainer as itself
    if config.get(config.BOUND_OPENERS):
        media_openers.enable()
        torch_dataloader.patch("decode deadline")


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
