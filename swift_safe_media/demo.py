"""``make demo``: decode a built-in corpus of good and hostile clips through the engine.

Builds clips with ffmpeg in a temporary folder, among them inputs that hang stock
decoders for ever (an HLS playlist named ``.mp4`` whose segment is a FIFO, a FIFO named
``.wav``) and one that makes them fail (a truncated MP4), then decodes each in a
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


def main() -> int:
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
