"""The decode thread budget: without SWIFT_SAFE_MEDIA_THREADS, each sandbox gets the
node's usable cores divided by the processes decoding on it (the DataLoader workers of
every local rank, or the caller itself), at least one; its FFmpeg and torch threads
follow, while the zygote stays single-threaded. A real DataLoader, real zygotes and sandboxes, in a fresh interpreter."""

import json
import os

import pytest

from swift_safe_media import config

from .fresh import clean_environment, run_python

pytest.importorskip("torch")


@pytest.mark.timeout(300)
def test_threads_default_to_the_cores_shared_among_decoding_processes():
    env = clean_environment()
    env.pop("LOCAL_WORLD_SIZE", None)
    env[config.PRELOAD] = "torch"
    done = run_python(module="tests.programs.decode_threads", env=env, timeout=280)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    cores = found["cores"]
    assert 1 <= cores <= len(os.sched_getaffinity(0))

    def threads(count):  # OpenMP's variable stays 1: the zygote imported with it; torch's pool follows the budget
        return {"threads": count, "omp": "1", "torch": count}

    assert found["alone"] == threads(cores)  # one decoding process: every core, as stock decoders use
    assert found["workers"] == [threads(max(1, cores // 2))] * 2
    assert found["two_ranks"] == threads(max(1, cores // 2))
    assert found["explicit"] == threads(3)  # the setting wins
    assert found["zygote_threads"] == 1 and "starting sandboxes by exec" not in done.stderr
