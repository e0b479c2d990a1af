"""Environments where one piece the decoders need is missing, made for real and cheaply:

- ``no_torchcodec`` / ``no_soundfile``: a fresh venv (``python -m venv``) whose
  site-packages links every entry of the test venv's except that package, as if it had
  never been installed;
- ``mismatched_torchcodec``: the same with torchcodec 0.10.0, built for torch 2.10, in
  place of the pinned one (its libraries fail to load with torch 2.14: undefined symbol);
- ``no_ffmpeg``: the test venv run in a user and mount namespace (``unshare -rm``) where
  the system library folder is replaced by links to everything in it but FFmpeg's
  libraries (libav*, libsw*, libpostproc), so torchcodec's dlopen finds none.

Each gives the interpreter to run and a prefix for the command line.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = sysconfig.get_paths()["purelib"]
MISMATCHED_TORCHCODEC = "0.10.0"  # torchcodec's table: 0.10 goes with torch 2.10
# Where `make test` installs it (pip install --target); fetched from PyPI if missing.
MISMATCHED_DIR = os.path.join(sys.prefix, "test-extras", f"torchcodec-{MISMATCHED_TORCHCODEC}")

DROP = {
    "torchcodec": ("torchcodec", "torchcodec-*.dist-info"),
    "soundfile": ("soundfile.py", "_soundfile.py", "_soundfile_data", "soundfile-*.dist-info"),
}
FFMPEG_LIBRARIES = ("libavutil*", "libavcodec*", "libavformat*", "libavdevice*", "libavfilter*",
                    "libswscale*", "libswresample*", "libpostproc*")
SYSTEM_LIBRARIES = "/usr/lib/x86_64-linux-gnu"
SCRIPTS = ("swift", "swift-safe-media")

KINDS = ("no_torchcodec", "mismatched_torchcodec", "no_ffmpeg", "no_soundfile")
# What the refusal must name, and the fix command it must give.
EXPECTED = {
    "no_torchcodec": ("torchcodec is not installed", '-m pip install "torchcodec>=0.12"'),
    "mismatched_torchcodec": (f"torchcodec {MISMATCHED_TORCHCODEC} does not load with torch",
                              '-m pip install "torchcodec>=0.12"'),
    "no_ffmpeg": ("FFmpeg's shared libraries", "apt-get install -y ffmpeg"),
    "no_soundfile": ("soundfile is not installed", '-m pip install "soundfile"'),
}


def mismatched_torchcodec() -> str:
    if not os.path.isdir(os.path.join(MISMATCHED_DIR, "torchcodec")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--target", MISMATCHED_DIR, f"torchcodec=={MISMATCHED_TORCHCODEC}"],
                       check=True, timeout=300)
    return MISMATCHED_DIR


def venv_without(folder: str, package: str, instead: str | None = None) -> str:
    """A venv in ``folder`` with everything of this one but ``package`` (or with the
    entries of the ``instead`` folder in its place); returns its python."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", folder],
                   check=True, timeout=120)
    python = os.path.join(folder, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    for source in (SITE, instead):
        if source is None:
            continue
        for name in os.listdir(source):
            if source == SITE and any(fnmatch.fnmatch(name, pattern) for pattern in DROP[package]):
                continue
            target = os.path.join(site, name)
            if not os.path.lexists(target):
                os.symlink(os.path.join(source, name), target)
    for script in SCRIPTS:  # console scripts, pointed at this venv's python
        with open(os.path.join(os.path.dirname(sys.executable), script)) as original:
            text = original.read().split("\n", 1)[1]
        path = os.path.join(folder, "bin", script)
        with open(path, "w") as out:
            out.write(f"#!{python}\n{text}")
        os.chmod(path, 0o755)
    return python


def ffmpeg_hidden_prefix(folder: str) -> list[str]:
    """A command prefix that runs the rest with FFmpeg's shared libraries out of sight."""
    links, original = os.path.join(folder, "lib"), os.path.join(folder, "original")
    os.makedirs(links)
    os.makedirs(original)
    for name in os.listdir(SYSTEM_LIBRARIES):
        if not any(fnmatch.fnmatch(name, pattern) for pattern in FFMPEG_LIBRARIES):
            os.symlink(os.path.join(original, name), os.path.join(links, name))
    script = (f"mount --bind {SYSTEM_LIBRARIES} {shlex.quote(original)} && "
              f"mount --bind {shlex.quote(links)} {SYSTEM_LIBRARIES} && exec \"$@\"")
    return ["unshare", "-rm", "sh", "-c", script, "sh"]


def make(kind: str, folder: str) -> tuple[str, list[str]]:
    """(python of the environment, command prefix) for one of ``KINDS``."""
    os.makedirs(folder, exist_ok=True)
    if kind == "no_torchcodec":
        return venv_without(os.path.join(folder, "venv"), "torchcodec"), []
    if kind == "no_soundfile":
        return venv_without(os.path.join(folder, "venv"), "soundfile"), []
    if kind == "mismatched_torchcodec":
        return venv_without(os.path.join(folder, "venv"), "torchcodec", instead=mismatched_torchcodec()), []
    if kind == "no_ffmpeg":
        if shutil.which("unshare") is None or not glob.glob(os.path.join(SYSTEM_LIBRARIES, "libavutil.so.*")):
            raise RuntimeError("needs unshare and FFmpeg's libraries in " + SYSTEM_LIBRARIES)
        return sys.executable, ffmpeg_hidden_prefix(folder)
    raise ValueError(kind)


def scrubbed_environment(**extra) -> dict:
    """This environment without our settings (the test process may have enabled protection)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env.update(extra)
    return env
