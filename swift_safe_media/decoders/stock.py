"""Stock loaders run whole in the sandbox: the twin for entry points that have no twin
of their own.

A stand-in made by :func:`in_sandbox` sends the arguments of a host's decode call
(``transformers.video_utils.load_video``, ``librosa.load``, ``whisper.load_audio``, ...)
to the sandbox, where the stock function itself runs (its original, never a patched
copy) and its result comes back through shared memory: stock's frames and samples by
construction, with the sandbox's timeout, isolation and error naming. A failure there
becomes ``MediaDecodeError`` naming the media and what stock raised (a ``RuntimeError``,
as most stock decoders raise). Media given already decoded (an array, a list of frames)
is handed to stock in place: there is nothing to decode. A file object is read here
and sent as bytes; media in memory (bytes, a file object: a WebDataset shard's member) is
opened by no name, so it goes to the pooled confined sandboxes, and a nameless
``io.BytesIO`` of a shard member's bytes is named as that member (:func:`shard_member`).
Stock opens a local file by name: each call runs in a confined
sandbox of its own that may read the call's own files (``engine.BY_NAME``); one whose
stock runs the ffmpeg program may also run it and write in a folder of its own
(``runs_ffmpeg``: ``engine.PROGRAMS``). A URL is fetched by stock in a download's sandbox
(``engine.NETWORK``). Each path and its confinement: :func:`decode_paths`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import os
import pickle
import sys
import types

from ..confinement import broker as confine_broker
from ..engine import calls as engine
from ..errors import MediaDecodeError, decode_failure
from ..patching.targets import original_of


def stock_function(module: str, name: str):
    """The host's own ``module.name``, unwrapped where we patched it."""
    function = getattr(importlib.import_module(module), name)
    return original_of(function) or function


def code_folder(module: str) -> str | None:
    """Where a model's own code is (transformers puts it in its modules cache), else None."""
    if module.startswith("transformers_modules."):
        from transformers.utils import HF_MODULES_CACHE

        return HF_MODULES_CACHE
    return None


def run_stock(module: str, name: str, args, kwargs, path=None):
    """In the sandbox: the stock function on the caller's arguments."""
    folder = code_folder(module)
    if folder and module not in sys.modules and folder not in sys.path:
        sys.path.append(folder)
    function = stock_function(module, name)
    try:
        return function(*args, **kwargs)
    except MediaDecodeError:
        raise
    except Exception as exc:
        raise decode_failure(path, exc, f"{module}.{name}", f"stock {module}.{name}") from exc


# --- the stock module, imported before a sandbox's first call ---------------------------
# A fresh sandbox (the first, or the successor of one killed at its timeout) would import
# the stock module inside the call, and librosa or transformers take seconds to import:
# out of the call's timeout. Once a process has used an entry point, every sandbox of
# its kind imports the module as it starts (``set_up_sandboxes``: under the start-up
# timeout, not counted as a decode).

_prepared: set[tuple[str, bool]] = set()


def import_in_sandbox(module: str, confined: bool) -> None:
    """In a sandbox, as it starts: import ``module`` where this sandbox serves its calls."""
    from ..confinement import policy as confine

    if confine.status_here()["no_new_privs"] == confined:
        try:
            importlib.import_module(module)
        except Exception:  # the call itself reports it
            pass


def _prepare_sandboxes(module: str, confined, backends=()) -> None:
    """``backends``: the libraries stock imports only as it decodes (transformers' PyAV,
    decord, OpenCV): a sandbox per call would import them in every call (PyAV: 0.1 s)."""
    if (module, confined) not in _prepared:
        _prepared.add((module, confined))
        if confined in (engine.BY_NAME, engine.NETWORK, engine.PROGRAMS):  # one per call: the zygote imports it once
            engine.import_before_fork(module, code_folder(module))
            for backend in backends:  # the top-level name: finding a submodule imports its package here
                if importlib.util.find_spec(backend.partition(":")[0].partition(".")[0]) is not None:
                    engine.import_before_fork(backend)
        else:
            engine.set_up_sandboxes(functools.partial(import_in_sandbox, module, confined))


def _label(media) -> str | None:
    """The name of the media in a call's errors, or None for media already decoded."""
    if isinstance(media, (str, os.PathLike)):
        return os.fspath(media)
    if isinstance(media, dict):  # qwen/keye style {"video": path or bytes, ...}
        return next((_label(media[key]) for key in ("video", "audio") if key in media), None)
    if isinstance(media, (bytes, bytearray, memoryview)):
        return f"<{len(media)} bytes>"
    if hasattr(media, "read"):
        return str(getattr(media, "name", "") or shard_member(media) or f"<{type(media).__name__}>")
    return None


# How many frames above the stand-in a WebDataset sample is looked for: the user's decode
# function, the pipeline stage that called it (webdataset's ``_map``, ``Decoder.decode``).
_SAMPLE_FRAMES = 10


def shard_member(media) -> str | None:
    """A nameless in-memory file made of a WebDataset-style sample's bytes
    (``io.BytesIO(sample["flac"])`` in a ``.map``, or in a ``.decode`` handler), named as
    the member of its shard, ``<shard>:<key>.<field>``: the sample (a dict with
    ``__key__``, as webdataset's tar readers yield) that holds these very bytes, found in
    the callers' frames. None where no caller holds one."""
    if not isinstance(media, io.BytesIO):
        return None
    frame = None
    try:
        data = media.getvalue()  # the bytes it was made from (no copy while it is unchanged)
        frame = sys._getframe(1)
        for _ in range(_SAMPLE_FRAMES):
            if frame is None:
                return None
            for value in list(frame.f_locals.values()):
                if isinstance(value, dict) and isinstance(value.get("__key__"), str):
                    for field, member in value.items():
                        if member is data or (isinstance(member, bytes) and len(member) == len(data)
                                              and member == data):
                            url = value.get("__url__")
                            name = f"{value['__key__']}.{field}"
                            return f"{url}:{name}" if isinstance(url, str) else name
            frame = frame.f_back
        return None
    except Exception:  # a name is a courtesy: never a reason for the decode to fail
        return None
    finally:
        del frame


def _in_memory(media) -> bool:
    """Media handed as bytes or a file object: stock reads it from memory, opening nothing by name."""
    return isinstance(media, (bytes, bytearray, memoryview)) or hasattr(media, "read")


def _sendable(value):
    """A file object as the bytes stock would read from it (an open file, a tar member
    cannot travel); everything else as it is."""
    if hasattr(value, "read") and not isinstance(value, io.BytesIO):
        data = io.BytesIO(value.read())
        data.name = getattr(value, "name", None)
        return data
    return value


def _is_url(label: str | None) -> bool:
    return bool(label) and label.startswith(("http://", "https://", "ftp://"))


# How each entry point's sandbox is confined, by dotted name (``swift-safe-media confinement``).
CONFINED_BY_NAME = "confined: it may read the call's own files by name, no other media"
CONFINED_RUNNING_FFMPEG = (CONFINED_BY_NAME + " (a sandbox per call); it may run the ffmpeg program (its loader "
                           "too: what runs stays confined) and write in a folder of its own")
DECODE_PATHS: dict[str, str] = {}


def in_sandbox(module: str, name: str, media=(0, "video"), runs_ffmpeg: bool = False, prepare=None,
               backends=()):
    """A stand-in for ``module.name`` that runs stock in the sandbox. ``media``: the
    position and keyword of the argument that names the media; ``runs_ffmpeg``: stock runs
    the ffmpeg program (and may write temporary files): its sandbox may too
    (``engine.PROGRAMS``, :mod:`..confinement.programs`); ``prepare(stand_in_call,
    args, kwargs)``: a hook for arguments that cannot travel (it returns the result);
    ``backends``: the libraries stock imports as it decodes (see :func:`_prepare_sandboxes`)."""
    position, keyword = media
    DECODE_PATHS[f"{module}.{name}"] = CONFINED_RUNNING_FFMPEG if runs_ffmpeg else CONFINED_BY_NAME

    def stand_in(*args, **kwargs):
        value = kwargs.get(keyword) if keyword in kwargs else args[position] if len(args) > position else None
        label = _label(value)
        if engine.in_sandbox() or label is None:
            return stock_function(module, name)(*args, **kwargs)
        args = tuple(_sendable(arg) for arg in args)
        kwargs = {key: _sendable(arg) for key, arg in kwargs.items()}

        # Stock opens the file by name: a confined sandbox of its own, which may read that file
        # (a URL: one that may connect out instead). Media in memory (a shard member's bytes)
        # is opened by no name: the pooled confined sandboxes, without a sandbox per call.
        if _is_url(label):
            confined = engine.NETWORK
        elif _in_memory(value) and not runs_ffmpeg:
            confined = True
        else:
            confined = engine.by_name(runs_ffmpeg, [label])
        _prepare_sandboxes(module, confined, backends)

        def run(args, kwargs):
            return engine.call(run_stock, module, name, args, kwargs, path=label, confine=confined)

        return prepare(run, args, kwargs) if prepare is not None else run(args, kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__doc__ = f"``{module}.{name}`` run in the sandbox (stock's result; bounded and named on failure)."
    return stand_in


# --- transformers' load_video: a frame sampler that cannot travel ----------------------

class _Sampled(Exception):
    """Carries what stock's reader hands its frame sampler out of the sandbox."""


def _report_metadata(metadata=None, **kwargs):
    raise _Sampled(metadata, kwargs)


def _given_indices(indices, metadata=None, **kwargs):
    return indices


def metadata_for_sampler(args, kwargs, path=None):
    """In the sandbox: stock's ``load_video`` up to the point where it asks its sampler
    which frames to decode; returns what the sampler would have been given."""
    try:
        run_stock("transformers.video_utils", "load_video", args, {**kwargs, "sample_indices_fn": _report_metadata},
                  path=path)
    except MediaDecodeError as exc:
        if isinstance(exc.__cause__, _Sampled):
            return exc.__cause__.args
        raise
    raise MediaDecodeError(path, "stock load_video never asked its sampler for frames")


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _load_video_with_local_sampler(run, args, kwargs):
    """``load_video`` whose ``sample_indices_fn`` (a lambda, a closure) cannot be pickled:
    the sandbox reads the metadata, the sampler runs here, the sandbox decodes the frames
    it chose. The same stock reader and the same indices, so the same frames."""
    sampler = kwargs.get("sample_indices_fn")
    if sampler is None or len(args) > 4 or _picklable(sampler):
        return run(args, kwargs)
    label = _label(args[0] if args else kwargs.get("video"))
    rest = {key: value for key, value in kwargs.items() if key != "sample_indices_fn"}
    metadata, sampler_kwargs = engine.call(metadata_for_sampler, args, rest, path=label,
                                           confine=engine.NETWORK if _is_url(label) else engine.by_name(files=[label]))
    indices = sampler(metadata=metadata, **sampler_kwargs)
    return run(args, {**rest, "sample_indices_fn": functools.partial(_given_indices, indices)})


# --- a model's own media loaders (remote code) -----------------------------------------

# What the last part of a name must say for a function to be taken for a media loader.
MEDIA_WORDS = ("audio", "video", "wav", "speech")


def names_media(dotted: str | None) -> bool:
    return bool(dotted) and any(word in dotted.rsplit(".", 1)[-1].lower() for word in MEDIA_WORDS)


def dynamic_module_function(*args, **kwargs):
    """transformers' ``get_class_from_dynamic_module``: a media loader of a model's own code
    (InternLM-XComposer's ``ixc_utils.load_video``, decord inside) comes back run in the
    sandbox, its first argument naming the media; classes and other functions as stock."""
    loaded = stock_function("transformers.dynamic_module_utils", "get_class_from_dynamic_module")(*args, **kwargs)
    reference = args[0] if args else kwargs.get("class_reference")
    if isinstance(loaded, types.FunctionType) and isinstance(reference, str) and names_media(reference):
        return in_sandbox(loaded.__module__, loaded.__name__, (0, None))
    return loaded


# --- the entry points ----------------------------------------------------------------

# Hugging Face: ms-swift's GLM-4.1V template, and the processors of MOSS-VL, Molmo2,
# MiniMax-VL, ERNIE-VL on the raw paths ms-swift hands them (fetch_videos); MiDashengLM.
VIDEO_BACKENDS = ("av", "decord", "cv2")  # torchvision and torchcodec: in the zygote already
# librosa's utils compile numba ufuncs as they load (from numba's cache where it has one): in
# a sandbox, with no cache it may write, that took 26 s a call. Each librosa.load asks audioread
# for its backends, which the first time runs gcc and ld (ctypes' find_library): 0.1 s a call.
LIBROSA_BACKENDS = ("librosa.core.audio", "librosa.util.utils", "audioread:available_backends")
load_video = in_sandbox("transformers.video_utils", "load_video", (0, "video"),
                        prepare=_load_video_with_local_sampler, backends=VIDEO_BACKENDS)
load_audio = in_sandbox("transformers.audio_utils", "load_audio", (0, "audio"), backends=(*LIBROSA_BACKENDS, "soundfile"))
load_audio_as = in_sandbox("transformers.audio_utils", "load_audio_as", (0, "audio"), backends=(*LIBROSA_BACKENDS, "soundfile"))
# Model-family utils: Keye-VL (decord, torchvision or torchcodec); MiniCPM-o's video
# with audio (decord, librosa, and ffmpeg programs and temporary files); Llama-Omni's
# whisper (an ffmpeg program without a timeout). The ffmpeg program is stock's own, so its
# samples are too (a twin on PyAV's FFmpeg differs by one LSB where the versions differ).
keye_fetch_video = in_sandbox("keye_vl_utils.vision_process", "fetch_video", (0, "ele"), backends=VIDEO_BACKENDS)
minicpmo_video_audio_segments = in_sandbox(
    "minicpmo.utils", "get_video_frame_audio_segments", (0, "video_path"),
    runs_ffmpeg=True, backends=("decord", *LIBROSA_BACKENDS))
whisper_load_audio = in_sandbox("whisper.audio", "load_audio", (0, "file"), runs_ffmpeg=True)
# The libraries' own function-shaped loaders, where any code (a remote-code model's
# utils, a user's dataset) reaches them: Step-Audio's torchaudio.load, Qwen3-TTS's
# librosa.load, WeNet-style torchaudio.load of shard bytes.
# librosa falls back to audioread, which runs ffmpeg, for what libsndfile cannot read.
librosa_load = in_sandbox("librosa.core.audio", "load", (0, "path"), runs_ffmpeg=True, backends=LIBROSA_BACKENDS)
soundfile_read = in_sandbox("soundfile", "read", (0, "file"))
torchaudio_load = in_sandbox("torchaudio", "load", (0, "uri"))
torchvision_read_video = in_sandbox("torchvision.io.video", "read_video", (0, "filename"))


# A download's sandboxes: pooled, as they read no file by name (engine.NETWORK).
DOWNLOADS = "confined but for connecting out: no reads by name, writes, exec or secrets"


def decode_paths(confined: bool, reads_limited: bool) -> dict[str, str]:
    """Each decode path and how its sandbox is confined here (``swift-safe-media
    confinement``, ``doctor``)."""
    if not confined:
        return {"every decode path": "not confined: SWIFT_SAFE_MEDIA_CONFINE=0"}
    why_not = confine_broker.why_not()
    by_name = CONFINED_BY_NAME + (f" (a sandbox per call: {why_not})" if why_not else
                                  " (a pooled sandbox, its opens of them answered by the caller)")
    by_name = by_name if reads_limited else "confined; reads are not limited here"
    return {
        "the twins (ms-swift's and the Qwen utils' loaders, LeRobot's decode)":
            "confined: the media handed as open descriptors",
        **{name: by_name if how == CONFINED_BY_NAME else how for name, how in DECODE_PATHS.items()},
        "a model's own media loader (remote code)": by_name,
        "LLaMA-Factory's mm_plugin readers": by_name,
        "a function under @isolated or call()": "confined: the media handed as open descriptors "
                                                "(confine=False: not confined, as its author chose)",
        "media URLs (downloads, stock given a URL)": DOWNLOADS + " (`swift deploy` refuses internal addresses)",
        "a LeRobot dataset streamed from the Hub": DOWNLOADS + " (the Hub's token only where "
                                                   "SWIFT_SAFE_MEDIA_SANDBOX_ENV names HF_TOKEN)",
    }
