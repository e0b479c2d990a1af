"""The real ``lerobot-train``, stock vs ``--safe_media=true``, side by side in one run.

A clean dataset recorded with LeRobot's own API (2 AV1 cameras, 8 episodes of 10 frames),
ACT on the CPU (torch on one thread; tiny, or at LeRobot's own size with ``--policy act``),
20 steps, 2 DataLoader workers (``--workers``), run from LeRobot's own environment:
``--lerobot 0.4`` (``.venv-lerobot/``) or ``--lerobot 0.6`` (``.venv-lerobot-0.6/``,
LeRobot 0.6.1), both built by ``make test``. The sides: stock and ours on 0.4 (stock
forks); on 0.6, stock with LeRobot's own default start method (spawn), stock with
``--dataloader_multiprocessing_context=fork``, and ours (LeRobot's default, which
protection replaces with the warm forkserver). Rounds rotate which side goes first, so
all see the same load. Per run: wall time of the whole command, the first batch's wait
(LeRobot's own ``data_s`` at step 1 with ``--log_freq=1``: worker start-up included,
which is where spawn costs), the steady samples/s (LeRobot's per-step ``updt_s +
data_s`` over the second half of the steps, once every process has started), and the peak PSS of its whole process tree (trainer,
workers, forkserver, zygote, sandboxes; sampled every 0.2 s, as ``bench/pipeline.py``
does). Prints medians, their ratios, and the spread over rounds, with the load average.

    python bench/lerobot_train.py [--lerobot 0.4|0.6] [--rounds 3] [--steps 20] [--policy tiny|act] [--workers 2]
        [--unfrozen] [--variant-env NAME=VALUE ...]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENVS = {"0.4": REPO / ".venv-lerobot", "0.6": REPO / ".venv-lerobot-0.6"}
LEROBOT_VENV = VENVS["0.4"]
# Each side: (the extra arguments, whether protected[, its environment]).
SIDES = {"0.4": {"stock": ([], False), "ours": ([], True)},
         "0.6": {"stock-spawn": ([], False), "stock-fork": (["--dataloader_multiprocessing_context=fork"], False),
                 "ours": ([], True)}}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "TQDM_DISABLE": "1"}
THREADS = {"OMP_NUM_THREADS": "1"}  # the trainer's torch: one thread, both sides alike


def build_dataset(root: Path) -> None:
    subprocess.run([str(LEROBOT_VENV / "bin" / "python"), "-m", "tests.lerobot_scenarios", "build", str(root),
                    "8", "10", "2", "libsvtav1"], cwd=REPO, env={**os.environ, **OFFLINE}, check=True,
                   capture_output=True)


def _bench_pipeline():
    """``bench/pipeline.py``: one way to run a command and measure its process tree's memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_pipeline", Path(__file__).with_name("pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ACT's sizes: "tiny" keeps the trainer's own memory small, so the ratio shows what
# protection adds to a trainer holding almost nothing; "act" is ACT as LeRobot configures
# it (ResNet-18 backbone, 512-wide transformer, 100-step chunks; random weights: nothing is
# downloaded), what a user trains.
POLICIES = {
    "tiny": ["--policy.dim_model=32", "--policy.n_heads=2", "--policy.dim_feedforward=64",
             "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1", "--policy.chunk_size=5",
             "--policy.n_action_steps=5"],
    "act": [],
}


BATCH = 4


def train(root: Path, output_dir: Path, steps: int, side: tuple, policy: str = "tiny", workers: int = 2,
          lerobot: str = "0.4") -> tuple[float, float, float, float, str]:
    """(wall seconds, first batch's wait in seconds, steady samples/s, peak PSS in MB,
    where it was) of one lerobot-train run."""
    extra, protected, *environment = side
    no_env_eval = "--env_eval_freq=0" if lerobot == "0.6" else "--eval_freq=0"
    command = [str(VENVS[lerobot] / "bin" / "lerobot-train"), "--dataset.repo_id=local/safe_media_test",
               f"--dataset.root={root}", "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
               "--policy.pretrained_backbone_weights=null", *POLICIES[policy], f"--batch_size={BATCH}",
               f"--num_workers={workers}", f"--steps={steps}", "--log_freq=1", "--save_checkpoint=false", no_env_eval,
               "--wandb.enable=false", f"--output_dir={output_dir}", *extra]
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWIFT_SAFE_MEDIA")}
    env.update(OFFLINE, **THREADS, **(environment[0] if environment else {}))
    if protected:
        command.append("--safe_media=true")
    else:
        env["SWIFT_SAFE_MEDIA"] = "0"
    pipeline = _bench_pipeline()
    returncode, output, wall, memory = pipeline.run_measured(command, env, REPO)
    if returncode != 0 or f"step:{steps} " not in output:
        sys.exit(f"lerobot-train failed ({'ours' if protected else 'stock'}):\n{output[-3000:]}")
    first = re.search(r"step:1 .*?data_s:([0-9.]+)", output)
    # Steady: the second half of the steps, once every process has started (the warm
    # forkserver's imports, the zygote and the sandboxes run beside the first steps).
    later = [float(update) + float(data) for step, update, data in
             re.findall(r"step:(\d+) .*?updt_s:([0-9.]+) data_s:([0-9.]+)", output) if int(step) > steps // 2]
    steady = BATCH * len(later) / sum(later)
    return wall, float(first.group(1)), steady, memory.peak_kb / 1024, pipeline.describe_memory(memory.at_peak)


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main():
    global LEROBOT_VENV
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lerobot", choices=sorted(VENVS), default="0.4", help="which LeRobot (its own venv)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="tiny",
                        help="ACT's size: tiny (the trainer holds almost nothing) or act (LeRobot's defaults)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (LeRobot's default: 4)")
    parser.add_argument("--unfrozen", action="store_true", help="a side more: protected, the trainer's objects "
                        "not frozen at the forkserver's fork (SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS=0)")
    parser.add_argument("--variant-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a side more, 'variant': protected, with these variables")
    args = parser.parse_args()
    LEROBOT_VENV = VENVS[args.lerobot]
    if not (LEROBOT_VENV / "bin" / "lerobot-train").exists():
        sys.exit(f"{LEROBOT_VENV} is missing: `make test` builds it")
    sides = dict(SIDES[args.lerobot])
    if args.unfrozen:
        sides["ours-unfrozen"] = ([], True, {"SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS": "0"})
    if args.variant_env:
        sides["variant"] = ([], True, dict(item.split("=", 1) for item in args.variant_env))
    names = list(sides)
    print(f"load average before: {load()} ({os.cpu_count()} cores)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-lerobot-train-") as folder:
        root = Path(folder) / "dataset"
        build_dataset(root)
        results = {name: [] for name in names}
        for number in range(args.rounds):
            for name in names[number % len(names):] + names[:number % len(names)]:  # rotated each round
                output_dir = Path(folder) / f"out-{number}-{name}"
                results[name].append(train(root, output_dir, args.steps, sides[name], args.policy, args.workers,
                                           args.lerobot))
                print_round(number, name, results[name][-1], digits=2)
    print(f"lerobot-train {args.lerobot}, {args.policy} ACT, {args.steps} steps, {args.workers} workers, "
          f"{args.rounds} rotating rounds (medians [spread]); load average after: {load()}")
    print_medians(results, names, digits=2)


def print_round(number: int, name: str, result: tuple, digits: int = 1) -> None:
    wall, first, steady, peak, where = result
    print(f"round {number + 1} {name}: wall {wall:.1f} s, first batch {first:.{digits}f} s, "
          f"steady {steady:.{digits}f} samples/s, peak PSS {peak:.0f} MB, load {load()}\n"
          f"    PSS at the peak, MB: {where}", flush=True)


def print_medians(results: dict, names: list, digits: int = 1) -> None:
    """Per side, the medians of (wall, first batch, steady, peak PSS) [their spread]; then ours/each other side."""
    def spread(values) -> str:
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    median = {name: [statistics.median(run[index] for run in results[name]) for index in range(4)] for name in names}
    for name in names:
        wall, first, steady, peak = median[name]
        runs = results[name]
        print(f"  {name:12s} wall {wall:6.1f} s [{spread([r[0] for r in runs])}]  first batch {first:5.{digits}f} s "
              f"[{spread([r[1] for r in runs])}]  steady {steady:5.{digits}f} samples/s "
              f"[{spread([r[2] for r in runs])}]  peak PSS {peak:5.0f} MB [{spread([r[3] for r in runs])}]")
    for name in names:
        if name == "ours":
            continue
        ours, stock = median["ours"], median[name]
        memory = f"{ours[3] / stock[3]:.2f}x" if stock[3] else "not sampled"
        print(f"  ours/{name}: wall {ours[0] / stock[0]:.2f}x, first batch {ours[1] / stock[1]:.2f}x, "
              f"steady {ours[2] / stock[2]:.2f}x, peak PSS {memory}")


if __name__ == "__main__":
    main()
