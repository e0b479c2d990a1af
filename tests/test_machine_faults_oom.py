"""A real OOM kill (issue 35): a trainer in a memory cgroup of its own fills it, the kernel's
OOM killer strikes during a decode of a valid clip, and the sample is not lost. The sandbox
is the OOM killer's first choice (``oom_score_adj`` 1000), not the trainer that holds far
more memory; the log names the OOM killer; the decode is retried in a fresh sandbox once the
pressure has passed and gives the frames it gave before; nothing enters the registry.

Needs a cgroup v1 memory hierarchy this process may create a group in (root, as training
containers run); skipped elsewhere, saying why."""

import json
import os
import time

import pytest

from swift_safe_media import quarantine

from .fresh import clean_environment, run_python
from .swift_scenario import _ffmpeg

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]  # it fills memory: alone
LIMIT = 2 << 30  # the trainer's cgroup: room for it, its zygote and the ballast
HEADROOM_MB = 24  # less than a sandbox needs to decode the clip


def _own_memory_cgroup() -> str | None:
    with open("/proc/self/cgroup") as cgroups:
        for line in cgroups:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                folder = f"/sys/fs/cgroup/memory{path}"
                return folder if os.path.isfile(os.path.join(folder, "memory.oom_control")) else None
    return None


@pytest.fixture
def cgroup(tmp_path):
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy here (the v2 counters are read the same way, by faults.oom_kills)")
    folder = os.path.join(parent, f"ssm-oom-test-{os.getpid()}")
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as limit:
            limit.write(str(LIMIT))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    yield folder
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.rmdir(folder)
            break
        except OSError:  # its last processes are still exiting
            time.sleep(0.2)


def test_the_oom_killer_takes_the_sandbox_and_the_decode_is_retried_not_lost(cgroup, tmp_path):
    clip = str(tmp_path / "valid_1080p.mp4")
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=1920x1080:rate=30:duration=3", "-c:v", "libx264", "-preset",
            "ultrafast", "-pix_fmt", "yuv420p", clip)
    registry = tmp_path / "q" / "quarantine.jsonl"
    env = {**clean_environment(), "SWIFT_SAFE_MEDIA_QUARANTINE": str(registry)}
    # The trainer joins the cgroup before Python starts, so that all it and its children hold is counted there.
    code = ("import os, sys, runpy; open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid())); "
            "runpy.run_module('tests.programs.oom_pressure', run_name='__main__')")
    done = run_python(code=code, args=(cgroup, clip, HEADROOM_MB), env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]  # the trainer was not the victim
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    print(outcome, done.stderr[-1500:])
    assert outcome["oom_kills"] >= 1, "the pressure never made the OOM killer strike: the test proves nothing"
    assert outcome.get("identical") is True, outcome
    assert f"{clip}: sandbox pid" in done.stderr and "the OOM killer" in done.stderr, done.stderr[-3000:]
    assert "trying again in a fresh sandbox" in done.stderr
    assert not registry.exists() or quarantine.Registry(str(registry)).current() == []
