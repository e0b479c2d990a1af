"""ms-swift's real templates that read their model while they encode, through a real
DataLoader with workers, stock and protected.

``python -m tests.programs.model_templates MODE OUT MEDIA [OMNI]`` builds each template of
:data:`FAMILIES` (ms-swift's own class and template meta, over a small byte-level
tokenizer and the family's real ``ModelMeta``) with a stand-in model that carries what the
template's ``_encode`` calls (no weights: no hub here), and, given the tiny Qwen2.5-Omni's
folder ``OMNI``, that model's own template with the model itself (a template that reaches its
model only through ms-swift's ``_get_model()``: protected workers keep the forkserver and
build ms-swift's dummy model). It encodes ``MEDIA``'s rows in a
DataLoader with two workers, strict (a row that fails raises), and writes the batches to
``OUT/MODE.pt`` and one JSON line per template: the start method the workers were given,
whether they forked from this process, and what each worker decoded in a sandbox.

MODE:
- ``stock``: no protection, the DataLoader as ms-swift makes it without a start method
  (workers fork, Linux's default);
- ``protected``: ``--safe_media true`` through ms-swift's real ``parse_args`` (the start-up
  hook teaches it the flag): its ``dataloader_multiprocessing_context`` goes to the
  DataLoader, as ms-swift's trainer passes it;
- ``named_forkserver``: the same, with the user naming ``--dataloader_multiprocessing_context
  forkserver``: what happens to these templates without the fork (the first one only).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Literal, Optional

import numpy as np
import torch

from swift.utils import parse_args


@dataclasses.dataclass
class TrainArgs:  # the fields of SftArguments that decide the DataLoader's workers
    dataloader_multiprocessing_context: Optional[Literal["fork", "spawn", "forkserver"]] = None


# --- stand-in models: what each template's _encode calls, deterministic, no weights ---

class StandIn(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype))  # what .dtype reads

    @property
    def dtype(self):
        return self.anchor.dtype


def _pixels(image, size=14) -> torch.Tensor:
    array = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class MiniCPMV(StandIn):  # MiniCPM-V 2.0's remote code: transform, get_slice_image_placeholder
    def transform(self, image):
        return _pixels(image)


class OvisVisualTokenizer(StandIn):
    def preprocess_image(self, image, max_partition=9):
        pixels = _pixels(image)[None]
        return pixels, [-301] + [-300] * 4 + [-302]


class Ovis(StandIn):
    def __init__(self):
        super().__init__()
        self.visual_tokenizer = OvisVisualTokenizer()


class Cog(StandIn):  # CogVLM2's remote code: build_conversation_input_ids
    def build_conversation_input_ids(self, tokenizer, *, query, history=None, images=None, template_version=None):
        text = tokenizer.encode(query, add_special_tokens=False)
        tokens = 4 if images else 0
        result = {"token_type_ids": torch.tensor([0] + [1] * tokens + [0] * len(text))}
        if images:
            picture = images[0]
            if isinstance(picture, torch.Tensor):  # a video: (C, T, H, W) uint8 frames
                result["images"] = [picture[:, :, ::8, ::8].float() / 255.0]
            else:
                result["images"] = [_pixels(picture)]
        return result


class XComposer2(StandIn):  # InternLM-XComposer2's remote code: vis_processor
    def vis_processor(self, image):
        return _pixels(image)


@dataclasses.dataclass
class Family:
    template_type: str
    model_type: str
    model: type
    media: str  # "image" or "video"
    specials: tuple = ()
    config: dict = dataclasses.field(default_factory=dict)
    processor: object = None  # builds the family's processor around the small tokenizer, where it can be


FAMILIES = [
    Family("minicpmv", "minicpmv", MiniCPMV, "image", ("<unk>", "<image>", "</image>", "<用户>", "<AI>"),
           {"query_num": 4, "slice_mode": False}),
    Family("ovis1_6", "ovis1_6", Ovis, "image", ("<bos>", "<start_of_turn>", "<end_of_turn>")),
    Family("cogvlm2", "cogvlm2", Cog, "image", ("<|reserved_special_token_0|>",)),
    Family("cogvlm2_video", "cogvlm2_video", Cog, "video", ("<|reserved_special_token_0|>",)),
    Family("ixcomposer2", "xcomposer2", XComposer2, "image", ("[UNUSED_TOKEN_146]", "[UNUSED_TOKEN_145]")),
]
OMNI = Family("qwen2_5_omni", "qwen2_5_omni", None, "image+audio")


# --- ms-swift's templates over a small tokenizer ---------------------------------------

def tokenizer(specials):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    base = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    backend.add_tokens([AddedToken(token, special=True, normalized=False)
                        for token in dict.fromkeys(base + list(specials))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def omni_template(model_dir: str):
    from transformers import Qwen2_5OmniForConditionalGeneration

    from swift.model import get_processor
    from swift.template import get_template

    template = get_template(get_processor(model_dir, model_type="qwen2_5_omni", download_model=False))
    template.set_mode("train")
    template.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir)  # as ms-swift's sft does
    return template


def template_for(family: Family, model_dir: str):
    from transformers import PretrainedConfig

    if family is OMNI:
        return omni_template(model_dir)
    from swift.model import MODEL_MAPPING
    from swift.model.model_meta import ModelInfo
    from swift.template import get_template

    processor = tokenizer(family.specials)
    if family.processor is not None:
        processor = family.processor(processor)
    config = PretrainedConfig(**family.config)
    processor.model_meta = MODEL_MAPPING[family.model_type]
    processor.model_info = ModelInfo(family.model_type, model_dir, torch.bfloat16, 4096, None, 0,
                                     is_multimodal=True, config=config, task_type="causal_lm")
    template = get_template(processor, template_type=family.template_type)
    template.set_mode("train")
    template.model = family.model()  # what ms-swift's sft does for a template with use_model
    return template


def rows(family: Family, media: str) -> list[dict]:
    if family is OMNI:  # a picture and a 16 kHz WAV per row
        pictures = sorted(name for name in os.listdir(media) if name.endswith(".png"))
        sounds = sorted(name for name in os.listdir(media) if name.endswith(".wav"))
        return [{"messages": [{"role": "user", "content": "<image><audio>What is in them?"},
                              {"role": "assistant", "content": f"pattern {index}"}],
                 "images": [os.path.join(media, picture)], "audios": [os.path.join(media, sound)]}
                for index, (picture, sound) in enumerate(zip(pictures, sounds))]
    found = sorted(name for name in os.listdir(media) if name.endswith(".png" if family.media == "image" else ".mp4"))
    key = "images" if family.media == "image" else "videos"
    return [{"messages": [{"role": "user", "content": f"<{family.media}>What is in it?"},
                          {"role": "assistant", "content": f"pattern {index}"}], key: [os.path.join(media, name)]}
            for index, name in enumerate(found)]


class Probed(torch.utils.data.Dataset):
    """LazyLLMDataset's rows, each with where it was encoded: a worker forked from the
    trainer, or not, and whether that worker has decoded in a sandbox."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.trainer = os.getpid()  # pickled with the dataset: a worker compares its parent with it

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        encoded = self.dataset[index]
        from swift_safe_media import process
        encoded["_worker"] = {"forked_from_trainer": os.getppid() == self.trainer,
                              "sandboxed_decodes": bool(process.current().engines)}
        return encoded


def collate(template, batch):
    where = [row.pop("_worker") for row in batch]
    return template.data_collator(batch), where


def encode_all(family: Family, media: str, model_dir: str, start_method):
    from swift.dataset.utils import LazyLLMDataset

    template = template_for(family, model_dir)
    dataset = Probed(LazyLLMDataset(rows(family, media), template.encode, strict=True))
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2, shuffle=False,
                                         collate_fn=functools.partial(collate, template),
                                         multiprocessing_context=start_method)
    batches, where = [], []
    for batch, seen in loader:
        batches.append(batch)
        where += seen
    return batches, where


def main(mode: str, out: str, media: str, omni: str | None = None) -> None:
    start_method = None
    if mode != "stock":
        argv = ["--safe_media", "true"]
        if mode == "named_forkserver":
            argv += ["--dataloader_multiprocessing_context", "forkserver"]
        args, _ = parse_args(TrainArgs, argv)
        start_method = args.dataloader_multiprocessing_context
    results = {}
    families = FAMILIES[:1] if mode == "named_forkserver" else FAMILIES + ([OMNI] if omni else [])
    for family in families:
        try:
            batches, where = encode_all(family, media, omni if family is OMNI else os.path.join(out, "model"),
                                        start_method)
        except Exception as exc:  # the failure a worker without the model meets, as the trainer sees it
            print(json.dumps({"template": family.template_type, "error": f"{type(exc).__name__}: {exc}"}))
            continue
        results[family.template_type] = batches
        print(json.dumps({"template": family.template_type, "start_method": start_method, "rows": len(where),
                          "forked_from_trainer": all(item["forked_from_trainer"] for item in where),
                          "none_forked_from_trainer": not any(item["forked_from_trainer"] for item in where),
                          "sandboxed_decodes": any(item["sandboxed_decodes"] for item in where)}))
    torch.save(results, os.path.join(out, f"{mode}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:5])
