"""What happens as a DataLoader starts its workers, while protection is on: one patch of
torch's ``DataLoader._get_iterator`` (a row of :mod:`..patching.torch_dataloader`'s
table, restored by ``disable()``) that

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

import logging

from .. import config
from . import decode_deadline, loaded_ahead, hold_ahead, plain as plain_workers, forkserver as warm_start, reduced_once, start_method
from ..patching import torch_dataloader

log = logging.getLogger("swift_safe_media")

def install() -> None:
    """Decide how the workers of every DataLoader of this process start (from now, or
    once torch's DataLoader is imported), through the table of torch's targets."""
    torch_dataloader.patch("worker start")
    torch_dataloader.patch("held arguments")
    loaded_ahead.install()
    plain_workers.patch_workers_tasks()  # here too: a forked worker keeps its parent's patches


def uninstall() -> None:
    """DataLoader's ``_get_iterator`` is torch's own again, the openers stock."""
    from ..patching import media_openers

    torch_dataloader.unpatch("worker start")
    torch_dataloader.unpatch("held arguments")
    loaded_ahead.uninstall()
    torch_dataloader.unpatch("decode deadline")
    torch_dataloader.unpatch("typed errors")
    media_openers.disable()


def get_iterator_deciding_start(stock_get_iterator, self):
    """``DataLoader._get_iterator``: decide how the workers start, prepare them, start them
    (a tokenizer the check and the workers' arguments pickle is reduced once: :mod:`.reduced_once`)."""
    with reduced_once.reduced_once():
        return _deciding_start(stock_get_iterator, self)


def _deciding_start(stock_get_iterator, self):
    method, inputs = None, start_method.StartInputs(self)
    try:
        if config.enabled_by_environment() and self.num_workers > 0:
            decision = start_method.decide(inputs)
            start_method.apply(self, decision)
            method = decision.method
            decode_deadline.prepare_folder()  # before the workers start: they find it in the environment
    except Exception:  # a check must never stop the DataLoader itself
        log.debug("swift_safe_media: worker start checks skipped", exc_info=True)
    with (hold_ahead.used_by_launches(inputs, method),  # before the environment's wrapper of worker_init_fn
          warm_start.workers_see_current_environment(self, method),
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
