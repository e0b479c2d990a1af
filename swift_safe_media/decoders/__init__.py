"""Safe, stock-identical twins of the media loaders used by ms-swift and the Qwen utils.

Every decode runs in the engine's sandbox (torchcodec for video and for audio inside
containers, soundfile for WAV/FLAC/OGG/MP3, PyAV where stock uses it or torchcodec cannot
decode a file right), behind the guards in ``guards``; never decord or audioread. Which
stream and rotation each twin takes follows its stock loader (``families``); where and why
a twin differs from stock: docs/media-parity.md. Importing this package is cheap: torch,
torchcodec, PyAV and PIL are imported inside the functions that use them. Part of the
core: may import the foundations, :mod:`..engine` and :mod:`..confinement`; never
:mod:`..hosts` (the adapters point their patch targets here).
"""

from .guards import Limits
from .qwen import fetch_video, process_audio_info
from .swift import (load_audio, load_video_cogvlm2, load_video_hf, load_video_internvl, load_video_llava,
                    load_video_minicpmv_mplug_owl3, load_video_ovis2, load_video_ovis2_5, load_video_valley,
                    load_vllm_video)

__all__ = ["Limits", "fetch_video", "process_audio_info", "load_audio", "load_video_cogvlm2", "load_video_hf",
           "load_video_internvl", "load_video_llava", "load_video_minicpmv_mplug_owl3", "load_video_ovis2",
           "load_video_ovis2_5", "load_video_valley", "load_vllm_video"]
