"""Stock vs patched ms-swift 4.6.0, LeRobot 0.4.4 and LeRobot 0.6.1, side by side in one run.

Builds the pristine trees from the PyPI sdists (``pip download --no-binary :all:``), applies
``patches/<project>[/<version>]/*.patch`` to a copy of each and makes clips with ffmpeg. Each variant
runs in an interpreter of its own (the two trees cannot share one process: same package name), warms
up, then serves timed calls; the variants take turns call by call (``--repeats`` rounds), so load on
a shared machine hits them alike. LeRobot 0.6.1 (Python 3.12) runs in ``.venv-lerobot-0.6/``
(``make test`` builds it), the tree first on PYTHONPATH. Prints medians and patched/stock ratios:

* ms-swift: ``load_video_internvl`` / ``load_video_cogvlm2`` on 854x480 and 1280x720 30 fps 10 s clips, and
  ``load_audio`` on WAV and M4A (stock reads M4A through audioread's ffmpeg pipe), for stock,
  patched with defaults, patched with ``SWIFT_VIDEO_BACKEND=torchcodec``, and patched with
  ``SWIFT_MEDIA_DECODE_TIMEOUT`` (the decode worker), with and without torchcodec;
* LeRobot 0.4.4 and 0.6.1: ``decode_video_frames`` (torchcodec, cached decoder; 0.6.1 with
  ``return_uint8=True`` as lerobot-train reads) on a 2-camera 480p 30 fps episode, single-frame
  queries at random timestamps, stock vs ``timeout_s`` (decode worker), as frames/s;
* LeRobot 0.6.1 items: ``LeRobotDataset[i]`` at random indices over a dataset recorded with
  LeRobot 0.6's own writer and encoder (two 640x480 cameras, SVT-AV1), ``return_uint8=True``:
  stock (the cameras decoded on threads in-process) vs ``video_decode_timeout_s`` (the item's
  cameras in one worker call, decoded on threads there), as items/s;
* kill-to-ready (ms-swift; LeRobot 0.6.1: its repro, ``upstream_pr/lerobot_repro.py --timeout 3``),
  a decode worker's memory, and what the repro's spinning file costs stock LeRobot 0.6.1.

    .venv/bin/python bench/upstream.py [--repeats 7] [--work DIR] [--only lerobot-0.6]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
LEROBOT06_PYTHON = ROOT / ".venv-lerobot-0.6" / "bin" / "python"
LEROBOT_REPRO = ROOT / "upstream_pr" / "lerobot_repro.py"


def run(*cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def ffmpeg(*args):
    run("ffmpeg", "-v", "error", "-y", *args, timeout=300)


def sdist_tree(package: str, version: str, work: Path, python_version: str | None = None) -> Path:
    """The pristine tree of ``package==version`` from its PyPI sdist (``python_version``: the Python
    it is for, when not this one: LeRobot 0.5+ declares Requires-Python >= 3.12)."""
    dl = work / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    archives = list(dl.glob(f"{package.replace('-', '_')}-{version}.tar.gz")) + list(
        dl.glob(f"{package}-{version}.tar.gz"))
    if not archives:
        target = ["--python-version", python_version] if python_version else []
        run(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--no-binary", ":all:", *target, "-d", dl, f"{package}=={version}")
        archives = list(dl.glob(f"{package.replace('-', '_')}-{version}.tar.gz")) + list(
            dl.glob(f"{package}-{version}.tar.gz"))
    target = work / f"{package}-{version}-pristine"
    if not target.exists():
        with tarfile.open(archives[0]) as tar:
            tar.extractall(work / "unpack", filter="data")
        shutil.move(str(work / "unpack" / archives[0].name[:-len(".tar.gz")]), target)
    return target


def patched_copy(pristine: Path, series: Path) -> Path:
    target = pristine.with_name(pristine.name.replace("-pristine", "-patched"))
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(pristine, target)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(target.parent))  # never patch an enclosing repo
    for patch in sorted(series.glob("*.patch")):
        run("git", "apply", "--check", patch, cwd=target, env=env)
        run("git", "apply", patch, cwd=target, env=env)
    return target


# Each variant runs in its own long-lived interpreter and serves one timed call per request, so the
# controller can interleave the variants call by call: load on a shared machine then hits all alike.
SWIFT_SERVE = r"""
import json, os, sys, time
from swift.template import vision_utils as vu
cases = json.loads(sys.argv[1])
if os.environ.get("BENCH_FORK_PER_CALL"):
    sys.path.insert(0, os.environ["BENCH_DIR"])
    from upstream import fork_per_call
    for func in {func for _, func, _ in cases}:
        setattr(vu, func, fork_per_call(getattr(vu, func), float(os.environ["BENCH_FORK_PER_CALL"])))

def reset():
    # Stock load_video_cogvlm2/_valley switch decord's global bridge to torch, after which stock
    # load_video_internvl fails ('Tensor' object has no attribute 'asnumpy'): run each loader as if alone.
    if "decord" in sys.modules:
        sys.modules["decord"].bridge.set_bridge("native")

for name, func, args in cases:  # warm-up; starts the decode worker when it is enabled
    reset()
    getattr(vu, func)(*args)
print("READY", flush=True)
for line in sys.stdin:
    name, func, args = cases[int(line)]
    reset()
    t = time.perf_counter()
    getattr(vu, func)(*args)
    print(f"T {time.perf_counter() - t}", flush=True)
"""

LEROBOT_SERVE = r"""
import json, random, sys, time
from lerobot.datasets.video_utils import decode_video_frames
videos, kwargs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rng = random.Random(0)
queries = [[round(rng.randrange(0, 299) / 30, 6)] for _ in range(40)]
for v in videos:  # warm-up: opens and caches each decoder, starts the worker
    decode_video_frames(v, [0.0], 1e-4, "torchcodec", **kwargs)
print("READY", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    for q in queries:
        for v in videos:
            decode_video_frames(v, q, 1e-4, "torchcodec", **kwargs)
    print(f"T {time.perf_counter() - t}", flush=True)
"""

# LeRobot 0.6's own writer and default encoder (SVT-AV1, GOP 2); episodes share a file, as LeRobot writes them.
LEROBOT06_BUILD = r"""
import sys
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root, cameras = sys.argv[1], ("observation.images.front", "observation.images.wrist")
features = {key: {"dtype": "video", "shape": (480, 640, 3), "names": ["height", "width", "channels"]}
            for key in cameras}
features["action"] = {"dtype": "float32", "shape": (2,), "names": None}
dataset = LeRobotDataset.create("bench/upstream", fps=30, features=features, root=root)
y, x = np.mgrid[0:480, 0:640]
for episode in range(3):
    for frame in range(100):
        images = {key: np.stack([(x + 7 * frame) % 256, (y + 5 * frame) % 256, (x + y + 40 * episode + n * 90) % 256],
                                axis=-1).astype(np.uint8) for n, key in enumerate(cameras)}
        dataset.add_frame({**images, "action": np.zeros(2, np.float32), "task": "pick"})
    dataset.save_episode()
dataset.finalize()
"""

LEROBOT06_ITEMS = r"""
import json, random, sys, time
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root, options = sys.argv[1], json.loads(sys.argv[2])
dataset = LeRobotDataset("bench/upstream", root=root, return_uint8=True, **options)
rng = random.Random(0)
indices = [rng.randrange(len(dataset)) for _ in range(40)]
for index in range(0, len(dataset), 100):  # warm-up: opens each file's decoders, starts the worker
    dataset[index]
print("READY", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    for index in indices:
        dataset[index]
    print(f"T {time.perf_counter() - t}", flush=True)
"""

# What the spinning file of the repro costs stock LeRobot 0.6.1: one decode, seconds.
SPIN_COST = r"""
import json, runpy, sys, tempfile, time
from lerobot.datasets.video_utils import decode_video_frames
spin = tempfile.mkdtemp() + "/spin.mp4"
runpy.run_path(sys.argv[1])["spin_video"](spin)
t = time.perf_counter()
try:
    decode_video_frames(spin, [0.0, 0.5], 1e-4, "torchcodec")
    outcome = "frames"
except Exception as e:
    outcome = type(e).__name__
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t, "outcome": outcome}), flush=True)
"""

# What one decode worker costs in memory: its smaps_rollup after a decode, beside its caller's.
WORKER_MEMORY = r"""
import json, re, sys
from lerobot.datasets import video_decode_worker
from lerobot.datasets.video_utils import decode_video_frames
decode_video_frames(sys.argv[1], [0.0], 1e-4, "torchcodec", return_uint8=True, timeout_s=60)
def mib(pid):
    text = open(f"/proc/{pid}/smaps_rollup").read()
    return {key: int(re.search(rf"^{key}:\s+(\d+)", text, re.M).group(1)) / 1024 for key in ("Pss", "Anonymous")}
print("RESULT " + json.dumps({"worker": mib(video_decode_worker._worker.process.pid), "caller": mib("self")}))
"""

KILL_TO_READY = r"""
import json, sys, time
from swift.template import vision_utils as vu
from swift.template.media_worker import MediaDecodeTimeoutError
good, stuck = sys.argv[1], sys.argv[2]
vu.load_audio(good, 16000)  # worker up
t = time.perf_counter()
try:
    vu.load_video_cogvlm2(stuck)
except MediaDecodeTimeoutError:
    pass
raised = time.perf_counter() - t
t = time.perf_counter()
vu.load_audio(good, 16000)
print("RESULT " + json.dumps({"raised_after_s": raised, "next_call_s": time.perf_counter() - t}), flush=True)
"""


def fork_per_call(func, timeout: float):
    """A bound on ``func`` in the shape ms-swift PR #9541 proposes for ``load_audio``: each
    call runs in a child forked for it (``multiprocessing``'s fork context), killed after
    ``timeout`` s. Written here from the PR's description, to measure the design."""
    import multiprocessing
    import pickle

    def child(connection, args):
        # Plain pickle: torch's own sharing of tensors through a pipe needs the child alive
        # until the parent has read them, and this child exits at once.
        try:
            connection.send_bytes(pickle.dumps((True, func(*args))))
        except BaseException as exc:  # noqa: BLE001 - handed to the parent
            connection.send_bytes(pickle.dumps((False, exc)))

    def bounded(*args):
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=child, args=(send, args), daemon=True)
        process.start()
        send.close()
        if not receive.poll(timeout):
            process.kill()
            process.join()
            raise TimeoutError(f"{func.__name__}{args} did not finish within {timeout} s")
        ok, value = pickle.loads(receive.recv_bytes())
        process.join()
        if not ok:
            raise value
        return value

    return bounded


# A DataLoader worker is a daemonic process, and multiprocessing refuses children to those.
IN_A_DATALOADER_WORKER = r"""
import json, sys, os
sys.path.insert(0, os.environ["BENCH_DIR"])
import torch
from swift.template import vision_utils as vu
from upstream import fork_per_call

class Clips(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        try:
            return {"shape": list(fork_per_call(vu.load_audio, 60)(sys.argv[1], 16000).shape)}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

loader = torch.utils.data.DataLoader(Clips(), batch_size=None, num_workers=1, multiprocessing_context="fork")
print("RESULT " + json.dumps({"in_process": list(fork_per_call(vu.load_audio, 60)(sys.argv[1], 16000).shape),
                              "in_a_worker": next(iter(loader))}), flush=True)
"""


class Server:
    def __init__(self, tree_path: Path, code: str, args: list, env_extra: dict, python: str = sys.executable):
        env = dict(os.environ, PYTHONPATH=str(tree_path), SWIFT_SAFE_MEDIA="0", **env_extra)
        self._log = tempfile.TemporaryFile(mode="w+")  # the variant's stderr, shown if it dies
        self.process = subprocess.Popen([python, "-c", code, *args], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line
        self._log.seek(0)
        raise RuntimeError(f"variant exited (rc={self.process.wait()}) before {prefix!r}:\n{self._log.read()[-3000:]}")

    def time(self, request: int) -> float:
        self.process.stdin.write(f"{request}\n")
        self.process.stdin.flush()
        return float(self._expect("T ").split()[1])

    def close(self):
        self.process.stdin.close()
        self.process.wait(60)


def interleaved_times(servers: dict, requests: list, repeats: int) -> dict:
    """Every time per (variant, request), round by round, the variants taking turns call by call."""
    times = {name: {r: [] for r in requests} for name in servers}
    names = list(servers)
    for rep in range(repeats):
        for r in requests:
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                times[name][r].append(servers[name].time(r))
    return times


def interleaved(servers: dict, requests: list, repeats: int) -> dict:
    """Median time per (variant, request), the variants taking turns call by call."""
    times = interleaved_times(servers, requests, repeats)
    return {name: {r: statistics.median(t) for r, t in per.items()} for name, per in times.items()}


def rate_table(servers: dict, repeats: int, count: int, unit: str) -> None:
    """``count`` units per timed round; rate per variant (median of the rounds) and its ratio to the
    first variant, with the spread of the round-by-round ratios (each round's variants ran back to back)."""
    times = interleaved_times(servers, [0], repeats)
    for server in servers.values():
        server.close()
    names = list(times)
    base = times[names[0]][0]
    print(f"| variant | {unit}/s | ratio to {names[0]} (median, min-max of {repeats} rounds) |\n|---|---|---|")
    for name in names:
        ratios = [b / t for b, t in zip(base, times[name][0])]
        print(f"| {name} | {count / statistics.median(times[name][0]):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


def measure(tree_path: Path, code: str, args: list, env_extra: dict, python: str = sys.executable) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree_path), SWIFT_SAFE_MEDIA="0", **env_extra)
    out = subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"measurement failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def make_media(folder: Path) -> dict:
    media = {}
    for height, width in ((480, 854), (720, 1280)):
        media[f"clip{height}"] = folder / f"clip_{height}p.mp4"
        ffmpeg("-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate=30:duration=10", "-c:v", "libx264",
               "-pix_fmt", "yuv420p", "-g", "60", "-bf", "2", media[f"clip{height}"])
    src = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100:duration=30", "-ac", "2"]
    media["wav"] = folder / "speech.wav"
    ffmpeg(*src, media["wav"])
    media["m4a"] = folder / "speech.m4a"
    ffmpeg(*src, "-c:a", "aac", media["m4a"])
    for cam in ("front", "wrist"):
        media[cam] = folder / f"episode_{cam}.mp4"
        ffmpeg("-f", "lavfi", "-i", "testsrc2=size=640x480:rate=30:duration=10", "-c:v", "libx264", "-pix_fmt",
               "yuv420p", "-g", "2", media[cam])  # LeRobot records with a GOP of 2
    media["stuck"] = folder / "stuck.mp4"
    os.mkfifo(media["stuck"])
    return media


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", type=Path, default=None, help="keep sdists and trees here between runs")
    parser.add_argument("--only", choices=["ms-swift", "lerobot", "lerobot-0.4", "lerobot-0.6"], default=None,
                        help="one host ('lerobot': both LeRobot series)")
    parser.add_argument("--lerobot06-python", default=str(LEROBOT06_PYTHON),
                        help="a Python 3.12 with LeRobot 0.6.1's dependencies (default: .venv-lerobot-0.6)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="upstream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    media_dir = Path(tempfile.mkdtemp(prefix="upstream-media-"))
    media = make_media(media_dir)
    reps = str(args.repeats)

    if args.only in (None, "ms-swift"):
        stock = sdist_tree("ms-swift", "4.6.0", work)
        patched = patched_copy(stock, PATCHES / "ms-swift")
        video_cases = [[f"{name} {h}p {n} frames", f"load_video_{name}", [str(media[f"clip{h}"])]]
                       for h in (480, 720) for name, n in (("internvl", 32), ("cogvlm2", 24))]
        audio_cases = [["load_audio wav 30 s -> 16 kHz", "load_audio", [str(media["wav"]), 16000]],
                       ["load_audio m4a 30 s -> 16 kHz", "load_audio", [str(media["m4a"]), 16000]]]
        cases = json.dumps(video_cases + audio_cases)
        variants = [
            ("stock 4.6.0", stock, {}),
            ("patched, defaults", patched, {}),
            ("patched, SWIFT_VIDEO_BACKEND=torchcodec", patched, {"SWIFT_VIDEO_BACKEND": "torchcodec"}),
            ("patched, SWIFT_MEDIA_DECODE_TIMEOUT=60", patched, {"SWIFT_MEDIA_DECODE_TIMEOUT": "60"}),
            ("patched, timeout + torchcodec", patched, {"SWIFT_MEDIA_DECODE_TIMEOUT": "60",
                                                        "SWIFT_VIDEO_BACKEND": "torchcodec"}),
            ("stock, a fork per call (#9541's design)", stock, {"BENCH_FORK_PER_CALL": "60",
                                                                "BENCH_DIR": str(Path(__file__).parent)}),
        ]
        servers = {name: Server(tree, SWIFT_SERVE, [cases], env) for name, tree, env in variants}
        results = interleaved(servers, list(range(len(video_cases + audio_cases))), args.repeats)
        for server in servers.values():
            server.close()
        base = results["stock 4.6.0"]
        print(f"\nms-swift 4.6.0: median of {reps} calls per variant, interleaved; seconds (ratio to stock)")
        print("| case | " + " | ".join(name for name, _, _ in variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for i, (case, _, _) in enumerate(video_cases + audio_cases):
            cells = [f"{results[name][i]:.3f} ({results[name][i] / base[i]:.2f}x)" for name, _, _ in variants]
            print(f"| {case} | " + " | ".join(cells) + " |")
        ktr = measure(patched, KILL_TO_READY, [str(media["wav"]), str(media["stuck"])],
                      {"SWIFT_MEDIA_DECODE_TIMEOUT": "5"})
        print(f"timeout 5 s on a stuck input: raised after {ktr['raised_after_s']:.2f} s; "
              f"next call on the replacement worker {ktr['next_call_s']:.2f} s")
        worker = measure(stock, IN_A_DATALOADER_WORKER, [str(media["wav"])], {"BENCH_DIR": str(Path(__file__).parent)})
        print(f"a fork per call, load_audio WAV: in the trainer {worker['in_process']}; "
              f"in a DataLoader worker {worker['in_a_worker']}")

    videos = json.dumps([str(media["front"]), str(media["wrist"])])
    if args.only in (None, "lerobot", "lerobot-0.4"):
        stock = sdist_tree("lerobot", "0.4.4", work)
        patched = patched_copy(stock, PATCHES / "lerobot" / "0.4.4")
        rows = [("stock 0.4.4", stock, {}), ("patched, defaults", patched, {}),
                ("patched, timeout_s=60", patched, {"timeout_s": 60})]
        print("\nLeRobot 0.4.4 decode_video_frames (torchcodec, cached decoder), 2 cameras 640x480 30 fps, "
              f"single-frame queries at random timestamps: {reps} interleaved rounds of 80 frames")
        rate_table({name: Server(tree / "src", LEROBOT_SERVE, [videos, json.dumps(kw)], {})
                    for name, tree, kw in rows}, args.repeats, 80, "frames")

    if args.only in (None, "lerobot", "lerobot-0.6"):
        python = args.lerobot06_python
        if not Path(python).exists():
            sys.exit(f"{python} is missing: `make test` builds .venv-lerobot-0.6, or pass --lerobot06-python")
        stock = sdist_tree("lerobot", "0.6.1", work, python_version="3.12")
        patched = patched_copy(stock, PATCHES / "lerobot" / "0.6.1")
        rows = [("stock 0.6.1", stock, {"return_uint8": True}), ("patched, defaults", patched, {"return_uint8": True}),
                ("patched, timeout_s=60", patched, {"return_uint8": True, "timeout_s": 60})]
        print("\nLeRobot 0.6.1 decode_video_frames (torchcodec, cached decoder, return_uint8=True), 2 cameras "
              f"640x480 30 fps, single-frame queries at random timestamps: {reps} interleaved rounds of 80 frames")
        rate_table({name: Server(tree / "src", LEROBOT_SERVE, [videos, json.dumps(kw)], {}, python)
                    for name, tree, kw in rows}, args.repeats, 80, "frames")

        dataset = media_dir / "lerobot06_dataset"
        env = dict(os.environ, PYTHONPATH=str(stock / "src"), SWIFT_SAFE_MEDIA="0")
        out = subprocess.run([python, "-c", LEROBOT06_BUILD, str(dataset)], env=env, capture_output=True, text=True,
                             timeout=1800)
        if out.returncode:
            raise RuntimeError(f"recording the LeRobot 0.6 dataset failed:\n{out.stderr[-4000:]}")
        rows = [("stock 0.6.1", stock, {}), ("patched, defaults", patched, {}),
                ("patched, video_decode_timeout_s=60", patched, {"video_decode_timeout_s": 60})]
        print("\nLeRobot 0.6.1 LeRobotDataset[i], recorded with LeRobot 0.6 (2 cameras 640x480, SVT-AV1, GOP 2, "
              f"3 episodes in one file each), return_uint8=True, random indices: {reps} interleaved rounds of 40 items")
        rate_table({name: Server(tree / "src", LEROBOT06_ITEMS, [str(dataset), json.dumps(kw)], {}, python)
                    for name, tree, kw in rows}, args.repeats, 40, "items")

        memory = measure(patched / "src", WORKER_MEMORY, [str(media["front"])], {}, python)
        print("\none decode worker (patched 0.6.1, after a decode): "
              f"{memory['worker']['Pss']:.0f} MiB PSS, {memory['worker']['Anonymous']:.0f} MiB anonymous "
              f"(its caller: {memory['caller']['Pss']:.0f} MiB PSS, {memory['caller']['Anonymous']:.0f} MiB anonymous)")
        spin = measure(stock / "src", SPIN_COST, [str(LEROBOT_REPRO)], {}, python)
        print(f"stock 0.6.1 on the repro's spin.mp4 (1,000,000 hidden frames): {spin['seconds']:.1f} s of decoding, "
              f"then {spin['outcome']}")
        env = dict(os.environ, PYTHONPATH=str(patched / "src"), SWIFT_SAFE_MEDIA="0")
        out = subprocess.run([python, str(LEROBOT_REPRO), "--timeout", "3", "--wait", "300"], env=env,
                             capture_output=True, text=True, timeout=1800)
        print("patched 0.6.1, upstream_pr/lerobot_repro.py --timeout 3 (seconds include a replacement worker's start):")
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                print(f"  {result['file']}: {result['outcome']} after {result['seconds']} s")

    shutil.rmtree(media_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
