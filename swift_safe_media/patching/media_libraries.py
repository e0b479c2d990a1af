"""The media libraries' own entry points, bounded in every protected process, whatever
host (or none) reaches them.

Each row names a function-shaped decode entry point (``transformers``' ``load_video`` and
``load_audio``, the model-family utils, ``librosa.load``, ``soundfile.read``,
``torchaudio.load``, ``torchvision.io.read_video``, ``whisper.load_audio``) and its
stand-in in :mod:`..decoders.stock`, which runs the stock function itself in the
sandbox. They are patched where they are defined and in every loaded module of their
packages that copied them, as each is imported, by ``enable()`` (no host needed: a
plain PyTorch script is covered) and by any host's adapter; DataLoader workers patch
them as they start (:mod:`..workers.plain`). Under ms-swift a failure is logged and
counted as its own loaders' are.

Object-shaped openers (``decord.VideoReader``, ``cv2.VideoCapture``, ``av.open``) are
not proxied: each is reached through one of these entry points or a twin, and
:mod:`..hosts.swift.coverage` names any template that reaches one otherwise.
"""

from __future__ import annotations

import functools
import sys

from . import import_hooks as _imports
from .moved_targets import DecodeFunctions
from .targets import Patches, Target

_STOCK = "swift_safe_media.decoders.stock"

TARGETS = (
    # Where a row names no release, the library has had it in every release read (4.51 on for transformers).
    Target("transformers.video_utils", "load_video", f"{_STOCK}:load_video", expected_in="transformers>=4.52"),
    Target("transformers.audio_utils", "load_audio", f"{_STOCK}:load_audio"),
    Target("transformers.audio_utils", "load_audio_as", f"{_STOCK}:load_audio_as", expected_in="transformers>=4.57"),
    Target("keye_vl_utils.vision_process", "fetch_video", f"{_STOCK}:keye_fetch_video"),
    Target("minicpmo.utils", "get_video_frame_audio_segments", f"{_STOCK}:minicpmo_video_audio_segments"),
    Target("whisper.audio", "load_audio", f"{_STOCK}:whisper_load_audio"),
    Target("librosa.core.audio", "load", f"{_STOCK}:librosa_load"),
    Target("soundfile", "read", f"{_STOCK}:soundfile_read"),
    Target("torchaudio", "load", f"{_STOCK}:torchaudio_load"),
    Target("torchvision.io.video", "read_video", f"{_STOCK}:torchvision_read_video",
           expected_in="torchvision<0.26"),  # torchvision 0.26 removed its video decoding
    # A media loader from a model's own code (InternLM-XComposer's ixc_utils.load_video).
    Target("transformers.dynamic_module_utils", "get_class_from_dynamic_module", f"{_STOCK}:dynamic_module_function"),
)
# transformers' video and audio loaders: load_video and load_audio are targets, the backends
# load_video calls are inner; a new loader of this shape is named at start-up.
DECODE_FUNCTIONS = (
    DecodeFunctions("transformers.video_utils", r"^(load_video|read_video_)",
                    inner=("read_video_opencv", "read_video_decord", "read_video_pyav", "read_video_torchvision",
                           "read_video_torchcodec")),
    DecodeFunctions("transformers.audio_utils", r"^load_audio", inner=("load_audio_torchcodec", "load_audio_librosa")),
)
# Where copies of these functions may live: their packages, ms-swift's templates, the
# Qwen utils, and remote-code models (``from transformers.video_utils import load_video``).
SCOPE = ("transformers", "keye_vl_utils", "minicpmo", "whisper", "librosa", "soundfile", "torchaudio",
         "torchvision.io", "swift.", "qwen_vl_utils", "qwen_omni_utils")


def _as_host_logs(stand_in):
    return functools.wraps(stand_in)(functools.partial(_call, stand_in))


def _call(stand_in, *args, **kwargs):
    """Under ms-swift, a failure is logged and counted against the error budget as its
    own loaders' failures are; elsewhere it propagates, naming the media."""
    swift = sys.modules.get("swift_safe_media.hosts.swift.adapter")
    if swift is not None and swift.is_patched():
        return swift._call_logging_failures(stand_in, *args, **kwargs)
    return stand_in(*args, **kwargs)


PATCHES = Patches(SCOPE, TARGETS, globals(), wrap_functions=_as_host_logs, label="the media libraries",
                  decode_functions=DECODE_FUNCTIONS)
is_patched, patched_sites = PATCHES.is_patched, PATCHES.sites
_enabled = False


def _patch(_module=None) -> None:
    try:
        PATCHES.patch()
    except Exception:  # fail open: the library runs as stock, the coverage warning says so
        import logging

        logging.getLogger("swift_safe_media").exception("swift_safe_media: could not bound the media libraries")


def enable() -> None:
    """Bound the entry points now, and each one as its module is imported."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    for module_name in PATCHES.modules:
        _imports.when_imported(module_name, _patch)


def disable() -> None:
    global _enabled
    if not _enabled:
        return
    _enabled = False
    for module_name in PATCHES.modules:
        _imports.clear(module_name)
    PATCHES.unpatch()


def bounded_names() -> set[str]:
    """``module.name`` of every entry point bounded here (for the coverage scan)."""
    return {f"{target.module}.{target.name}" for target in TARGETS}
