"""Scan throughput against plain decoding with the same worker count, side by side.

Plain: a process pool whose workers run the very same loaders in-process (no sandbox).
Scan: ``swift_safe_media.scan`` with as many sandboxes. Both warmed up first.

    .venv/bin/python bench/scan.py [--workers 2] [--clips 16]
"""

import argparse
import multiprocessing
import subprocess
import tempfile
import time
from pathlib import Path

from swift_safe_media import config, engine, scan, shutdown


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


def plain(items, workers: int) -> float:
    with multiprocessing.get_context("spawn").Pool(workers, initializer=in_process_worker) as pool:
        pool.map(scan.decode_item, items[:workers * 2])  # warm: imports, first decodes
        started = time.perf_counter()
        pool.map(scan.decode_item, items, chunksize=1)
        return time.perf_counter() - started


def sandboxed(items, workers: int) -> float:
    problems, _ = scan.scan(items[:workers * 2], workers)  # warm: zygote and sandboxes
    assert not problems, problems
    problems, elapsed = scan.scan(items, workers)
    assert not problems, problems
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clips", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        items = make_corpus(Path(folder), args.clips)
        plain_s = plain(items, args.workers)
        scan_s = sandboxed(items, args.workers)
        shutdown()
    plain_rate, scan_rate = len(items) / plain_s, len(items) / scan_s
    print(f"## scan throughput, {len(items)} items ({args.clips} 360p clips, {args.clips} 20 s WAVs), "
          f"{args.workers} workers")
    print("| mode | items/s |\n|---|---|")
    print(f"| plain in-process decode | {plain_rate:.2f} |\n| swift-safe-media scan | {scan_rate:.2f} |")
    print(f"\nscan / plain throughput: {scan_rate / plain_rate:.3f}x (target >= 0.90x)")


if __name__ == "__main__":
    main()
