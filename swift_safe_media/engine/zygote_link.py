"""This process's one way to a zygote, shared by all its pools.

A process has a pool per kind of sandbox (confined, unconfined, one per call, a
download's). They all fork from one zygote: the rank's shared one when there is one,
else one this process starts on its first call. Before, each pool started its own, so a
pool of a new kind (a download's first hop, say) waited seconds for a zygote of its own,
and each cost one more process full of imports. A confined zygote forks every kind (the
confinement is applied in each sandbox, not in the zygote); one that confines none serves
no confined sandbox, so the link is chosen by ``SWIFT_SAFE_MEDIA_CONFINE``.

The control connection takes one request at a time: callers hold :attr:`ZygoteLink.lock`
around each. Every sandbox keeps the zygote it came from (``SandboxHandle.origin``), so a
pool never asks a new zygote to reap a sandbox of the old one.
"""

from __future__ import annotations

import logging
import threading

from .. import config, process
from .shared_zygote import shared_address
from .zygote import Zygote

log = logging.getLogger("swift_safe_media")


class ZygoteLink:
    def __init__(self, confined: bool):
        self.confined = confined
        self.lock = threading.Lock()
        self.zygote: Zygote | None = None
        self._shared_failed = False  # the rank's shared zygote failed us: use our own from now on

    def current(self) -> Zygote:
        """The zygote, opened (or opened again, after it died) here; call with the lock held."""
        if self.zygote is None or not self.zygote.is_alive():
            self.drop()
            self.zygote = self._open()
        return self.zygote

    def serves(self, zygote) -> bool:
        """Whether a sandbox that came from ``zygote`` is still this link's and alive."""
        return zygote is not None and zygote is self.zygote and zygote.is_alive()

    def _open(self) -> Zygote:
        address = None if self._shared_failed else shared_address(self.confined)
        if address is not None:
            try:
                return Zygote.connect(address)
            except OSError as exc:
                self.shared_unusable(exc)
        return Zygote(config.start_timeout(), self.confined)

    def shared_unusable(self, exc) -> None:
        self._shared_failed = True
        log.warning("swift_safe_media: the shared zygote is not answering (%s); this process "
                    "starts its own", exc)

    def drop(self, wait: float = 0.5) -> None:
        """Close the zygote (its sandboxes die with the connection); call with the lock held."""
        if self.zygote is not None:
            self.zygote.close(wait=wait)
            self.zygote = None

    def close(self) -> None:
        with self.lock:
            self.drop(wait=2.0)

    def abandon(self) -> None:
        """In a forked child: the zygote is the parent's; drop our copies only."""
        if self.zygote is not None:
            self.zygote.abandon()
            self.zygote = None


def for_this_process() -> ZygoteLink:
    """The link this process's pools share (see the module's text)."""
    state = process.current()
    confined = config.confine()
    with state.engine_lock:
        link = state.zygote_links.get(confined)
        if link is None:
            link = state.zygote_links[confined] = ZygoteLink(confined)
    return link
