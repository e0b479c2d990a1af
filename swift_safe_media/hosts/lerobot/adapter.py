"""LeRobot adapter (0.4.x, 0.5.x, 0.6.x): bounded video decode, skip-and-substitute, the
workers' start method, the run summary and the command-line flags.

One adapter for every LeRobot line: the patch-target table is chosen by what the
installed LeRobot has (:mod:`.layouts`: the first declared layout whose every
function is defined, with the parameters expected, in LeRobot's source), never by a copy
of the adapter per version. A LeRobot that matches no layout, or whose version is
outside ``SUPPORTED``, gets one warning and is left untouched as a whole.

- :mod:`.decode`: every decode of the training path (``LeRobotDataset``,
  ``MultiLeRobotDataset``, ``StreamingLeRobotDataset``; RGB and depth; torchcodec and
  PyAV) in the sandbox with the timeout, a sample's cameras in one round trip (at once
  where LeRobot decodes them on threads), frames bit-identical to stock;
- :mod:`.substitute`: a sample whose video fails is substituted and named;
- :mod:`.workers`: the workers' start method (LeRobot's default replaced by the
  warm forkserver, the user's choice kept) and the run summary as batches are drawn;
- here: the protocol of :mod:`swift_safe_media.patching.host_adapters`, and the flags:
  ``--safe_media=true`` (and ``--safe_media_timeout``, ``_mp_context``, ``_max_memory_mb``,
  ``_quarantine``, ``_stall_timeout``, ``_stall_action``) on any LeRobot command line, taken
  out of ``sys.argv`` before draccus parses it and written to the ``SWIFT_SAFE_MEDIA*``
  environment. The quarantine registry defaults to ``<output_dir>/safe_media/quarantine.jsonl``.
"""

from __future__ import annotations

import functools
import os
import sys

from ... import config
from ...engine import calls as engine
from ...patching.host_adapters import ModuleAdapter, env_state, installed_version, register
from .. import flags
from . import layouts
from ...patching.targets import Patches
from .decode import import_lerobot_in_sandbox
from .workers import train_config_has_start_method, worker_start_method  # noqa: F401 (protocol)

HOST = "lerobot"
DISTRIBUTION = "lerobot"
SUPPORTED = ((0, 4, 0), (0, 7, 0))  # dataset format v3.0; tested with 0.4.4, 0.5.x (layouts) and 0.6.1
# What DataLoader workers need to unpickle a LeRobotDataset: the warm forkserver imports
# it once (see warm_start).
WORKER_PRELOAD = ("lerobot.datasets.lerobot_dataset", "lerobot.datasets.utils")
LOADERS_HELD = False  # they get their start method's context (workers.py); their tensors go as descriptors
FLAG_MODULES = ("lerobot.configs.parser",)
VIDEO_UTILS = layouts.VIDEO_UTILS


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


def unsupported() -> str | None:
    """Why the installed LeRobot cannot be patched (no declared layout matches), or None."""
    return None if layouts.installed() is not None else layouts.why_none()


@functools.lru_cache(maxsize=1)
def current_patches() -> Patches | None:
    """The patches of the installed layout (None: no layout matches)."""
    layout = layouts.installed()
    return None if layout is None else Patches(("lerobot",), layout.targets, {}, label="LeRobot",
                                               decode_functions=layouts.DECODE_FUNCTIONS)


def __getattr__(name):
    # The table, and the modules whose import (re)applies it, are the installed layout's
    # (importing a module of another layout would fail). With no layout, the decode
    # module still triggers the one warning.
    if name == "TARGETS":
        return layouts.installed().targets if layouts.installed() else ()
    if name == "PATCHES":
        return current_patches()
    if name == "TRIGGER_MODULES":
        return layouts.installed().modules if layouts.installed() else (VIDEO_UTILS,)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def patch() -> None:
    """Patch whatever of the installed layout is loaded now; called again as more is imported."""
    patches = current_patches()
    if patches is None:
        return  # integrations warned once already (unsupported)
    # Importing LeRobot takes seconds in a fresh sandbox (one per worker, and one after
    # every kill); that must not count against a decode's own timeout.
    engine.set_up_sandboxes(import_lerobot_in_sandbox)
    patches.patch()


def unpatch() -> None:
    patches = current_patches()
    if patches is not None:
        patches.unpatch()
    engine.forget_sandbox_setup(import_lerobot_in_sandbox)


def is_patched() -> bool:
    patches = current_patches()
    return patches is not None and patches.is_patched()


# -- flags ----------------------------------------------------------------------------
QUARANTINE_UNDER_OUTPUT_DIR = ("safe_media", "quarantine.jsonl")
take_flags = flags.take_flags


def command_line_asks_for_protection() -> bool:
    """``lerobot-train ... --safe_media=true``: seen as LeRobot begins importing."""
    return flags.asks_for_protection(sys.argv[1:])


def register_flags() -> None:
    """Take our flags out of ``sys.argv`` before draccus sees them and apply them."""
    values, remaining = take_flags(sys.argv[1:])
    sys.argv[1:] = remaining
    enabled = values.get(flags.ENABLED)
    protected = enabled is True or (enabled is None and env_state())
    output_dir, log_freq = flags.argument(remaining, "--output_dir"), flags.argument(remaining, "--log_freq")
    if protected and output_dir and "quarantine" not in values and not config.is_set(config.QUARANTINE):
        # Only named now: lerobot-train refuses an output_dir that already exists.
        values["quarantine"] = os.path.join(output_dir, *QUARANTINE_UNDER_OUTPUT_DIR)
    if protected and log_freq and not config.is_set(config.SUMMARY_STEPS):
        config.put(config.SUMMARY_STEPS, log_freq)  # the summary joins LeRobot's own log lines
    if protected:
        values[flags.ENABLED] = True  # again if on already: the stats folder follows the registry
    flags.apply(values, HOST)


ADAPTER = register(ModuleAdapter(sys.modules[__name__]))  # the protocol of patching/host_adapters.py, filled in
