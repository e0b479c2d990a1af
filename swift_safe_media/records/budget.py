"""Error budget for skip-and-substitute: skipping a bad sample is fine, training on
nothing is not. After too many consecutive failures, or too large a share of failures,
the run stops with an error that says which limit was hit and what failed last.

Counted per process (each DataLoader worker keeps its own budget).
"""

from __future__ import annotations

import os

from .. import config, process
from ..config import MAX_CONSECUTIVE_FAILURES, MAX_FAILURE_FRACTION

DEFAULT_MAX_CONSECUTIVE = config.SETTINGS[MAX_CONSECUTIVE_FAILURES].default  # Megatron-Energon's default
DEFAULT_MAX_FRACTION = config.SETTINGS[MAX_FAILURE_FRACTION].default
# The fraction is judged only after this many samples: two failures in the first ten
# samples say little about a dataset.
MIN_SAMPLES_FOR_FRACTION = 100


class ErrorBudgetExceeded(RuntimeError):
    """Too many samples failed to decode; training stops instead of skipping on."""


class ErrorBudget:
    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE,
                 max_fraction: float = DEFAULT_MAX_FRACTION,
                 min_samples_for_fraction: int = MIN_SAMPLES_FOR_FRACTION):
        self.max_consecutive = max_consecutive  # 0: no limit
        self.max_fraction = max_fraction  # 1.0: no limit
        self.min_samples_for_fraction = min_samples_for_fraction
        self.samples = self.failures = self.consecutive = 0

    @classmethod
    def from_environment(cls) -> "ErrorBudget":
        return cls(config.get(MAX_CONSECUTIVE_FAILURES), config.get(MAX_FAILURE_FRACTION))

    def success(self) -> None:
        self.samples += 1
        self.consecutive = 0

    def failure(self, what: str) -> None:
        """Count one failed sample; raise ErrorBudgetExceeded if a limit is now passed."""
        self.samples += 1
        self.failures += 1
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise ErrorBudgetExceeded(
                f"swift_safe_media: {self.consecutive} consecutive samples failed to decode "
                f"(limit {self.max_consecutive}, {MAX_CONSECUTIVE_FAILURES}) in process {os.getpid()}; "
                f"stopping instead of training on substitutes. Last failure: {what}")
        fraction = self.failures / self.samples
        if self.samples >= self.min_samples_for_fraction and fraction > self.max_fraction:
            raise ErrorBudgetExceeded(
                f"swift_safe_media: {self.failures} of {self.samples} samples ({fraction:.1%}) failed "
                f"to decode (limit {self.max_fraction:.1%}, {MAX_FAILURE_FRACTION}) in process "
                f"{os.getpid()}; stopping instead of training on substitutes. Last failure: {what}")


def process_budget() -> ErrorBudget:
    """This process's budget, from the environment (a forked worker starts its own count)."""
    state = process.current()
    if state.budget is None:
        state.budget = ErrorBudget.from_environment()
    return state.budget
