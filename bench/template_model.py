"""What each way of giving DataLoader workers a template's model costs (issue 27: the
templates that read ``self.model`` while they encode). Not a timed test. Prints:

1. fork: a trainer holding W GiB of weights (touched tensors) forks a worker that touches
   nothing and exits; the time to ``fork()`` and the worker's private memory: what
   protection does for those templates (their workers fork, as stock ms-swift's do);
2. weights sent: the same model as an argument of a spawned worker (ms-swift 4.0-4.5
   shipped the template with it): seconds until the worker has it, against a worker
   without it, and the worker's private memory;
3. dummy model: ms-swift's ``_get_model()`` in a fresh worker-like process (the dummy model,
   on the meta device, built from the model folder), for Qwen2.5-Omni at its real 7B
   size: what a worker pays where encoding reaches the model only through it, and what
   giving every template a dummy model would cost; it has no weights, so the two
   templates whose encoding runs a network (Step-Audio's audio tokenizer, MiMo-V2's) cannot
   use it at all.

    .venv/bin/python bench/template_model.py [--gib 2] [--repeats 5] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def private_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Clean", "Private_Dirty")))


def weights(gib: float):
    import torch

    layers = max(1, int(gib * 8))  # 128 MiB each
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 8192, bias=False) for _ in range(layers)))
    for parameter in model.parameters():
        parameter.data.normal_()  # touched: resident, as a loaded model is
    return model


def fork_cost(repeats: int) -> tuple[list[float], list[int]]:
    seconds, private = [], []
    for _ in range(repeats):
        ready_r, ready_w = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.write(ready_w, b"x")
            time.sleep(0.3)  # while the parent reads its memory
            os._exit(0)
        seconds.append(time.perf_counter() - start)
        os.read(ready_r, 1)
        private.append(private_kib(pid))
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
    return seconds, private


def _report_ready(model, ready) -> None:
    ready.send((time.perf_counter(), private_kib(os.getpid())))


def spawn_cost(model, repeats: int) -> tuple[list[float], list[float], list[int]]:
    """Seconds from start() until a spawned child has unpickled its argument: with the
    model (torch moves each tensor's storage to shared memory and passes the child a file
    descriptor per storage) and with a one-element tensor; the child's private memory with the model."""
    import multiprocessing

    import torch

    context = multiprocessing.get_context("spawn")
    small = torch.zeros(1)  # the child imports torch either way
    with_model, without, private = [], [], []
    for _ in range(repeats):
        for argument, into in ((model, with_model), (small, without)):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_report_ready, args=(argument, send))
            start = time.perf_counter()
            child.start()
            ready, memory = receive.recv()
            into.append(ready - start)
            if argument is not None:
                private.append(memory)
            child.join()
    return with_model, without, private


DUMMY = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from swift.model import get_processor
from swift.template import get_template
import swift.model, torch  # what a worker has imported before it encodes
template = get_template(get_processor({model!r}, model_type="qwen2_5_omni", download_model=False))
def private_mib():
    with open("/proc/self/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Clean", "Private_Dirty"))) / 1024
before = private_mib()
start = time.perf_counter()
model = template._get_model()
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "mib_added": private_mib() - before,
                  "parameters": sum(p.numel() for p in model.parameters())}}))
"""


def real_size_omni(work: str) -> str:
    """The tiny Qwen2.5-Omni's folder (tokenizer, processor) with the 7B model's config."""
    from tests import tiny_models

    folder = tiny_models.build(os.path.join(work, "omni_7b"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    thinker = config["thinker_config"]
    thinker["text_config"].pop("layer_types", None)
    thinker["text_config"].update(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4)
    thinker["vision_config"].update(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
    thinker["audio_config"].update(encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                                   d_model=1280, output_dim=3584)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def dummy_cost(work: str, repeats: int) -> list[dict]:
    model = real_size_omni(work)
    found = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", DUMMY.format(root=ROOT, model=model)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                           "MODELSCOPE_OFFLINE": "1", "SWIFT_SAFE_MEDIA": "0"})
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return found


def spread(values, unit="", scale=1.0) -> str:
    values = [value * scale for value in values]
    return f"median {statistics.median(values):.3g}{unit} (min {min(values):.3g}, max {max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="weights the trainer holds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default=None)
    options = parser.parse_args()
    work = options.work or tempfile.mkdtemp(prefix="template-model-")

    model = weights(options.gib)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"trainer holds {held / 2**30:.2f} GiB of weights, private {private_kib(os.getpid()) / 2**20:.2f} GiB")
    seconds, private = fork_cost(options.repeats)
    print(f"(a) fork: fork() {spread(seconds, ' ms', 1e3)}; worker's private memory {spread(private, ' MiB', 1 / 1024)}")
    with_model, without, private = spawn_cost(model, options.repeats)
    print(f"(b) weights sent to a spawned worker: ready after {spread(with_model, ' s')} "
          f"(without them {spread(without, ' s')}); its private memory {spread(private, ' MiB', 1 / 1024)}; "
          f"the trainer's weights now live in shared memory (CPU; a model on a GPU goes by CUDA IPC, "
          f"a CUDA context in every worker)")
    del model
    dummy = dummy_cost(work, options.repeats)
    print(f"(b) dummy model (Qwen2.5-Omni 7B config, meta device, {dummy[0]['parameters'] / 1e9:.1f}B parameters) "
          f"per worker: {spread([d['seconds'] for d in dummy], ' s')}, private memory added "
          f"{spread([d['mib_added'] for d in dummy], ' MiB')}")


if __name__ == "__main__":
    main()
