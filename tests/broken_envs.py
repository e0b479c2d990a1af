"""Environments where one piece the decoders need is missing, made for real and cheaply:

- ``no_torchcodec`` / ``no_soundfile``: a fresh venv (``python -m venv``) whose
  site-packages links every entry of the test venv's except that package, as if it had
  never been installed;
- ``mismatched_torchcodec``: the same with torchcodec 0.10.0, built for torch 2.10, in
  place of the pinned one (its libraries fail to load with torch 2.14: undefined symbol);
- ``no_ffmpeg``: the test venv run in a user and mount namespace (``unshare -rm``) where
  the system library folder is replaced by links to everything in it but FFmpeg's
  libraries (libav*, libsw*, libpostproc), so torchcodec's dlopen finds none;
- ``no_audioread``: the test venv without audioread, as librosa 1.0 leaves it, beside the
  qwen_omni_utils that imports it;
- ``cuda_mismatch``: LeRobot's venv (``.venv-lerobot``: torch 2.10 built for CUDA 12.8)
  with torchcodec 0.17.0, PyPI's build for CUDA 13, in place of its own, and this
  package from the test venv: the CUDA libraries it links are not there.

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
CUDA13_TORCHCODEC = "0.17.0"  # PyPI's build links CUDA 13 (libnvrtc.so.13, libcudart.so.13)
CUDA13_DIR = os.path.join(sys.prefix, "test-extras", f"torchcodec-{CUDA13_TORCHCODEC}")
LEROBOT_VENV = os.path.join(ROOT, ".venv-lerobot")  # torch 2.10.0+cu128, made by `make test`
OURS = ("swift_safe_media", "swift_safe_media-*.dist-info", "_swift_safe_media_startup.py", "swift_safe_media.pth")

DROP = {
    "torchcodec": ("torchcodec", "torchcodec-*.dist-info"),
    "soundfile": ("soundfile.py", "_soundfile.py", "_soundfile_data", "soundfile-*.dist-info"),
    "audioread": ("audioread", "audioread-*.dist-info"),
}
FFMPEG_LIBRARIES = ("libavutil*", "libavcodec*", "libavformat*", "libavdevice*", "libavfilter*",
                    "libswscale*", "libswresample*", "libpostproc*")
SYSTEM_LIBRARIES = "/usr/lib/x86_64-linux-gnu"
SCRIPTS = ("swift", "swift-safe-media")

KINDS = ("no_torchcodec", "mismatched_torchcodec", "no_ffmpeg", "no_soundfile", "no_audioread", "cuda_mismatch")
# What a command line that names an Omni model adds (ms-swift then loads qwen_omni_utils).
OMNI_ARGS = ("--model_type", "qwen2_5_omni")
# What the refusal must name, and the fix command it must give.
EXPECTED = {
    "no_torchcodec": ("torchcodec is not installed", '-m pip install "torchcodec>=0.12"'),
    "mismatched_torchcodec": (f"torchcodec {MISMATCHED_TORCHCODEC} does not load with torch",
                              '-m pip install "torchcodec>=0.12"'),
    "no_ffmpeg": ("FFmpeg's shared libraries", "apt-get install -y ffmpeg"),
    "no_soundfile": ("soundfile is not installed", '-m pip install "soundfile"'),
    "no_audioread": ("audioread is not installed: qwen_omni_utils", '-m pip install "audioread"'),
    "cuda_mismatch": (f"CUDA build mismatch: torchcodec {CUDA13_TORCHCODEC} is built for CUDA 13 "
                      "(it needs libnvrtc.so.13), but torch 2.10.0+cu128 is built for CUDA 12.8",
                      '-m pip install "torchcodec==0.10.*" --force-reinstall'),
}


def torchcodec_kept_aside(version: str, folder: str) -> str:
    """torchcodec ``version`` in ``folder`` (``make test`` puts it there; fetched if missing)."""
    if not os.path.isdir(os.path.join(folder, "torchcodec")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--target", folder, f"torchcodec=={version}"], check=True, timeout=300)
    return folder


def mismatched_torchcodec() -> str:
    return torchcodec_kept_aside(MISMATCHED_TORCHCODEC, MISMATCHED_DIR)


def _site_of(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def venv_without(folder: str, package: str, instead: str | None = None, base: str | None = None) -> str:
    """A venv in ``folder`` with everything of this one (or of the venv ``base``, with this
    package as installed here) but ``package`` (or with the entries of the ``instead``
    folder in its place); returns its python."""
    base_python = os.path.join(base, "bin", "python") if base else sys.executable
    base_site = _site_of(base_python) if base else SITE
    interpreter = os.path.realpath(base_python) if base else getattr(sys, "_base_executable", sys.executable)
    subprocess.run([interpreter, "-m", "venv", "--without-pip", folder], check=True, timeout=120)
    python = os.path.join(folder, "bin", "python")
    site = _site_of(python)
    ours = [name for name in os.listdir(SITE) if any(fnmatch.fnmatch(name, pattern) for pattern in OURS)]
    for source, names in ((base_site, os.listdir(base_site)), (SITE if base else None, ours),
                          (instead, os.listdir(instead) if instead else [])):
        if source is None:
            continue
        for name in names:
            if source == base_site and any(fnmatch.fnmatch(name, pattern)
                                           for pattern in DROP[package] + (OURS if base else ())):
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
    if kind == "no_audioread":
        return venv_without(os.path.join(folder, "venv"), "audioread"), []
    if kind == "cuda_mismatch":
        if not os.path.exists(os.path.join(LEROBOT_VENV, "bin", "python")):
            raise RuntimeError(f"needs {LEROBOT_VENV} (torch 2.10 built for CUDA 12.8): `make test` builds it")
        return venv_without(os.path.join(folder, "venv"), "torchcodec", base=LEROBOT_VENV,
                            instead=torchcodec_kept_aside(CUDA13_TORCHCODEC, CUDA13_DIR)), []
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
