"""A DataLoader worker forked from the warm forkserver watches the trainer, not the
forkserver.

torch's worker loop ends when its ``ManagerWatchdog`` sees the worker's parent change
(``os.getppid()``): under spawn that parent is the trainer, but a worker forked from the
warm forkserver has the forkserver as its parent. Killed from outside (an operator, the
OOM killer), the forkserver would take every worker of the epoch with it, and torch
would end the run ("DataLoader worker ... exited unexpectedly"). In the processes the
forkserver forks, the watchdog watches the trainer that started it
(``SWIFT_SAFE_MEDIA_FORKSERVER_PARENT``) through a pidfd, so the workers go on; the next
epoch's workers come from a new forkserver (multiprocessing starts one)."""

from __future__ import annotations

import os
import select
import sys

from .. import config


class TrainerWatchdog:
    """torch's ``ManagerWatchdog``, watching the trainer through a pidfd."""

    trainer = 0

    def __init__(self) -> None:
        self.manager_pid = self.trainer
        self.manager_dead = False
        try:
            self._pidfd = os.pidfd_open(self.trainer)
        except OSError:  # gone already
            self._pidfd, self.manager_dead = -1, True

    def is_alive(self) -> bool:
        if not self.manager_dead:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            self.manager_dead = bool(poller.poll(0))  # readable: it exited
        return not self.manager_dead


def watch_the_trainer() -> None:
    """In a process just forked from the warm forkserver (fails open)."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    trainer = config.get(config.FORKSERVER_PARENT)
    if worker is None or not trainer or not hasattr(os, "pidfd_open") or not hasattr(worker, "ManagerWatchdog"):
        return
    TrainerWatchdog.trainer = trainer
    worker.ManagerWatchdog = TrainerWatchdog
