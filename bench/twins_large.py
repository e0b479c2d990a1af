"""ms-swift's video loaders against their safe twins on large frames (issue 45).

A 1080p and a 4K H.264 clip (testsrc2, 30 fps, x264 veryfast: B-frames, CABAC), made with
ffmpeg at run time: 15 s of 1080p and 5 s of 4K with a keyframe every 2 s (what cameras and
phones write), which keeps the default run near 10 minutes on 2 cores; ``--long``: 60 s of
1080p and 15 s of 4K with x264's default GOP (a keyframe every 250 frames, 8.3 s), the
shape of the clip in issue 45 (about 40 minutes at 3 rounds: narrow it with --only). Each twin
(``_SWIFT_LOADERS`` of the ms-swift adapter but ``load_audio``) is timed against stock's
loader (decord, PyAV, moviepy, OpenCV, transformers, in this process) at 8 and 32 frames
where the loader takes a count (an argument, or ``NUM_FRAMES`` for cogvlm2 and llava;
valley always takes 8). ``load_video_hf`` decodes every frame, so it reads shorter clips
of the same kind (4 s of 1080p, 1 s of 4K). minicpmv picks one frame a second, so it
returns at most as many frames as the clip has seconds. The twins run as ``bench/decoders.py`` runs
them: ``swift_safe_media.decoders`` called here, the decode in the sandbox, frames back
through shared memory, PIL images or tensors built here.

Per twin and clip one warm-up call of each side (imports, sandbox, file cache), then
rounds of stock, ours, stock, ours... Prints each side's median [least-most] in seconds,
the ratio of the medians and the spread of the per-round ratios, with the load average
before and after (a shared 2-core machine: read the spreads).

    python bench/twins_large.py [--rounds 3] [--only cogvlm2 --only llava] [--sizes 1080p 4k]
                                [--frames 8 32] [--long] [--clips-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

# size, seconds, seconds for hf, frames between keyframes (None: x264's default, 250)
SIZES = {"1080p": ("1920x1080", 15, 4, 60), "4k": ("3840x2160", 5, 1, 60)}
LONG = {"1080p": ("1920x1080", 60, 4, None), "4k": ("3840x2160", 15, 1, None)}
FRAMES = (8, 32)


def _encode(path: str, size: str, seconds: float, gop: int | None) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size={size}:rate=30:duration={seconds}", "-c:v", "libx264", "-preset", "veryfast",
                    *(["-g", str(gop)] if gop else []), "-pix_fmt", "yuv420p", path], check=True, timeout=900)


def clips(directory: str, sizes, shapes=SIZES) -> dict[str, tuple[str, str]]:
    """{size: (the long clip, the short one for load_video_hf)}, made unless already there."""
    made = {}
    for name in sizes:
        size, seconds, short, gop = shapes[name]
        paths = []
        for length in (seconds, short):
            path = os.path.join(directory, f"testsrc2_{name}_{length}s_gop{gop or 250}.mp4")
            if not os.path.exists(path):
                print(f"making {path}", file=sys.stderr)
                _encode(path + ".part.mp4", size, length, gop)
                os.replace(path + ".part.mp4", path)
            paths.append(path)
        made[name] = tuple(paths)
    return made


def _num_frames_env(call):
    """``call(module, path)`` with ``NUM_FRAMES`` set to n (cogvlm2 and llava read it)."""
    def run(module, path, n):
        os.environ["NUM_FRAMES"] = str(n)
        try:
            return call(module, path)
        finally:
            os.environ.pop("NUM_FRAMES", None)
    return run


# (twin, takes a frame count, call(module, path, n), reads the short clip)
TWINS = [
    ("load_video_internvl", True, lambda m, p, n: m.load_video_internvl(p, num_segments=n), False),
    ("load_video_cogvlm2", True, _num_frames_env(lambda m, p: m.load_video_cogvlm2(p)), False),
    ("load_video_llava", True, _num_frames_env(lambda m, p: m.load_video_llava(p)), False),
    ("load_video_minicpmv_mplug_owl3", True, lambda m, p, n: m.load_video_minicpmv_mplug_owl3(p, n), False),
    ("load_video_valley", False, lambda m, p, n: m.load_video_valley(p), False),
    ("load_video_ovis2", True, lambda m, p, n: m.load_video_ovis2(p, n), False),
    ("load_video_ovis2_5", True, lambda m, p, n: m.load_video_ovis2_5(p, n), False),
    ("load_video_hf", False, lambda m, p, n: m.load_video_hf([p]), True),
    ("load_vllm_video", True, lambda m, p, n: m.load_vllm_video(p, n), False),
]


def _check_twins_cover_the_adapter():
    from swift_safe_media.hosts.swift import adapter

    missing = set(adapter._SWIFT_LOADERS) - {"load_audio"} - {name for name, *_ in TWINS}
    if missing:
        print(f"warning: twins not benched: {sorted(missing)}", file=sys.stderr)


def _timed(fn) -> float:
    if "decord" in sys.modules:  # stock cogvlm2 and valley leave decord's bridge on torch
        sys.modules["decord"].bridge.set_bridge("native")
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def time_row(stock_fn, ours_fn, rounds):
    stock, ours = [], []
    for _ in range(rounds):
        stock.append(_timed(stock_fn))
        ours.append(_timed(ours_fn))
    return stock, ours


def _cell(times) -> str:
    return f"{statistics.median(times):.3f} [{min(times):.3f}-{max(times):.3f}]"


def _row(name, size, frames, stock, ours) -> str:
    ratios = [o / s for s, o in zip(stock, ours)]
    ratio = statistics.median(ours) / statistics.median(stock)
    return (f"| {name} | {size} | {frames} | {_cell(stock)} | {_cell(ours)} | {ratio:.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] |")


def run(args, made) -> list[str]:
    import swift.template.vision_utils as stock_vu

    import swift_safe_media.decoders.swift as ours_vu

    rows = []
    for name, counted, call, short in TWINS:
        if args.only and not any(text in name for text in args.only):
            continue
        for size in args.sizes:
            path = made[size][1 if short else 0]
            counts = args.frames if counted else [8]
            call(stock_vu, path, counts[0]), call(ours_vu, path, counts[0])  # warm-up
            for n in counts:
                stock, ours = time_row(lambda: call(stock_vu, path, n), lambda: call(ours_vu, path, n), args.rounds)
                label = n if counted else ("all" if short else "8 (fixed)")
                rows.append(_row(name, size, label, stock, ours))
                print(f"  {rows[-1]}  load {_load()}", file=sys.stderr, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="only twins whose name contains NAME (repeat for more)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--frames", nargs="+", type=int, default=list(FRAMES))
    parser.add_argument("--long", action="store_true", help="60 s of 1080p, 15 s of 4K, a keyframe every 250 frames")
    parser.add_argument("--clips-dir", help="where the clips are made, or found from an earlier run "
                                            "(default: a temporary folder)")
    args = parser.parse_args()
    _check_twins_cover_the_adapter()
    from swift_safe_media import config

    started, load_before, start = datetime.datetime.now(datetime.timezone.utc), _load(), time.perf_counter()
    with tempfile.TemporaryDirectory() as temporary:
        directory = args.clips_dir or temporary
        os.makedirs(directory, exist_ok=True)
        made = clips(directory, args.sizes, LONG if args.long else SIZES)
        rows = run(args, made)
    print(f"{started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load before {load_before}, after {_load()}; "
          f"{args.rounds} rounds; {'long clips' if args.long else 'default clips'}; sandbox decode threads {config.decoder_threads()}; "
          f"{time.perf_counter() - start:.0f} s")
    print("| twin | size | frames | stock s, median [min-max] | ours s, median [min-max] | ours/stock [per round] |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
