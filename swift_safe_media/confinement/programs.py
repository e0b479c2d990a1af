"""What a sandbox for stock code that runs the ffmpeg program may run and write.

whisper's ``load_audio``, MiniCPM-o's video-with-audio loader and librosa's fallback
(audioread) run the ``ffmpeg`` program, and MiniCPM-o writes temporary files. Their
sandbox (``engine.PROGRAMS``, one per call) is confined as the others are, and besides:

- **May run** the ``ffmpeg`` found on ``PATH`` and its ELF interpreter (the dynamic loader),
  and the ffmpeg imageio-ffmpeg runs instead (moviepy's and imageio's: the one
  ``IMAGEIO_FFMPEG_EXE`` or moviepy's ``FFMPEG_BINARY`` names, else the static build its wheel
  bundles; MiniCPM-o reads a video's audio through moviepy where librosa 1.0 refuses it, and
  another ffmpeg's samples differ by one step): Landlock's execute right on those files only
  (the kernel opens the interpreter as a program too, so it needs the right). The loader, run
  by itself, starts any program the sandbox may read, so this is not "ffmpeg and nothing
  else": what runs keeps the whole confinement (seccomp, Landlock, no_new_privs are inherited
  across exec): no network, no writes outside the folder below, no reads outside the read policy.
- **May write** in a folder of its own (``TMPDIR`` names it), made by the caller for the
  call and removed after it (:func:`..engine.run_folders.scratch_for_call`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import struct
import sys
import tempfile

PROGRAM_NAMES = ("ffmpeg",)
_PT_INTERP = 3


def elf_interpreter(path: str) -> str | None:
    """The program interpreter an ELF executable names (``PT_INTERP``), or None."""
    try:
        with open(path, "rb") as binary:
            head = binary.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only (what runs here)
                return None
            order = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack_from(order + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            for index in range(phnum):
                binary.seek(phoff + index * phentsize)
                kind, _, offset, _, _, size = struct.unpack(order + "IIQQQQ", binary.read(40))
                if kind == _PT_INTERP:
                    binary.seek(offset)
                    return binary.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


@functools.lru_cache(maxsize=None)
def runnable() -> tuple[str, ...]:
    """The files such a sandbox may execute: each program found on ``PATH`` and its
    interpreter, symbolic links resolved (Landlock's rule holds the file itself)."""
    found = []
    for path in [shutil.which(name) for name in PROGRAM_NAMES] + _imageio_ffmpeg():
        if path is None:
            continue
        real = os.path.realpath(path)
        interpreter = elf_interpreter(real)
        found += [real] + ([os.path.realpath(interpreter)] if interpreter else [])
    return tuple(dict.fromkeys(found))


def _imageio_ffmpeg() -> list[str | None]:
    """The ffmpeg imageio-ffmpeg's ``get_ffmpeg_exe`` may pick (found without importing it):
    the program its setting or moviepy's names, and the builds its wheel bundles."""
    named = [shutil.which(os.environ[name]) for name in ("IMAGEIO_FFMPEG_EXE", "FFMPEG_BINARY") if os.environ.get(name)]
    try:
        spec = importlib.util.find_spec("imageio_ffmpeg")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        binaries = os.path.join(folder, "binaries")
        with contextlib.suppress(OSError):
            named += [os.path.join(binaries, name) for name in sorted(os.listdir(binaries))
                      if name.startswith("ffmpeg") and os.access(os.path.join(binaries, name), os.X_OK)]
    return named


def write_here(folder: str) -> None:
    """In the sandbox, before it is confined: temporary files go to ``folder``."""
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # read TMPDIR again
    # numba (librosa's) caches compiled functions beside their modules, which the sandbox may
    # not write: refused at import unless its cache folder is writable.
    os.environ["NUMBA_CACHE_DIR"] = folder
    numba_config = sys.modules.get("numba.core.config")  # numba read its settings in the zygote
    if numba_config is not None:
        numba_config.CACHE_DIR = folder
