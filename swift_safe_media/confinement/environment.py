"""What environment a zygote and its sandboxes hold: an allow-list, never the trainer's.

A training process carries credentials in its environment (``HF_TOKEN``,
``WANDB_API_KEY``, AWS and cloud keys); an exploited decoder that could read them
(``os.environ``, ``/proc/self/environ``) could hand them out through anything it may
still reach. So the zygote and every sandbox start from the names decoding reads and
nothing else (:func:`allowed`): locale and time zone, the thread-pool and FFmpeg
variables, CUDA's device selection, the interpreter's own (``PATH``,
``PYTHONPATH``, ``LD_LIBRARY_PATH``, ...), the hosts' decode settings (ms-swift's and
qwen_vl_utils' ``FPS``, ``MAX_PIXELS``, ``VIDEO_*``, ...), our own ``SWIFT_SAFE_MEDIA_*``,
plus the names a user lists in ``SWIFT_SAFE_MEDIA_SANDBOX_ENV``.

A zygote started by exec gets that environment from the start. One forked from the warm
forkserver inherited the trainer's: :func:`scrub` empties ``os.environ`` and libc's
``environ`` down to the allowed names and zeroes the process's initial environment block
(what ``/proc/self/environ`` shows), before anything untrusted runs.
"""

from __future__ import annotations

import ctypes
import os

from .. import config

# Exact names. Everything here is a setting, a path or a locale, never a credential.
ALLOWED_NAMES = frozenset({
    # locale, time, terminal
    "LANG", "LANGUAGE", "TZ", "TZDIR", "TERM", "NO_COLOR",
    # the interpreter and the dynamic loader
    "PATH", "HOME", "TMPDIR", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONNOUSERSITE",
    "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER",
    "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_ARENA_MAX",
    # GPUs a user's decode may use
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    # URL downloads (in an unconfined sandbox of their own; a confined one has no network)
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "SSL_CERT_FILE",
    "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    # torchrun's layout (the thread budget reads LOCAL_WORLD_SIZE)
    "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE",
    # ms-swift's and qwen_vl_utils' decode settings (get_env_args reads the upper-cased name)
    "ROOT_IMAGE_DIR", "SWIFT_TIMEOUT", "VIDEO_LOAD_BACKEND", "SWIFT_AUDIO_LOAD_BACKEND",
    "FORCE_QWENVL_VIDEO_READER", "MODEL_SEQ_LEN", "FPS", "NFRAMES", "IMAGE_FACTOR", "MIN_PIXELS", "MAX_PIXELS",
    "MAX_RATIO", "FRAME_FACTOR", "FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "SPATIAL_MERGE_SIZE", "IMAGE_MAX_TOKEN_NUM",
    "IMAGE_MIN_TOKEN_NUM", "SAMPLING_RATE",
})
# Name prefixes: locale categories, thread pools, FFmpeg's log switches, torch's and
# ms-swift's video settings, and our own settings (the internal ones included).
ALLOWED_PREFIXES = ("LC_", "OMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "VECLIB_", "OPENCV_", "KMP_", "GOMP_",
                    "AV_LOG_", "TORCH_", "PYTORCH_", "VIDEO_", "QWENVL_", "SWIFT_SAFE_MEDIA",
                    "_SWIFT_SAFE_MEDIA")


def is_allowed(name: str, extra=()) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES) or name in extra


def allowed(environment=None) -> dict:
    """The part of ``environment`` (default: this process's) a zygote or sandbox may hold."""
    environment = os.environ if environment is None else environment
    # The user's extra names as ``environment`` itself says (a sandbox filters what it is sent).
    extra = frozenset(config.parse(config.SETTINGS[config.SANDBOX_ENV], environment.get(config.SANDBOX_ENV)) or ())
    return {name: value for name, value in environment.items() if is_allowed(name, extra)}


# Words in a variable's name that say it holds a credential (``HF_TOKEN``, ``WANDB_API_KEY``,
# ``AWS_SECRET_ACCESS_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``).
_CREDENTIAL_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def looks_like_a_credential(name: str) -> bool:
    return any(word in name.upper() for word in _CREDENTIAL_WORDS)


def withheld(environment=None) -> list[str]:
    """The names of ``environment`` a sandbox does not get (for doctor: names, never values),
    credential-like names first: a report cut to its first names still shows the ones a reader
    looks for (a CI machine holds dozens of others)."""
    environment = os.environ if environment is None else environment
    keep = allowed(environment)
    return sorted((name for name in environment if name not in keep),
                  key=lambda name: (not looks_like_a_credential(name), name))


# Where a download's sandbox looks for the Hub's token file: nowhere (see without_token_file).
NO_TOKEN_FILE = "/nonexistent/swift-safe-media/hub-token"


def without_token_file() -> None:
    """In a download's sandbox, as it is confined: the Hub's client reads its token file
    (under ``$HOME``, which the sandbox may not read) whenever no token is in the environment,
    and a refusal there fails the read of a public file; pointed at no file, it goes on
    without one. A token reaches such a sandbox only as a name listed in
    ``SWIFT_SAFE_MEDIA_SANDBOX_ENV`` (``HF_TOKEN``: a private dataset streamed from the Hub)."""
    import sys

    os.environ["HF_TOKEN_PATH"] = NO_TOKEN_FILE
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # read once, as it was imported (in the zygote)
        constants.HF_TOKEN_PATH = NO_TOKEN_FILE


def scrub() -> None:
    """Leave this process (a zygote forked from the warm forkserver) with the allowed
    environment only, in ``os.environ``, libc's ``environ`` and the initial block."""
    keep = allowed()
    os.environ.clear()  # unsetenv each: libc's environ no longer points into the block
    os.environ.update(keep)  # setenv: copies on the heap
    start, end = _environment_block()
    if start and end > start:
        ctypes.memset(start, 0, end - start)


def _environment_block() -> tuple[int, int]:
    """Where the kernel put this process's initial environment (``env_start``,
    ``env_end``: fields 50 and 51 of ``/proc/self/stat``)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[50 - 3]), int(fields[51 - 3])  # fields[0] is field 3 (state)
    except (OSError, IndexError, ValueError):
        return 0, 0


# A command-line option whose value is a credential (ms-swift's ``--hub_token``, ``--api_key``, ...).
_SECRET_OPTION = ("token", "_key", "-key", "apikey", "secret", "password", "passwd", "credentials")
WITHHELD = "<withheld>"


def redacted_argv(argv) -> list[str]:
    """The caller's ``argv`` for a zygote and its sandboxes (``sys.argv`` there): the value
    of any option named like a credential replaced by ``<withheld>``."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            out.append(WITHHELD)
            hide_next = False
            continue
        hide_next = False
        name, equals, _ = arg.partition("=")
        secret = arg.startswith("-") and name.lower().endswith(_SECRET_OPTION)
        if secret and equals:
            out.append(f"{name}={WITHHELD}")
        else:
            out.append(arg)
            hide_next = secret
    return out

