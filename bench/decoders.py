"""Safe twins against the stock loaders, timed side by side in one run.

For each loader and clip: best-of-N wall time of the stock loader (decord, PyAV, moviepy,
OpenCV, librosa, qwen_vl_utils, run in this process) and of the safe twin (sandboxed
torchcodec/soundfile, results through shared memory, PIL built here), alternating
stock and safe calls after one warm-up call of each (best-of-N, because a shared
2-core machine adds noise to both sides that is not the decoders' cost). Prints a
markdown table. The sandbox decodes with SWIFT_SAFE_MEDIA_THREADS FFmpeg threads (by
default every usable core here: one process decodes); decord and OpenCV use all cores.

    python bench/decoders.py [--repeats 7] [--only internvl --only fetch_video] [--clips h264_720p.mp4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _load_media_corpus():
    # By file path: putting tests/ on sys.path would let its modules shadow packages.
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "media_corpus.py")
    spec = importlib.util.spec_from_file_location("media_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


media_corpus = _load_media_corpus()

VIDEO_CLIPS = ["h264_720p.mp4", "h264_aac_bframes.mp4"]
AUDIO_CLIPS = ["pcm_48k_stereo.wav", "mp3_44k_stereo.mp3", "aac_44k_stereo.m4a", "h264_aac_bframes.mp4"]


def video_cases(stock_vu, safe):
    return [
        ("load_video_internvl (32)", lambda m, p: m.load_video_internvl(p, num_segments=32)),
        ("load_video_cogvlm2", lambda m, p: m.load_video_cogvlm2(p)),
        ("load_video_llava", lambda m, p: m.load_video_llava(p)),
        ("load_video_minicpmv_mplug_owl3 (16)", lambda m, p: m.load_video_minicpmv_mplug_owl3(p, 16)),
        ("load_video_valley", lambda m, p: m.load_video_valley(p)),
        ("load_video_ovis2 (16)", lambda m, p: m.load_video_ovis2(p, 16)),
        ("load_video_ovis2_5 (16)", lambda m, p: m.load_video_ovis2_5(p, 16)),
        ("load_video_hf (all frames)", lambda m, p: m.load_video_hf([p])),
        ("load_vllm_video (16)", lambda m, p: m.load_vllm_video(p, 16)),
    ]


def time_pair(stock_fn, safe_fn, repeats):
    stock_fn(), safe_fn()  # warm-up: imports, sandbox start, file cache
    stock_times, safe_times = [], []
    for _ in range(repeats):
        for fn, times in ((stock_fn, stock_times), (safe_fn, safe_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(stock_times), min(safe_times)


def safe_threads() -> int:
    """What the sandbox of this process decodes with (SWIFT_SAFE_MEDIA_THREADS, else the budget)."""
    from swift_safe_media import config

    return config.decoder_threads()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only loaders whose name contains TEXT (repeat for more)")
    parser.add_argument("--clips", nargs="+", help=f"video clips (default: {' '.join(VIDEO_CLIPS)})")
    args = parser.parse_args()
    print(f"decode threads in the sandbox: {safe_threads()}", file=sys.stderr)

    import qwen_omni_utils
    import qwen_vl_utils
    import qwen_vl_utils.vision_process as qwen_vision
    import swift.template.vision_utils as stock_vu

    import swift_safe_media.decoders as safe

    with tempfile.TemporaryDirectory() as directory:
        corpus = media_corpus.build(directory)
        rows = []

        def add(loader, clip, stock_fn, safe_fn):
            if args.only and not any(text in loader for text in args.only):
                return
            def stock_call():
                # Stock cogvlm2/valley leave decord's bridge on torch, which breaks the others.
                if "decord" in sys.modules:
                    sys.modules["decord"].bridge.set_bridge("native")
                return stock_fn()

            stock_s, safe_s = time_pair(stock_call, safe_fn, args.repeats)
            rows.append((loader, clip, stock_s, safe_s))
            print(f"  {loader:40s} {clip:24s} {safe_s / stock_s:.2f}x", file=sys.stderr)

        for clip in args.clips or VIDEO_CLIPS:
            path = corpus[clip]
            for loader, run in video_cases(stock_vu, safe):
                add(loader, clip, lambda: run(stock_vu, path), lambda: run(safe, path))
            for backend in ("torchcodec", "decord"):
                qwen_vision.FORCE_QWENVL_VIDEO_READER = backend
                qwen_vision.get_video_reader_backend.cache_clear()
                element = {"video": path, "nframes": 16}
                add(f"qwen fetch_video (16, stock {backend})", clip,
                    lambda: qwen_vl_utils.fetch_video(element), lambda: safe.fetch_video(element))
        for backend in ("librosa", "soundfile_pyav"):
            os.environ["SWIFT_AUDIO_LOAD_BACKEND"] = backend
            for clip in AUDIO_CLIPS:
                path = corpus[clip]
                add(f"load_audio ({backend}, 16 kHz)", clip,
                    lambda: stock_vu.load_audio(path, 16000), lambda: safe.load_audio(path, 16000))
        conversation = media_corpus.omni_conversation(directory)
        add("qwen_omni process_audio_info", "3 items", lambda: qwen_omni_utils.process_audio_info(conversation, True),
            lambda: safe.process_audio_info(conversation, True))

    print("| loader | clip | stock (s) | safe (s) | safe/stock |")
    print("| --- | --- | ---: | ---: | ---: |")
    for loader, clip, stock_s, safe_s in rows:
        print(f"| {loader} | {clip} | {stock_s:.4f} | {safe_s:.4f} | {safe_s / stock_s:.2f}x |")


if __name__ == "__main__":
    main()
