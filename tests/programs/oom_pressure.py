"""A trainer in a memory cgroup of its own, under memory pressure from itself, as a node
whose other jobs fill its memory: ``python -m tests.programs.oom_pressure CGROUP CLIP HEADROOM_MB``.

It decodes CLIP once (the reference; its zygote starts then, before the pressure, so that
it shares none of the ballast), fills the cgroup up to HEADROOM_MB below its limit with
ballast it touches, and decodes CLIP again: the sandbox needs more than the headroom, so the
kernel's OOM killer takes a process. The moment the cgroup's OOM-kill counter rises, the
ballast is freed (pressure that passes, as another job's peak does). Prints one JSON line:
whether the second decode gave the reference's frames, the kills the counter saw, and the
failure if there was one."""

import json
import os
import sys
import threading
import time


def _read(cgroup: str, name: str, key: str | None = None) -> int:
    with open(os.path.join(cgroup, name)) as f:
        if key is None:
            return int(f.read().split()[0])
        return next(int(line.split()[1]) for line in f if line.split()[0] == key)


def main() -> None:
    import numpy as np

    from swift_safe_media import MediaDecodeError, shutdown
    from swift_safe_media.decoders import load_video_internvl

    cgroup, clip, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3]) << 20
    reference = np.stack([np.asarray(frame) for frame in load_video_internvl(clip, num_segments=8)])
    kills_before = _read(cgroup, "memory.oom_control", "oom_kill")
    ballast = [np.ones(_read(cgroup, "memory.limit_in_bytes") - _read(cgroup, "memory.usage_in_bytes") - headroom,
                       dtype=np.uint8)]
    freed = threading.Event()

    def free_when_the_oom_killer_strikes():
        while not freed.is_set():
            if _read(cgroup, "memory.oom_control", "oom_kill") > kills_before:
                ballast.clear()
                freed.set()
            time.sleep(0.002)

    threading.Thread(target=free_when_the_oom_killer_strikes, daemon=True).start()
    outcome = {}
    try:
        frames = np.stack([np.asarray(frame) for frame in load_video_internvl(clip, num_segments=8)])
        outcome["identical"] = bool(np.array_equal(frames, reference))
    except MediaDecodeError as exc:
        outcome["failure"] = f"{type(exc).__name__}: {exc}"
    freed.set()
    outcome["oom_kills"] = _read(cgroup, "memory.oom_control", "oom_kill") - kills_before
    shutdown()
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
