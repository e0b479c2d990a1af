"""Settings. The environment is the single source of truth: flags write into it,
so spawned DataLoader workers and sandboxes inherit the same values."""

from __future__ import annotations

import os

TIMEOUT = "SWIFT_SAFE_MEDIA_TIMEOUT"
MAX_MEMORY_MB = "SWIFT_SAFE_MEDIA_MAX_MEMORY_MB"
THREADS = "SWIFT_SAFE_MEDIA_THREADS"
PRELOAD = "SWIFT_SAFE_MEDIA_PRELOAD"
SANDBOXES = "SWIFT_SAFE_MEDIA_SANDBOXES"
START_TIMEOUT = "SWIFT_SAFE_MEDIA_START_TIMEOUT"
MP_CONTEXT = "SWIFT_SAFE_MEDIA_MP_CONTEXT"
STALL_TIMEOUT = "SWIFT_SAFE_MEDIA_STALL_TIMEOUT"
STALL_ACTION = "SWIFT_SAFE_MEDIA_STALL_ACTION"
QUARANTINE = "SWIFT_SAFE_MEDIA_QUARANTINE"  # set but empty: quarantine off

MP_CONTEXTS = ("spawn", "forkserver", "fork", "default")

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 180.0
DEFAULT_PRELOAD = "numpy,PIL.Image,torch,torchcodec.decoders,swift_safe_media.decoders"
# Libraries that size thread pools from these variables at import time.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "OPENCV_FOR_THREADS_NUM")


def _number(name: str, default, kind=float, minimum=None):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


def timeout() -> float:
    return _number(TIMEOUT, DEFAULT_TIMEOUT_S, float, minimum=0.001)


def start_timeout() -> float:
    return _number(START_TIMEOUT, DEFAULT_START_TIMEOUT_S, float, minimum=1.0)


def default_max_memory_mb() -> int:
    """A quarter of physical memory, between 2 GiB and 32 GiB: room for any sane clip,
    far from what takes the training host down."""
    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    return int(min(max(total_mb // 4, 2048), 32768))


def max_memory_mb() -> int:
    """Address space a sandbox may add above its preloaded baseline; 0 means no cap."""
    if not os.environ.get(MAX_MEMORY_MB, "").strip():
        return default_max_memory_mb()
    return _number(MAX_MEMORY_MB, 0, int, minimum=0)


def decoder_threads() -> int:
    return _number(THREADS, 1, int, minimum=1)


def max_sandboxes() -> int:
    return _number(SANDBOXES, 1, int, minimum=1)


def preload_modules() -> list[str]:
    raw = os.environ.get(PRELOAD, DEFAULT_PRELOAD)
    return [name.strip() for name in raw.split(",") if name.strip()]


def mp_context() -> str:
    """Start method for DataLoader workers; "default" leaves the host's choice alone."""
    value = os.environ.get(MP_CONTEXT, "").strip().lower() or "spawn"
    if value not in MP_CONTEXTS:
        raise ValueError(f"{MP_CONTEXT}={value!r} must be one of {', '.join(MP_CONTEXTS)}")
    return value


_WRITABLE = {"timeout": TIMEOUT, "max_memory_mb": MAX_MEMORY_MB, "mp_context": MP_CONTEXT,
             "stall_timeout": STALL_TIMEOUT, "stall_action": STALL_ACTION, "quarantine": QUARANTINE}


def write(**settings) -> None:
    """Write settings given explicitly (flags, ``enable(...)``) over the environment."""
    for key, value in settings.items():
        if value is None:
            continue
        if key == "quarantine" and str(value):
            value = os.path.abspath(os.path.expanduser(os.fspath(value)))  # workers may change directory
        os.environ[_WRITABLE[key]] = str(value)
    validate()


def validate() -> None:
    """Raise ValueError naming the variable if any setting is malformed."""
    timeout(), max_memory_mb(), mp_context(), decoder_threads(), max_sandboxes()
    stall_timeout(), stall_action()


def stall_timeout() -> float:
    """Seconds without a batch before the watchdog reports; 0: off."""
    return _number(STALL_TIMEOUT, 0.0, float, minimum=0.0)


def stall_action() -> str:
    action = os.environ.get(STALL_ACTION, "").strip().lower() or "log"
    if action not in ("log", "abort"):
        raise ValueError(f"{STALL_ACTION}={action!r} must be 'log' or 'abort'")
    return action
