"""The LLaMA-Factory scenario: ``llamafactory-cli train`` of a tiny Qwen2.5-Omni (LoRA,
the ``qwen2_omni`` template) over a dataset of video and audio rows, some of which hang or
crash LLaMA-Factory's stock readers. Shared by tests/test_llamafactory_train.py and
bench/llamafactory.py.

Media (built with ffmpeg at run time, tests/swift_scenario.py ``build_media``):
- ``good_N.mp4``: 2 s, 64x64, h264 + aac, asked for as videos; ``tone_N.wav``: 1 s of 16 kHz audio;
- ``fifo.wav``: a FIFO named like a clip (``torchaudio.load`` blocks in open() for ever);
- ``playlist.mp4``: an HLS playlist posing as a video, its segment a FIFO (PyAV refuses it);
- ``cut.mp4``: a good clip cut to 40 % (its index is gone: PyAV raises).

    python -m tests.llamafactory_scenario DIRECTORY   (with LLaMA-Factory's Python; prints what it built, as JSON)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import swift_scenario, tiny_models

DATASET = "safe_media_test"
GOOD_TONES = 2
BAD = ("fifo.wav", "playlist.mp4", "cut.mp4")  # the FIFO first: stock hangs on it
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "DISABLE_VERSION_CHECK": "1"}


def build_media(directory: Path) -> dict[str, str]:
    media = {name: path for name, path in swift_scenario.build_media(directory).items()
             if name != "edit_list_cut.mp4"}  # PyAV decodes it well: not a bad file here
    cut = directory / "cut.mp4"
    data = Path(media["good_0.mp4"]).read_bytes()
    cut.write_bytes(data[: len(data) * 4 // 10])
    media[cut.name] = str(cut)
    for index in range(GOOD_TONES):
        tone = directory / f"tone_{index}.wav"
        if not tone.exists():
            swift_scenario._ffmpeg("-f", "lavfi", "-i", f"sine=frequency={440 + 110 * index}:sample_rate=16000:"
                                   "duration=1", "-c:a", "pcm_s16le", str(tone))
        media[tone.name] = str(tone)
    return media


def row(path: str) -> dict:
    kind = "audios" if path.endswith(".wav") else "videos"
    question = "<audio>What do you hear?" if kind == "audios" else "<video>What do you see?"
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "a test signal"}],
            kind: [path]}


def build_dataset(directory: Path, paths: list[str], name: str = DATASET) -> None:
    """``name`` in ``directory/dataset_info.json``: one sharegpt row per file."""
    rows = [row(path) for path in paths]
    for entry in rows:  # every row has both columns (LLaMA-Factory aligns them)
        entry.setdefault("videos", [])
        entry.setdefault("audios", [])
    (directory / f"{name}.json").write_text(json.dumps(rows))
    info_path = directory / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info[name] = {"file_name": f"{name}.json", "formatting": "sharegpt",
                  "columns": {"messages": "messages", "videos": "videos", "audios": "audios"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}}
    info_path.write_text(json.dumps(info, indent=1))


def yaml_text(model: str, dataset_dir: str, output_dir: str, *, dataset: str = DATASET, workers: int = 2,
              batch: int = 1, extra: dict | None = None) -> str:
    """A LoRA SFT run on the CPU, one epoch; ``extra`` adds keys (``safe_media: true``, ...)."""
    settings = {
        "model_name_or_path": model, "trust_remote_code": True, "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "q_proj,v_proj", "lora_rank": 4,
        "dataset": dataset, "dataset_dir": dataset_dir, "template": "qwen2_omni", "cutoff_len": 4096,
        "overwrite_cache": True, "video_max_pixels": 64 * 64, "video_fps": 2.0, "video_maxlen": 4,
        "output_dir": output_dir, "overwrite_output_dir": True, "logging_steps": 1, "save_strategy": "no",
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1, "num_train_epochs": 1.0,
        "learning_rate": 1.0e-4, "dataloader_num_workers": workers, "report_to": "none", "bf16": False,
        "use_cpu": True, **(extra or {})}
    return "".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items())


def build(directory: str | os.PathLike, **yaml_settings) -> dict[str, str]:
    """Tiny model, media, the hostile and clean datasets and a YAML for each."""
    directory = Path(directory)
    media = build_media(directory / "media")
    model = tiny_models.build(str(directory / "tiny_qwen2_5_omni"))
    good = [path for name, path in sorted(media.items()) if name.startswith(("good_", "tone_"))]
    bad = [media[name] for name in BAD]
    hostile = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:]  # bad rows among good ones
    build_dataset(directory, hostile, DATASET)
    build_dataset(directory, good, DATASET + "_clean")
    return {"model": model, "dataset_dir": str(directory), "rows": str(len(hostile)), "good_rows": str(len(good)),
            **{f"media:{name}": path for name, path in media.items()}}


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
