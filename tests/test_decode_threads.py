"""The decode thread budget: without SWIFT_SAFE_MEDIA_THREADS, each sandbox gets the
node's usable cores divided by the processes decoding on it (the DataLoader workers of
every local rank, or the caller itself), at least one; its FFmpeg and torch threads
follow, while the zygote stays single-threaded. A real DataLoader, real zygotes and sandboxes, in a fresh interpreter."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from swift_safe_media import config

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import swift_safe_media
    from swift_safe_media import call, config
    from torch.utils.data import DataLoader, Dataset
    from tests import sandboxed

    class Ask(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, index):
            return json.dumps(call(sandboxed.decode_threads))

    def fresh(**env):
        swift_safe_media.shutdown()  # the next call starts a zygote that reads the budget anew
        os.environ.update(env)
        return call(sandboxed.decode_threads)

    if __name__ == "__main__":
        found = {"cores": config.usable_cores(), "alone": call(sandboxed.decode_threads)}
        zygote = swift_safe_media.engine.get_engine()._zygote.process.pid
        found["zygote_threads"] = len(os.listdir(f"/proc/{zygote}/task"))  # still safe to fork
        loader = DataLoader(Ask(), batch_size=None, num_workers=2, multiprocessing_context="fork")
        found["workers"] = [json.loads(item) for item in loader]
        found["two_ranks"] = fresh(LOCAL_WORLD_SIZE="2")
        found["explicit"] = fresh(SWIFT_SAFE_MEDIA_THREADS="3")
        print(json.dumps(found))
""")


@pytest.mark.timeout(300)
def test_threads_default_to_the_cores_shared_among_decoding_processes(tmp_path):
    script = tmp_path / "ask.py"
    script.write_text(PROGRAM)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SWIFT_SAFE_MEDIA") and key != "LOCAL_WORLD_SIZE"}
    env[config.PRELOAD] = "torch"
    done = subprocess.run([sys.executable, str(script), ROOT], capture_output=True, text=True, env=env,
                          timeout=280, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
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
