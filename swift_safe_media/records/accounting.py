"""What is counted around each decode of ``call`` / ``call_each``: the quarantine check
before it and the record after a failure, the in-flight marker the stall watchdog
reads while it runs, and the run statistics (outcome and latency) after it."""

from __future__ import annotations

import time

from . import quarantine, summary, watchdog
from ..errors import MACHINE, MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout, MediaQuarantined

FAILURE_KINDS = {MediaDecodeTimeout: "timeout", MediaDecodeCrash: "crash"}


class Accounting:
    """One per ``call`` (or ``call_each`` batch); ``begin``/``end`` bracket each decode."""

    def __init__(self, fn):
        self.fn = fn
        self.registry = quarantine.current()
        self.stats = summary.recorder()
        self.tracker = watchdog.in_flight()
        self.media, self.started, self.marker = None, None, ""

    def check(self, media) -> None:
        """Raise MediaQuarantined (and count it) if ``media`` failed before."""
        if self.registry is not None and media is not None:
            try:
                self.registry.check(media)
            except MediaQuarantined:
                if self.stats is not None:
                    self.stats.record(media, "quarantined", 0.0)
                raise

    def begin(self, media) -> None:
        self.media, self.started = media, time.monotonic()
        self.marker = self.tracker.begin(media, self.fn) if self.tracker is not None else ""

    def restart_clock(self) -> None:
        """Latency counts the decode, not the sandbox's start or setup before it."""
        self.started = time.monotonic()

    def forget(self) -> None:
        """Close the current step without counting it (the decode it prepares is counted)."""
        watchdog.InFlight.end(self.marker)
        self.marker, self.started = "", None

    def end(self, exc: BaseException | None = None, retried: bool = False) -> None:
        """Close the current decode: ok without ``exc``, else the failure ``exc`` (a machine
        fault: ``retried`` in a fresh sandbox, or the sample skipped; never quarantined)."""
        if self.started is None:
            return  # failed before it began (quarantined)
        watchdog.InFlight.end(self.marker)
        elapsed = time.monotonic() - self.started
        outcome = "ok"
        if isinstance(exc, MediaDecodeError) and exc.fault == MACHINE:
            outcome = "machine" if retried else "machine_skipped"
        elif exc is not None:
            outcome = FAILURE_KINDS.get(type(exc), "error")
            if isinstance(exc, MediaDecodeError) and self.registry is not None and self.media is not None:
                self.registry.record(self.media, outcome, exc.reason, exc.elapsed, ambiguous=exc.ambiguous)
        if self.stats is not None:
            self.stats.record(self.media, outcome, elapsed)
        self.marker, self.started = "", None
