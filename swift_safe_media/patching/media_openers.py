"""The object-shaped media openers a user's own code calls (decord, PyAV, OpenCV,
torchcodec, imageio, moviepy), each call marked so that a DataLoader worker's decode ends
within the timeout (:mod:`..workers.decode_deadline`).

These do not move into a sandbox: what they return (a reader, a container, a capture)
lives on in the caller and is used call after call. Instead each call of an opener, and
of the methods of what it opened that decode, marks the worker's slot; the trainer kills
a worker whose mark outlives the timeout. A method is marked where the library's class is
Python (decord, torchcodec, moviepy's readers); PyAV's containers are not Python classes, so only
``av.open`` marks, and a container's decoding is bounded by the timeout from the open.
OpenCV's ``VideoCapture`` cannot be changed, so ``cv2.VideoCapture`` becomes a class that
holds one and marks its ``__init__``, ``open``, ``read``, ``grab`` and ``retrieve`` (an
object of it is not an instance of OpenCV's own class).

Rows are patched as their module is imported, in every protected process (a mark outside
a DataLoader worker costs one attribute lookup and does nothing), and in each worker that
does not fork (:mod:`..workers.plain`). ``SWIFT_SAFE_MEDIA_BOUND_OPENERS=0`` leaves them
as stock.
"""

from __future__ import annotations

import logging
import sys

from . import import_hooks as _imports
from .targets import Patches, Target, mark as mark_original, original_of
from ..workers import decode_deadline

log = logging.getLogger("swift_safe_media")

_HERE = "swift_safe_media.patching.media_openers"
OPENED, USED = f"{_HERE}:opened", f"{_HERE}:used"


def _object_rows(module: str, cls: str, methods: tuple[str, ...], expected_in: str | None = None):
    return (Target(module, f"{cls}.__init__", OPENED, expected_in=expected_in),
            *(Target(module, f"{cls}.{method}", USED, expected_in=expected_in) for method in methods))


TARGETS = (
    *_object_rows("decord.video_reader", "VideoReader",
                  ("__len__", "__getitem__", "next", "get_batch", "get_key_indices", "get_frame_timestamp",
                   "seek", "seek_accurate", "skip_frames")),
    *_object_rows("decord.audio_reader", "AudioReader", ("__getitem__", "get_batch")),
    *_object_rows("decord.av_reader", "AVReader", ("__getitem__", "get_batch")),
    *_object_rows("torchcodec.decoders._video_decoder", "VideoDecoder",
                  ("__getitem__", "get_frame_at", "get_frames_at", "get_frames_in_range", "get_frame_played_at",
                   "get_frames_played_at", "get_frames_played_in_range")),
    *_object_rows("torchcodec.decoders._audio_decoder", "AudioDecoder",
                  ("get_all_samples", "get_samples_played_in_range")),
    # moviepy's clips read through these (an ffmpeg program's pipe), in 1.x and 2.x alike.
    *_object_rows("moviepy.video.io.ffmpeg_reader", "FFMPEG_VideoReader",
                  ("initialize", "skip_frames", "read_frame", "get_frame")),
    *_object_rows("moviepy.audio.io.readers", "FFMPEG_AudioReader",
                  ("initialize", "skip_chunk", "read_chunk", "seek", "get_frame")),
    Target("av.container.core", "open", f"{_HERE}:av_open"),
    Target("imageio.core.imopen", "imopen", f"{_HERE}:imageio_imopen"),
    Target("imageio_ffmpeg._io", "read_frames", f"{_HERE}:imageio_ffmpeg_read_frames"),
    Target("imageio_ffmpeg._io", "count_frames_and_secs", f"{_HERE}:imageio_ffmpeg_count_frames_and_secs"),
)
# Where copies of the functions may live: their packages, and a script's own
# ``from av import open`` (its main module, also as a worker started by spawn sees it).
SCOPE = ("av", "imageio", "imageio_ffmpeg", "__main__", "__mp_main__")
# What a class's __del__ reads that its __init__ sets first (decord's readers, moviepy's).
_READ_BY_DEL = {"VideoReader": ("_handle",), "AudioReader": ("_handle",), "FFMPEG_VideoReader": ("proc",),
                "FFMPEG_AudioReader": ("proc",)}
SOURCE_ATTRIBUTE = "_swift_safe_media_source"  # what an opened object was opened on


def _source(args, kwargs, *names):
    if args:
        return args[0]
    return next((kwargs[name] for name in names if name in kwargs), None)


def _name(cls, method: str = "") -> str:
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}" + (f".{method}" if method else "")


def opened(original, self, *args, **kwargs):
    source = _source(args, kwargs, "uri", "source", "filename", "file", "path")
    try:
        setattr(self, SOURCE_ATTRIBUTE, source)
    except AttributeError:
        pass
    try:
        decode_deadline.mark(_name(type(self)), source)
    except Exception:  # refused: what __del__ reads, as the __init__ it skips would set it first
        for name in _READ_BY_DEL.get(type(self).__name__, ()):
            vars(self).setdefault(name, None)
        raise
    return original(self, *args, **kwargs)


def used(original, self, *args, **kwargs):
    decode_deadline.mark(_name(type(self), original.__name__), getattr(self, SOURCE_ATTRIBUTE, None), False)
    return original(self, *args, **kwargs)


def _function(module: str, name: str, shown: str, *keywords):
    def stand_in(*args, **kwargs):
        decode_deadline.mark(shown, _source(args, kwargs, *keywords))
        function = getattr(sys.modules[module], name)
        return (original_of(function) or function)(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


av_open = _function("av.container.core", "open", "av.open", "file")
imageio_imopen = _function("imageio.core.imopen", "imopen", "imageio.imopen", "uri")
imageio_ffmpeg_read_frames = _function("imageio_ffmpeg._io", "read_frames", "imageio_ffmpeg.read_frames", "path")
imageio_ffmpeg_count_frames_and_secs = _function("imageio_ffmpeg._io", "count_frames_and_secs",
                                                 "imageio_ffmpeg.count_frames_and_secs", "path")


# -- OpenCV's VideoCapture: a wrapper stands in for it ----------------------------------
def _bounded_capture(capture):
    """A class that holds a real ``capture`` and marks what decodes. Not a subclass: a
    Python subclass of OpenCV's type is tracked by the garbage collector, which OpenCV's
    deallocator does not expect (measured: a segfault at the next collection)."""

    def marked(method: str):
        def call(self, *args, **kwargs):
            decode_deadline.mark(f"cv2.VideoCapture.{method}", self._swift_safe_media_source, False)
            return getattr(self._capture, method)(*args, **kwargs)

        call.__name__ = call.__qualname__ = method
        return call

    class VideoCapture:
        __doc__ = capture.__doc__

        def __init__(self, *args, **kwargs):
            self._swift_safe_media_source = _source(args, kwargs, "filename", "index") if args or kwargs else None
            if args or kwargs:
                decode_deadline.mark("cv2.VideoCapture", self._swift_safe_media_source)
            self._capture = capture(*args, **kwargs)

        def open(self, *args, **kwargs):
            self._swift_safe_media_source = _source(args, kwargs, "filename", "index")
            decode_deadline.mark("cv2.VideoCapture.open", self._swift_safe_media_source)
            return self._capture.open(*args, **kwargs)

        read, grab, retrieve = marked("read"), marked("grab"), marked("retrieve")

        def __getattr__(self, name):  # every other method: OpenCV's own
            if name == "_capture":
                raise AttributeError(name)
            return getattr(self._capture, name)

        def __repr__(self):
            return repr(self._capture)

    VideoCapture.__module__, VideoCapture.__qualname__ = "cv2", "VideoCapture"
    return mark_original(VideoCapture, capture)


class _Capture:
    """``cv2.VideoCapture`` swapped for its bounded subclass in cv2 and the main modules."""

    def __init__(self):
        self.swapped: list[tuple[object, object]] = []  # (module, original)

    def patch(self, _module=None) -> None:
        cv2 = sys.modules.get("cv2")
        capture = getattr(cv2, "VideoCapture", None)
        if capture is None or original_of(capture) is not None or not isinstance(capture, type):
            return
        bounded = _bounded_capture(capture)
        for name in ("cv2", "__main__", "__mp_main__"):
            module = sys.modules.get(name)
            for attribute, value in list(vars(module).items()) if module is not None else ():
                if value is capture:
                    setattr(module, attribute, bounded)
                    self.swapped.append((module, attribute, capture))

    def unpatch(self) -> None:
        while self.swapped:
            module, attribute, original = self.swapped.pop()
            if original_of(getattr(module, attribute, None)) is original:
                setattr(module, attribute, original)


PATCHES = Patches(SCOPE, TARGETS, globals(), label="the media openers in DataLoader workers")
CAPTURE = _Capture()
_enabled = False


def _patch(_module=None) -> None:
    try:
        PATCHES.patch()
        CAPTURE.patch()
    except Exception:  # fail open: the openers run as stock
        log.exception("swift_safe_media: could not mark the media openers")


def enable() -> None:
    """Mark the openers now, and each as its module is imported (idempotent)."""
    global _enabled
    from .. import config

    if _enabled or not config.get(config.BOUND_OPENERS):
        return
    _enabled = True
    for module_name in (*PATCHES.modules, "cv2"):
        _imports.when_imported(module_name, _patch)


def disable() -> None:
    global _enabled
    if not _enabled:
        return
    _enabled = False
    for module_name in (*PATCHES.modules, "cv2"):
        _imports.clear(module_name)
    PATCHES.unpatch()
    CAPTURE.unpatch()


def is_patched() -> bool:
    return PATCHES.is_patched() or bool(CAPTURE.swapped)
