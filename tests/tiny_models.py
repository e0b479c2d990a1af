"""A tiny, randomly initialised Qwen2.5-Omni (audio + video, the seed's model family),
built offline in seconds, that ms-swift loads from a local directory as it would the
real one: the real special-token ids, processor files and ``spk_dict.pt``.

    python -m tests.tiny_models OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

# Real Qwen2.5-Omni ids: the model config and ms-swift's template look tokens up by id.
FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>",
    "<|IMAGE|>", "<|VIDEO|>", "<tool_call>", "</tool_call>",
]
VOCAB_SIZE = 151936
# Attributes Qwen2_5OmniProcessor reads from its tokenizer (transformers 5: extra_special_tokens).
NAMED_TOKENS = {
    "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer():
    """A byte-level BPE over the 256 byte symbols, padded to the real vocabulary size so
    that the special tokens land on their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    merges = []
    for left in "etaoinsrhl":  # a few merges so BPE has something to do
        for right in "etaoinsrhl":
            token = left + right
            if token not in vocab:
                vocab[token] = len(vocab)
                merges.append((left, right))
    while len(vocab) < FIRST_SPECIAL_ID:
        vocab[f"<|unused_{len(vocab)}|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([_special(token) for token in SPECIAL_TOKENS])
    assert tokenizer.token_to_id("<|endoftext|>") == FIRST_SPECIAL_ID
    assert tokenizer.token_to_id("<|VIDEO|>") == 151656
    return tokenizer


def _special(content):
    from tokenizers import AddedToken
    return AddedToken(content, special=True, normalized=False)


def _processor(out_dir):
    from transformers import (PreTrainedTokenizerFast, Qwen2_5OmniProcessor, Qwen2VLImageProcessor,
                              WhisperFeatureExtractor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=NAMED_TOKENS, model_max_length=32768)
    tokenizer.chat_template = CHAT_TEMPLATE
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(), video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)


def _config():
    from transformers import Qwen2_5OmniConfig

    text = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": [2, 3, 3]},
                eos_token_id=151645, pad_token_id=151643)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[1], window_size=112)
    audio = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=32, num_mel_bins=128)
    config = Qwen2_5OmniConfig(thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio),
                               enable_audio_output=False)
    # Ids the real thinker config carries and the model and ms-swift read from it.
    for name, value in {"vision_start_token_id": 151652, "vision_end_token_id": 151653,
                        "vision_token_id": 151654, "ignore_index": -100}.items():
        setattr(config.thinker_config, name, value)
    return config


def build(out_dir: str) -> str:
    """Write the tiny model to ``out_dir`` (once) and return it."""
    marker = os.path.join(out_dir, "tiny_model.json")
    if os.path.exists(marker):
        return out_dir
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(_config())
    model.save_pretrained(out_dir)
    torch.save({"Chelsie": {"cond": torch.zeros(1), "ref_mel": torch.zeros(1), "bos_token": 0}},
               os.path.join(out_dir, "spk_dict.pt"))
    _processor(out_dir)
    with open(marker, "w") as f:
        json.dump({"family": "qwen2_5_omni", "parameters": sum(p.numel() for p in model.parameters())}, f)
    return out_dir


if __name__ == "__main__":
    print(build(sys.argv[1]))
