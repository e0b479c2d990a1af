import pytest

from swift_safe_media.records.budget import ErrorBudget, ErrorBudgetExceeded


def test_consecutive_failures_stop_at_the_limit_and_successes_reset_the_count():
    budget = ErrorBudget(max_consecutive=3, max_fraction=1.0)
    budget.failure("a")
    budget.failure("b")
    budget.success()
    budget.failure("c")
    budget.failure("d")
    with pytest.raises(ErrorBudgetExceeded, match=r"3 consecutive samples .* Last failure: e"):
        budget.failure("e")


def test_failure_fraction_is_judged_after_enough_samples():
    budget = ErrorBudget(max_consecutive=0, max_fraction=0.25, min_samples_for_fraction=8)
    for _ in range(3):
        budget.failure("early")  # 100 % of 3 samples, too few to judge
    for _ in range(4):
        budget.success()
    with pytest.raises(ErrorBudgetExceeded, match=r"4 of 8 samples \(50.0%\)"):
        budget.failure("late")


def test_limits_come_from_the_environment(monkeypatch):
    assert (ErrorBudget.from_environment().max_consecutive, ErrorBudget.from_environment().max_fraction) == (100, 0.1)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES", "7")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION", "0.5")
    budget = ErrorBudget.from_environment()
    assert (budget.max_consecutive, budget.max_fraction) == (7, 0.5)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION", "2")
    with pytest.raises(ValueError, match="SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION"):
        ErrorBudget.from_environment()
