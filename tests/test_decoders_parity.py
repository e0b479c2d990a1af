"""The safe twins return what the stock loaders return, on a corpus made with ffmpeg.

Stock references (decord, librosa/audioread, PyAV, moviepy, OpenCV, qwen_vl_utils,
qwen_omni_utils) run in a separate interpreter under a timeout, since decord and
audioread can hang; where a stock loader fails on a good clip, or hangs on it (the
edit-list clip), the reference is PyAV decoding every frame of the file in order and
taking the frames at the stock formula's indices for the true frame count.

Frames: the same uint8 RGB pixels, bit for bit. Audio: the same samples, bit for bit where
stock and twin decode with the same library (libsndfile, soxr, PyAV); within one 16-bit step
where stock reads through audioread's 16-bit ffmpeg pipe and the twin decodes the same steps
with torchcodec (S16_STEP).
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

try:
    from tests import media_corpus
except ImportError:  # tests/ run as rootdir-less modules
    import media_corpus

import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeError
from swift_safe_media.decoders import audio as audio_decoder
from swift_safe_media.decoders import swift as safe_swift
from swift_safe_media.decoders.video import Seconds, VideoInfo

pytest.importorskip("swift.template.vision_utils", reason="the stock ms-swift loaders are the reference")

S16_STEP = 2.0 / 32768
REFERENCE_TIMEOUT_S = 200

HONEST_VIDEOS = [name for name in media_corpus.VIDEO_NAMES if name != "h264_720p.mp4"]
AUDIO_INPUTS = media_corpus.AUDIO_NAMES + media_corpus.VIDEO_WITH_AUDIO
QWEN_VIDEOS = ["h264_aac_bframes.mp4", "vp9.webm", "vfr.mp4", "mjpeg.avi", "odd_161x97.avi"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return media_corpus.session_corpus(tmp_path_factory)


@pytest.fixture(scope="session")
def stock(corpus, tmp_path_factory):
    """Directory of stock results, computed by four bounded child interpreters at once."""
    out = str(tmp_path_factory.mktemp("stock_references"))
    corpus_dir = os.path.dirname(corpus["vfr.mp4"])
    runs = [
        media_corpus.spawn_stock_references(corpus_dir, out, "video", HONEST_VIDEOS),
        media_corpus.spawn_stock_references(corpus_dir, out, "audio", AUDIO_INPUTS),
        media_corpus.spawn_stock_references(corpus_dir, out, "qwen", QWEN_VIDEOS),
        media_corpus.spawn_stock_references(corpus_dir, out, "qwen", QWEN_VIDEOS,
                                            env={"FORCE_QWENVL_VIDEO_READER": "decord"}),
    ]
    deadline = time.monotonic() + REFERENCE_TIMEOUT_S
    for run in runs:
        try:
            run.wait(max(1.0, deadline - time.monotonic()))
        except Exception:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return out


def stock_result(stock_dir, key):
    """(frames, meta) the stock loader returned, or (None, error text) when it raised."""
    base = os.path.join(stock_dir, key)
    if os.path.exists(base + ".npy"):
        with open(base + ".json") as f:
            return np.load(base + ".npy"), json.load(f)
    if os.path.exists(base + ".err"):
        with open(base + ".err") as f:
            return None, f.read()
    pytest.fail(f"no stock result for {key}: the reference run hung or died "
                f"(see the stderr-*.txt files in {stock_dir})")


def every_frame(path):
    """All frames PyAV decodes, in order: the ground truth of what the file holds."""
    import av
    with av.open(path) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def true_info(path) -> tuple[VideoInfo, np.ndarray]:
    import av
    frames = every_frame(path)
    with av.open(path) as container:
        stream = container.streams.video[0]
        duration = float(stream.duration * stream.time_base) if stream.duration else float(container.duration / 1e6)
        nominal = float(stream.guessed_rate)
    return VideoInfo(len(frames), len(frames) / duration, duration, frames.shape[2], frames.shape[1], nominal), frames


# Stock formula for each case, for the reference built from every_frame().
CASE_RULES = {
    "internvl": lambda info: safe_swift.internvl_indices(info, None, 8),
    "cogvlm2": lambda info: safe_swift.cogvlm2_indices(info, 24),
    "llava": lambda info: safe_swift.llava_indices(info, 16),
    "minicpmv": lambda info: safe_swift.minicpmv_indices(info, 4),
    "valley": safe_swift.valley_indices,
    "ovis2": lambda info: safe_swift.ovis2_indices(info, 6),
    "ovis2_5": lambda info: safe_swift.ovis2_5_indices(info, 6),
    "vllm": lambda info: safe_swift.vllm_indices(info, 6),
    "hf": safe_swift.all_indices,
}


def reference_indices(case, info):
    picked = CASE_RULES[case](info)
    if isinstance(picked, Seconds):  # moviepy's by-time rules; these clips are constant-rate
        return np.array([int(t * info.fps) for t in picked])
    return np.asarray(picked, dtype=int)


def assert_frames_match(ours, reference, what):
    assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != {reference.shape}"
    assert ours.dtype == reference.dtype, f"{what}: dtype {ours.dtype} != {reference.dtype}"
    np.testing.assert_array_equal(ours, reference, err_msg=what)


CASES = [(case, function, kwargs) for case, function, kwargs in media_corpus.SWIFT_VIDEO_CASES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", HONEST_VIDEOS)
@pytest.mark.parametrize("case,function,kwargs", CASES, ids=[c[0] for c in CASES])
def test_swift_video_loader_matches_stock(stock, corpus, case, function, kwargs, name):
    path = corpus[name]
    ours, our_meta = media_corpus.run_video_case(safe, function, kwargs, path)
    reference, stock_meta = stock_result(stock, f"{case}__{name}")
    if reference is None:
        # Stock fails on this good clip (decord on VP9, PyAV without a frame count in
        # Matroska): compare with the frames the file holds, at the stock formula's indices.
        info, frames = true_info(path)
        assert_frames_match(ours, frames[reference_indices(case, info)], f"{case} {name}")
        return
    if case == "ovis2" and name == "one_frame.mp4":
        # moviepy counts int(fps * duration cut to 10 ms) = 0 frames and returns [];
        # the clip holds one frame and we return it.
        assert len(reference) == 0
        assert_frames_match(ours, every_frame(path), f"{case} {name}")
        return
    assert_frames_match(ours, reference, f"{case} {name}")
    for key, value in stock_meta.items():
        if isinstance(value, float):
            assert our_meta[key] == pytest.approx(value, rel=1e-6), f"{case} {name}: {key}"
        else:
            assert our_meta[key] == value, f"{case} {name}: {key}"


@pytest.mark.parametrize("case", list(CASE_RULES))
def test_lying_container_decodes_the_frames_it_holds(corpus, case):
    """The edit-list clip promises 435 frames and holds 300: stock decord loaders never
    return on it. Ours index the 300 frames that decode, with the stock formula."""
    path = corpus[media_corpus.LYING_CLIP]
    info, frames = true_info(path)
    assert info.num_frames == 300
    function, kwargs = next((f, k) for c, f, k in media_corpus.SWIFT_VIDEO_CASES if c == case)
    ours, meta = media_corpus.run_video_case(safe, function, kwargs, path)
    assert_frames_match(ours, frames[reference_indices(case, info)], case)
    if case in ("hf", "vllm"):
        assert meta["total_num_frames"] == 300


@pytest.mark.parametrize("backend", ["default", "decord"])
@pytest.mark.parametrize("name", QWEN_VIDEOS)
def test_qwen_fetch_video_matches_stock(stock, corpus, backend, name):
    ours, our_meta = media_corpus.run_video_case(safe, "fetch_video", {}, corpus[name])
    reference, stock_meta = stock_result(stock, f"qwen-{backend}__{name}")
    if reference is None:
        assert backend == "decord" and "DECORDError" in stock_meta, stock_meta
        reference, stock_meta = stock_result(stock, f"qwen-default__{name}")
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    np.testing.assert_array_equal(ours, reference)
    assert our_meta["frames_indices"] == stock_meta["frames_indices"]
    assert our_meta["total_num_frames"] == stock_meta["total_num_frames"]
    assert our_meta["fps"] == pytest.approx(stock_meta["fps"], rel=1e-6)


def test_qwen_fetch_video_on_lying_container(corpus):
    path = corpus[media_corpus.LYING_CLIP]
    info, frames = true_info(path)
    video, meta = safe.fetch_video({"video": path, **media_corpus.QWEN_VIDEO_ELEMENT}, return_video_metadata=True)
    assert meta["total_num_frames"] == 300
    assert meta["frames_indices"] == np.linspace(0, 299, 4).round().astype(int).tolist()
    assert video.shape[0] == 4 and video.dtype.is_floating_point


def assert_audio_match(ours, reference, what, step=0.0):
    """The same samples: bit for bit, or within `step` of each other."""
    assert ours.dtype == np.float32, what
    assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != {reference.shape}"
    difference = np.max(np.abs(ours.astype(np.float64) - reference.astype(np.float64))) if ours.size else 0.0
    assert difference <= step, f"{what}: samples differ by up to {difference}"


# Containers libsndfile does not read: stock librosa decodes them through audioread's ffmpeg pipe.
THROUGH_AUDIOREAD = (".m4a", ".mp4", ".mkv", ".mov")


@pytest.mark.parametrize("sr,mono", media_corpus.AUDIO_SETTINGS)
@pytest.mark.parametrize("backend", media_corpus.AUDIO_BACKENDS)
@pytest.mark.parametrize("name", AUDIO_INPUTS)
def test_load_audio_matches_stock(stock, corpus, monkeypatch, name, backend, sr, mono):
    monkeypatch.setenv("SWIFT_AUDIO_LOAD_BACKEND", backend)
    reference, meta = stock_result(stock, f"audio-{backend}-{sr}-{int(mono)}__{name}")
    if reference is None and backend == "librosa" and audio_decoder.librosa_without_audioread():
        assert_refused_as_librosa_1_refuses(lambda: safe.load_audio(corpus[name], sr, mono=mono), corpus[name])
        return
    ours, our_sr = safe.load_audio(corpus[name], sr, return_sr=True, mono=mono)
    if reference is None:
        # Stock soundfile_pyav resamples each channel of a transposed array and PyAV
        # refuses the non-contiguous row: stereo with mono=False always raises there.
        assert backend == "soundfile_pyav" and not mono and "C-contiguous" in meta, meta
        reference, meta = stock_result(stock, f"audio-librosa-{sr}-{int(mono)}__{name}")
        # librosa stands in, with another resampler (soxr, where the twin runs stock's
        # PyAV resampler on each channel): the same sound, not the same samples.
        assert our_sr == meta["sr"] and ours.shape[:-1] == reference.shape[:-1]
        assert abs(ours.shape[-1] - reference.shape[-1]) <= 1
        n = min(ours.shape[-1], reference.shape[-1])
        for a, b in zip(ours.reshape(-1, ours.shape[-1]), reference.reshape(-1, reference.shape[-1])):
            assert np.corrcoef(a[:n], b[:n])[0, 1] >= 0.999
        return
    assert our_sr == meta["sr"]
    step = S16_STEP if backend == "librosa" and name.endswith(THROUGH_AUDIOREAD) else 0.0
    assert_audio_match(ours, reference, f"{name} {backend} sr={sr} mono={mono}", step)
    assert isinstance(safe.load_audio(corpus[name], sr, mono=mono), np.ndarray)


def assert_refused_as_librosa_1_refuses(load, path):
    """librosa 1.x has no audioread fallback: what its libsndfile refuses, the twin refuses."""
    with pytest.raises(MediaDecodeError, match="libsndfile cannot read this file") as refused:
        load()
    assert refused.value.path == path


def test_under_librosa_1_the_twin_reads_what_libsndfile_opens_and_refuses_the_rest(corpus):
    """librosa 1.0 dropped its audioread fallback: stock reads only what libsndfile opens.
    Where it is installed (``make newest`` runs the parity above against it), the twin's entry
    is given its version: here, told 1.0.0 beside librosa 0.x, it reads librosa's own samples
    of what libsndfile opens, and refuses an AAC naming the file and libsndfile's reason."""
    import librosa

    from swift_safe_media.decoders import guards, inputs
    from swift_safe_media.engine import calls as engine

    limits, url_timeout = guards.Limits.from_env(), inputs.url_timeout()

    def load(path):
        source = inputs.fetched(inputs.describe(path), limits, url_timeout)
        return engine.call(audio_decoder.load, source, limits, url_timeout, None, False, libsndfile_only="1.0.0",
                           path=source.label)

    samples, rate = load(corpus["pcm_48k_stereo.wav"])
    reference, reference_rate = librosa.load(corpus["pcm_48k_stereo.wav"], sr=None, mono=False)
    assert rate == reference_rate and samples.dtype == reference.dtype and np.array_equal(samples, reference)
    assert_refused_as_librosa_1_refuses(lambda: load(corpus["aac_44k_stereo.m4a"]), corpus["aac_44k_stereo.m4a"])


def test_qwen_omni_audio_matches_stock(stock, corpus):
    conversation = media_corpus.omni_conversation(os.path.dirname(corpus["vfr.mp4"]))
    reference, meta = stock_result(stock, "omni__audio")
    if reference is None and audio_decoder.librosa_without_audioread():
        assert_refused_as_librosa_1_refuses(lambda: safe.process_audio_info(conversation, True),
                                            corpus["h264_aac_bframes.mp4"])
        return
    ours = safe.process_audio_info(conversation, use_audio_in_video=True)
    assert [len(a) for a in ours] == pytest.approx(meta["lengths"], abs=1)
    offset = 0
    for audio, length in zip(ours, meta["lengths"]):
        assert_audio_match(audio, reference[offset:offset + length], "omni", S16_STEP)
        offset += length
    assert safe.process_audio_info(conversation, use_audio_in_video=False)[0].shape[0] == meta["lengths"][1]


def test_inputs_bytes_bytesio_base64_data_uri_and_root_dir(corpus, monkeypatch):
    import base64
    import io
    path = corpus["h264_aac_bframes.mp4"]
    expected = safe.load_video_llava(path)
    raw = open(path, "rb").read()
    encoded = base64.b64encode(raw).decode()
    for form in (raw, io.BytesIO(raw), encoded, "data:video/mp4;base64," + encoded, "file://" + path):
        np.testing.assert_array_equal(safe.load_video_llava(form), expected)
    monkeypatch.setenv("ROOT_IMAGE_DIR", os.path.dirname(path))
    np.testing.assert_array_equal(safe.load_video_llava(os.path.basename(path)), expected)
    wav = corpus["pcm_16k_stereo.wav"]
    np.testing.assert_array_equal(safe.load_audio(open(wav, "rb").read(), 16000), safe.load_audio(wav, 16000))


def test_load_video_hf_with_image_list(corpus, tmp_path):
    from PIL import Image
    import swift.template.vision_utils as stock_vu
    frames = every_frame(corpus["h264_noaudio.mp4"])[:3]
    names = []
    for i, frame in enumerate(frames):
        names.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(frame).save(names[-1])
    ours, our_meta = safe.load_video_hf([names])
    reference, stock_meta = stock_vu.load_video_hf([names])  # PIL on PNGs: no video decoder involved
    np.testing.assert_array_equal(ours[0], reference[0])
    assert our_meta == stock_meta == [None]


def test_qwen_fetch_video_with_image_list(corpus, tmp_path):
    from PIL import Image
    import qwen_vl_utils
    names = []
    for i, frame in enumerate(every_frame(corpus["h264_noaudio.mp4"])[:3]):
        names.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(frame).save(names[-1])
    element = {"video": names, "sample_fps": 2.0}
    ours, our_meta = safe.fetch_video(element, return_video_metadata=True)
    reference, stock_meta = qwen_vl_utils.fetch_video(element, return_video_metadata=True)  # PIL on PNGs
    assert ours.shape == reference.shape and float((ours - reference).abs().max()) == 0.0
    assert our_meta == stock_meta
