"""The real ``llamafactory-cli train``, stock vs ``safe_media: true``, side by side in one run.

A tiny random Qwen2.5-Omni, LoRA on the CPU with the ``qwen2_omni`` template (torch on one
thread), over a clean dataset of 2 s h264+aac clips (as videos) and 1 s tones (as audios),
batch size 2, 2 DataLoader workers, from LLaMA-Factory 0.9.5's own environment
(``.venv-llamafactory/``, built by ``make test``). Stock's workers fork from the trainer;
ours start from the warm forkserver. Rounds alternate which side goes first, so both see
the same load. Per run: the wall time of the whole command, the first batch's wait (from
the moment the trainer has its DataLoader to the first training step: worker start-up and
the first collation, where every media file of the batch is decoded again), the steady
samples/s (the second half of the steps), and the peak PSS of the whole process tree
(trainer, workers, forkserver, zygote, sandboxes; sampled every 0.2 s, as
``bench/pipeline.py`` does). The same timing hooks run on both sides: the command is
``python bench/llamafactory.py --run CONFIG``, which times ``Trainer.get_train_dataloader``
and ``Trainer.training_step`` and then runs LLaMA-Factory's own CLI.

    python bench/llamafactory.py [--rounds 3] [--rows 32] [--roots] [--exec] [--per-call] [--unfrozen]
        [--variant-env NAME=VALUE ...] [--no-memory]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-llamafactory"
BATCH, WORKERS = 2, 2
TIMINGS = "BENCH_LLAMAFACTORY_TIMINGS"


def run_cli(config: str) -> None:
    """In LLaMA-Factory's interpreter: time the DataLoader and every step, then run the CLI.
    The Trainer is timed once LLaMA-Factory imports it, so LLaMA-Factory is the first thing
    imported, as under ``llamafactory-cli`` (where the start-up hook sees it begin)."""
    from swift_safe_media.patching import import_hooks

    marks = {"loader": None, "steps": []}

    def instrument(module):
        stock_loader, stock_step = module.Trainer.get_train_dataloader, module.Trainer.training_step

        def get_train_dataloader(self, *args, **kwargs):
            loader = stock_loader(self, *args, **kwargs)
            marks["loader"] = time.perf_counter()
            return loader

        def training_step(self, *args, **kwargs):
            marks["steps"].append(time.perf_counter())
            return stock_step(self, *args, **kwargs)

        module.Trainer.get_train_dataloader, module.Trainer.training_step = get_train_dataloader, training_step

    import_hooks.when_imported("transformers.trainer", instrument)
    sys.argv = ["llamafactory-cli", "train", config]
    here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]  # not this file: the package
    from llamafactory.cli import main

    try:
        main()
    finally:
        with open(os.environ[TIMINGS], "w") as out:
            json.dump(marks, out)


def _bench(name: str):
    """Another bench script as a module (``pipeline``: running a command and measuring its
    process tree's memory; ``lerobot_train``: printing rounds and medians)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(folder: Path, rows: int) -> dict:
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "tests.llamafactory_scenario", str(folder)], cwd=REPO,
                          env={**os.environ, "SWIFT_SAFE_MEDIA": "0"}, capture_output=True, text=True, check=True)
    built = json.loads(done.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(REPO))
    from tests import llamafactory_scenario as scenario

    good = [path for name, path in sorted(built.items()) if name.startswith(("media:good_", "media:tone_"))]
    scenario.build_dataset(folder, [good[index % len(good)] for index in range(rows)], "bench")
    return built


def train(built: dict, folder: Path, name: str, protected: bool,
          variables: dict | None = None, sample_memory: bool = True) -> tuple[float, float, float, float, str]:
    """(wall seconds, first batch's wait in seconds, steady samples/s, peak PSS in MB, where it was)."""
    from tests import llamafactory_scenario as scenario

    config = folder / f"{name}.yaml"
    extra = {"safe_media": True} if protected else {}
    config.write_text(scenario.yaml_text(built["model"], built["dataset_dir"], str(folder / f"out-{name}"),
                                         dataset="bench", workers=WORKERS, batch=BATCH, extra=extra))
    timings = folder / f"{name}.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env.update(scenario.OFFLINE, OMP_NUM_THREADS="1", **{TIMINGS: str(timings)})
    if not protected:
        env["SWIFT_SAFE_MEDIA"] = "0"
    if name.endswith("roots"):  # the dataset's folder named: pooled confined sandboxes, not one per call
        env["SWIFT_SAFE_MEDIA_READ_ROOTS"] = str(folder)
    if name.endswith("exec"):  # the warm forkserver started by exec, as before issue 45
        env["SWIFT_SAFE_MEDIA_FORKSERVER_FROM_TRAINER"] = "0"
    if name.endswith("unfrozen"):  # the trainer's objects not frozen at the forkserver's fork
        env["SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS"] = "0"
    if name.endswith("per-call"):  # a sandbox per read, as before the open broker
        env["SWIFT_SAFE_MEDIA_OPEN_BROKER"] = "0"
    env.update(variables or {})
    pipeline = _bench("pipeline")
    command = [str(VENV / "bin" / "python"), str(Path(__file__).resolve()), "--run", str(config)]
    returncode, output, wall, memory = pipeline.run_measured(command, env, REPO, sample_memory=sample_memory)
    if returncode != 0 or "Training completed" not in output:
        sys.exit(f"llamafactory-cli train failed ({name}):\n{output[-3000:]}")
    marks = json.loads(timings.read_text())
    steps = marks["steps"]
    half = len(steps) // 2
    steady = BATCH * (len(steps) - 1 - half) / (steps[-1] - steps[half])
    return wall, steps[0] - marks["loader"], steady, memory.peak_kb / 1024, pipeline.describe_memory(memory.at_peak)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32, help="rows of the dataset (one epoch, batch size 2)")
    parser.add_argument("--roots", action="store_true",
                        help="a third side: protected, with the dataset's folder in SWIFT_SAFE_MEDIA_READ_ROOTS")
    parser.add_argument("--exec", action="store_true",
                        help="a side more: protected, the warm forkserver started by exec (not forked from the trainer)")
    parser.add_argument("--per-call", action="store_true",
                        help="a side more: protected, a sandbox per read (SWIFT_SAFE_MEDIA_OPEN_BROKER=0)")
    parser.add_argument("--unfrozen", action="store_true", help="a side more: protected, the trainer's objects "
                        "not frozen at the forkserver's fork (SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS=0)")
    parser.add_argument("--variant-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a side more, 'variant': protected, with these variables")
    parser.add_argument("--no-memory", action="store_true", help="time the runs with nothing sampling their "
                        "memory (every sample reads each process's smaps_rollup); peak PSS is then 0")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one side, inside LLaMA-Factory's interpreter
    args = parser.parse_args()
    if args.run:
        return run_cli(args.run)
    if not (VENV / "bin" / "llamafactory-cli").exists():
        sys.exit(f"{VENV} is missing: `make test` builds it")
    names = ["stock", "ours"] + (["ours-roots"] if args.roots else []) + (["ours-exec"] if args.exec else []) + \
        (["ours-per-call"] if args.per_call else []) + (["ours-unfrozen"] if args.unfrozen else []) + \
        (["variant"] if args.variant_env else [])
    variant = dict(item.split("=", 1) for item in args.variant_env)
    report = _bench("lerobot_train")
    load = report.load
    print(f"load average before: {load()} ({os.cpu_count()} cores)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-llamafactory-") as folder:
        folder = Path(folder)
        built = build(folder, args.rows)
        results = {name: [] for name in names}
        for number in range(args.rounds):
            for name in names[number % len(names):] + names[:number % len(names)]:  # rotated each round
                results[name].append(train(built, folder, f"{number}-{name}", name != "stock",
                                           variant if name == "variant" else {}, not args.no_memory))
                report.print_round(number, name, results[name][-1], digits=2)
    print(f"llamafactory-cli train 0.9.5, tiny Qwen2.5-Omni LoRA, {args.rows} rows, batch {BATCH}, {WORKERS} workers, "
          f"{args.rounds} alternating rounds (medians [spread]); load average after: {load()}")
    report.print_medians(results, names, digits=2)


if __name__ == "__main__":
    main()
