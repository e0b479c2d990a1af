"""Audio decoding, run inside the sandbox: soundfile for the formats libsndfile reads
(as librosa does), torchcodec's AudioDecoder for audio inside other containers.
Never audioread: its ffmpeg pipe can deadlock (audioread #130).

Samples come back as float32, shaped like librosa's: (n,) mono or (channels, n).
Resampling uses soxr at librosa's default quality, and the length is librosa's:
ceil(n * target_sr / native_sr).
"""

from __future__ import annotations

import io
import math

from ..errors import MediaDecodeError, is_out_of_memory
from . import demuxers, families, guards, inputs

# Containers libsndfile decodes itself; anything else (MP4/M4A, Matroska, ...) goes to torchcodec.
_SOUNDFILE_CONTAINERS = {"wav", "flac", "ogg", "mp3", "mp3/aac", "aiff"}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def _read_soundfile(label, data, limits, offset, duration):
    """(samples (channels, n) or (n,), native rate), or None when libsndfile can't read it."""
    import soundfile

    try:
        with soundfile.SoundFile(data if isinstance(data, str) else io.BytesIO(data)) as f:
            native_sr = f.samplerate
            guards.check_audio_seconds(label, f.frames / native_sr if duration is None else duration, limits)
            start = int(offset * native_sr)
            if start:
                f.seek(start)
            frames = -1 if duration is None else int(duration * native_sr)
            samples = f.read(frames=frames, dtype="float32", always_2d=False).T
    except soundfile.LibsndfileError:
        return None
    if samples.shape[-1] == 0:  # a header with no payload behind it (or an offset past the end)
        raise MediaDecodeError(label, "no audio samples decoded")
    return samples, native_sr


def _open_audio(label, data, stream_index=None):
    from torchcodec.decoders import AudioDecoder

    pinned = demuxers.for_torchcodec(label, data)  # the file opened here, the demuxer checked
    try:
        return AudioDecoder(pinned, stream_index=stream_index)
    except Exception as exc:
        if "audio stream" in str(exc).lower():
            raise MediaDecodeError(label, "no audio stream") from None
        raise MediaDecodeError(label, f"cannot open audio: {_reason(exc)}") from None


def _audio_streams(label, data, decoder, rule):
    """(the input's audio streams, FFmpeg's best one) as ``families.pick_audio`` wants
    them; ([], None) where this torchcodec does not tell. Dispositions are read with PyAV,
    and only where there is a choice to make by them."""
    try:
        from torchcodec import _core

        container = _core.get_container_metadata(decoder._decoder)
    except Exception:
        return [], None
    streams = [families.StreamInfo(s.stream_index, float(s.bit_rate or 0), channels=s.num_channels or 0)
               for s in container.streams if type(s).__name__ == "AudioStreamMetadata"]
    if len(streams) > 1 and rule == families.COMMAND_LINE:
        try:
            with demuxers.open_pyav(label, data) as pyav_container:
                default = {s.index: bool(s.disposition & 1) for s in pyav_container.streams.audio}
            streams = [families.StreamInfo(s.index, s.bit_rate, channels=s.channels, default=default.get(s.index))
                       for s in streams]
        except Exception:  # no PyAV: the most channels, then the first
            pass
    return streams, container.best_audio_stream_index


def _read_torchcodec(label, data, limits, offset, duration, rule=families.COMMAND_LINE):
    decoder = _open_audio(label, data)
    streams, best = _audio_streams(label, data, decoder, rule)
    if len(streams) > 1:
        wanted = families.pick_audio(streams, rule, best)
        if wanted is not None and wanted != decoder.stream_index:
            decoder = _open_audio(label, data, wanted)
    native_sr = decoder.metadata.sample_rate
    header_seconds = decoder.metadata.duration_seconds_from_header
    if duration is None and header_seconds:
        guards.check_audio_seconds(label, header_seconds - offset, limits)
    # Never decode past the cap, even when the header does not say how long the stream is.
    span = limits.max_audio_seconds if duration is None else min(duration, limits.max_audio_seconds)
    try:
        samples = decoder.get_samples_played_in_range(start_seconds=offset, stop_seconds=offset + span + 1.0)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise MemoryError(f"decoding {span:.0f} s of audio: {_reason(exc)}") from None
        raise MediaDecodeError(label, f"decode failed: {_reason(exc)}") from None
    y = samples.data.numpy()
    if duration is None and y.shape[-1] > limits.max_audio_seconds * native_sr:
        guards.check_audio_seconds(label, y.shape[-1] / native_sr, limits)
    if duration is not None:
        y = y[:, :int(duration * native_sr)]
    if y.shape[-1] == 0:
        raise MediaDecodeError(label, "no audio samples decoded")
    return (y[0] if y.shape[0] == 1 else y), native_sr


def resample(y, native_sr: int, target_sr: int):
    """soxr 'HQ' along the last axis, trimmed or padded to ceil(n * target / native)."""
    import numpy as np
    import soxr

    if native_sr == target_sr:
        return y
    length = math.ceil(y.shape[-1] * target_sr / native_sr)
    out = soxr.resample(y.T, native_sr, target_sr, quality="soxr_hq").T
    if out.shape[-1] > length:
        out = out[..., :length]
    elif out.shape[-1] < length:
        out = np.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, length - out.shape[-1])])
    return np.ascontiguousarray(out, dtype=np.float32)


def decode(label, data, limits, offset=0.0, duration=None, rule=families.COMMAND_LINE):
    """(float32 samples at the native rate, native rate, decoded by soundfile?). `rule`:
    which audio stream of a container with several (``families.pick_audio``): librosa's
    audioread pipe takes what the ffmpeg command line maps, PyAV's users the first."""
    kind = guards.container_of(data[:guards.HEAD_BYTES] if isinstance(data, bytes) else _head(data))
    if kind in _SOUNDFILE_CONTAINERS:
        result = _read_soundfile(label, data, limits, offset, duration)
        if result is not None:
            return (*result, True)
    return (*_read_torchcodec(label, data, limits, offset, duration, rule), False)


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(guards.HEAD_BYTES)


def load(source: inputs.Source, limits: guards.Limits, url_timeout, sr, mono=True, offset=0.0, duration=None):
    """Sandbox entry, librosa.load semantics: (samples, rate)."""
    import numpy as np

    data = inputs.materialize(source, limits, url_timeout)
    y, native_sr, _ = decode(source.label, data, limits, offset, duration)
    if mono and y.ndim > 1:
        y = np.mean(y, axis=0)
    if sr is not None and sr != native_sr:
        return resample(y, native_sr, int(sr)), sr
    return np.ascontiguousarray(y, dtype=np.float32), native_sr


def load_soundfile_pyav(source: inputs.Source, limits: guards.Limits, url_timeout, sr, mono=True):
    """Sandbox entry, ms-swift's soundfile_pyav backend semantics: (samples, rate)."""
    import numpy as np

    data = inputs.materialize(source, limits, url_timeout)
    y, native_sr, by_soundfile = decode(source.label, data, limits, rule=families.FIRST)
    if by_soundfile:
        if mono and y.ndim > 1:
            y = np.mean(y, axis=0)
        if sr is not None and sr != native_sr:
            return resample(y, native_sr, int(sr)), int(sr)
        return np.ascontiguousarray(y, dtype=np.float32), native_sr
    # Stock's PyAV branch: channels first even for a mono stream, and its resampler
    # outputs a mono layout whatever `mono` says. Shapes kept as stock returns them.
    if y.ndim == 1:
        y = y[np.newaxis, :]
    if sr is not None and sr != native_sr:
        y = resample(np.mean(y, axis=0), native_sr, int(sr))[np.newaxis, :]
    if mono:
        y = np.mean(y, axis=0)
    return np.ascontiguousarray(y, dtype=np.float32), sr or native_sr
