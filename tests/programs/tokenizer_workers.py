"""A DataLoader whose dataset holds a Hugging Face fast tokenizer (a real ``tokenizers.Tokenizer``
with Qwen2.5's vocabulary size, ``tests.tiny_models``), 2 workers started from the warm
forkserver under ``enable()``.

``python -m tests.programs.tokenizer_workers`` prints one JSON object: each item's token ids as
a worker encoded them and as this process does, the workers' parent and the forkserver, how many
times the tokenizer's reduction was computed and given again while the loader started its
workers (``workers.reduced_once``), and whether ``copyreg.dispatch_table`` is as before after.
"""

from __future__ import annotations

import copyreg
import json
import os

import swift_safe_media
from swift_safe_media import process
from swift_safe_media.workers import reduced_once
from torch.utils.data import DataLoader, Dataset

from tests import tiny_models

TEXTS = ["a clip of 2 s", "héllo wörld", "<tool_call>", "0123456789 " * 3]


class Encoding(Dataset):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __len__(self):
        return len(TEXTS)

    def __getitem__(self, index):
        return {"index": index, "ids": self.tokenizer.encode(TEXTS[index]).ids, "ppid": os.getppid()}


def main():
    from multiprocessing import forkserver

    swift_safe_media.enable(hosts=[])
    process.current().shared_zygote.ready.wait(120)
    tokenizer = tiny_models._byte_level_tokenizer()
    table_before = dict(copyreg.dispatch_table)
    seen = []
    compute = reduced_once.KeptReductions.__call__

    def counting(self, obj):  # the real reducer, its counts noted after each pickle of the tokenizer
        result = compute(self, obj)
        seen.append({"computed": self.computed, "given": self.given})
        return result
    reduced_once.KeptReductions.__call__ = counting
    loader = DataLoader(Encoding(tokenizer), batch_size=None, num_workers=2)
    items = list(loader)
    return {"items": items, "expected": [tokenizer.encode(text).ids for text in TEXTS],
            "forkserver": forkserver._forkserver._forkserver_pid, "counts": seen[-1] if seen else None,
            "table_restored": dict(copyreg.dispatch_table) == table_before,
            "context": type(loader.multiprocessing_context).__name__}


if __name__ == "__main__":
    print(json.dumps(main()))
