"""The media openers ``enable()`` does not bound, as the user-code scan
(:mod:`.user_code`) recognises them in a call, and how its warning reads.

``enable()`` bounds function-shaped entry points (``librosa.load``, ``soundfile.read``,
``torchaudio.load``, transformers' loaders, ``torchvision.io.read_video``: the rows of
:mod:`..patching.media_libraries`) wherever they run. The object-shaped openers of
:mod:`..patching.media_openers` (decord, PyAV, OpenCV, torchcodec, imageio, moviepy) are
bounded in DataLoader workers (:mod:`..workers.decode_deadline`), so a call to one is
named only where it runs in the training process (a dataset's ``__init__``) or with
``SWIFT_SAFE_MEDIA_BOUND_OPENERS=0``. The rest (decord's ``VideoLoader``, torchvision's
``VideoReader``, ffmpeg-python, the ffmpeg programs run by hand) are named wherever the
DataLoader reaches them. Each is named here by its package and its name, so that an
alias (``import decord as de``, ``from av import open as av_open``) or a submodule path
(``decord.video_reader.VideoReader``, ``av.container.open``) reads the same.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

from .. import config

# (top-level package, name): opened whatever the call's arguments.
OBJECT_OPENERS = frozenset({
    ("decord", "VideoReader"), ("decord", "AudioReader"), ("decord", "AVReader"), ("decord", "VideoLoader"),
    ("av", "open"),
    ("cv2", "VideoCapture"),
    ("torchvision", "VideoReader"), ("torchvision", "read_video_timestamps"),
    ("torchcodec", "VideoDecoder"), ("torchcodec", "AudioDecoder"),
    ("imageio", "get_reader"), ("imageio", "mimread"), ("imageio", "imiter"), ("imageio", "imopen"),
    ("imageio_ffmpeg", "read_frames"), ("imageio_ffmpeg", "count_frames_and_secs"),
    ("moviepy", "VideoFileClip"), ("moviepy", "AudioFileClip"),
    ("ffmpeg", "input"), ("ffmpeg", "probe"), ("ffmpeg", "run"),  # ffmpeg-python: runs the ffmpeg program
})
# Bounded in a DataLoader worker (patching.media_openers), unless SWIFT_SAFE_MEDIA_BOUND_OPENERS=0.
BOUNDED_IN_WORKERS = frozenset({
    ("decord", "VideoReader"), ("decord", "AudioReader"), ("decord", "AVReader"), ("av", "open"),
    ("cv2", "VideoCapture"), ("torchcodec", "VideoDecoder"), ("torchcodec", "AudioDecoder"),
    ("imageio", "get_reader"), ("imageio", "mimread"), ("imageio", "imiter"), ("imageio", "imopen"),
    ("imageio", "imread"), ("imageio", "improps"), ("imageio", "immeta"),  # through imopen
    ("imageio_ffmpeg", "read_frames"), ("imageio_ffmpeg", "count_frames_and_secs"),
    ("moviepy", "VideoFileClip"), ("moviepy", "AudioFileClip"),
})
# imageio's readers of one image read video too, through FFmpeg or PyAV: named when the
# call says so (a plugin or format, or a literal file name with a video extension).
MAYBE_VIDEO = frozenset({("imageio", "imread"), ("imageio", "improps"), ("imageio", "immeta")})
VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".flv", ".m4v", ".mpg", ".mpeg", ".ts", ".wmv")
VIDEO_PLUGINS = ("ffmpeg", "pyav", "av")
# Functions that run a program: named when the program is ffmpeg or ffprobe.
RUNNERS = frozenset({"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                     "subprocess.check_output", "os.system", "os.popen", "os.execv", "os.execvp",
                     "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell"})
PROGRAMS = ("ffmpeg", "ffprobe")
# How a function says it runs in a sandbox already: ``@swift_safe_media.isolated``.
ISOLATED = frozenset({"swift_safe_media.isolated", "swift_safe_media.engine.calls.isolated"})


def opener(dotted: str, call: ast.Call, in_worker: bool = True) -> str | None:
    """What ``call`` (to ``dotted``, its callee's full name; ``in_worker``: made in a
    DataLoader worker, not the training process) opens unbounded, as named in the
    warning; None when it is not an opener or is one ``enable()`` bounds there."""
    parts = dotted.split(".")
    key = (parts[0], parts[-1])
    if in_worker and key in BOUNDED_IN_WORKERS and config.get(config.BOUND_OPENERS):
        return None
    if key in OBJECT_OPENERS:
        return dotted
    if key in MAYBE_VIDEO and _reads_video(call):
        return f"{dotted} (of video)"
    program = _program(call) if dotted in RUNNERS else None
    if program:
        return f"{dotted} running {program}"
    return None


def _reads_video(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg in ("plugin", "format") and isinstance(keyword.value, ast.Constant):
            if str(keyword.value.value).lower() in VIDEO_PLUGINS:
                return True
    return any(isinstance(arg, ast.Constant) and isinstance(arg.value, str)
               and arg.value.lower().endswith(VIDEO_EXTENSIONS) for arg in call.args)


def _program(call: ast.Call) -> str | None:
    """``ffmpeg`` or ``ffprobe`` when that is the program ``call`` runs."""
    if not call.args:
        return None
    first = call.args[0]
    if isinstance(first, (ast.List, ast.Tuple)) and first.elts:
        first = first.elts[0]
    if isinstance(first, ast.JoinedStr) and first.values:
        first = first.values[0]
    if isinstance(first, ast.Call):  # imageio_ffmpeg.get_ffmpeg_exe(), shutil.which("ffmpeg")
        text = ast.unparse(first).lower()
        return next((program for program in PROGRAMS if program in text), None)
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.strip():
        program = os.path.basename(first.value.split()[0]).lower()
        return next((known for known in PROGRAMS if program.startswith(known)), None)
    return None


@dataclass(frozen=True)
class Finding:
    """One call to an opener ``enable()`` does not bound, in user code."""
    path: str  # the file of the call
    line: int
    function: str  # the function that makes the call ("load_clip", "VideoDataset.__getitem__")
    opener: str  # what it calls ("decord.VideoReader")
    entry: str  # how the DataLoader reaches it ("VideoDataset.__getitem__", "collate_fn collate")

    @property
    def site(self) -> str:
        return f"{shown_path(self.path)}:{self.line}"

    def message(self) -> str:
        reached = "" if self.function == self.entry.split(" ")[-1] else f" (reached from {self.entry})"
        return (f"swift-safe-media: {self.site} {self.function}{reached} opens media with {self.opener}, "
                f"which enable() does not bound: a hang or crash there stalls the run with no error. "
                f"Bound it: {how_to_bound(self.function, self.opener)}")


# These openers read the file by its name, natively: a sandbox confined for that call's files.
DECORATOR = "@swift_safe_media.isolated(timeout=30, confine=swift_safe_media.BY_NAME)"


# A confined sandbox runs no program but ffmpeg itself (measured: ffprobe is refused): a
# function that runs one needs an unconfined sandbox, still bounded by its timeout.
DECORATOR_RUNNING_PROGRAMS = "@swift_safe_media.isolated(timeout=30, confine=False)"


def how_to_bound(function: str, opener: str = "") -> str:
    """The one-line fix: the opening function run in a sandbox with a hard timeout."""
    runs_a_program = " running " in opener or opener.startswith("ffmpeg.")
    decorator = DECORATOR_RUNNING_PROGRAMS if runs_a_program else DECORATOR
    unconfined = " (it runs a program: an unconfined sandbox)" if runs_a_program else ""
    if "." in function or function.startswith("<"):  # a method or a lambda: its opening moves out
        return (f"move what opens the media into a module-level function decorated with {decorator}{unconfined}, "
                f"its path the first argument (arguments and result must pickle; see docs/engine.md)")
    return (f"decorate it, {decorator} above def {function}{unconfined}, its path the first argument "
            f"(arguments and result must pickle; see docs/engine.md)")


def shown_path(path: str) -> str:
    """``path`` relative to the current folder when it is beneath it, else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative
