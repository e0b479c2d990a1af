"""What happens as a DataLoader starts its workers, while protection is on: one patch of
torch's ``DataLoader._get_iterator`` that applies, in order,

0. the host's start method: an adapter may choose the start method of the DataLoaders
   its host starts (``worker_start_method``, see :mod:`.integrations`); else a loader
   whose start method nobody named gets the warm forkserver (:mod:`.plain_workers`);
   chosen first, so the checks below judge the method the workers will really get;
1. the main-script check (:mod:`.spawn_guard`): workers that would re-run an unguarded
   script fork instead of hanging;
2. the warm forkserver's verdict (:mod:`.warm_start`): workers that would fork from a
   forkserver with threads are spawned instead, with one warning;
3. the environment: workers forked from the warm forkserver adopt their parent's
   environment as it is now, not as it was when the forkserver started; and workers
   that do not fork bound the media libraries as they start (:mod:`.plain_workers`).

Each check fails open: a check that raises never stops the DataLoader.
"""

from __future__ import annotations

import functools
import logging

from .. import config
from ..patching import host_adapters as integrations
from . import plain as plain_workers, spawn_guard, forkserver as warm_start
from ..patching import import_hooks as _imports

log = logging.getLogger("swift_safe_media")

DATALOADER_MODULE = "torch.utils.data.dataloader"

_installed = False
_warned: set[str] = set()


def install() -> None:
    """Check every DataLoader of this process before it starts workers (now, or once
    torch's DataLoader is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    _imports.when_imported(DATALOADER_MODULE, _patch_dataloader)


def spawn_if_forkserver_unsafe(loader) -> None:
    """Give ``loader`` the spawn start method if it would fork its workers from a warm
    forkserver that has threads."""
    if loader.num_workers <= 0 or spawn_guard.start_method(loader) != warm_start.FORKSERVER:
        return
    problem = warm_start.forkserver_verdict(config.start_timeout())
    if problem is not None:
        loader.multiprocessing_context = "spawn"
        if warm_start.FORKSERVER not in _warned:
            _warned.add(warm_start.FORKSERVER)
            log.warning("swift_safe_media: %s; DataLoader workers are spawned instead", problem)


def _patch_dataloader(module) -> None:
    DataLoader = module.DataLoader
    stock_get_iterator = DataLoader._get_iterator

    @functools.wraps(stock_get_iterator)
    def _get_iterator(self):
        method = None
        try:
            if config.enabled_by_environment() and self.num_workers > 0:
                integrations.choose_worker_start_method(self)
                plain_workers.choose_start_method(self)
                spawn_guard.fork_if_main_would_rerun(self)
                spawn_if_forkserver_unsafe(self)
                method = spawn_guard.start_method(self)
        except Exception:  # a check must never stop the DataLoader itself
            log.debug("swift_safe_media: worker start checks skipped", exc_info=True)
        with (warm_start.workers_see_current_environment(self, method),
              plain_workers.workers_bound_libraries(self, method)):
            try:
                return stock_get_iterator(self)
            except (EOFError, ConnectionError) as exc:
                if method != warm_start.FORKSERVER:
                    raise
                # The forkserver was killed (a machine fault): multiprocessing starts a new one.
                log.warning("swift_safe_media: the warm forkserver is gone (%r), a machine fault; starting "
                            "the workers from a new one", exc)
                return stock_get_iterator(self)

    DataLoader._get_iterator = _get_iterator
