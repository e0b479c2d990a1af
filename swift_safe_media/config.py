"""Settings: every ``SWIFT_SAFE_MEDIA*`` environment variable, declared once, read here.

The environment is the single source of truth and the channel to child processes:
flags and ``enable(...)`` write into it (:func:`write`), so spawned DataLoader workers,
a host's child processes and the sandboxes inherit the same values. Every other
module reads a setting through :func:`get` (or one of the accessors below), never
``os.environ`` itself, and writes one through :func:`put` / :func:`write`.
``enable()`` calls :func:`validate`, so a malformed value fails there, naming the
variable, and not later inside a worker.

Adding a setting is one entry in the registry below, next to its neighbours::

    CONFINE = _declare("SWIFT_SAFE_MEDIA_CONFINE", SWITCH, True,
                       "confine sandboxes (no network, no exec, no writes); false: off")

then read it with ``config.get(config.CONFINE)`` and add its row to the table of
``docs/settings.md`` (``tests/test_settings.py`` checks that the two agree). Kinds:
``FLOAT`` and ``INT`` (with ``minimum``, ``above`` or ``maximum``; an int may be
written ``1e9``), ``CHOICE`` (``choices``, case-insensitive), ``SWITCH`` (true/false
words, :data:`TRUE_WORDS` / :data:`FALSE_WORDS`), ``TEXT``, ``PATH`` (made absolute
when written: children may change directory) and ``LIST`` (comma-separated). For
numbers and choices an empty value means the default; for text, paths and lists only
an unset variable does (``SWIFT_SAFE_MEDIA_QUARANTINE=`` turns the registry off).
A ``default`` may be a function, called when the default is needed.
"""

from __future__ import annotations

import os
import sys

# The mechanism (what a setting is, parsing, reading and writing the environment) is
# settings_registry's; the settings themselves are declared here, once.
from .settings_registry import (  # noqa: F401  (this module is where callers find them)
    CHOICE, FALSE_WORDS, FLOAT, INT, LIST, PATH, SETTINGS, SWITCH, TEXT, TRUE_WORDS, Setting, get,
    is_set, origin, parse, put, restore, snapshot, validate, write)
from .settings_registry import declare as _declare


def default_max_memory_mb() -> int:
    """A quarter of physical memory, between 2 GiB and 32 GiB: room for any sane clip,
    far from what takes the training host down."""
    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    return int(min(max(total_mb // 4, 2048), 32768))


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, within a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def decoding_processes(workers: int | None = None) -> int:
    """Processes of this node that decode at once: the DataLoader workers of this rank (1,
    the caller itself, outside a worker; ``workers``: as a worker of a loader with that many
    counts) times the sandboxes each keeps times the local ranks (``LOCAL_WORLD_SIZE``, set
    by torchrun, ms-swift's launcher and accelerate)."""
    if workers is None:
        data = sys.modules.get("torch.utils.data")
        info = data.get_worker_info() if data is not None else None
        workers = info.num_workers if info is not None else 1
    workers = max(1, workers)
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # not ours: the launcher's
    except ValueError:
        ranks = 1
    return workers * max_sandboxes() * ranks


def decode_thread_budget(workers: int | None = None) -> int:
    """The node's usable cores shared among the processes decoding on it, at least 1: one
    clip on an idle machine decodes as fast as stock, a full DataLoader does not
    oversubscribe. The caller resolves it (only it knows its DataLoader) and hands the
    number to its zygote and sandboxes in ``SWIFT_SAFE_MEDIA_THREADS``."""
    return max(1, usable_cores() // decoding_processes(workers))


DEFAULT_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 180.0
DEFAULT_PRELOAD = "numpy,PIL.Image,torch,torchcodec.decoders,swift_safe_media.decoders"
MP_CONTEXTS = ("spawn", "forkserver", "fork", "default")
STALL_ACTIONS = ("log", "abort")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "NOTSET", "WARN", "FATAL")

# -- the registry ---------------------------------------------------------------------
# The switch.
ENABLED = _declare("SWIFT_SAFE_MEDIA", SWITCH, None,
                   "`1`: the start-up hook enables the host adapters in every process; `0`: forced off")
STARTUP_HOOK = _declare("SWIFT_SAFE_MEDIA_STARTUP_HOOK", SWITCH, True,
                        "`0`: the start-up hook (`swift_safe_media.pth`) does nothing at all")
# The engine.
TIMEOUT = _declare("SWIFT_SAFE_MEDIA_TIMEOUT", FLOAT, DEFAULT_TIMEOUT_S,
                   "seconds a call may run before its sandbox is killed", minimum=0.001)
TIMEOUT_CEILING = _declare("SWIFT_SAFE_MEDIA_TIMEOUT_CEILING", FLOAT, 5.0,
                           "most a call may run, as a multiple of its timeout, when time its sandbox "
                           "waited for a CPU is added to it", minimum=1.0)
MACHINE_RETRIES = _declare("SWIFT_SAFE_MEDIA_MACHINE_RETRIES", INT, 2,
                           "fresh sandboxes a call tries after a machine fault", minimum=0)
BOUND_OPENERS = _declare("SWIFT_SAFE_MEDIA_BOUND_OPENERS", SWITCH, True,
                         "a decode your own code makes in a DataLoader worker with decord, PyAV, OpenCV, "
                         "torchcodec, imageio or moviepy ends at the timeout (the worker is killed and replaced)")
WORKER_RESTARTS = _declare("SWIFT_SAFE_MEDIA_WORKER_RESTARTS", INT, 3,
                           "DataLoader workers killed from outside that a DataLoader iterator replaces",
                           minimum=0)
MAX_MEMORY_MB = _declare("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", INT, default_max_memory_mb,
                         "address space a sandbox may add; 0: no cap", minimum=0)
THREADS = _declare("SWIFT_SAFE_MEDIA_THREADS", INT, decode_thread_budget,
                   "FFmpeg and torch threads of a decode; default: usable cores / decoding processes "
                   "(DataLoader workers x sandboxes x `LOCAL_WORLD_SIZE`), at least 1", minimum=1)
SANDBOXES = _declare("SWIFT_SAFE_MEDIA_SANDBOXES", INT, 1, "sandboxes per calling process", minimum=1)
PRELOAD = _declare("SWIFT_SAFE_MEDIA_PRELOAD", LIST, DEFAULT_PRELOAD, "modules the zygote imports once")
ZYGOTE = _declare("SWIFT_SAFE_MEDIA_ZYGOTE", TEXT, None,
                  "the zygote this rank shares with its DataLoader workers: its kind and socket",
                  internal=True)
START_TIMEOUT = _declare("SWIFT_SAFE_MEDIA_START_TIMEOUT", FLOAT, DEFAULT_START_TIMEOUT_S,
                         "seconds the zygote may take to start", minimum=1.0)
# Confinement of the decode sandboxes (confine.py).
CONFINE = _declare("SWIFT_SAFE_MEDIA_CONFINE", SWITCH, True,
                   "`0`: decode sandboxes run unconfined (see Confinement)")
OPEN_BROKER = _declare("SWIFT_SAFE_MEDIA_OPEN_BROKER", SWITCH, True,
                       "code that opens its media by name (stock's loaders, LLaMA-Factory's readers) runs in a "
                       "pooled confined sandbox whose opens of the call's own files the caller answers "
                       "(Linux >= 5.14); `0`: a sandbox per call, confined for its files")
READ_ROOTS = _declare("SWIFT_SAFE_MEDIA_READ_ROOTS", TEXT, None,  # os.pathsep-separated, like PATH
                      "`os.pathsep`-separated folders a confined sandbox may read besides the media handed "
                      "to it and what the decoding libraries need")
SANDBOX_ENV = _declare("SWIFT_SAFE_MEDIA_SANDBOX_ENV", LIST, "",
                       "more environment variables zygote and sandboxes keep (they start from an allow-list: "
                       "locale, thread and FFmpeg variables, the hosts' decode settings; never the trainer's "
                       "tokens)")
REPLY_GLOBALS = _declare("SWIFT_SAFE_MEDIA_REPLY_GLOBALS", LIST, "",
                         "more globals a sandbox's reply may hold, `module:name` or `module:*` (every class and "
                         "function that module defines): types a `call()`ed function returns (see Confinement)")
CONFINE_WARNED = _declare("SWIFT_SAFE_MEDIA_CONFINE_WARNED", SWITCH, False,
                          "the log said once that a confinement layer is missing here", internal=True)
# DataLoader workers.
MP_CONTEXT = _declare("SWIFT_SAFE_MEDIA_MP_CONTEXT", CHOICE, "forkserver",
                      "DataLoader worker start method (`forkserver`: the warm one; `default`: the host's own)",
                      choices=MP_CONTEXTS)
WARM_START = _declare("SWIFT_SAFE_MEDIA_WARM_START", SWITCH, True,
                      "`enable()` starts the warm forkserver and the rank's shared zygote in the background; "
                      "`0`: each process starts its own zygote at its first decode")
FORKSERVER_FROM_TRAINER = _declare("SWIFT_SAFE_MEDIA_FORKSERVER_FROM_TRAINER", SWITCH, True,
                                   "the warm forkserver is forked from the trainer, sharing its torch, where "
                                   "protection is asked for while the trainer has one thread (see "
                                   "workers/forked_forkserver.py); `0`: started by exec")
FREEZE_TRAINER_OBJECTS = _declare("SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS", SWITCH, True,
                                  "where the warm forkserver is forked from the trainer, the trainer's "
                                  "objects alive at that fork are frozen (`gc.freeze()`), so that its "
                                  "collections leave the pages it shares with the forkserver's family "
                                  "unwritten; `0`: they are not")
WORKER_FIRST_SANDBOX = _declare("SWIFT_SAFE_MEDIA_WORKER_FIRST_SANDBOX", SWITCH, True,
                                "a DataLoader worker started from the warm forkserver asks for its first "
                                "sandbox as it begins, while it reads its dataset; `0`: at its first decode")
WORKER_ARGUMENTS_AHEAD = _declare("SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD", SWITCH, True,
                                  "a DataLoader's dataset and collate_fn are unpickled as it is made, once, by a "
                                  "process its workers from the warm forkserver fork from; `0`: each worker "
                                  "unpickles them as it starts")
LOADS_AHEAD = _declare("SWIFT_SAFE_MEDIA_LOADS_AHEAD", SWITCH, True,
                       "what transformers' `from_pretrained` loads (the first fast tokenizer, the model family's "
                       "modules) is unpickled and imported ahead by holding servers a loader's holding server "
                       "is then forked from; `0`: the loader's server does it all")
WORKER_PRELOAD = _declare("SWIFT_SAFE_MEDIA_WORKER_PRELOAD", LIST, "",
                          "more modules the warm forkserver imports for DataLoader workers")
# glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), so
# the frames and tensors a worker frees each sample stay in its heap: measured 150-250 MB
# more per LeRobot worker than with a fixed threshold (2026-11-23), and, since LeRobot's
# frames are recycled (held_memory), 100 MB more per LLaMA-Factory worker (docs/figures.md).
WORKER_MMAP_THRESHOLD_KB = _declare("SWIFT_SAFE_MEDIA_WORKER_MMAP_THRESHOLD_KB", INT, 1024,
                                    "processes forked from the warm forkserver (workers, zygote, sandboxes) "
                                    "map blocks of at least this many KiB and return them when freed "
                                    "(glibc `M_MMAP_THRESHOLD`); 0: glibc's sliding threshold",
                                    minimum=0, maximum=32 * 1024)
FORKSERVER_PRELOAD = _declare("SWIFT_SAFE_MEDIA_FORKSERVER_PRELOAD", LIST, "",
                              "what the warm forkserver imports", internal=True)
# Every forkserver or spawn child imports the main script before it runs; imported once in
# the forkserver, it is found there (CPython's own default preload is the main script). The
# shared zygote forked from the forkserver is prepared without it (warm_start): a zygote busy
# running an unguarded script's top level could not serve that script's first decode.
FORKSERVER_IMPORTS_MAIN = _declare("SWIFT_SAFE_MEDIA_FORKSERVER_IMPORTS_MAIN", SWITCH, True,
                                   "the warm forkserver imports the main script once, when its top level "
                                   "only imports and defines, so workers share it instead of each importing "
                                   "it; `0`: each worker imports it")
# Idle workers of a killed trainer notice only their own parent's death (torch checks
# getppid()); theirs is the forkserver, which must go with the trainer for them to go too.
FORKSERVER_PARENT = _declare("SWIFT_SAFE_MEDIA_FORKSERVER_PARENT", INT, 0,
                             "the trainer whose main thread started the warm forkserver: the forkserver "
                             "gets SIGKILL when it exits; 0: none", minimum=0, internal=True)
FORKSERVER_MAIN = _declare("SWIFT_SAFE_MEDIA_FORKSERVER_MAIN", TEXT, None,
                           "the main script the warm forkserver imports: `path:FILE` or `module:NAME`",
                           internal=True)
# Never silent: quarantine, watchdog, summary, error budget.
QUARANTINE = _declare("SWIFT_SAFE_MEDIA_QUARANTINE", PATH, None,
                      "quarantine registry (JSONL); unset or empty: off")
STALL_TIMEOUT = _declare("SWIFT_SAFE_MEDIA_STALL_TIMEOUT", FLOAT, 0.0,
                         "seconds without a batch before the watchdog reports; 0: off", minimum=0.0)
STALL_ACTION = _declare("SWIFT_SAFE_MEDIA_STALL_ACTION", CHOICE, "log",
                        "`abort`: exit 75 after the report", choices=STALL_ACTIONS)
STATS_DIR = _declare("SWIFT_SAFE_MEDIA_STATS_DIR", PATH, None,
                     "per-process decode statistics for the run summary (next to the registry)",
                     internal=True)
DEADLINE_DIR = _declare("SWIFT_SAFE_MEDIA_DEADLINE_DIR", PATH, None,
                        "where DataLoader workers mark the decodes the trainer ends at the timeout", internal=True)
INFLIGHT_DIR = _declare("SWIFT_SAFE_MEDIA_INFLIGHT_DIR", PATH, None,
                        "what each process decodes now, for the stall watchdog", internal=True)
SUMMARY_STEPS = _declare("SWIFT_SAFE_MEDIA_SUMMARY_STEPS", INT, 200,  # LeRobot's own log_freq default
                         "batches between run summaries where the host counts batches (LeRobot); "
                         "0: only at the end", minimum=0)
MAX_CONSECUTIVE_FAILURES = _declare("SWIFT_SAFE_MEDIA_MAX_CONSECUTIVE_FAILURES", INT, 100,
                                    "error budget: consecutive failed samples; 0: no limit", minimum=0)
MAX_FAILURE_FRACTION = _declare("SWIFT_SAFE_MEDIA_MAX_FAILURE_FRACTION", FLOAT, 0.1,
                                "error budget: failed share of samples, judged after 100",
                                minimum=0.0, maximum=1.0)
# Decoder caps.
MAX_PIXELS = _declare("SWIFT_SAFE_MEDIA_MAX_PIXELS", INT, 1_000_000_000,  # 3 GB as RGB uint8: ~480 1080p frames
                      "decoded pixels per call", above=0)
MAX_AUDIO_SECONDS = _declare("SWIFT_SAFE_MEDIA_MAX_AUDIO_SECONDS", FLOAT, 4 * 3600.0,  # 0.9 GB mono at 16 kHz
                             "decoded audio seconds per call", above=0)
MAX_URL_BYTES = _declare("SWIFT_SAFE_MEDIA_MAX_URL_BYTES", INT, 1 << 30, "bytes one URL may download", above=0)
# What one loader call may hand its caller, counted as the caller holds it. At least what
# the pixel cap admits as RGB uint8 (1e9 pixels, 2.8 GiB) and the largest tensor Qwen's
# fetch_video makes with its default budget (128k tokens of float32 frames, 2.0 GiB); it
# bounds everything else a call returns (PIL copies, upscaled float frames, audio).
MAX_RESULT_MB = _declare("SWIFT_SAFE_MEDIA_MAX_RESULT_MB", INT, 3072,
                         "bytes one loader call may hand its caller, as the caller holds them (PIL, float frames)",
                         above=0)
# A decompression bomb (8 frames of 8192x8192 FFV1 in 134 KB) stays under the caps above;
# no real recording decodes to thousands of times its size in the few frames or seconds a
# loader asks for. Checked from the header, before decoding, above a floor (decoders/guards.py).
MAX_EXPANSION = _declare("SWIFT_SAFE_MEDIA_MAX_EXPANSION", INT, 4096,
                         "decoded bytes (RGB frames, float32 samples) per byte of the input, above 256 MB; 0: no cap",
                         minimum=0)
# data: URIs and base64 strings are decoded in the caller, before any timeout applies:
# refused by their length before decoding (64 MiB decodes in a fraction of a second).
MAX_INLINE_BYTES = _declare("SWIFT_SAFE_MEDIA_MAX_INLINE_BYTES", INT, 64 << 20,
                            "bytes a `data:` URI or base64 string may decode to", above=0)
# Serving (`swift deploy`): the media URLs of a request (hosts/swift/url_policy.py).
SERVE_ALLOW_HOSTS = _declare("SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS", LIST, "",
                             "host names, IP addresses and CIDR networks (comma-separated) whose internal "
                             "addresses a request's media URL may reach while serving; every other internal "
                             "address is refused")

# The pre-flight check (preflight.py).
PREFLIGHT = _declare("SWIFT_SAFE_MEDIA_PREFLIGHT", SWITCH, True,
                     "`0`: `enable()` skips the check that the decoders load")
PREFLIGHT_PASSED = _declare("SWIFT_SAFE_MEDIA_PREFLIGHT_PASSED", TEXT, None,
                            "what passed the check, for child processes (they do not check again)",
                            internal=True)
# Logging.
LOG_LEVEL = _declare("SWIFT_SAFE_MEDIA_LOG_LEVEL", CHOICE, "INFO",
                     "level of the package's own stderr log handler", choices=LOG_LEVELS)

# Libraries that size thread pools from these variables at import time (not our settings).
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "OPENCV_FOR_THREADS_NUM")


# -- accessors for the settings read most -----------------------------------------------
def timeout() -> float:
    return get(TIMEOUT)


def timeout_ceiling() -> float:
    return get(TIMEOUT_CEILING)


def machine_retries() -> int:
    return get(MACHINE_RETRIES)


def start_timeout() -> float:
    return get(START_TIMEOUT)


def max_memory_mb() -> int:
    """Address space a sandbox may add above its preloaded baseline; 0 means no cap."""
    return get(MAX_MEMORY_MB)


def decoder_threads() -> int:
    return get(THREADS)


def max_sandboxes() -> int:
    return get(SANDBOXES)


def preload_modules() -> list[str]:
    return get(PRELOAD)


def confine() -> bool:
    """Whether decode sandboxes are confined (no network, no exec, no writes)."""
    return get(CONFINE)


def read_roots() -> list[str] | None:
    """Folders a confined sandbox may read besides the media handed to it and what the
    decoding libraries need (``/``: anywhere)."""
    raw = get(READ_ROOTS) or ""
    return [os.path.abspath(os.path.expanduser(root.strip())) for root in raw.split(os.pathsep) if root.strip()]


def open_broker() -> bool:
    """Whether opens by name are brokered by the caller (else a sandbox per call)."""
    return get(OPEN_BROKER)


def mp_context() -> str:
    """Start method for DataLoader workers; "default" leaves the host's choice alone."""
    return get(MP_CONTEXT)


def stall_timeout() -> float:
    """Seconds without a batch before the watchdog reports; 0: off."""
    return get(STALL_TIMEOUT)


def stall_action() -> str:
    return get(STALL_ACTION)


def preflight() -> bool:
    """Whether ``enable()`` checks that the decoders load before anything starts."""
    return get(PREFLIGHT)


def enabled_by_environment() -> bool | None:
    """True/False when ``SWIFT_SAFE_MEDIA`` turns the package on/off, None when unset
    (or not a true/false word: the start-up hook never breaks an interpreter)."""
    try:
        return get(ENABLED)
    except ValueError:
        return None
