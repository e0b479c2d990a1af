"""A DataLoader worker's first sandbox is forked while the worker unpickles its arguments
(workers/first_sandbox.py), with what the worker's first decode would ask for: the
trainer's environment and the worker's thread budget. Real workers from the warm
forkserver, a real shared zygote; when each sandbox started is read from /proc."""

from __future__ import annotations

import json

import pytest

from .fresh import clean_environment, run_python

MARGIN_S = 0.2  # the dataset takes 0.5 s to unpickle; /proc counts in hundredths


def _run(case: str, env: dict | None = None) -> list[dict]:
    done = run_python(module="tests.programs.first_sandbox", args=[case],
                      env=clean_environment(env, warm_start=True), timeout=240)
    items = json.loads(done.stdout.strip().splitlines()[-1])["items"]
    assert sorted(item["index"] for item in items) == [0, 1, 2, 3]
    assert len({item["worker"] for item in items}) == 2
    return items


def _first_of_each_worker(items) -> list[dict]:
    firsts = {}
    for item in sorted(items, key=lambda item: item["index"]):
        firsts.setdefault(item["worker"], item)
    return list(firsts.values())


@pytest.mark.timeout(300)
def test_a_workers_first_sandbox_is_forked_while_it_unpickles():
    # A worker that unpickles its dataset itself: no holding server unpickles it ahead (workers.held_arguments).
    items = _run("plain", {"SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD": "0"})
    for item in _first_of_each_worker(items):
        # started before the worker had its dataset, and it served the worker's first call
        assert item["sandbox_started_at"] < item["unpickled_at"] - MARGIN_S, item
        # with what a sandbox asked for at that call would have: the trainer's late variable
        # and the worker's thread budget (1 of 2 cores' worth per worker here, not the 2 a
        # process outside a DataLoader gets)
        assert item["sandbox"]["late"] == "set after enable()", item
        assert item["sandbox"]["threads"] == str(item["worker_threads"]), item
    # one sandbox per worker: the first one served every call of its worker
    assert len({item["sandbox"]["pid"] for item in items}) == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, env", [("plain", {"SWIFT_SAFE_MEDIA_WORKER_FIRST_SANDBOX": "0"}),
                                       ("nothing_decoded_here", None)])
def test_the_first_decode_asks_switched_off_or_with_no_host_and_no_decode_in_the_trainer(case, env):
    """No host enabled and nothing decoded in the trainer: a script's own loader, whose
    workers may never call a sandbox, gets none ahead."""
    for item in _first_of_each_worker(_run(case, env)):
        assert item["sandbox_started_at"] > item["unpickled_at"] - 0.02, item
        assert item["sandbox"]["late"] == "set after enable()", item


@pytest.mark.timeout(300)
def test_a_sandbox_asked_for_before_the_environment_changed_is_not_used():
    """The worker_init_fn sets a variable the sandboxes keep: the sandbox asked for before
    it would decode without it, so the first call gets a new one that has it."""
    items = _run("init_changes")
    for item in _first_of_each_worker(items):
        assert item["sandbox"]["init"] == "set by worker_init_fn", item
        assert item["sandbox_started_at"] > item["unpickled_at"] - 0.02, item
    assert all(item["sandbox"]["init"] == "set by worker_init_fn" for item in items)
