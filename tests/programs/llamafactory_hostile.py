"""LLaMA-Factory's own media readers, protected, on the hostile corpus, in this fresh
interpreter (LLaMA-Factory's environment):
``python -m tests.programs.llamafactory_hostile HOSTILE_DIR GOOD_VIDEO GOOD_AUDIO``
prints one JSON line per (reader, hostile file): what the read raised (its type, whether
it is a ``MediaDecodeError``, its ``.path`` and message) or, had it not raised, what it
returned; then one line per (reader, good file): what it decoded (frames and their
size, samples, the metadata). The metadata reader is stock's ``_get_qwen_video_stream_metadata``,
which answers None for a file PyAV cannot open (it catches the error itself).

The readers are the plugin methods that open media by name: ``MMPluginMixin._regularize_videos``
(through ``llava_next_video``), ``Qwen2VLPlugin._regularize_videos`` (``qwen2_vl``),
``Gemma4Plugin._regularize_videos``, ``Qwen2VLPlugin._get_qwen_video_stream_metadata`` and
``MMPluginMixin._regularize_audios`` (through ``qwen2_audio``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VIDEO_KWARGS = {"image_max_pixels": 128 * 128, "image_min_pixels": 16 * 16, "video_fps": 2.0, "video_maxlen": 8}
TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>"}


def readers() -> dict:
    """name -> (kind, read(path)): each of LLaMA-Factory's readers on one file."""
    from llamafactory.data.mm_plugin import get_mm_plugin

    base, qwen, gemma = (get_mm_plugin(name, **TOKENS) for name in ("llava_next_video", "qwen2_vl", "gemma4"))
    audio = get_mm_plugin("qwen2_audio", **TOKENS)
    return {
        "MMPluginMixin._regularize_videos": ("video", lambda p: base._regularize_videos([p], **VIDEO_KWARGS)),
        "Qwen2VLPlugin._regularize_videos": ("video", lambda p: qwen._regularize_videos([p], **VIDEO_KWARGS)),
        "Gemma4Plugin._regularize_videos": ("video", lambda p: gemma._regularize_videos([p], **VIDEO_KWARGS)),
        "Qwen2VLPlugin._get_qwen_video_stream_metadata":
            ("metadata", lambda p: qwen._get_qwen_video_stream_metadata(p, 2.0, 8)),
        "MMPluginMixin._regularize_audios": ("audio", lambda p: audio._regularize_audios([p], sampling_rate=16000)),
    }


def shape(kind: str, output):
    """What a reader returned, in a few numbers: frames and their size, samples, the metadata."""
    if kind == "video":
        frames = output["videos"][0]
        return {"frames": len(frames), "size": list(frames[0].size) if frames else None}
    if kind == "audio":
        return {"samples": int(output["audios"][0].shape[-1]), "rate": output["sampling_rates"][0]}
    return None if output is None else {key: repr(value) for key, value in output.items()}


def attempt(reader: str, kind: str, read, path: str) -> dict:
    """One read: its output's shape, or what it raised."""
    from swift_safe_media import MediaDecodeError

    row = {"reader": reader, "kind": kind, "file": path}
    try:
        output = read(path)
    except Exception as exc:  # noqa: BLE001 - the test judges every kind of failure
        row.update(error=f"{type(exc).__module__}.{type(exc).__qualname__}",
                   media_decode_error=isinstance(exc, MediaDecodeError),
                   path=getattr(exc, "path", None), message=str(exc)[:600])
        return row
    row.update(error=None, decoded=shape(kind, output))
    return row


def main(hostile_dir: str, good_video: str, good_audio: str) -> None:
    import swift_safe_media

    swift_safe_media.enable(hosts=["llamafactory"], quarantine="")
    hostile = sorted(str(path) for path in Path(hostile_dir).iterdir() if path.is_file())
    for reader, (kind, read) in readers().items():
        for path in hostile:
            print(json.dumps({"hostile": True, **attempt(reader, kind, read, path)}), flush=True)
        good = good_audio if kind == "audio" else good_video
        print(json.dumps({"hostile": False, **attempt(reader, kind, read, good)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
