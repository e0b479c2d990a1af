"""The real ``lerobot-train``, stock vs ``--safe_media=true``, side by side in one run.

A clean dataset recorded with LeRobot's own API (2 AV1 cameras, 8 episodes of 10 frames),
ACT on the CPU (torch on one thread; tiny, or at LeRobot's own size with ``--policy act``),
20 steps, 2 DataLoader workers (``--workers``), run from LeRobot's own environment
(``.venv-lerobot/``, built by ``make test``). Rounds alternate which side goes first, so
both see the same load. Per run: wall time of the whole command, and the first batch's
wait (LeRobot's own ``data_s`` at step 1 with ``--log_freq=1``: worker start-up included,
which is where spawn costs), and the peak PSS of its whole process tree (trainer, workers,
forkserver, zygote, sandboxes; sampled every 0.2 s, as ``bench/pipeline.py`` does).
Prints medians, their ratio, and the spread over rounds.

    python bench/lerobot_train.py [--rounds 3] [--steps 20] [--policy tiny|act] [--workers 2]
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
LEROBOT_VENV = REPO / ".venv-lerobot"
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


def train(root: Path, output_dir: Path, steps: int, protected: bool,
          policy: str = "tiny", workers: int = 2) -> tuple[float, float, float, str]:
    """(wall seconds, first batch's wait in seconds, peak PSS in MB, where it was) of one
    lerobot-train run."""
    command = [str(LEROBOT_VENV / "bin" / "lerobot-train"), "--dataset.repo_id=local/safe_media_test",
               f"--dataset.root={root}", "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
               "--policy.pretrained_backbone_weights=null", *POLICIES[policy], "--batch_size=4", f"--num_workers={workers}",
               f"--steps={steps}", "--log_freq=1", "--save_checkpoint=false", "--eval_freq=0",
               "--wandb.enable=false", f"--output_dir={output_dir}"]
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWIFT_SAFE_MEDIA")}
    env.update(OFFLINE, **THREADS)
    if protected:
        command.append("--safe_media=true")
    else:
        env["SWIFT_SAFE_MEDIA"] = "0"
    pipeline = _bench_pipeline()
    returncode, output, wall, memory = pipeline.run_measured(command, env, REPO)
    if returncode != 0 or f"step:{steps} " not in output:
        sys.exit(f"lerobot-train failed ({'ours' if protected else 'stock'}):\n{output[-3000:]}")
    first = re.search(r"step:1 .*?data_s:([0-9.]+)", output)
    return wall, float(first.group(1)), memory.peak_kb / 1024, pipeline.describe_memory(memory.at_peak)


def spread(values) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="tiny",
                        help="ACT's size: tiny (the trainer holds almost nothing) or act (LeRobot's defaults)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (LeRobot's default: 4)")
    args = parser.parse_args()
    if not (LEROBOT_VENV / "bin" / "lerobot-train").exists():
        sys.exit(f"{LEROBOT_VENV} is missing: `make test` builds it")
    with tempfile.TemporaryDirectory(prefix="bench-lerobot-train-") as folder:
        root = Path(folder) / "dataset"
        build_dataset(root)
        results = {False: [], True: []}
        for number in range(args.rounds):
            for protected in ((False, True) if number % 2 == 0 else (True, False)):
                output_dir = Path(folder) / f"out-{number}-{int(protected)}"
                results[protected].append(train(root, output_dir, args.steps, protected, args.policy, args.workers))
                wall, first, peak, where = results[protected][-1]
                print(f"round {number + 1} {'ours ' if protected else 'stock'}: wall {wall:.1f} s, "
                      f"first batch {first:.1f} s, peak PSS {peak:.0f} MB\n    PSS at the peak, MB: {where}",
                      flush=True)
    stock_wall, ours_wall = ([run[0] for run in results[side]] for side in (False, True))
    stock_first, ours_first = ([run[1] for run in results[side]] for side in (False, True))
    stock_peak, ours_peak = ([run[2] for run in results[side]] for side in (False, True))
    print(f"lerobot-train, {args.policy} ACT, {args.steps} steps, {args.workers} workers, {args.rounds} alternating rounds (medians, spread):")
    print(f"  wall time   ours/stock {statistics.median(ours_wall) / statistics.median(stock_wall):.2f}x "
          f"({statistics.median(ours_wall):.1f} s [{spread(ours_wall)}] vs "
          f"{statistics.median(stock_wall):.1f} s [{spread(stock_wall)}])")
    print(f"  first batch ours-stock {statistics.median(ours_first) - statistics.median(stock_first):+.1f} s "
          f"({statistics.median(ours_first):.1f} s [{spread(ours_first)}] vs "
          f"{statistics.median(stock_first):.1f} s [{spread(stock_first)}])")
    print(f"  peak PSS    ours/stock {statistics.median(ours_peak) / statistics.median(stock_peak):.2f}x "
          f"({statistics.median(ours_peak):.0f} MB [{spread(ours_peak)}] vs "
          f"{statistics.median(stock_peak):.0f} MB [{spread(stock_peak)}])")


if __name__ == "__main__":
    main()
