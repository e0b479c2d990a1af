"""Child program for tests/test_damaged_media.py: how much a loader call grows the
caller's memory (peak RSS, from /proc), next to the size of what it returned.

    python -m tests.caller_memory WARMUP_CLIP LOADER:CLIP[:RESULT_CAP_MB] ...

Prints one JSON line per job: {"job", "growth_mb", "result_mb", "error"}. A warm-up call
of each loader on a small clip loads the libraries and starts the sandbox first, so each
growth is the call's own.
"""

import gc
import json
import os
import sys

LOADERS = {
    "valley": lambda path: __import__("swift_safe_media.decoders", fromlist=["x"]).load_video_valley(path),
    "internvl14": lambda path: __import__("swift_safe_media.decoders", fromlist=["x"]).load_video_internvl(
        path, num_segments=14),
    "fetch_video": lambda path: __import__("swift_safe_media.decoders", fromlist=["x"]).fetch_video({"video": path}),
}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def held_bytes(result) -> int:
    """Bytes the caller holds in `result`: arrays and tensors by size, PIL RGB images at
    Pillow's 4 bytes per pixel."""
    if isinstance(result, (list, tuple)):
        return sum(held_bytes(item) for item in result)
    if hasattr(result, "getbands"):
        return result.size[0] * result.size[1] * 4
    if hasattr(result, "element_size"):
        return result.element_size() * result.nelement()
    return getattr(result, "nbytes", 0)


def touch(result) -> None:
    """Read every byte, as training would: pages shared with the sandbox count once read."""
    import numpy as np

    if isinstance(result, (list, tuple)):
        for item in result:
            touch(item)
    elif hasattr(result, "getbands"):
        result.getextrema()
    elif hasattr(result, "numpy"):
        float(result.sum())
    elif isinstance(result, np.ndarray):
        float(result.sum(dtype=np.float64))


def measure(loader: str, clip: str, result_cap_mb: str | None) -> dict:
    from swift_safe_media import MediaDecodeError

    if result_cap_mb:
        os.environ["SWIFT_SAFE_MEDIA_MAX_RESULT_MB"] = result_cap_mb
    else:
        os.environ.pop("SWIFT_SAFE_MEDIA_MAX_RESULT_MB", None)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _status("VmRSS")
    result, error = None, None
    try:
        result = LOADERS[loader](clip)
        touch(result)
    except MediaDecodeError as exc:
        error = str(exc)
    growth = _status("VmHWM") - before
    return {"growth_mb": growth / 2**20, "result_mb": held_bytes(result) / 2**20, "error": error}


def main(warmup: str, jobs) -> None:
    """Each job is LOADER:CLIP or LOADER:CLIP:RESULT_CAP_MB, measured in turn."""
    for loader in {job.split(":")[0] for job in jobs}:
        LOADERS[loader](warmup)
    for job in jobs:
        loader, clip, *cap = job.split(":")
        print(json.dumps({"job": job, **measure(loader, clip, cap[0] if cap else None)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
