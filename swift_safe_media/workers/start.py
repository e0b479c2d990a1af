"""What happens as a DataLoader starts its workers, while protection is on: one patch of
torch's ``DataLoader._get_iterator`` that

1. decides how the workers start, once, and writes it to the loader once
   (:mod:`.start_method`: the host's preference, the user's choice, the configured
   method, and the checks that keep workers from hanging or inheriting threads);
2. prepares the workers for that method: workers forked from the warm forkserver adopt
   their parent's environment as it is now, not as it was when the forkserver started
   (:mod:`.forkserver`); workers that do not fork bound the media libraries as they
   start (:mod:`.plain`).

It fails open: a decision that raises never stops the DataLoader.
"""

from __future__ import annotations

import functools
import logging

from .. import config
from . import plain as plain_workers, forkserver as warm_start, start_method
from ..patching import import_hooks as _imports

log = logging.getLogger("swift_safe_media")

DATALOADER_MODULE = "torch.utils.data.dataloader"

_installed = False


def install() -> None:
    """Check every DataLoader of this process before it starts workers (now, or once
    torch's DataLoader is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    _imports.when_imported(DATALOADER_MODULE, _patch_dataloader)


def _patch_dataloader(module) -> None:
    DataLoader = module.DataLoader
    stock_get_iterator = DataLoader._get_iterator

    @functools.wraps(stock_get_iterator)
    def _get_iterator(self):
        method = None
        try:
            if config.enabled_by_environment() and self.num_workers > 0:
                decision = start_method.decide(start_method.StartInputs(self))
                start_method.apply(self, decision)
                method = decision.method
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
