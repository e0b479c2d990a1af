"""Engine overhead, measured side by side in one run.

For a 360p and a 720p clip (made here with ffmpeg), decodes 32 evenly spaced frames
with torchcodec in this process and through ``swift_safe_media.call``, alternating,
and prints the ratio of medians, plus the engine's own cost per call (wall time of
``call`` minus the decode time measured inside the sandbox), which decode-time noise
cannot hide; the same decode in an unconfined sandbox (``confine=False``) runs
alongside, for the cost of confinement (seccomp filter, Landlock). Then times
kill-to-ready: a sandbox stuck in a GIL-holding native call is killed at its timeout,
and the engine starts its successor; and the start of a sandbox up to its first answer,
confined and unconfined in alternating rounds.

    .venv/bin/python bench/engine.py [--repeats 9]
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import swift_safe_media
from swift_safe_media import MediaDecodeTimeout, call, config
from swift_safe_media.engine import pool
from swift_safe_media.engine.calls import get_engine

FRAMES = 32


def make_clip(folder: Path, height: int, width: int) -> str:
    path = folder / f"clip_{height}p.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size={width}x{height}:rate=30:duration=10",
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", "-g", "60", "-bf", "2", str(path)],
                   check=True)
    return str(path)


def decode_frames(path: str):
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(path)
    count = decoder.metadata.num_frames
    indices = [round(i * (count - 1) / (FRAMES - 1)) for i in range(FRAMES)]
    return decoder.get_frames_at(indices).data


def stuck_forever():
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def decode_frames_timed(path: str):
    started = time.perf_counter()
    frames = decode_frames(path)
    return time.perf_counter() - started, frames


def timed(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def compare(path: str, repeats: int):
    local, isolated, overhead, unconfined = [], [], [], []
    decode_frames(path), call(decode_frames, path), call(decode_frames, path, confine=False)  # warm all paths
    for _ in range(repeats):
        seconds, expected = timed(decode_frames, path)
        local.append(seconds)
        seconds, (inside, got) = timed(call, decode_frames_timed, path)
        isolated.append(seconds)
        overhead.append(seconds - inside)
        assert got.shape == expected.shape and bool((got == expected).all())
        seconds, _ = timed(lambda: call(decode_frames_timed, path, confine=False))
        unconfined.append(seconds)
        del got, expected
    return (statistics.median(local), statistics.median(isolated), statistics.median(overhead),
            statistics.median(unconfined))


def sandbox_start(engine) -> float:
    """Seconds from asking the zygote for a sandbox to that sandbox's first answer
    (confinement is applied in between)."""
    message, fd, owned = pool._encode_request(len, ("ready",), {})
    started = time.perf_counter()
    box = engine._spawn()
    engine._exchange(box, message, fd, owned, 10.0, None, keep=True)
    seconds = time.perf_counter() - started
    engine._end(box)
    return seconds


def confined_start(rounds: int):
    """Sandbox start-up confined and unconfined, in alternating rounds (ABBA)."""
    confined_pool, open_pool = get_engine(True), get_engine(False)
    assert confined_pool.confined and not open_pool.confined, "SWIFT_SAFE_MEDIA_CONFINE=0 is set"
    call(len, "warm"), call(len, "warm", confine=False)
    confined, unconfined, differences = [], [], []
    for index in range(rounds):
        order = (confined_pool, open_pool) if index % 2 == 0 else (open_pool, confined_pool)
        times = {pool: sandbox_start(pool) for pool in order}
        confined.append(times[confined_pool])
        unconfined.append(times[open_pool])
        differences.append(times[confined_pool] - times[open_pool])
    quartiles = statistics.quantiles(differences, n=4)
    return statistics.median(confined), statistics.median(unconfined), statistics.median(differences), quartiles


def kill_to_ready(trials: int):
    engine = get_engine()
    internal, next_call = [], []
    for _ in range(trials):
        try:
            call(stuck_forever, timeout=0.3)
        except MediaDecodeTimeout:
            pass
        internal.append(engine.stats["last_kill_to_ready_s"])
        seconds, _ = timed(call, len, "ready")
        next_call.append(seconds)
    return statistics.median(internal), statistics.median(next_call)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--start-rounds", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        # decode_frames opens its clip by name (torchcodec), which a confined sandbox may
        # do only below SWIFT_SAFE_MEDIA_READ_ROOTS; the twins read the descriptor handed.
        config.put(config.READ_ROOTS, folder)
        started = time.perf_counter()
        call(len, "warm")
        startup = time.perf_counter() - started
        rows = []
        for height, width in ((360, 640), (720, 1280)):
            path = make_clip(Path(folder), height, width)
            rows.append((f"{height}p", *compare(path, args.repeats)))
    kill_ready, first_call_after = kill_to_ready(5)
    start_confined, start_open, start_extra, (q1, _, q3) = confined_start(args.start_rounds)
    print(f"## engine overhead: torchcodec decode of {FRAMES} frames, median of {args.repeats}")
    print("| clip | in-process s | isolated s | isolated/in-process | engine cost per call "
          "| unconfined sandbox s | confined/unconfined |")
    print("|---|---|---|---|---|---|---|")
    for name, local, isolated, overhead, unconfined in rows:
        print(f"| {name} | {local:.4f} | {isolated:.4f} | {isolated / local:.3f}x | {overhead * 1000:.1f} ms "
              f"| {unconfined:.4f} | {isolated / unconfined:.3f}x |")
    print(f"\nsandbox start to first answer, median of {args.start_rounds} alternating rounds: confined "
          f"{start_confined * 1000:.1f} ms, unconfined {start_open * 1000:.1f} ms; confined costs "
          f"{start_extra * 1000:+.2f} ms (quartiles {q1 * 1000:+.2f} .. {q3 * 1000:+.2f} ms; target <= 5 ms)")
    print(f"\nkill-to-ready (successor sandbox started after a timeout kill): {kill_ready * 1000:.1f} ms")
    print(f"first call after a timeout: {first_call_after * 1000:.1f} ms")
    print(f"first call of a process (zygote start with preload): {startup:.2f} s")
    swift_safe_media.shutdown()


if __name__ == "__main__":
    main()
