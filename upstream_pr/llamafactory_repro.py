"""LLaMA-Factory's audio read on a FIFO that nobody writes (a stand-in for any file that blocks
FFmpeg: a playlist whose segment is a FIFO, a network mount that stopped answering).

    python llamafactory_repro.py                # stock: blocks for ever in torchaudio.load
    python llamafactory_repro.py --timeout 3    # patched: MediaDecodeTimeoutError naming the file

Prints ``READING`` before the read and ``RESULT {json}`` after it.
"""

import argparse
import json
import os
import tempfile
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=0, help="MEDIA_DECODE_TIMEOUT (the patched series)")
    args = parser.parse_args()
    if args.timeout:
        os.environ["MEDIA_DECODE_TIMEOUT"] = str(args.timeout)
    from llamafactory.data.mm_plugin import get_mm_plugin

    plugin = get_mm_plugin("qwen2_omni", image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>")
    with tempfile.TemporaryDirectory() as folder:
        fifo = os.path.join(folder, "clip.wav")
        os.mkfifo(fifo)
        print("READING", flush=True)
        started = time.monotonic()
        try:
            plugin._regularize_audios([fifo], sampling_rate=16000)
            result = {"error": None}
        except Exception as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        result["elapsed_s"] = round(time.monotonic() - started, 2)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
