"""Audio decoding with PyAV, run inside the sandbox, always from the first packet on.

- ms-swift's ``soundfile_pyav`` backend resamples with PyAV's resampler and reads what
  libsndfile cannot with PyAV: ``resample_like_stock`` and ``decode_like_stock`` are that
  code, on a file opened and pinned here (``demuxers.open_pyav``), so the samples are the
  ones stock returns, bit for bit (same PyAV, same FFmpeg build).
- ``decode_float``: the fallback where torchcodec fails on a container FFmpeg reads from
  the start (a FLAC with variable block sizes that torchcodec cannot seek in).
"""

from __future__ import annotations

import math

from ..errors import MediaDecodeError, decode_failure, short_reason
from . import demuxers, guards


def available() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def resample_like_stock(y, orig_sr: float, target_sr: float):
    """ms-swift 4.6's ``_resample_audio_pyav`` (after vLLM's): each channel alone, at
    least 1024 samples in, PyAV's resampler flushed, cut to ceil(n * target / orig).
    A stereo file with ``mono=False`` works (stock raises there)."""
    import av
    import numpy as np

    orig, target = int(round(orig_sr)), int(round(target_sr))
    if orig == target:
        return y
    if y.ndim == 2:
        return np.stack([resample_like_stock(channel, orig_sr, target_sr) for channel in y], axis=0)
    expected = int(math.ceil(y.shape[-1] * target / orig))
    # Contiguous: stock hands PyAV a strided row of a stereo file and PyAV refuses it.
    samples = np.ascontiguousarray(y, dtype=np.float32)
    if len(samples) < 1024:
        samples = np.pad(samples, (0, 1024 - len(samples)))
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="fltp", layout="mono")
    frame.sample_rate = orig
    out = resampler.resample(frame)
    out.extend(resampler.resample(None))
    return np.concatenate([f.to_ndarray() for f in out], axis=1).squeeze(0)[:expected]


def decode_like_stock(label, data, limits: guards.Limits, sr, mono: bool):
    """ms-swift 4.6's ``_load_pyav``: the first audio stream, resampled to mono at `sr`
    by PyAV's resampler (not flushed, as stock), or the decoded frames as they are.
    Integer samples are scaled to [-1, 1] (stock casts them to float unscaled)."""
    import av
    import numpy as np

    with demuxers.open_pyav(label, data) as container:
        if not container.streams.audio:
            raise MediaDecodeError(label, "no audio stream")
        stream = container.streams.audio[0]
        stream.thread_type = "AUTO"
        native_sr = stream.rate
        target_sr = sr or native_sr
        resampling = not math.isclose(float(target_sr), float(native_sr), rel_tol=0.0, abs_tol=1e-6)
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=target_sr) if resampling else None
        as_float = None if resampling else av.AudioResampler(format="fltp")
        chunks, held, decoded, size = [], 0, 0, guards.input_size(data)
        try:
            for frame in container.decode(stream):
                decoded += frame.samples  # at the native rate, what the decompression cap counts
                _check_expansion(label, decoded * stream.channels, size, limits)
                for out in (resampler or as_float).resample(frame):
                    chunks.append(out.to_ndarray())
                    held += out.samples
                guards.check_audio_seconds(label, held / (target_sr if resampling else native_sr), limits)
            if as_float is not None:
                chunks.extend(out.to_ndarray() for out in as_float.resample(None))
        except MediaDecodeError:
            raise
        except Exception as exc:
            raise decode_failure(label, exc, "decoding audio with PyAV", "PyAV") from None
    if not chunks:
        raise MediaDecodeError(label, "no audio samples decoded")
    y = np.concatenate(chunks, axis=-1).astype(np.float32)
    if mono and y.ndim > 1:
        y = np.mean(y, axis=0)
    return np.ascontiguousarray(y, dtype=np.float32), target_sr


def _check_expansion(label, samples: int, input_bytes, limits: guards.Limits) -> None:
    """``guards.check_expansion`` on the float32 samples decoded so far (all channels)."""
    guards.check_expansion(label, samples * 4, "audio samples as float32", input_bytes, limits)


def decode_float(label, data, limits: guards.Limits, offset: float, duration, stream_index: int | None):
    """(float32 samples (channels, n), native rate) of one audio stream, decoded in
    order from its start, `offset` and `duration` in seconds applied after decoding."""
    import av
    import numpy as np

    with demuxers.open_pyav(label, data) as container:
        streams = container.streams.audio
        stream = next((s for s in streams if s.index == stream_index), streams[0] if streams else None)
        if stream is None:
            raise MediaDecodeError(label, "no audio stream")
        native_sr = stream.rate
        to_float = av.AudioResampler(format="fltp")
        stop = None if duration is None else offset + duration
        cap = offset + limits.max_audio_seconds if stop is None else min(stop, offset + limits.max_audio_seconds)
        chunks, held, errors, last_error, size = [], 0, 0, None, guards.input_size(data)
        try:
            for packet in container.demux(stream):
                # As the ffmpeg command line (what librosa's audioread pipe runs) does, a
                # packet that does not decode is skipped, not the end of the stream.
                try:
                    frames = packet.decode()
                except av.error.FFmpegError as exc:
                    errors, last_error = errors + 1, exc
                    continue
                for frame in frames:
                    for out in to_float.resample(frame):
                        chunks.append(out.to_ndarray())
                        held += out.samples
                _check_expansion(label, held * stream.channels, size, limits)
                if held / native_sr > cap + 1.0:
                    break
            chunks.extend(out.to_ndarray() for out in to_float.resample(None))
        except Exception as exc:
            raise decode_failure(label, exc, "decoding audio with PyAV", "PyAV") from None
        if not chunks and last_error is not None:
            raise MediaDecodeError(label, f"decode failed (PyAV, {errors} packets): {short_reason(last_error)}")
    if not chunks:
        raise MediaDecodeError(label, "no audio samples decoded")
    y = np.concatenate(chunks, axis=-1).astype(np.float32)
    if duration is None and y.shape[-1] - int(offset * native_sr) > limits.max_audio_seconds * native_sr:
        guards.check_audio_seconds(label, y.shape[-1] / native_sr - offset, limits)
    y = y[:, int(offset * native_sr):None if stop is None else int(stop * native_sr)]
    if y.shape[-1] == 0:
        raise MediaDecodeError(label, "no audio samples decoded")
    return y, native_sr
