"""The cost of bounding the libraries' entry points (issue 32), measured side by side.

1. Each entry point run whole in the sandbox (what protection does where stock opens its file
   by name: a pooled confined sandbox whose opens the caller answers, issue 45; on another
   file than the last call's) against stock in this process, against a confined sandbox per
   call on another file (``SWIFT_SAFE_MEDIA_OPEN_BROKER=0``, what older kernels get) and against
   a pooled unconfined sandbox reused call after call (before issue 42): median wall time of
   alternating calls after one warm-up call of each, with the spread.
2. What a proxy at the library boundary would pay instead: one round trip to the sandbox
   per method call of an object-shaped opener (``decord.VideoReader``: ``len``, fps, then
   ``vr[i]`` per frame), measured as N round trips of a call that returns one frame.
3. What protection adds at start-up: patching the entry points in a process that has
   transformers and ms-swift's templates loaded, and reading one template's decode paths
   (the coverage warning, once per template class).

    python bench/entry_points.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.decoders import media_corpus  # noqa: E402


def frame(shape=(720, 1280, 3)):
    import numpy as np
    return np.zeros(shape, dtype=np.uint8)


def cases(corpus):
    """(name, media, call of a path): each entry point as stock calls it."""
    video, wav = corpus["h264_720p.mp4"], corpus["pcm_48k_stereo.wav"]
    return [
        ("transformers load_video (pyav, 16 frames, 720p)", video,
         lambda path: __import__("transformers.video_utils").video_utils.load_video(path, num_frames=16)),
        ("transformers load_video (decord, 16 frames, 720p)", video,
         lambda path: __import__("transformers.video_utils").video_utils.load_video(path, num_frames=16,
                                                                              backend="decord")),
        ("keye_vl_utils.fetch_video (720p)", video, lambda path: __import__("keye_vl_utils").fetch_video({"video": path})),
        ("librosa.load (48 kHz stereo -> 16 kHz)", wav, lambda path: __import__("librosa").load(path, sr=16000)),
        ("soundfile.read (48 kHz stereo)", wav, lambda path: __import__("soundfile").read(path)),
        ("whisper.load_audio (ffmpeg)", wav, lambda path: __import__("whisper").load_audio(path)),
    ]


def _pools():
    """This process's pool for calls by name (brokered where the kernel can) and a second one
    that gets a sandbox per call, as without the broker."""
    from swift_safe_media import process
    from swift_safe_media.engine import calls as engine
    from swift_safe_media.engine.pool import SandboxPool
    from swift_safe_media.engine.zygote_link import for_this_process

    brokered = engine.get_engine(engine.BY_NAME)
    os.environ["SWIFT_SAFE_MEDIA_OPEN_BROKER"] = "0"
    try:
        per_call = SandboxPool(engine.BY_NAME, for_this_process())
    finally:
        del os.environ["SWIFT_SAFE_MEDIA_OPEN_BROKER"]
    return process.current().engines, brokered, per_call


def median_columns(call, media, repeats):
    """Stock here; in the sandbox as protection runs it, on another file each call (two
    copies, taken in turn); the same in a sandbox per call (the other copy: a fresh sandbox
    each time); in a pooled sandbox reused call after call (what it was before issue 42: the
    unconfined pool). Alternating, after a warm-up of each: (median, least, most) of each."""
    import shutil

    from swift_safe_media.engine import calls as engine
    from swift_safe_media.patching import media_libraries as media_patches

    stem, suffix = os.path.splitext(media)
    copies = [media, f"{stem}-copy{suffix}"]
    shutil.copyfile(media, copies[1])
    by_name = engine.by_name
    pools, brokered, per_call = _pools()

    def timed(patched, path, pool=brokered, pooled=False):
        (media_patches.PATCHES.patch if patched else media_patches.PATCHES.unpatch)()
        engine.by_name = (lambda runs_ffmpeg=False, files=(): False) if pooled else by_name
        pools[engine.BY_NAME] = pool
        start = time.perf_counter()
        try:
            call(path)
        finally:
            engine.by_name, pools[engine.BY_NAME] = by_name, brokered
        return time.perf_counter() - start

    def one_round(turn):
        ours = timed(True, copies[turn % 2])  # the other copy than the last call's
        return timed(False, media), ours, timed(True, copies[(turn + 1) % 2], per_call), timed(True, media, pooled=True)

    one_round(1)  # warm-up: imports, sandboxes, numba, file cache
    rounds = [one_round(turn) for turn in range(repeats)]
    media_patches.PATCHES.patch()
    return [(statistics.median(column), min(column), max(column)) for column in zip(*rounds)]


def round_trip(repeats):
    import swift_safe_media as ssm
    ssm.call(frame)
    return statistics.median(_timed(lambda: ssm.call(frame)) for _ in range(repeats * 4))


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def start_up():
    import swift.template.templates  # noqa: F401  every template class
    import transformers.audio_utils  # noqa: F401
    import transformers.video_utils  # noqa: F401
    from swift.template.templates.qwen import Qwen2_5VLTemplate

    from swift_safe_media.patching import media_libraries as media
    from swift_safe_media.hosts.swift import coverage as swift_coverage

    media.PATCHES.unpatch()
    patch = _timed(media.PATCHES.patch)
    reading = _timed(lambda: swift_coverage.unbounded(Qwen2_5VLTemplate))
    return patch, reading


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import swift_safe_media as ssm

    with tempfile.TemporaryDirectory() as folder:
        corpus = media_corpus.build(folder)
        ssm.enable(timeout=120)
        print("| entry point | stock, in process | ours, another file (brokered where it can) | ratio | "
              "a sandbox per call, another file | ratio | a pooled unconfined sandbox (before issue 42) | ratio |\n"
              "|---|---|---|---|---|---|---|---|")
        for name, media, call in cases(corpus):
            (stock, *_), (ours, low, high), (fresh, f_low, f_high), (pooled, *_) = median_columns(call, media, args.repeats)
            print(f"| {name} | {stock * 1e3:.1f} ms | {ours * 1e3:.1f} ms [{low * 1e3:.1f}-{high * 1e3:.1f}] | "
                  f"{ours / stock:.2f}x | {fresh * 1e3:.1f} ms [{f_low * 1e3:.1f}-{f_high * 1e3:.1f}] | "
                  f"{fresh / stock:.2f}x | {pooled * 1e3:.1f} ms | {pooled / stock:.2f}x |")
        one = round_trip(args.repeats)
        print(f"\nproxy at the library boundary: one round trip returning a 720p frame {one * 1e3:.2f} ms; "
              f"a 16-frame decord read through a proxy: 18 round trips, about {one * 18 * 1e3:.1f} ms "
              f"on top of the decode (one round trip in the design chosen)")
        patch, reading = start_up()
        print(f"start-up: patching the entry points {patch * 1e3:.1f} ms; reading one template's decode "
              f"paths (Qwen2.5-VL, once per class) {reading * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
