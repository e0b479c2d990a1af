"""Protection's cost on real training pipelines: stock (fork, no protection) against
protected (our defaults), side by side in one run, alternating rounds. Not a timed test.

- ms-swift: its own pipeline, ``LazyLLMDataset(dataset, template.encode)`` with
  ``template.data_collator`` through a torch DataLoader (batch size 1), the Qwen2.5-Omni
  template with ``USE_AUDIO_IN_VIDEO=1``, a tiny random model built here and attached to
  the template as ``swift sft`` does, rows of 480p/720p h264+aac clips of 8-12 s made with
  ffmpeg;
- LeRobot: ``LeRobotDataset`` (2 cameras, recorded with LeRobot's API as in
  bench/lerobot.py) through a shuffled DataLoader drawn with LeRobot's ``cycle``.

Each side runs in a fresh interpreter (its own imports, its own workers). Printed per
pipeline: the first batch (s), steady samples/s after it, and the peak PSS of the whole
process tree (the interpreter, its workers, zygotes and sandboxes; every descendant's
``/proc/<pid>/smaps_rollup`` summed, sampled every 0.2 s from this process), medians
over rounds and the protected/stock ratios against the targets (first batch <= 1.25x,
steady >= 1.0x, peak PSS <= 1.3x). ``--breakdown`` adds where a protected worker's
first batch goes, the pickled size of what each worker receives, and our own modules'
import time in a worker.

    .venv/bin/python bench/pipeline.py [--rows 6] [--rounds 2] [--workers 2]
        [--only swift|lerobot] [--lerobot-setup-seconds 0] [--protected-context spawn|forkserver|fork|default]
        [--protected-env SWIFT_SAFE_MEDIA_THREADS=1 ...] [--stock-context fork] [--breakdown]
        [--variant-env SWIFT_SAFE_MEDIA_FREEZE_TRAINER_OBJECTS=0 ...]

The issue's full run: ``--rows 24 --rounds 3 --lerobot-batches 60``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/lerobot.py sits next to this file: keep this folder from shadowing the lerobot package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

TARGETS = {"first_batch_s": ("<=", 1.25), "steady_samples_per_s": (">=", 1.0), "peak_pss_mb": ("<=", 1.3)}
SWIFT_ENV = {"USE_AUDIO_IN_VIDEO": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "MODELSCOPE_OFFLINE": "1"}
SIZES = ("854x480", "1280x720")


# -- inputs, made once under --work ----------------------------------------------------
def _ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args],
                   check=True, stdin=subprocess.DEVNULL, timeout=600)


def build_swift_inputs(work: Path, rows: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests import tiny_models

    model = tiny_models.build(str(work / "tiny_qwen2_5_omni"))
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(rows):
        size, seconds = SIZES[index % 2], 8 + (index * 3) % 5  # 480p and 720p, 8-12 s
        clip = media / f"clip_{index}_{size}_{seconds}s.mp4"
        if not clip.exists():
            _ffmpeg("-f", "lavfi", "-i", f"testsrc2=size={size}:rate=30:duration={seconds}",
                    "-f", "lavfi", "-i", f"sine=frequency={220 + 40 * index}:sample_rate=44100:duration={seconds}",
                    "-c:v", "libx264", "-preset", "veryfast", "-pix_fmt", "yuv420p", "-c:a", "aac",
                    "-shortest", str(clip) + ".tmp.mp4")
            os.replace(str(clip) + ".tmp.mp4", clip)
        lines.append(json.dumps({"messages": [{"role": "user", "content": "<video>What happens here?"},
                                              {"role": "assistant", "content": "a test pattern and a tone"}],
                                 "videos": [str(clip)]}))
    dataset = work / f"rows_{rows}.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    return {"model": model, "dataset": str(dataset)}


def _bench_lerobot():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lerobot", Path(__file__).with_name("lerobot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_lerobot_inputs(work: Path, seconds: int, python: str = sys.executable) -> dict:
    """The episode, recorded with the LeRobot of ``python`` (its own API and encoder)."""
    tag = "" if python == sys.executable else "_" + subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('lerobot'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    root = work / f"lerobot_{seconds}s{tag}"
    if not (root / "meta" / "info.json").exists():
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        if python == sys.executable:
            _bench_lerobot().record_episode(root, seconds)
        else:
            subprocess.run([python, __file__, "--record-lerobot", str(root), str(seconds)], check=True,
                           env={**os.environ, "SWIFT_SAFE_MEDIA": "0"})
    return {"root": str(root)}


# -- memory of a process tree ----------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def _memory_kb(pid: int) -> dict:
    """Pss, its anonymous, file-backed and shared-memory (memfd: results crossing to or kept by
    a sandbox) parts, and what only this process holds (USS), in kB."""
    wanted = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem",
              "Private_Clean:": "uss", "Private_Dirty:": "uss"}
    found = {"pss": 0, "anon": 0, "file": 0, "shmem": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    found[wanted[name]] += int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


def _role(pid: int, root: int, forkservers: set) -> str:
    """What a process of the tree is: the run itself, a DataLoader worker, the forkserver,
    the zygote, a sandbox, a holding server (a loader's dataset held ahead) or another helper."""
    if pid == root:
        return "parent"
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "gone"
    if comm in ("ssm-zygote", "ssm-sandbox"):
        return comm[4:]
    if comm == "ssm-holding":
        return "holding server"
    if "resource_tracker" in cmdline:
        return "helper"
    if comm == "ssm-forkserver" or ("multiprocessing.forkserver" in cmdline and parent not in forkservers):
        forkservers.add(pid)
        return "forkserver"
    return "worker"


class TreeMemory(threading.Thread):
    """Peak of the summed PSS of a process and all its descendants, and how that peak
    divides between the kinds of process (parent, workers, forkserver, zygote, sandboxes,
    holding servers)."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak_kb, self.processes = pid, every, 0, 0
        self.at_peak: dict[str, dict] = {}
        self.done = threading.Event()

    def run(self):
        forkservers: set = set()
        while not self.done.is_set():
            tree = _descendants(self.pid)
            roles: dict[str, dict] = {}
            for pid in tree:
                memory = _memory_kb(pid)
                role = roles.setdefault(_role(pid, self.pid, forkservers), {"count": 0, **dict.fromkeys(memory, 0)})
                role["count"] += 1
                for key, value in memory.items():
                    role[key] += value
            total = sum(role["pss"] for role in roles.values())
            if total > self.peak_kb:
                self.peak_kb, self.at_peak = total, roles
            self.processes = max(self.processes, len(tree))
            self.done.wait(self.every)


def describe_memory(at_peak: dict) -> str:
    """'parent 612 (anon 380, uss 420), 2 workers 480 (...)' in MB, at the peak."""
    order = ("parent", "worker", "holding server", "forkserver", "zygote", "sandbox", "helper")
    parts = []
    for role in sorted(at_peak, key=lambda name: order.index(name) if name in order else len(order)):
        facts = at_peak[role]
        count = f"{facts['count']} " if facts["count"] > 1 else ""
        plural = ("es" if role.endswith("x") else "s") if facts["count"] > 1 else ""
        parts.append(f"{count}{role}{plural} {facts['pss'] / 1024:.0f} "
                     f"(anon {facts['anon'] / 1024:.0f}, file {facts['file'] / 1024:.0f}, "
                     f"shmem {facts['shmem'] / 1024:.0f}, "
                     f"own {facts['uss'] / 1024:.0f})")
    return ", ".join(parts)


# -- one side, in a fresh interpreter ----------------------------------------------------
def run_side(pipeline: str, side: str, args, inputs: dict, extra_env: dict, timeout: float = 1200) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env.update(SWIFT_ENV)
    env.update(extra_env)
    command = [sys.executable, __file__, "--child", pipeline, "--side", side, "--workers", str(args.workers),
               "--inputs", json.dumps(inputs), "--lerobot-batches", str(args.lerobot_batches),
               "--batch-size", str(args.batch_size), "--lerobot-setup-seconds", str(args.lerobot_setup_seconds)]
    context = args.protected_context if side == "protected" else args.stock_context
    if context:
        command += ["--context", context]
    if args.breakdown_dir:
        command += ["--breakdown-dir", args.breakdown_dir]
    if pipeline == "lerobot":
        command[0] = args.lerobot_python
    elif side == "protected":
        command += ["--safe_media", "true"]  # ms-swift's flag, as on its command line
    result, memory = run_child_measured(command, env, ROOT, timeout, f"{pipeline} {side}")
    return {**result, "peak_pss_mb": memory.peak_kb / 1024, "processes": memory.processes,
            "memory_at_peak": memory.at_peak}


def run_measured(command: list[str], env: dict, cwd, timeout: float | None = None, sample_memory: bool = True):
    """Run ``command`` while sampling its process tree's memory: (exit code, its output,
    wall seconds until it exited, the ``TreeMemory``). Killed after ``timeout``. Without
    ``sample_memory``, nothing reads the tree while it runs (each sample reads every process's
    ``smaps_rollup``, which walks its page tables under its memory map's lock), and the memory
    is 0."""
    with tempfile.TemporaryFile("w+") as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=str(cwd))
        memory = TreeMemory(process.pid)
        if sample_memory:
            memory.start()
        try:
            process.wait(timeout)
            wall = time.perf_counter() - started
        finally:
            memory.done.set()
            if sample_memory:
                memory.join()
            if process.poll() is None:
                process.kill()
                process.wait()
        output.seek(0)
        return process.returncode, output.read(), wall, memory


def run_child_measured(command: list[str], env: dict, cwd, timeout: float | None, what: str):
    """Run a bench's child side (:func:`run_measured`): (the figures it printed last, as a
    ``{"first_batch_s": ...}`` line of JSON, and the ``TreeMemory``); raises with its output
    if it failed or printed none."""
    returncode, text, _, memory = run_measured(command, env, cwd, timeout)
    results = [json.loads(line) for line in text.splitlines() if line.startswith('{"first_batch_s"')]
    if returncode != 0 or not results:
        raise RuntimeError(f"{what} failed (exit {returncode}):\n{text[-4000:]}")
    return results[-1], memory


def child_swift(args, inputs: dict) -> dict:
    """The protected side goes as ``swift sft --safe_media true`` does: the flag is on its
    command line (the start-up hook sees it as ms-swift begins importing), and ``enable()``
    comes once ms-swift is imported, where ms-swift's parser calls it."""
    import torch
    from torch.utils.data import DataLoader

    from swift.dataset import load_dataset
    from swift.dataset.utils import LazyLLMDataset
    from swift.model import get_processor
    from swift.template import get_template

    if args.side == "protected":
        import swift_safe_media

        swift_safe_media.enable(hosts=["swift"])  # what --safe_media true does when the arguments are parsed
    from transformers import Qwen2_5OmniForConditionalGeneration  # as swift sft loads the model: after

    processor = get_processor(inputs["model"], model_type="qwen2_5_omni", download_model=False)
    template = get_template(processor)
    template.set_mode("train")
    template.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(inputs["model"])  # as swift sft does
    dataset = load_dataset(inputs["dataset"], num_proc=1)[0]
    rows = LazyLLMDataset(dataset, template.encode, random_state=42)
    chosen = None
    if args.side == "protected":
        # What the adapter's parse_args adds (--dataloader_multiprocessing_context) for swift sft.
        from swift_safe_media import config

        chosen = config.mp_context()
    context = _context(args, chosen)
    loader = DataLoader(rows, batch_size=1, num_workers=args.workers, collate_fn=template.data_collator,
                        worker_init_fn=_instrument_worker if args.breakdown_dir else None, **context)
    if args.breakdown_dir:
        _note_what_workers_receive(args.breakdown_dir, {"dataset": rows, "collate_fn": template.data_collator})
    return _timed_batches(loader, len(rows), args.breakdown_dir)


def child_lerobot(args, inputs: dict) -> dict:
    if args.side == "protected":
        import swift_safe_media

        swift_safe_media.enable(hosts=["lerobot"])  # what --safe_media=true does
    import torch
    from torch.utils.data import DataLoader

    import inspect

    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    try:
        from lerobot.utils.utils import cycle  # LeRobot 0.6
    except ImportError:
        from lerobot.datasets.utils import cycle

    # As lerobot-train makes it: LeRobot 0.6's gives uint8 frames, converted on the trainer's side.
    uint8 = "return_uint8" in inspect.signature(LeRobotDataset.__init__).parameters
    dataset = LeRobotDataset(_bench_lerobot().REPO_ID, root=inputs["root"], **({"return_uint8": True} if uint8 else {}))
    # lerobot-train makes (or loads) its policy between parsing its arguments, where
    # protection starts, and its first batch; this pipeline alone has no model to load.
    time.sleep(args.lerobot_setup_seconds)
    # LeRobot 0.6's lerobot-train keeps its workers across epochs and prefetches 4 batches each.
    workers_as_lerobot_train = {"persistent_workers": True, "prefetch_factor": 4} if uint8 and args.workers else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(0), drop_last=True, **_context(args),
                        **workers_as_lerobot_train)
    batches = cycle(loader)  # how lerobot-train draws batches (and where protection picks the start method)
    result = _timed_batches(batches, args.lerobot_batches, None)  # its workers start at the first next()
    result["samples_per_batch"] = args.batch_size
    result["steady_samples_per_s"] *= args.batch_size
    return result


def _context(args, chosen_by_protection: str | None = None) -> dict:
    """The DataLoader's start method: --context, else the one protection writes for the
    host (ms-swift's flags do; LeRobot's ``cycle`` chooses as workers start), else the
    side's own default (stock forks). Nothing for a loader without workers: nothing starts."""
    method = args.context or chosen_by_protection
    if args.workers == 0 or not method or method == "default":
        return {}
    return {"multiprocessing_context": method}


def _timed_batches(batches, count: int, breakdown_dir) -> dict:
    """The clock starts before the workers do (iter() of a DataLoader starts them)."""
    started = time.perf_counter()
    if breakdown_dir:
        _record(breakdown_dir, "parent", "iteration_started", time.time())
    batches = iter(batches)
    next(batches)
    first = time.perf_counter()
    if breakdown_dir:
        _record(breakdown_dir, "parent", "first_batch", time.time())
    for _ in range(count - 1):
        next(batches)
    ended = time.perf_counter()
    return {"first_batch_s": first - started, "steady_samples_per_s": (count - 1) / (ended - first),
            "batches": count}


# -- --breakdown: where a protected worker's first batch goes ----------------------------
def _record(folder, who, event, value) -> None:
    with open(os.path.join(folder, f"{who}.jsonl"), "a") as events:
        events.write(json.dumps({"event": event, "value": value}) + "\n")


def _process_started_at() -> float:
    """Wall-clock start of this process (from /proc, 10 ms resolution)."""
    with open("/proc/self/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as system:
        boot = next(int(line.split()[1]) for line in system if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _instrument_worker(worker_id: int) -> None:
    """worker_init_fn: note when this worker started and was ready, then time its
    zygote's start, each sandbox fork, sandbox setups and the first exchanges."""
    now = time.time()
    folder = os.environ["BENCH_BREAKDOWN_DIR"]
    who = f"worker{worker_id}"
    _record(folder, who, "process_started", _process_started_at())
    _record(folder, who, "ready", now)
    modules = [name for name in sys.modules if name.startswith("swift_safe_media")]
    _record(folder, who, "our_modules_loaded", len(modules))
    from swift.dataset.utils import LazyLLMDataset

    from swift_safe_media.engine import pool, zygote

    def timed(owner, name, event, first_only=False):
        original = getattr(owner, name)
        seen = []

        def wrapper(*args, **kwargs):
            started = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                if not (first_only and seen):
                    seen.append(1)
                    _record(folder, who, event, [started, time.time()])
        setattr(owner, name, wrapper)

    timed(zygote.Zygote, "__init__", "zygote_start")
    timed(zygote.Zygote, "spawn", "sandbox_fork")
    timed(pool.SandboxPool, "_exchange", "exchange", first_only=False)
    timed(LazyLLMDataset, "__getitem__", "first_getitem", first_only=True)


def _note_what_workers_receive(folder, parts: dict) -> None:
    """Pickled size (as spawn writes it) and unpickling time here (modules already loaded)."""
    import pickle
    from multiprocessing import context, reduction

    os.environ["BENCH_BREAKDOWN_DIR"] = folder
    sizes = {}
    context.set_spawning_popen(object())
    try:
        # A worker's arguments are pickled in one go, so what they share (the template, here)
        # travels once: "together" is what a worker really receives.
        for name, value in {**parts, "together": tuple(parts.values())}.items():
            data = reduction.ForkingPickler.dumps(value)
            started = time.perf_counter()
            pickle.loads(data)
            sizes[name] = {"bytes": len(data), "unpickle_s": time.perf_counter() - started}
    finally:
        context.set_spawning_popen(None)
    _record(folder, "parent", "pickled", sizes)


def our_import_time_in_a_worker(env: dict) -> dict:
    """Import time of our modules in a worker-like interpreter (SWIFT_SAFE_MEDIA=1, ms-swift's
    template and the Qwen utils imported, so the adapter patches), from -X importtime."""
    code = "import swift.template, swift.dataset.utils, qwen_omni_utils"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          env={**env, "SWIFT_SAFE_MEDIA": "1"}, timeout=600)
    ours = total = 0
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.split(":", 1)[1].split("|")
        total += int(self_us)
        if name.strip().lstrip().startswith(("swift_safe_media", "_swift_safe_media_startup")):
            ours += int(self_us)
    return {"ours_ms": ours / 1000, "all_ms": total / 1000}


def print_breakdown(folder: str, pickled_env: dict) -> None:
    events: dict[str, dict] = {}
    for path in Path(folder).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            events.setdefault(path.stem, {}).setdefault(record["event"], []).append(record["value"])
    parent = events.pop("parent")
    start = parent["iteration_started"][0]
    print(f"  breakdown of one protected first batch ({parent['first_batch'][0] - start:.2f} s), "
          f"seconds from the DataLoader's iter():")
    for who, seen in sorted(events.items()):
        started, ready = seen["process_started"][0], seen["ready"][0]
        zygote = seen.get("zygote_start", [[0, 0]])[0]
        forks = seen.get("sandbox_fork", [])
        exchanges = seen.get("exchange", [])
        getitem = seen.get("first_getitem", [[0, 0]])[0]
        print(f"    {who}: process started +{started - start:.2f}; ready (interpreter, imports, unpickling) "
              f"+{ready - start:.2f}; first sample +{getitem[0] - start:.2f} to +{getitem[1] - start:.2f} "
              f"({getitem[1] - getitem[0]:.2f} s): zygote start {zygote[1] - zygote[0]:.2f} s, sandbox fork "
              f"{', '.join(f'{end - begin:.3f}' for begin, end in forks)} s, first decode(s) in the sandbox "
              f"{', '.join(f'{end - begin:.2f}' for begin, end in exchanges[:3])} s")
    for name, facts in parent["pickled"][0].items():
        print(f"    each worker receives {name}: {facts['bytes'] / 1e6:.2f} MB pickled, "
              f"unpickled in {facts['unpickle_s'] * 1e3:.0f} ms once modules are loaded")
    imports = our_import_time_in_a_worker(pickled_env)
    print(f"    our modules' import time in a worker: {imports['ours_ms']:.0f} ms of {imports['all_ms']:.0f} ms "
          f"(ms-swift template + Qwen utils, -X importtime self times)")


# -- report ------------------------------------------------------------------------------
def report(pipeline: str, results: dict, what: str) -> None:
    print(f"{pipeline}: {what}")
    medians = {side: {key: statistics.median(r[key] for r in runs) for key in TARGETS}
               for side, runs in results.items()}
    for key, (direction, target) in TARGETS.items():
        stock = medians["stock"][key]
        spread = {side: ", ".join(f"{r[key]:.2f}" for r in runs) for side, runs in results.items()}
        for side in [name for name in results if name != "stock"]:
            protected = medians[side][key]
            ratio = protected / stock
            met = ratio <= target if direction == "<=" else ratio >= target
            print(f"  {key:22s} stock {stock:8.2f} [{spread['stock']}]  {side} {protected:8.2f} "
                  f"[{spread[side]}]  ratio {ratio:.2f}x (target {direction} {target}x: "
                  f"{'met' if met else 'NOT met'})")


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6, help="ms-swift rows (clips) per run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating stock/protected rounds")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", choices=("swift", "lerobot"))
    parser.add_argument("--lerobot-python", default=sys.executable,
                        help="the interpreter of the LeRobot side, e.g. .venv-lerobot-0.6/bin/python (LeRobot 0.6.1; "
                             "with --stock-context spawn, its own default)")
    parser.add_argument("--record-lerobot", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--lerobot-batches", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="LeRobot samples per batch")
    parser.add_argument("--lerobot-seconds", type=int, default=10, help="length of the recorded episode")
    parser.add_argument("--lerobot-setup-seconds", type=float, default=0.0,
                        help="wait between building the LeRobot dataset and its first batch, both sides "
                             "(stands for lerobot-train making its policy; 0: none)")
    parser.add_argument("--protected-context", choices=("spawn", "forkserver", "fork", "default"),
                        help="start method of the protected side (default: protection's own choice)")
    parser.add_argument("--stock-context", choices=("spawn", "forkserver", "fork"), default="fork")
    parser.add_argument("--protected-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the protected side (repeat), e.g. SWIFT_SAFE_MEDIA_THREADS=1")
    parser.add_argument("--stock-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--variant-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a third side, 'variant': protected, with these variables besides --protected-env")
    parser.add_argument("--breakdown", action="store_true",
                        help="one more protected ms-swift run, instrumented: where its first batch goes")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "swift-safe-media-bench-pipeline"),
                        help="where clips, the tiny model and the LeRobot dataset are made (kept for reruns)")
    # In the child interpreter:
    parser.add_argument("--child", choices=("swift", "lerobot"), help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("stock", "protected"), help=argparse.SUPPRESS)
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown-dir", help=argparse.SUPPRESS)
    parser.add_argument("--safe_media", help=argparse.SUPPRESS)  # ms-swift's flag, read by the start-up hook
    args = parser.parse_args()

    if args.record_lerobot:
        _bench_lerobot().record_episode(Path(args.record_lerobot[0]), int(args.record_lerobot[1]))
        return
    if args.child:
        if args.breakdown_dir:
            os.environ["BENCH_BREAKDOWN_DIR"] = args.breakdown_dir
        run = child_swift if args.child == "swift" else child_lerobot
        print(json.dumps(run(args, json.loads(args.inputs))), flush=True)
        return

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env_of = {"stock": dict(item.split("=", 1) for item in args.stock_env),
              "protected": dict(item.split("=", 1) for item in args.protected_env)}
    env_of["variant"] = {**env_of["protected"], **dict(item.split("=", 1) for item in args.variant_env)}
    names = ["stock", "protected"] + (["variant"] if args.variant_env else [])
    args.breakdown_dir = None
    print(f"load average before: {_load()} ({os.cpu_count()} cores); workers {args.workers}; "
          f"stock context {args.stock_context}, protected context {args.protected_context or 'ours (default)'}; "
          f"protected env {env_of['protected'] or '-'}", flush=True)
    pipelines = []
    if args.only in (None, "swift"):
        pipelines.append(("swift", build_swift_inputs(work, args.rows),
                          f"LazyLLMDataset + template.data_collator, Qwen2.5-Omni, USE_AUDIO_IN_VIDEO=1, "
                          f"{args.rows} rows of 480p/720p h264+aac 8-12 s, batch size 1"))
    if args.only in (None, "lerobot"):
        pipelines.append(("lerobot", build_lerobot_inputs(work, args.lerobot_seconds, args.lerobot_python),
                          f"LeRobotDataset, 2 cameras 640x480 AV1, shuffled, batch size {args.batch_size}, "
                          f"{args.lerobot_batches} batches through cycle()"
                          + (f", {args.lerobot_setup_seconds:g} s between dataset and first batch"
                             if args.lerobot_setup_seconds else "")))
    for pipeline, inputs, what in pipelines:
        results = {name: [] for name in names}
        for number in range(args.rounds):
            for side in names[number % len(names):] + names[:number % len(names)]:  # rotated each round
                result = run_side(pipeline, "protected" if side == "variant" else side, args, inputs, env_of[side])
                results[side].append(result)
                print(f"  [{pipeline} round {number + 1} {side}] first batch {result['first_batch_s']:.2f} s, "
                      f"{result['steady_samples_per_s']:.2f} samples/s, peak PSS {result['peak_pss_mb']:.0f} MB "
                      f"({result['processes']} processes), load {_load()}", flush=True)
                print(f"    PSS at the peak, MB: {describe_memory(result['memory_at_peak'])}", flush=True)
        if args.rounds:
            report(pipeline, results, what)
        if args.breakdown and pipeline == "swift":
            with tempfile.TemporaryDirectory() as folder:
                args.breakdown_dir = folder
                run_side(pipeline, "protected", args, inputs, env_of["protected"])
                args.breakdown_dir = None
                child_env = {key: value for key, value in os.environ.items()
                             if not key.startswith("SWIFT_SAFE_MEDIA")}
                print_breakdown(folder, {**child_env, **SWIFT_ENV})
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
