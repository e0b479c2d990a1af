"""A worker's exit status read through its forkserver (``workers.liveness``), with a real
CPython forkserver that is stopped and resumed: the pidfd says a worker has ended before the
forkserver, which reaps it, has said how."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from swift_safe_media.workers import liveness


def exits_with(code: int) -> None:
    os._exit(code)


def sleeps() -> None:
    time.sleep(60)


@pytest.fixture
def context():
    context = multiprocessing.get_context("forkserver")
    context.Process(target=exits_with, args=(0,)).start()  # the forkserver runs from here on
    yield context


def forkserver_pid() -> int:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


@pytest.mark.timeout(60)
def test_a_join_waits_for_the_status_the_forkserver_says_after_the_worker_ended(context):
    worker = context.Process(target=exits_with, args=(7,))
    worker.start()
    liveness.outlives_its_forkserver(worker)
    server = forkserver_pid()
    os.kill(server, signal.SIGSTOP)  # it cannot reap the worker nor say its status
    try:
        resumed = threading.Timer(1.0, os.kill, (server, signal.SIGCONT))
        resumed.start()
        began = time.monotonic()
        worker.join(30)
        waited = time.monotonic() - began
    finally:
        os.kill(server, signal.SIGCONT)
    # The worker ended at once; its status came once the forkserver ran again, and join waited for it.
    assert worker.exitcode == 7 and not worker.is_alive()
    assert waited >= 0.9, waited


@pytest.mark.timeout(60)
def test_a_terminated_worker_reads_as_ended_by_that_signal_once_joined(context):
    worker = context.Process(target=sleeps)
    worker.start()
    liveness.outlives_its_forkserver(worker)
    worker.terminate()
    worker.join(30)
    assert worker.exitcode == -signal.SIGTERM
