"""The seed scenario, small: `swift sft` of a tiny Qwen2.5-Omni over clips of which some
hang ms-swift's stock loaders for real. Shared by the end-to-end tests, `make demo` and
bench/swift_startup.py.

Clips (built with ffmpeg at run time):
- ``good_N.mp4``: 2 s, 64x64, h264 + aac;
- ``edit_list_cut.mp4``: good data cut by stream copy at a non-keyframe; decord counts
  frames that do not decode and spins for ever on them (stock qwen_omni_utils with
  ``FORCE_QWENVL_VIDEO_READER=decord``);
- ``playlist.mp4``: an HLS playlist whose segment is a FIFO (every stock reader blocks);
- ``fifo.wav``: a FIFO named like a clip (librosa blocks in open()).

``build_broken`` adds clips that fail at once (for the error budget): ``empty.mp4``
(zero bytes) and ``garbage.mp4`` (random bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import tiny_models
from .fresh import clean_environment

FFMPEG = os.environ.get("FFMPEG", "ffmpeg")
SWIFT = os.path.join(os.path.dirname(sys.executable), "swift")

GOOD_CLIPS = 4
HANGING = ("edit_list_cut.mp4", "playlist.mp4", "fifo.wav")
REFUSED = ("playlist.mp4", "fifo.wav")  # bad data: the protected run skips these

# Environment for every run: small videos, the seed's audio-in-video, stock decord path.
RUN_ENV = {
    "USE_AUDIO_IN_VIDEO": "1",
    "FORCE_QWENVL_VIDEO_READER": "decord",
    "VIDEO_MAX_PIXELS": str(64 * 28 * 28),
    "FPS_MAX_FRAMES": "8",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "MODELSCOPE_OFFLINE": "1",  # never reach a hub; a local model directory is used as is
}


def _ffmpeg(*args: str) -> None:
    subprocess.run([FFMPEG, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args],
                   check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)


def _av_source(seconds: float, size: str = "64x64") -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc2=size={size}:rate=30:duration={seconds}",
            "-f", "lavfi", "-i", f"sine=frequency=440:sample_rate=16000:duration={seconds}"]


def build_media(directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    clips = {}
    for index in range(GOOD_CLIPS):
        out = directory / f"good_{index}.mp4"
        if not out.exists():
            _ffmpeg(*_av_source(2), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
                    "-c:a", "aac", "-shortest", str(out))
        clips[out.name] = str(out)

    cut = directory / "edit_list_cut.mp4"
    if not cut.exists():
        source = directory / "long_gop_source.mp4"
        _ffmpeg(*_av_source(20, "96x96"), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
                "-g", "600", "-keyint_min", "600", "-sc_threshold", "0", "-c:a", "aac", "-shortest", str(source))
        _ffmpeg("-ss", "4.5", "-t", "10", "-i", str(source), "-c", "copy", str(cut))
        source.unlink()
    clips[cut.name] = str(cut)

    segment = directory / "segment.ts"
    if not segment.exists():
        os.mkfifo(segment)
    playlist = directory / "playlist.mp4"
    playlist.write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n"
                        f"#EXTINF:10.0,\n{segment.name}\n#EXT-X-ENDLIST\n")
    clips[playlist.name] = str(playlist)

    fifo_wav = directory / "fifo.wav"
    if not fifo_wav.exists():
        os.mkfifo(fifo_wav)
    clips[fifo_wav.name] = str(fifo_wav)
    return clips


def build_broken(directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "empty.mp4").write_bytes(b"")
    (directory / "garbage.mp4").write_bytes(bytes(range(256)) * 64)
    return {name: str(directory / name) for name in ("empty.mp4", "garbage.mp4")}


def build_dataset(directory: Path, clips: dict[str, str], name: str = "train.jsonl") -> str:
    """One row per clip: with batch size 1, one epoch is one step per row."""
    rows = []
    for name_of_clip, path in clips.items():
        if name_of_clip.endswith(".wav"):
            rows.append({"messages": [{"role": "user", "content": "<audio>What do you hear?"},
                                      {"role": "assistant", "content": "a tone"}], "audios": [path]})
        else:
            rows.append({"messages": [{"role": "user", "content": "<video>What do you see?"},
                                      {"role": "assistant", "content": "a test pattern"}], "videos": [path]})
    path = directory / name
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def build(directory: str | os.PathLike) -> dict[str, str]:
    """Tiny model, clips and dataset under ``directory``; returns their paths."""
    directory = Path(directory)
    clips = build_media(directory / "media")
    return {"model": tiny_models.build(str(directory / "tiny_qwen2_5_omni")),
            "dataset": build_dataset(directory, clips), **clips}


def sft_args(built: dict[str, str], output_dir: str, *, workers: int = 2, lazy: bool = True,
             dataset: str | None = None) -> list[str]:
    """One epoch, batch size 1: as many steps as rows, unless rows are dropped."""
    return ["--model", built["model"], "--model_type", "qwen2_5_omni", "--dataset", dataset or built["dataset"],
            "--tuner_type", "lora", "--torch_dtype", "float32", "--num_train_epochs", "1",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--dataloader_num_workers", str(workers), "--lazy_tokenize", str(lazy).lower(), "--max_length", "4096",
            "--check_model", "false", "--save_strategy", "no", "--report_to", "none",
            "--logging_steps", "1", "--output_dir", output_dir, "--dataset_num_proc", "1",
            "--split_dataset_ratio", "0", "--data_seed", "42", "--seed", "42"]


def yaml_config(args: list[str], path: str, extra: dict[str, str] | None = None, env: dict | None = None) -> str:
    """The same command line as a `swift sft CONFIG.yaml` file (its ENV: block sets variables)."""
    pairs = dict(zip(args[0::2], args[1::2]))
    lines = [f"{key.lstrip('-')}: {json.dumps(value)}" for key, value in {**pairs, **(extra or {})}.items()]
    if env:
        lines.append("ENV:")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in env.items()]
    Path(path).write_text("\n".join(lines) + "\n")
    return path


TRAIN_STARTED = "Train:"


def run_sft(argv: list[str], *, env: dict[str, str] | None = None, timeout: float, log_path: str,
            stall_timeout: float | None = None, command: str = "sft") -> tuple[int | None, float, str]:
    """Run `swift sft ARGV` (or `swift COMMAND ARGV`) in its own session; kill its whole process group after
    ``timeout`` s, or once the training loop has gone ``stall_timeout`` s without a step.
    Returns (exit code, or None when killed; wall seconds; the log)."""
    full_env = clean_environment({**RUN_ENV, **(env or {})}, warm_start=True)
    start = time.monotonic()
    progress, last_progress = None, start
    with open(log_path, "wb") as log:
        process = subprocess.Popen([SWIFT, command, *argv], env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        while process.poll() is None and time.monotonic() - start < timeout:
            time.sleep(0.5)
            if stall_timeout is None:
                continue
            text = Path(log_path).read_text(errors="replace")
            now_progress = (TRAIN_STARTED in text, steps(text)[0])
            if now_progress != progress:
                progress, last_progress = now_progress, time.monotonic()
            elif progress[0] and time.monotonic() - last_progress > stall_timeout:
                break
        code = process.poll()
        if code is None:
            os.killpg(process.pid, 9)
            process.wait()
    elapsed = time.monotonic() - start
    return code, elapsed, Path(log_path).read_text(errors="replace")


def steps(log: str) -> tuple[int, int]:
    """(steps done, steps planned) from ms-swift's `'global_step/max_steps': 'N/M'` log lines."""
    import re
    found = [(int(done), int(total)) for done, total in re.findall(r"'global_step/max_steps': '(\d+)/(\d+)'", log)]
    return max(found, default=(0, 0))


def skipped(log: str) -> dict[str, str]:
    """file name -> reason, from our `swift_safe_media: skipped PATH: REASON (...)` lines."""
    import re
    return {os.path.basename(path): reason
            for path, reason in re.findall(r"swift_safe_media: skipped (\S+): (.*?) \(\w+, after", log)}


def run_folder(output_dir: str) -> Path:
    """``<output_dir>/v<N>-<time>/safe_media``: the run's registry, stats and summary."""
    [version] = Path(output_dir).glob("v*-*")
    return version / "safe_media"


def registry_entries(path) -> list[dict]:
    from swift_safe_media.records import quarantine

    return quarantine.entries(path)


def summaries(log: str) -> list[dict]:
    """The counts of each `swift_safe_media summary at step N: ...` line, in order."""
    import re
    found = []
    for step, counts in re.findall(r"swift_safe_media summary at step (\d+): (.*?);", log):
        found.append({"step": int(step), **{kind: int(number) for number, kind in re.findall(r"(\d+) (\w+)", counts)}})
    return found
