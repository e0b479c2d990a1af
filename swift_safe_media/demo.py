"""``make demo``: the protected ``swift sft`` for a person, or, without ms-swift, the engine.

With ms-swift installed (the test environment has it): builds a tiny random Qwen2.5-Omni
and a dataset of good clips and clips that hang ms-swift's stock loaders for ever, runs
``swift sft ... --safe_media true --safe_media_timeout 5`` with two DataLoader workers,
and prints, file by file, what was trained on and what was skipped and why.

Without it: builds a corpus of good and hostile clips (an HLS playlist named ``.mp4``
whose segment is a FIFO, a FIFO named ``.wav``, a truncated MP4), decodes each in a
sandbox with a short timeout and prints what happened, file by file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import call, shutdown
from .errors import MediaDecodeError

TIMEOUT_S = 3.0


def decode_video(path: str, frames: int = 8):
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(path)
    count = decoder.metadata.num_frames
    return decoder.get_frames_at([round(i * (count - 1) / (frames - 1)) for i in range(frames)]).data


def decode_audio(path: str):
    from torchcodec.decoders import AudioDecoder

    return AudioDecoder(path).get_all_samples().data


def _ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-y", *args], check=True)


def build_corpus(folder: Path) -> list[tuple[str, str]]:
    good_video, good_audio = folder / "good.mp4", folder / "good.wav"
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=320x240:rate=30:duration=4",
            "-f", "lavfi", "-i", "sine=frequency=440:duration=4", "-c:v", "libx264",
            "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(good_video))
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=440:duration=2", "-ar", "16000", str(good_audio))

    truncated = folder / "truncated.mp4"
    truncated.write_bytes(good_video.read_bytes()[: good_video.stat().st_size // 3])

    os.mkfifo(folder / "segment0.ts")
    playlist = folder / "playlist_in_disguise.mp4"
    playlist.write_text("#EXTM3U\n#EXT-X-TARGETDURATION:4\n#EXTINF:4.0,\nsegment0.ts\n#EXT-X-ENDLIST\n")
    fifo_wav = folder / "fifo.wav"
    os.mkfifo(fifo_wav)
    return [("video", str(good_video)), ("audio", str(good_audio)), ("video", str(truncated)),
            ("video", str(playlist)), ("audio", str(fifo_wav))]


def swift_sft_demo(scenario) -> int:
    """The seed scenario, small: returns 0 when the run finished its epoch."""
    with tempfile.TemporaryDirectory(prefix="swift-safe-media-demo-") as folder:
        print("building a tiny random Qwen2.5-Omni, clips and a dataset (ffmpeg, ~30 s) ...")
        built = scenario.build(folder)
        args = scenario.sft_args(built, os.path.join(folder, "out"))
        args += ["--safe_media", "true", "--safe_media_timeout", "5"]
        print("$ swift sft --model tiny_qwen2_5_omni --dataset train.jsonl --dataloader_num_workers 2 ... "
              "--safe_media true --safe_media_timeout 5")
        print("  (stock, this run never finishes: decord spins on the edit-list cut, FFmpeg blocks on the FIFOs)\n")
        code, elapsed, log = scenario.run_sft(args, timeout=600, log_path=os.path.join(folder, "sft.log"))
        done, planned = scenario.steps(log)
        skipped = scenario.skipped(log)
        clips = [name for name in built if name not in ("model", "dataset")]
    width = max(map(len, clips))
    for name in clips:
        outcome = f"skipped: {skipped[name]}" if name in skipped else "trained on"
        print(f"  {name:<{width}}  {outcome}")
    print(f"\nswift sft exited {code} after {elapsed:.0f} s: {done} of {planned} steps; "
          f"ms-swift took another sample for each skipped one")
    return 0 if code == 0 and done == planned else 1


def main() -> int:
    try:
        import swift.template  # noqa: F401
        from tests import swift_scenario  # the repository's scenario (make demo runs from its root)
    except ImportError:
        return engine_demo()
    return swift_sft_demo(swift_scenario)


def engine_demo() -> int:
    print(f"swift-safe-media demo: every decode runs in a sandbox with a {TIMEOUT_S:g} s timeout\n")
    with tempfile.TemporaryDirectory(prefix="swift-safe-media-demo-") as folder:
        corpus = build_corpus(Path(folder))
        import torch  # noqa: F401  (a training process has it already; results arrive as tensors)

        started = time.monotonic()
        call(len, "warm-up")  # the first call starts the zygote; keep it out of the timings
        print(f"sandbox ready in {time.monotonic() - started:.1f} s\n")
        outcomes = []
        for kind, path in corpus:
            decode = decode_video if kind == "video" else decode_audio
            began = time.monotonic()
            try:
                result = call(decode, path, timeout=TIMEOUT_S)
                outcome = f"ok: {kind} tensor {tuple(result.shape)}"
            except MediaDecodeError as exc:
                outcome = f"{type(exc).__name__}: {exc.reason}"
            except Exception as exc:  # the decoder's own error, raised in the sandbox
                outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            outcomes.append((Path(path).name, outcome, time.monotonic() - began))
    width = max(len(name) for name, _, _ in outcomes)
    for name, outcome, elapsed in outcomes:
        print(f"{name:<{width}}  {elapsed:5.2f} s  {outcome}")
    shutdown()
    hung = [name for name, _, elapsed in outcomes if elapsed > TIMEOUT_S + 1]
    print("\nnothing hung: every file returned or failed within its timeout" if not hung
          else f"\nOVERRAN: {hung}")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
