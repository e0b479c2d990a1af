"""Every media read of LLaMA-Factory's ``mm_plugin`` in the sandbox, with the timeout.

LLaMA-Factory reads media in a few methods of its plugins, which every plugin class
inherits or overrides: ``_regularize_images`` (PIL), ``_regularize_videos`` (PyAV:
``av.open`` and a decode loop; overridden by ``Qwen2VLPlugin``, so its Qwen2.5/3-VL and
Omni subclasses too, and by ``Gemma4Plugin``), ``_regularize_audios``
(``torchaudio.load``, which reads through torchcodec) and
``Qwen2VLPlugin._get_qwen_video_stream_metadata`` (``av.open`` for the token count);
MiniCPM-V 4.6's ``_get_mm_inputs`` hands the files to the Hugging Face processor, which
reads them: that whole call runs in the sandbox.
Each stand-in runs LLaMA-Factory's own method, unpatched, in the sandbox, one media item
per call (the methods treat each item on its own, so the merged lists are what one call
gives): outputs are stock's by construction, bit for bit. Items already decoded (PIL
images, arrays, a video given as frames) are not read there: the stock method runs here.

A failure inside the sandbox is raised as ``MediaDecodeError`` naming the file (so it is
quarantined and counted); a timeout or crash as ``MediaDecodeTimeout`` /
``MediaDecodeCrash``. Each carries the file under ``engine.FAILED_PATH``.
"""

from __future__ import annotations

import importlib
import os

from ...confinement import handed
from ...engine import calls as engine
from ...errors import MediaDecodeError, decode_failure
from ...patching.targets import original_of

MM_PLUGIN = "llamafactory.data.mm_plugin"
FAILED_PATH = engine.FAILED_PATH


def import_llamafactory_in_sandbox() -> None:
    """The sandbox's setup: LLaMA-Factory's plugin module (torch, torchaudio, PyAV,
    transformers' image utilities) imported once, not under a decode's timeout."""
    importlib.import_module(MM_PLUGIN)


def _stock(qualname: str):
    """LLaMA-Factory's own ``Class.method`` of ``mm_plugin``, unwrapped if patched here."""
    class_name, name = qualname.split(".")
    function = vars(getattr(importlib.import_module(MM_PLUGIN), class_name))[name]
    return original_of(function) or function


def media_name(item) -> str | None:
    """The file an item of a plugin's media list is read from; None: nothing to read
    (decoded already, a video given as frames, an open file object)."""
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    if isinstance(item, bytes):
        return f"<{len(item)} bytes>"
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            return f"<{len(item['bytes'])} bytes>"
        if item.get("path") is not None:
            return str(item["path"])
    return None


def stock_in_sandbox(qualname: str, plugin, args: tuple, kwargs: dict, label: str):
    """Runs in the sandbox: the stock method; its failure as MediaDecodeError naming ``label``."""
    try:
        return _stock(qualname)(plugin, *args, **kwargs)
    except MediaDecodeError:
        raise
    except Exception as exc:
        raise decode_failure(label, exc, f"reading {label}", "LLaMA-Factory") from exc


def regularize_each(stock, plugin, items, *args, **kwargs):
    """``_regularize_images`` / ``_videos`` / ``_audios``: each item read in the sandbox, the
    per-item lists of the outputs joined (the methods loop over the items independently)."""
    names = [media_name(item) for item in items] if isinstance(items, (list, tuple)) else []
    if not any(names):
        return stock(plugin, items, *args, **kwargs)
    qualname = stock.__qualname__
    outputs = engine.call_each(stock_in_sandbox, [(qualname, plugin, ([item], *args), kwargs, name or "<decoded>")
                                                  for item, name in zip(items, names)],
                               [name or "<decoded>" for name in names],
                               confine=engine.by_name(files=[name for name in names if name]))
    return _joined(outputs)


def _joined(outputs: list[dict]) -> dict:
    joined = {key: [] for key in outputs[0]}
    for output in outputs:
        for key, values in output.items():
            joined[key].extend(values)
    return joined


def video_metadata_in_sandbox(stock, plugin, video, *args, **kwargs):
    """``_get_qwen_video_stream_metadata``: opens the file with PyAV, so in the sandbox too."""
    name = media_name(video) if isinstance(video, (str, os.PathLike)) else None
    if name is None:
        return stock(plugin, video, *args, **kwargs)
    return engine.call(stock_in_sandbox, stock.__qualname__, plugin, (video, *args), kwargs, name, path=name,
                       confine=engine.by_name(files=[name]))


def mm_inputs_in_sandbox(stock, plugin, images, videos, audios, processor, **kwargs):
    """``_get_mm_inputs`` of a plugin that hands the files themselves to the Hugging Face
    processor (MiniCPM-V 4.6: its image and video processors and ``audio_feature_extract``
    read them): the whole call, processor included, in the sandbox. A failure names the
    batch's first file (the processor reads them all in one call)."""
    names = [name for items in (images, videos, audios) for name in map(media_name, items or ()) if name]
    if not names:
        return stock(plugin, images, videos, audios, processor, **kwargs)
    # Every file goes along open: the processor reads them all, by name, in one sandbox.
    images, videos, audios = ([_handed(item) for item in items] if items else items for items in (images, videos, audios))
    return engine.call(stock_in_sandbox, stock.__qualname__, plugin, (images, videos, audios, processor), kwargs,
                       names[0], path=names[0], confine=engine.by_name(files=names))


def _handed(item):
    """An item of a media list whose file the sandbox may read by name (see :mod:`...confinement.handed`)."""
    if isinstance(item, str) and not item.startswith(("http://", "https://")) and os.path.isfile(item):
        return handed.hand(os.path.abspath(item))
    return item


def failed_path(exc: BaseException) -> str | None:
    """The file a failure of a bounded read is pinned on; None: not a media failure."""
    pinned = getattr(exc, FAILED_PATH, None)
    if pinned is None and isinstance(exc, MediaDecodeError):
        pinned = exc.path
    return pinned
