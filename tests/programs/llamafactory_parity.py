"""LLaMA-Factory's media reads, stock and protected, in this fresh interpreter (its own
environment): ``python -m tests.programs.llamafactory_parity CORPUS_DIR PROCESSOR_DIR``
prints one JSON line: per case, whether the protected output is stock's bit for bit
(PIL pixels, arrays and tensors by their bytes, dtypes and shapes; numbers exactly), and
how many decodes the sandbox ran.

Cases: every plugin class that reads media itself (``MMPluginMixin`` through
``llava_next_video``, ``Qwen2VLPlugin``, ``Qwen3VLPlugin``, ``Qwen2OmniPlugin``, ``Gemma4Plugin``)
over every video, audio and image of the corpus, the Qwen video metadata, and
``Qwen2OmniPlugin._get_mm_inputs`` with a real Qwen2.5-Omni processor (what the collator
hands the model). Stock runs first, then protection is turned on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

VIDEO_KWARGS = {"image_max_pixels": 128 * 128, "image_min_pixels": 16 * 16, "video_fps": 2.0, "video_maxlen": 8}
IMAGE_KWARGS = {"image_max_pixels": 96 * 96, "image_min_pixels": 32 * 32}
PLUGINS = ("llava_next_video", "qwen2_vl", "qwen3_vl", "qwen2_omni", "gemma4")


def digest(value):
    """What the comparison sees of an output: every byte of pixels and arrays."""
    import torch
    from PIL import Image

    if isinstance(value, Image.Image):
        return ["image", value.mode, list(value.size), hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous()
        return ["tensor", str(value.dtype), list(value.shape),
                hashlib.sha256(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"").hexdigest()]
    if isinstance(value, np.ndarray):
        return ["array", str(value.dtype), list(value.shape), hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()]
    if isinstance(value, dict) or hasattr(value, "keys"):
        return {str(key): digest(value[key]) for key in sorted(value.keys())}
    if isinstance(value, (list, tuple)):
        return [digest(item) for item in value]
    if isinstance(value, (np.floating, np.integer)):
        return repr(value.item())
    return repr(value)


def images(directory: Path) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    made = []
    for name, mode, size in (("rgb.png", "RGB", (120, 80)), ("rgba.png", "RGBA", (300, 200)),
                             ("gray.jpg", "L", (40, 30)), ("tall.jpg", "RGB", (20, 90))):
        pixels = rng.integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
        Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels).save(directory / name)
        made.append(str(directory / name))
    return made


def cases(corpus: Path, processor_dir: str):
    from llamafactory.data.mm_plugin import get_mm_plugin
    from transformers import AutoProcessor

    from tests import media_corpus

    videos = [str(corpus / name) for name in media_corpus.VIDEO_NAMES if (corpus / name).exists()]
    audios = [str(corpus / name) for name in media_corpus.AUDIO_NAMES]
    pictures = images(corpus)
    for name in PLUGINS:
        plugin = get_mm_plugin(name, image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>")
        for video in videos:
            yield f"{name} video {Path(video).name}", lambda p=plugin, v=video: p._regularize_videos([v], **VIDEO_KWARGS)
            if hasattr(plugin, "_get_qwen_video_stream_metadata"):
                yield (f"{name} metadata {Path(video).name}",
                       lambda p=plugin, v=video: p._get_qwen_video_stream_metadata(v, 2.0, 8))
        yield f"{name} videos together", lambda p=plugin: p._regularize_videos(videos[:3], **VIDEO_KWARGS)
        yield f"{name} images", lambda p=plugin: p._regularize_images(pictures, **IMAGE_KWARGS)
        yield f"{name} audios", lambda p=plugin: p._regularize_audios(audios, sampling_rate=16000)
    omni = get_mm_plugin("qwen2_omni", image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>")
    processor = AutoProcessor.from_pretrained(processor_dir)
    for attribute, value in (("video_max_pixels", 64 * 64), ("video_maxlen", 4), ("video_fps", 2.0)):
        setattr(processor, attribute, value)
    yield "qwen2_omni _get_mm_inputs", lambda: omni._get_mm_inputs(pictures[:1], videos[:2], audios[:2], processor)


def main(corpus_dir: str, processor_dir: str) -> None:
    import swift_safe_media
    from swift_safe_media.records import summary

    corpus = Path(corpus_dir)
    stock = {label: digest(run()) for label, run in cases(corpus, processor_dir)}
    swift_safe_media.enable(hosts=["llamafactory"], quarantine="")
    protected = {label: digest(run()) for label, run in cases(corpus, processor_dir)}
    print(json.dumps({"equal": {label: stock[label] == protected.get(label) for label in stock},
                      "decodes": summary.collect()["decodes"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
