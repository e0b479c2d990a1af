"""ms-swift integration benchmark (not a timed test). Prints:

1. time to first batch of ms-swift's own DataLoader pieces (LazyLLMDataset over the
   Qwen2.5-Omni template, its data_collator, 2 workers) with the safe loaders, workers
   started by spawn vs fork (spawn also proves the dataset and collator pickle);
2. the start-up hook's cost per interpreter start: the import time of
   ``_swift_safe_media_startup`` (what ``swift_safe_media.pth`` runs) from ``-X importtime``,
   and ``python -c pass`` with the hook on vs ``SWIFT_SAFE_MEDIA_STARTUP_HOOK=0``.

    python bench/swift_startup.py [WORK_DIR]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FIRST_BATCH = """
import os, sys, time, json
sys.path.insert(0, {root!r})
import swift_safe_media
swift_safe_media.enable(hosts=["swift"], timeout=30)
from swift.model import get_processor
from swift.template import get_template
from swift.dataset import load_dataset
from swift.dataset.utils import LazyLLMDataset
from torch.utils.data import DataLoader

processor = get_processor({model!r}, model_type="qwen2_5_omni", download_model=False)
template = get_template(processor, max_length=4096)
template.set_mode("train")
dataset = load_dataset({dataset!r}, num_proc=1)[0]
loader = DataLoader(LazyLLMDataset(dataset, template.encode, random_state=42), batch_size=1, num_workers=2,
                    collate_fn=template.data_collator, multiprocessing_context={context!r})
start = time.perf_counter()
batch = next(iter(loader))
print(json.dumps({{"first_batch_s": time.perf_counter() - start, "keys": sorted(batch)[:4]}}))
"""


def first_batch_seconds(built: dict, context: str, env: dict) -> float:
    import json
    code = FIRST_BATCH.format(root=ROOT, model=built["model"], dataset=built["good_dataset"], context=context)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["first_batch_s"]


def hook_import_us() -> float:
    """Cumulative import time of the start-up hook module, in microseconds."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True)
    for line in done.stderr.splitlines():
        if line.rstrip().endswith("_swift_safe_media_startup"):
            return float(line.split("|")[1])
    raise RuntimeError("the start-up hook is not installed (pip install the package, not -e)")


def interpreter_start_ms(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    from tests import swift_scenario

    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="bench_swift_")
    built = swift_scenario.build(work)
    good = {name: path for name, path in built.items() if name.startswith("good_")}
    good_dir = swift_scenario.Path(work) / "good"
    good_dir.mkdir(exist_ok=True)
    built["good_dataset"] = swift_scenario.build_dataset(good_dir, good)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env.update(swift_scenario.RUN_ENV)

    print("time to first batch, ms-swift LazyLLMDataset + data_collator, 2 workers, safe loaders:")
    for context in ("fork", "spawn", "fork", "spawn"):
        print(f"  {context:6s} {first_batch_seconds(built, context, env):6.2f} s")

    imports = [hook_import_us() for _ in range(20)]
    print(f"start-up hook import (-X importtime, cumulative), median of 20: {statistics.median(imports):.0f} us")
    on, off = [], []
    for _ in range(20):
        on.append(interpreter_start_ms(env))
        off.append(interpreter_start_ms({**env, "SWIFT_SAFE_MEDIA_STARTUP_HOOK": "0"}))
    print(f"python -c pass, median of 20: hook on {statistics.median(on):.1f} ms, "
          f"hook off (SWIFT_SAFE_MEDIA_STARTUP_HOOK=0) {statistics.median(off):.1f} ms")


if __name__ == "__main__":
    main()
