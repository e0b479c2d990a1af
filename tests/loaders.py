"""The safe loader twins, each called the way a test calls it with one path: shared by
the bad-input, damaged-media and hostile-media tests."""

import swift_safe_media.decoders as safe

VIDEO_LOADERS = {
    "internvl": lambda p: safe.load_video_internvl(p, num_segments=4),
    "cogvlm2": safe.load_video_cogvlm2,
    "llava": safe.load_video_llava,
    "minicpmv": lambda p: safe.load_video_minicpmv_mplug_owl3(p, 4),
    "valley": safe.load_video_valley,
    "ovis2": lambda p: safe.load_video_ovis2(p, 4),
    "ovis2_5": lambda p: safe.load_video_ovis2_5(p, 4),
    "hf": lambda p: safe.load_video_hf([p]),
    "vllm": lambda p: safe.load_vllm_video(p, 4),
    "qwen": lambda p: safe.fetch_video({"video": p, "nframes": 2}),
}
AUDIO_LOADERS = {
    "load_audio": lambda p: safe.load_audio(p, 16000),
    "omni": lambda p: safe.process_audio_info([{"role": "user", "content": [{"type": "audio", "audio": p}]}], False),
}
ALL_LOADERS = {**VIDEO_LOADERS, **AUDIO_LOADERS}


def audio_reason(reason: str) -> str:
    """What the audio twins' refusal of a file libsndfile does not open says: ``reason``; under
    librosa 1.x, which reads only what libsndfile opens, libsndfile's refusal (as stock's)."""
    from swift_safe_media.decoders import audio

    return "libsndfile cannot read this file" if audio.librosa_without_audioread() else reason
