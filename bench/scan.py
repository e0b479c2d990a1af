"""Scan throughput against plain decoding with the same worker count, side by side.

Plain: a process pool whose workers run the very same loaders in-process (no sandbox).
Scan: ``swift_safe_media.checks.scan`` with as many sandboxes. Both warmed up first, then
measured in alternating rounds.

    .venv/bin/python bench/scan.py [--workers 2] [--clips 16]
"""

import argparse
import multiprocessing
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from swift_safe_media import config, shutdown
from swift_safe_media.engine import calls as engine
from swift_safe_media.checks import scan


def make_corpus(folder: Path, clips: int) -> list:
    items = []
    for index in range(clips):
        video, audio = folder / f"clip{index}.mp4", folder / f"clip{index}.wav"
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                        f"testsrc2=size=640x360:rate=30:duration=4", "-c:v", "libx264", "-pix_fmt", "yuv420p",
                        "-g", "60", str(video)], check=True)
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                        f"sine=frequency={200 + index * 10}:duration=20", "-ar", "44100", str(audio)], check=True)
        items += [scan.Item(str(video), "video"), scan.Item(str(audio), "audio")]
    return items


def in_process_worker() -> None:
    """Decode in this pool worker with the sandbox's thread settings, so only isolation differs."""
    import torch

    engine.mark_in_sandbox()
    torch.set_num_threads(config.decoder_threads())


def plain(pool, items) -> float:
    started = time.perf_counter()
    pool.map(scan.decode_item, items, chunksize=1)
    return time.perf_counter() - started


def sandboxed(items, workers: int) -> float:
    problems, elapsed = scan.scan(items, workers)
    assert not problems, problems
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain_s, scan_s = [], []
    with tempfile.TemporaryDirectory() as folder:
        items = make_corpus(Path(folder), args.clips)
        with multiprocessing.get_context("spawn").Pool(args.workers, initializer=in_process_worker) as pool:
            plain(pool, items[:args.workers * 2])  # warm: imports, first decodes
            sandboxed(items[:args.workers * 2], args.workers)  # warm: zygote and sandboxes
            for _ in range(args.rounds):  # alternating, so both see the same load
                plain_s.append(plain(pool, items))
                scan_s.append(sandboxed(items, args.workers))
        shutdown()
    plain_rate, scan_rate = len(items) / statistics.median(plain_s), len(items) / statistics.median(scan_s)
    print(f"## scan throughput, {len(items)} items ({args.clips} 360p clips, {args.clips} 20 s WAVs), "
          f"{args.workers} workers, median of {args.rounds} alternating rounds")
    print("| mode | items/s |\n|---|---|")
    print(f"| plain in-process decode | {plain_rate:.2f} |\n| swift-safe-media scan | {scan_rate:.2f} |")
    print(f"\nscan / plain throughput: {scan_rate / plain_rate:.3f}x (target >= 0.90x)")


if __name__ == "__main__":
    main()
