"""What a spawned DataLoader worker receives of ms-swift's ``LazyLLMDataset(dataset,
template.encode)`` when the template holds the model (as ms-swift's sft sets it for the
Qwen2-VL/Omni templates).

``python -m tests.programs.template_in_a_worker MODEL_DIR`` builds the Qwen2.5-Omni
template over the tiny model in MODEL_DIR, sets ``template.model``, and prints one JSON
line: where ms-swift comes from, whether the template uses the model, the model's weight
bytes, the dataset's pickled size for a spawned child and as a plain pickle, whether
``copy.copy`` keeps the model, and (from one spawned worker) whether the worker's template
has the model and the keys of a row it encoded.
"""

from __future__ import annotations

import copy
import json
import pickle
import sys
from multiprocessing import context, reduction

from torch.utils.data import DataLoader, Dataset
from swift.dataset.utils import LazyLLMDataset
from swift.model import get_processor
from swift.template import get_template


class Probe(Dataset):  # what the worker holds: its template's model, and a row encoded by it
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return {"model_in_worker": self.dataset.encode_func.__self__.model is not None,
                "encoded": sorted(self.dataset[index])}


def spawn_pickled_size(value):  # what multiprocessing writes for a spawned child
    context.set_spawning_popen(object())
    try:
        return len(reduction.ForkingPickler.dumps(value))
    finally:
        context.set_spawning_popen(None)


def main(model_dir: str) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration
    import swift

    template = get_template(get_processor(model_dir, model_type="qwen2_5_omni", download_model=False))
    template.set_mode("train")
    template.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir)  # as ms-swift's sft does
    rows = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}]
    dataset = LazyLLMDataset(rows, template.encode)
    loader = DataLoader(Probe(dataset), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    print(json.dumps({"swift": swift.__file__, "uses_model": template.use_model,
                      "weights": sum(p.numel() * p.element_size() for p in template.model.parameters()),
                      "spawn_pickled": spawn_pickled_size(dataset), "pickled": len(pickle.dumps(dataset)),
                      "copy_keeps_model": copy.copy(template).model is template.model,
                      **next(iter(loader))}))


if __name__ == "__main__":
    main(sys.argv[1])
