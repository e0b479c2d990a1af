"""DataLoader workers SIGKILLed from outside (issue 35): a map-style dataset's worker is
replaced and its outstanding tasks sent again, so the epoch gives the batches, in the
order, of an undisturbed one; an IterableDataset keeps torch's rule; the bound holds;
``disable()`` gives torch its own iterator back."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import wait_until_dead
from .fresh import ROOT, clean_environment, run_python


def killed_workers_run(*args, **settings) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-m", "tests.programs.worker_killed", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,  # under pytest-timeout's 300 s: a hang fails this test alone
                          env=clean_environment({"PYTHONPATH": ROOT, **settings}, warm_start=args[0] == "forkserver"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def assert_nothing_left(result: dict) -> None:
    pids = [kill["pid"] for kill in result["disturbed"]["killed"]] + result["disturbed"]["pids"]
    assert wait_until_dead(pids, within=10) == {}


# "sent": each worker is killed once its results are in the queue, unread (their tensors'
# file descriptors, fetched from the sender as a result is read, go with it).
# "holding_lock": each worker is killed holding the lock of the result queue all workers share
# (as one killed in the middle of sending a result is; it happened about one run in ten of the
# plain "fork" case): before the lock was released, the other workers' results waited on it for
# ever and so did the epoch.
@pytest.mark.parametrize("options", [("fork", "map"), ("forkserver", "map"), ("fork", "map", "persistent", "pin"),
                                     ("fork", "map", "sent"), ("forkserver", "map", "pin", "sent"),
                                     ("fork", "map", "holding_lock"), ("forkserver", "map", "pin", "holding_lock")],
                         ids=["fork", "forkserver", "fork-persistent-pin-thread", "fork-results-sent",
                              "forkserver-pin-thread-results-sent", "fork-killed-holding-the-result-lock",
                              "forkserver-pin-thread-killed-holding-the-result-lock"])
def test_killed_workers_are_replaced_and_the_epoch_keeps_its_batches_and_order(options):
    result, err = killed_workers_run(*options)
    undisturbed, disturbed = result["undisturbed"], result["disturbed"]
    assert disturbed["error"] is None, err[-3000:]
    assert [kill["outstanding"] > 0 for kill in disturbed["killed"]] == [True, True], disturbed["killed"]
    assert disturbed["batches"] == undisturbed["batches"]  # same samples, same order, none substituted
    assert len(disturbed["batches"]) == 12 and sorted(row[0] for batch in disturbed["batches"] for row in batch) \
        == list(range(24))
    assert err.count("a machine fault, not the data's; replaced by pid") == 2, err[-3000:]
    assert "samples sent to it again" in err
    assert not set(disturbed["pids"]) & {kill["pid"] for kill in disturbed["killed"]}
    assert result["summary"]["workers_replaced"] == 2
    assert disturbed["pin_thread"] == ("pin" in options)
    if "holding_lock" in options:
        assert err.count("had left the lock of the workers' result queue held") == 2, err[-3000:]
    assert_nothing_left(result)


def test_an_iterable_datasets_killed_worker_keeps_torchs_rule():
    result, err = killed_workers_run("fork", "iterable")
    assert result["disturbed"]["error"] and "DataLoader worker" in result["disturbed"]["error"], result
    assert "cannot resume an IterableDataset's stream" in err, err[-3000:]
    assert "replaced by pid" not in err
    assert_nothing_left(result)


def test_past_the_bound_torchs_error_stands_with_a_line_naming_it():
    result, err = killed_workers_run("fork", "map", SWIFT_SAFE_MEDIA_WORKER_RESTARTS="1")
    disturbed = result["disturbed"]
    assert disturbed["error"] and "DataLoader worker" in disturbed["error"], disturbed
    assert err.count("replaced by pid") == 1
    assert "all that SWIFT_SAFE_MEDIA_WORKER_RESTARTS allows" in err, err[-3000:]
    assert len(disturbed["batches"]) < 12
    assert_nothing_left(result)


def test_disable_gives_torch_its_own_dataloader_iterator_back():
    code = """
import torch, torch.utils.data.dataloader as d
from torch.utils.data._utils import signal_handling
import swift_safe_media
stock = (d._MultiProcessingDataLoaderIter._try_get_data, d._MultiProcessingDataLoaderIter._reset,
         signal_handling._error_if_any_worker_fails)
swift_safe_media.enable()
patched = (d._MultiProcessingDataLoaderIter._try_get_data, d._MultiProcessingDataLoaderIter._reset,
           signal_handling._error_if_any_worker_fails)
swift_safe_media.disable()
after = (d._MultiProcessingDataLoaderIter._try_get_data, d._MultiProcessingDataLoaderIter._reset,
         signal_handling._error_if_any_worker_fails)
assert all(a is not b for a, b in zip(stock, patched)), patched
assert all(a is b for a, b in zip(stock, after)), after
assert signal_handling._error_if_any_worker_fails is torch._C._error_if_any_worker_fails
print("ok")
"""
    done = run_python(code=code, env=clean_environment({"PYTHONPATH": ROOT}))
    assert done.stdout.strip().endswith("ok")
