"""Audio decoding, run inside the sandbox: soundfile for the formats libsndfile reads
(as librosa does), torchcodec's AudioDecoder for audio inside other containers.
Never audioread: its ffmpeg pipe can deadlock (audioread #130).

Samples come back as float32, shaped like librosa's: (n,) mono or (channels, n).
Resampling uses soxr at librosa's default quality, and the length is librosa's:
ceil(n * target_sr / native_sr).
"""

from __future__ import annotations

import functools
import importlib.metadata
import io
import math

from ..confinement import handed
from ..errors import MediaDecodeError, is_out_of_memory, short_reason, typed_entry
from . import audio_pyav, demuxers, families, guards, inputs

# A decode this much shorter than the duration the header declares (the stream's, else
# the container's: Matroska keeps only the latter) is checked against PyAV's. Headers
# round to a millisecond; a false alarm costs a second decode, never other samples.
_SHORT_BY_SECONDS = 0.001

# Containers libsndfile decodes itself; anything else (MP4/M4A, Matroska, ...) goes to torchcodec.
# As librosa and ms-swift's soundfile_pyav, libsndfile is tried first on everything it
# may read (SPHERE, AU, VOC, W64 and CAF too); what it refuses goes on to FFmpeg.
_SOUNDFILE_CONTAINERS = {"wav", "flac", "ogg", "mp3", "mp3/aac", "aiff", "nistsphere", "amr/au/wavpack/ape", "voc",
                         "w64", "caf"}


def _read_soundfile(label, data, limits, offset, duration, refusal: list | None = None):
    """(samples (channels, n) or (n,), native rate), or None when libsndfile can't read it
    (FFmpeg then decodes it: whatever libsndfile raises, it is not the file's last word; its
    reason is appended to ``refusal``)."""
    import soundfile

    try:
        # A path: libsndfile reads the descriptor the caller handed (it opens nothing by name).
        with soundfile.SoundFile(handed.open_reader(data) if isinstance(data, str) else io.BytesIO(data)) as f:
            native_sr = f.samplerate
            seconds = f.frames / native_sr if duration is None else duration
            guards.check_audio_seconds(label, seconds, limits)
            guards.check_expansion(label, seconds * native_sr * f.channels * 4, "audio samples as float32",
                                   guards.input_size(data), limits)
            samples = _read_frames(f, int(offset * native_sr), -1 if duration is None else int(duration * native_sr))
    except (MediaDecodeError, MemoryError):
        raise
    except Exception as exc:  # LibsndfileError, or its Python side's ValueError / RuntimeError
        if is_out_of_memory(exc):
            raise MemoryError(f"decoding audio with libsndfile: {short_reason(exc)}") from None
        if refusal is not None:
            refusal.append(short_reason(exc))
        return None
    if samples.shape[-1] == 0:
        # A WAV whose recorder never wrote the data size (0: libsndfile reads nothing,
        # FFmpeg reads to the end, as BWF field recorders leave it), or a header with no
        # payload: FFmpeg decodes what is there, or says "no audio samples decoded".
        return None
    return samples, native_sr


# Frames read at a time from a file libsndfile cannot seek in (GSM 6.10 in WAV).
_BLOCK_FRAMES = 1 << 16


def _read_frames(f, start: int, frames: int):
    """`frames` frames (-1: all) from frame `start` on, (channels, n) or (n,). A file
    libsndfile cannot seek in (GSM 6.10, where soundfile's read(-1) raises "frames must
    be specified for non-seekable files") is read block by block from its start."""
    import numpy as np

    if f.seekable():
        if start:
            f.seek(start)
        return f.read(frames=frames, dtype="float32", always_2d=False).T
    blocks, skipped, wanted = [], 0, frames
    while wanted:
        block = f.read(frames=_BLOCK_FRAMES if wanted < 0 else min(wanted, _BLOCK_FRAMES), dtype="float32",
                       always_2d=True)
        if not len(block):
            break
        if skipped < start:
            cut = min(start - skipped, len(block))
            skipped, block = skipped + cut, block[cut:]
        if len(block):
            blocks.append(block)
            wanted = wanted - len(block) if wanted > 0 else wanted
    samples = np.concatenate(blocks) if blocks else np.zeros((0, f.channels), np.float32)
    return (samples[:, 0] if f.channels == 1 else samples).T


def _open_audio(label, data, stream_index=None):
    from torchcodec.decoders import AudioDecoder

    pinned = demuxers.for_torchcodec(label, data)  # the file opened here, the demuxer checked
    try:
        return AudioDecoder(pinned, stream_index=stream_index)
    except Exception as exc:
        if "audio stream" in str(exc).lower():
            raise MediaDecodeError(label, "no audio stream") from None
        raise MediaDecodeError(label, f"cannot open audio: {short_reason(exc)}") from None


def _audio_streams(label, data, decoder, rule):
    """(the input's audio streams, FFmpeg's best one, the container's declared duration)
    as ``families.pick_audio`` wants them; ([], None, None) where this torchcodec does not
    tell. Dispositions are read with PyAV, and only where there is a choice to make by them."""
    try:
        from torchcodec import _core

        container = _core.get_container_metadata(decoder._decoder)
    except Exception:
        return [], None, None
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
    return streams, container.best_audio_stream_index, container.duration_seconds_from_header


def _read_torchcodec(label, data, limits, offset, duration, rule=families.COMMAND_LINE):
    decoder = _open_audio(label, data)
    streams, best, container_seconds = _audio_streams(label, data, decoder, rule)
    if len(streams) > 1:
        wanted = families.pick_audio(streams, rule, best)
        if wanted is not None and wanted != decoder.stream_index:
            decoder = _open_audio(label, data, wanted)
    native_sr = decoder.metadata.sample_rate
    header_seconds = decoder.metadata.duration_seconds_from_header or container_seconds
    if duration is None and header_seconds:
        guards.check_audio_seconds(label, header_seconds - offset, limits)
    if header_seconds:
        seconds = min(header_seconds - offset, limits.max_audio_seconds) if duration is None else duration
        guards.check_expansion(label, seconds * native_sr * (decoder.metadata.num_channels or 1) * 4,
                               "audio samples as float32", guards.input_size(data), limits)
    # Never decode past the cap, even when the header does not say how long the stream is.
    span = limits.max_audio_seconds if duration is None else min(duration, limits.max_audio_seconds)
    try:
        samples = decoder.get_samples_played_in_range(start_seconds=offset, stop_seconds=offset + span + 1.0)
        y = samples.data.numpy()
    except Exception as exc:
        if is_out_of_memory(exc):
            raise MemoryError(f"decoding {span:.0f} s of audio: {short_reason(exc)}") from None
        if not audio_pyav.available():
            raise MediaDecodeError(label, f"decode failed: {short_reason(exc)}") from None
        # A valid file torchcodec cannot decode (it seeks first): PyAV from the start.
        try:
            y, native_sr = audio_pyav.decode_float(label, data, limits, offset, duration, decoder.stream_index)
        except MediaDecodeError as pyav_exc:
            raise MediaDecodeError(label, f"decode failed: {short_reason(exc)}; PyAV could not decode it either: "
                                          f"{pyav_exc.reason}") from None
    if header_seconds and offset == 0 and duration is None and audio_pyav.available() \
            and y.shape[-1] < (header_seconds - _SHORT_BY_SECONDS) * native_sr:
        # Fewer samples than the header promises (torchcodec trims frames whose
        # timestamps overlap, as in some WMA, drops Opus/Speex pre-skip and an ALAC
        # track's first frame in Matroska): PyAV from the start, if it finds more.
        try:
            more, _ = audio_pyav.decode_float(label, data, limits, 0.0, None, decoder.stream_index)
        except MediaDecodeError:
            more = None
        if more is not None and more.shape[-1] > y.shape[-1]:
            y = more
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
    kind = _container(data)
    if kind in _SOUNDFILE_CONTAINERS:
        result = _read_soundfile(label, data, limits, offset, duration)
        if result is not None:
            return (*result, True)
    # Headerless (raw G.722, GSM) or found by FFmpeg only with the file's name (a short MP3
    # behind junk): only PyAV can be told its demuxer.
    if kind in demuxers.PYAV_ONLY or demuxers.picked_by_name(data):
        if not audio_pyav.available():
            raise MediaDecodeError(label, f"{kind} known by its name is read with PyAV, which is not installed "
                                          "(pip install av)")
        y, native_sr = audio_pyav.decode_float(label, data, limits, offset, duration, None)
        return (y[0] if y.shape[0] == 1 else y), native_sr, False
    return (*_read_torchcodec(label, data, limits, offset, duration, rule), False)


def _container(data) -> str | None:
    """What container `data` (bytes or a guarded path) starts, or its name says it holds."""
    if isinstance(data, bytes):
        return guards.container_of(data[:guards.HEAD_BYTES])
    return guards.container_of(_head(data)) or guards.raw_by_name(data)


def _head(path: str) -> bytes:
    with handed.open_reader(path) as f:
        return f.read(guards.HEAD_BYTES)


@functools.lru_cache(maxsize=1)
def librosa_without_audioread() -> str | None:
    """In the caller: the installed librosa's version where it reads only what libsndfile
    opens (1.0 dropped its audioread fallback), else None (0.x, or no librosa)."""
    try:
        version = importlib.metadata.version("librosa")
    except importlib.metadata.PackageNotFoundError:
        return None
    major = version.split(".", 1)[0]
    return version if major.isdigit() and int(major) >= 1 else None


def _libsndfile_only(label, data, limits, offset, duration, librosa_version: str):
    """As librosa 1.x reads: libsndfile, or its refusal. Where libsndfile opens the file but
    reads no samples (a recorder's unsized data), FFmpeg reads it to the end, as with 0.x."""
    refusal: list = []
    result = _read_soundfile(label, data, limits, offset, duration, refusal)
    if result is not None:
        return (*result, True)
    if not refusal:
        return decode(label, data, limits, offset, duration)
    raise MediaDecodeError(label, f"librosa {librosa_version} reads only what libsndfile opens (it has no "
                                  f"audioread fallback), and libsndfile cannot read this file: {refusal[0]}")


@typed_entry
def load(source: inputs.Source, limits: guards.Limits, url_timeout, sr, mono=True, offset=0.0, duration=None,
         libsndfile_only: str | None = None):
    """Sandbox entry, librosa.load semantics: (samples, rate). ``libsndfile_only``: the
    caller's librosa version where it has no audioread fallback (:func:`librosa_without_audioread`):
    what libsndfile cannot read is then refused, as that librosa refuses it."""
    import numpy as np

    data = inputs.materialize(source, limits, url_timeout)
    if libsndfile_only:
        y, native_sr, by_soundfile = _libsndfile_only(source.label, data, limits, offset, duration, libsndfile_only)
    else:
        y, native_sr, by_soundfile = decode(source.label, data, limits, offset, duration)
    if not by_soundfile:
        # What libsndfile cannot read, librosa reads through audioread's ffmpeg pipe as
        # 16-bit samples: the same steps and the same clipping here, so the samples are
        # stock's (ffmpeg rounds a float sample to the nearest step, as rint does).
        y = np.clip(np.rint(y * 32768.0), -32768.0, 32767.0).astype(np.float32) / np.float32(32768.0)
    if mono and y.ndim > 1:
        y = np.mean(y, axis=0)
    if sr is not None and sr != native_sr:
        return resample(y, native_sr, int(sr)), sr
    return np.ascontiguousarray(y, dtype=np.float32), native_sr


@typed_entry
def load_soundfile_pyav(source: inputs.Source, limits: guards.Limits, url_timeout, sr, mono=True):
    """Sandbox entry, ms-swift's soundfile_pyav backend semantics: (samples, rate).

    With PyAV installed (stock's backend needs it), resampling and the formats libsndfile
    cannot read go through stock's own PyAV code (``audio_pyav``): the same samples. Without
    it, soxr and torchcodec do that work, in the shapes stock returns."""
    import numpy as np

    data = inputs.materialize(source, limits, url_timeout)
    with_pyav = audio_pyav.available()
    by_libsndfile = _container(data) in _SOUNDFILE_CONTAINERS
    result = _read_soundfile(source.label, data, limits, 0.0, None) if by_libsndfile else None
    if result is None and with_pyav:
        return audio_pyav.decode_like_stock(source.label, data, limits, sr, mono)
    if result is not None:
        y, native_sr = result
        if mono and y.ndim > 1:
            y = np.mean(y, axis=0)
        if sr is not None and sr != native_sr:
            if with_pyav:
                return np.ascontiguousarray(audio_pyav.resample_like_stock(y, native_sr, sr), np.float32), int(sr)
            return resample(y, native_sr, int(sr)), int(sr)
        return np.ascontiguousarray(y, dtype=np.float32), native_sr
    y, native_sr = _read_torchcodec(source.label, data, limits, 0.0, None, families.FIRST)
    # Stock's PyAV branch: channels first even for a mono stream, and its resampler
    # outputs a mono layout whatever `mono` says. Shapes kept as stock returns them.
    if y.ndim == 1:
        y = y[np.newaxis, :]
    if sr is not None and sr != native_sr:
        y = resample(np.mean(y, axis=0), native_sr, int(sr))[np.newaxis, :]
    if mono:
        y = np.mean(y, axis=0)
    return np.ascontiguousarray(y, dtype=np.float32), sr or native_sr
