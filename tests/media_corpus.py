"""Media corpus for the decoder tests and bench, made with the system ffmpeg at run time.

Clips are small (160x120, a few seconds) so the whole corpus builds in seconds on 2 cores.
`build(directory)` returns {name: path}; names say what each clip exercises.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

FFMPEG = os.environ.get("FFMPEG", "ffmpeg")


def _video_src(seconds: float, size: str = "160x120", rate: int = 30) -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc2=size={size}:rate={rate}:duration={seconds}"]


def _tone(seconds: float, rate: int = 44100, layout: str = "stereo") -> list[str]:
    # Two tones so stereo channels differ and resampling has something to keep.
    expr = "0.4*sin(2*PI*440*t)+0.2*sin(2*PI*1330*t)|0.3*sin(2*PI*660*t)+0.1*sin(2*PI*90*t)"
    if layout == "mono":
        expr = expr.split("|")[0]
    return ["-f", "lavfi", "-i", f"aevalsrc={expr}:s={rate}:d={seconds}"]


H264 = ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]

# name -> ffmpeg arguments after the inputs (the output path is appended).
VIDEO_RECIPES: dict[str, tuple[list[str], list[str]]] = {
    # B-frames and a GOP longer than the clip: every seek decodes from the start.
    "h264_aac_bframes.mp4": (_video_src(3) + _tone(3), [
        "-c:v", "libx264", "-preset", "veryfast", "-pix_fmt", "yuv420p", "-bf", "3", "-g", "250",
        "-c:a", "aac", "-b:a", "64k", "-shortest"]),
    "h264_noaudio.mp4": (_video_src(2), H264 + ["-g", "15"]),
    "vp9.webm": (_video_src(2), ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8",
                                 "-b:v", "300k", "-g", "30"]),
    "vp9_opus.mkv": (_video_src(2) + _tone(2, 48000), [
        "-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-b:v", "300k",
        "-c:a", "libopus", "-shortest"]),
    "mjpeg.avi": (_video_src(2, rate=25), ["-c:v", "mjpeg", "-q:v", "3", "-pix_fmt", "yuvj420p"]),
    "h264.mov": (_video_src(2, rate=24) + _tone(2), H264 + ["-c:a", "aac", "-shortest"]),
    # Odd width and height (4:4:4 chroma, since 4:2:0 encoders round odd sizes to even).
    "odd_161x97.avi": (_video_src(2, rate=25), ["-vf", "scale=161:97", "-c:v", "mjpeg", "-q:v", "3",
                                                              "-pix_fmt", "yuvj444p"]),
    "one_frame.mp4": (_video_src(1), H264 + ["-frames:v", "1"]),
    "h264_720p.mp4": (_video_src(4, size="1280x720"), H264 + ["-g", "60"]),
}

AUDIO_RECIPES: dict[str, tuple[list[str], list[str]]] = {
    "pcm_8k_mono.wav": (_tone(2, 8000, "mono"), ["-c:a", "pcm_s16le"]),
    "pcm_16k_stereo.wav": (_tone(2, 16000), ["-c:a", "pcm_s16le"]),
    "pcm_44k_mono.wav": (_tone(2, 44100, "mono"), ["-c:a", "pcm_s16le"]),
    "pcm_48k_stereo.wav": (_tone(2, 48000), ["-c:a", "pcm_s16le"]),
    "mp3_44k_stereo.mp3": (_tone(2, 44100), ["-c:a", "libmp3lame", "-b:a", "128k"]),
    "flac_48k_stereo.flac": (_tone(2, 48000), ["-c:a", "flac"]),
    "opus_48k_stereo.ogg": (_tone(2, 48000), ["-c:a", "libopus", "-b:a", "96k"]),
    "aac_44k_stereo.m4a": (_tone(2, 44100), ["-c:a", "aac", "-b:a", "128k"]),
}


def _run(args: list[str]) -> None:
    subprocess.run([FFMPEG, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args],
                   check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)


def _make_vfr(directory: Path) -> Path:
    """Variable frame rate: 30 frames 1/30 s apart, then 15 frames 1/10 s apart."""
    out = directory / "vfr.mp4"
    _run([*_video_src(2), "-vf", "setpts='if(lt(N,30),N/30,1+(N-30)/10)/TB'", "-frames:v", "45",
          "-fps_mode", "passthrough", *H264, str(out)])
    return out


def _make_edit_list_cut(directory: Path) -> Path:
    """Stream copy cut at a non-keyframe from a 30 fps source with one keyframe per 20 s.

    The MP4 carries an edit list; decord counts more frames than decode and spins forever
    on the missing ones (decord #373)."""
    source = directory / "_long_gop_source.mp4"
    _run([*_video_src(30), *H264, "-g", "600", "-keyint_min", "600", "-sc_threshold", "0", str(source)])
    out = directory / "edit_list_cut.mp4"
    _run(["-ss", "4.5", "-t", "10", "-i", str(source), "-c", "copy", str(out)])
    source.unlink()
    return out


def build(directory: str | os.PathLike, *, include_720p: bool = True) -> dict[str, str]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for name, (inputs, outputs) in {**VIDEO_RECIPES, **AUDIO_RECIPES}.items():
        if name == "h264_720p.mp4" and not include_720p:
            continue
        out = directory / name
        _run([*inputs, *outputs, str(out)])
        corpus[name] = str(out)
    corpus["vfr.mp4"] = str(_make_vfr(directory))
    corpus["edit_list_cut.mp4"] = str(_make_edit_list_cut(directory))
    return corpus


VIDEO_NAMES = [*VIDEO_RECIPES, "vfr.mp4"]
AUDIO_NAMES = list(AUDIO_RECIPES)
# Containers with an audio stream, for audio-from-video parity.
VIDEO_WITH_AUDIO = ["h264_aac_bframes.mp4", "vp9_opus.mkv", "h264.mov"]
# The container promises more frames than decode: stock decord loaders never return on it.
LYING_CLIP = "edit_list_cut.mp4"

_BUILT: dict[str, dict[str, str]] = {}


def session_corpus(tmp_path_factory) -> dict[str, str]:
    """The corpus, built once per test session whichever test module asks first."""
    if "corpus" not in _BUILT:
        _BUILT["corpus"] = build(tmp_path_factory.mktemp("media_corpus"), include_720p=False)
    return _BUILT["corpus"]


# --- stock references -----------------------------------------------------------------
# Loader cases shared by the parity tests and the stock reference runner: (case, function
# name in swift/template/vision_utils.py and in swift_safe_media.decoders, kwargs).
SWIFT_VIDEO_CASES = [
    ("internvl", "load_video_internvl", {"num_segments": 8}),
    ("cogvlm2", "load_video_cogvlm2", {}),
    ("llava", "load_video_llava", {}),
    ("minicpmv", "load_video_minicpmv_mplug_owl3", {"max_num_frames": 4}),
    ("valley", "load_video_valley", {}),
    ("ovis2", "load_video_ovis2", {"num_frames": 6}),
    ("ovis2_5", "load_video_ovis2_5", {"num_frames": 6}),
    ("vllm", "load_vllm_video", {"num_frames": 6}),
    ("hf", "load_video_hf", {}),
]
QWEN_VIDEO_ELEMENT = {"nframes": 4}
AUDIO_SETTINGS = [(16000, True), (22050, False)]
AUDIO_BACKENDS = ["librosa", "soundfile_pyav"]


def run_video_case(module, function: str, kwargs: dict, path: str):
    """Call a loader, stock or safe, and reduce its result to (frames, metadata).

    frames: uint8 (T, H, W, 3) for every loader (float (T, C, H, W) for qwen's fetch_video);
    metadata: a JSON-able dict of what the loader returned besides the frames."""
    import numpy as np

    fn = getattr(module, function)
    if function == "load_video_hf":
        frames, metadata = fn([path])
        meta = metadata[0]
        return np.asarray(frames[0]), {"total_num_frames": int(meta.total_num_frames), "fps": float(meta.fps),
                                       "frames_indices": [int(i) for i in meta.frames_indices]}
    if function == "fetch_video":
        frames, meta = fn({"video": path, **QWEN_VIDEO_ELEMENT}, return_video_metadata=True)
        return frames.numpy(), {"total_num_frames": int(meta["total_num_frames"]), "fps": float(meta["fps"]),
                                "frames_indices": [int(i) for i in meta["frames_indices"]]}
    result = fn(path, **kwargs)
    meta = {"return_type": type(result).__name__}
    if function == "load_vllm_video":
        result, info = result
        meta.update({k: (float(v) if k in ("fps", "duration") else v) for k, v in info.items()})
    if function == "load_video_cogvlm2":
        meta["dtype"] = str(result.dtype)
        result = result.permute(1, 2, 3, 0).numpy()
    if isinstance(result, list):
        meta["types"] = sorted({type(x).__name__ for x in result})
        meta["modes"] = sorted({x.mode for x in result})
        result = np.stack([np.asarray(x) for x in result]) if result else np.zeros((0, 0, 0, 3), np.uint8)
    return np.asarray(result), meta


def _save(out_dir: Path, key: str, frames=None, meta=None, error=None) -> None:
    import json

    import numpy as np
    if error is not None:
        (out_dir / f"{key}.err").write_text(error)
        return
    np.save(out_dir / f"{key}.npy", frames)
    (out_dir / f"{key}.json").write_text(json.dumps(meta))


def stock_references(corpus_dir: str, out_dir: str, names: list[str], which: str) -> None:
    """Run stock loaders and save what they return, one file per case as it finishes.

    Runs in its own process (decord and audioread can hang): the parity tests start it
    with a timeout and read whatever it saved."""
    import json
    import sys
    import traceback

    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def attempt(key, fn):
        if "decord" in sys.modules:  # stock cogvlm2/valley switch decord's global bridge to torch
            sys.modules["decord"].bridge.set_bridge("native")
        try:
            frames, meta = fn()
            _save(out, key, frames, meta)
        except Exception:
            _save(out, key, error=traceback.format_exc())

    if which == "qwen":  # FORCE_QWENVL_VIDEO_READER is read at import: set by the caller
        import qwen_vl_utils
        backend = os.environ.get("FORCE_QWENVL_VIDEO_READER", "default")
        for name in names:
            attempt(f"qwen-{backend}__{name}",
                    lambda: run_video_case(qwen_vl_utils, "fetch_video", {}, os.path.join(corpus_dir, name)))
        return
    import swift.template.vision_utils as vu
    for name in names:
        path = os.path.join(corpus_dir, name)
        if which == "video":
            for case, function, kwargs in SWIFT_VIDEO_CASES:
                attempt(f"{case}__{name}", lambda: run_video_case(vu, function, kwargs, path))
        else:
            for backend in AUDIO_BACKENDS:
                os.environ["SWIFT_AUDIO_LOAD_BACKEND"] = backend
                for sr, mono in AUDIO_SETTINGS:
                    attempt(f"audio-{backend}-{sr}-{int(mono)}__{name}",
                            lambda: (lambda y, r: (np.asarray(y), {"sr": int(r)}))(
                                *vu.load_audio(path, sr, return_sr=True, mono=mono)))
    if which == "audio":
        import qwen_omni_utils
        conversation = omni_conversation(corpus_dir)
        attempt("omni__audio", lambda: (np.concatenate(qwen_omni_utils.process_audio_info(conversation, True)),
                                        {"lengths": [len(a) for a in
                                                     qwen_omni_utils.process_audio_info(conversation, True)]}))
    (out / "DONE").write_text(json.dumps(names))


def spawn_stock_references(corpus_dir: str, out_dir: str, which: str, names: list[str], env=None):
    """Start `stock_references` in a fresh interpreter (a Popen: the caller bounds it).

    This file is loaded by path with the working directory set to `out_dir`, so sibling
    test modules (tests/datasets.py, ...) cannot shadow installed packages there."""
    import sys
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('media_corpus', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "m.stock_references(sys.argv[2], sys.argv[3], sys.argv[5:], sys.argv[4])")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(out_dir, f"stderr-{which}.txt"), "ab") as stderr:
        return subprocess.Popen([sys.executable, "-c", code, os.path.abspath(__file__), corpus_dir, out_dir, which,
                                 *names], cwd=out_dir, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def omni_conversation(corpus_dir: str) -> list[dict]:
    """A Qwen-Omni conversation: audio in a video, a file:// wav cut by start/end, an MP3."""
    return [{"role": "user", "content": [
        {"type": "video", "video": os.path.join(corpus_dir, "h264_aac_bframes.mp4")},
        {"type": "audio", "audio": "file://" + os.path.join(corpus_dir, "pcm_48k_stereo.wav"),
         "audio_start": 0.5, "audio_end": 1.5},
        {"type": "audio", "audio": os.path.join(corpus_dir, "mp3_44k_stereo.mp3")},
        {"type": "text", "text": "describe"},
    ]}]


if __name__ == "__main__":
    import sys
    import time
    start = time.time()
    built = build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/swift_safe_media_corpus")
    for name, path in built.items():
        print(f"{os.path.getsize(path):>9}  {path}")
    print(f"built {len(built)} clips in {time.time() - start:.1f} s")
