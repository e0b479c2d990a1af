"""Pre-flight check: can the decoders load here? Asked once, before any worker starts.

``enable()`` (and so ``--safe_media true``, ``SWIFT_SAFE_MEDIA=1`` in the process that
starts a run, ``lerobot-train --safe_media=true``) calls :func:`require` for the hosts
it protects. Without it a missing decoder shows up only inside the sandboxes, as one
failed sample after another until the error budget trips; with it the run stops at
once with one :class:`~swift_safe_media.errors.ProtectionUnavailable` naming the missing
piece and the command that installs it.

What is checked, and how cheaply (the check runs at the start of every protected run):

- torchcodec is found without being imported (``import torchcodec`` also imports
  ``torch._dynamo``, about a second), and its core and custom-ops libraries are loaded
  with ``ctypes`` the way torchcodec loads them, for each FFmpeg major version it ships,
  newest first. That load is the real test: a torchcodec built for another torch fails
  with an undefined ``c10``/``at`` symbol, missing FFmpeg libraries with "cannot open
  shared object file". The libraries need torch's own, so torch is imported (hosts have
  imported it already).
  A library missing for another reason is named for what it is: one of CUDA's (a
  torchcodec built for another CUDA than torch's, or a CUDA build beside a CPU-only torch).
- soundfile (with its libsndfile) and soxr are imported (a few ms).
- For ms-swift, where qwen_omni_utils is installed: the modules it imports (audioread,
  librosa, av) are found, without importing them (librosa 1.0 no longer installs
  audioread, and qwen_omni_utils imports it). A run whose command line names an Omni
  model is refused without them; any other gets a warning.

The verdict is kept per process, and a passed check is written to the environment
(``SWIFT_SAFE_MEDIA_PREFLIGHT_PASSED``), so DataLoader workers, ``swift sft``'s
training process and sandboxes inherit it and do not repeat it. A failed check is
never written there: nothing gets started after one. ``SWIFT_SAFE_MEDIA_PREFLIGHT=0``
skips the check.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys

from .. import config
from ..errors import ProtectionUnavailable
from ..patching.host_adapters import installed_version, parse_version

log = logging.getLogger("swift_safe_media")

# What each host's safe loaders decode with (see the adapters): ms-swift's twins use
# torchcodec for video and for audio in containers, soundfile and soxr for the rest;
# LeRobot decodes with torchcodec, or with PyAV where torchcodec is not installed.
TORCHCODEC, SOUNDFILE, SOXR, LEROBOT_VIDEO = "torchcodec", "soundfile", "soxr", "torchcodec-or-pyav"
QWEN_OMNI = "qwen_omni_utils"  # ms-swift's Qwen2.5-Omni / Qwen3-Omni models and templates
HOST_NEEDS = {
    "swift": (TORCHCODEC, SOUNDFILE, SOXR, QWEN_OMNI),
    "lerobot": (LEROBOT_VIDEO,),
    # LLaMA-Factory's own readers (PyAV, torchaudio, PIL) run in the sandbox: it needs
    # nothing beyond what LLaMA-Factory itself needs.
    "llamafactory": (),
}
# What qwen_omni_utils imports as it loads (its audio_process module), by distribution.
QWEN_OMNI_IMPORTS = {"audioread": "audioread", "librosa": "librosa", "av": "av"}

# torchcodec's compatibility table (its README): the release line for each torch. From
# 0.12 on torchcodec builds against torch's stable ABI and works with any torch >= 2.11.
_TORCHCODEC_FOR_TORCH = {(2, 4): "==0.0.3", (2, 5): "==0.1.*", (2, 6): "==0.2.*", (2, 7): "==0.5.*",
                         (2, 8): "==0.7.*", (2, 9): "==0.9.*", (2, 10): "==0.10.*"}
_STABLE_ABI = ((2, 11), ">=0.12")
# libavutil's soname for each FFmpeg major version: to name the FFmpeg found.
_AVUTIL_SONAME = {4: 56, 5: 57, 6: 58, 7: 59, 8: 60, 9: 61}


@dataclasses.dataclass
class Finding:
    """One piece the decoders need: what was found, and if it is unusable, why and the fix."""
    name: str
    version: str | None = None
    detail: str = ""
    problem: str | None = None      # None: usable
    fix: str | None = None
    required: bool = True           # False: a problem is warned about, the run goes on

    @property
    def ok(self) -> bool:
        return self.problem is None


def pip_install(requirement: str) -> str:
    """The exact command for this interpreter (a bare ``pip`` may belong to another one)."""
    return f'{sys.executable} -m pip install "{requirement}"'


def torchcodec_requirement(torch_version: str | None) -> str:
    """The torchcodec that goes with this torch, as a pip requirement."""
    wanted = parse_version(torch_version or "")[:2]
    if wanted >= _STABLE_ABI[0]:
        return "torchcodec" + _STABLE_ABI[1]
    return "torchcodec" + _TORCHCODEC_FOR_TORCH.get(wanted, "")


def ffmpeg_fix(majors: list[int]) -> str:
    """The command that installs FFmpeg's shared libraries here."""
    lowest, highest = min(majors, default=4), max(majors, default=8)
    if os.path.isdir(os.path.join(sys.prefix, "conda-meta")):
        return f'conda install -c conda-forge "ffmpeg>={lowest},<{highest + 1}"'
    sudo = "" if os.geteuid() == 0 else "sudo "
    if shutil.which("apt-get"):
        return f"{sudo}apt-get install -y ffmpeg   (Debian/Ubuntu: FFmpeg's libavcodec, libavformat, ...)"
    if shutil.which("dnf"):
        return f"{sudo}dnf install -y ffmpeg-libs   (RPM Fusion)"
    return f"install FFmpeg {lowest} to {highest} with its shared libraries (libavcodec, libavformat, ...)"


# --- the pieces ---------------------------------------------------------------------

def check_torch() -> Finding:
    found = Finding("torch", installed_version("torch"))
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        found.problem = "torch is not installed"
        found.fix = "install torch first: https://pytorch.org/get-started/locally/"
        return found
    try:
        import torch
    except Exception as exc:  # a broken install; say so rather than fail later
        found.problem = f"torch does not import ({type(exc).__name__}: {exc})"
        found.fix = pip_install(f"torch=={found.version}" if found.version else "torch") + " --force-reinstall"
        return found
    found.version = torch.__version__
    return found


def _torchcodec_libraries(package_dir: str) -> list[tuple[int, str, str]]:
    """(FFmpeg major, core library, custom-ops library), newest FFmpeg first, as torchcodec tries them."""
    found = []
    for core in glob.glob(os.path.join(package_dir, "libtorchcodec_core*.so")):
        match = re.search(r"libtorchcodec_core(\d+)\.so$", core)
        ops = os.path.join(package_dir, f"libtorchcodec_custom_ops{match.group(1)}.so") if match else ""
        if match and os.path.exists(ops):
            found.append((int(match.group(1)), core, ops))
    return sorted(found, reverse=True)


def check_torchcodec(torch_found: Finding) -> tuple[Finding, Finding]:
    """(torchcodec, FFmpeg): whether torchcodec's libraries load with this torch and this FFmpeg."""
    torchcodec = Finding("torchcodec", installed_version("torchcodec"))
    ffmpeg = Finding("FFmpeg", ffmpeg_version())
    requirement = torchcodec_requirement(torch_found.version)
    if not torch_found.ok:
        torchcodec.problem, torchcodec.fix = "torchcodec needs torch", torch_found.fix
        return torchcodec, ffmpeg
    spec = importlib.util.find_spec("torchcodec")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        torchcodec.problem = "torchcodec is not installed (it decodes video, and audio in containers)"
        torchcodec.fix = pip_install(requirement)
        return torchcodec, ffmpeg
    loaded = sys.modules.get("torchcodec._core.ops")
    if loaded is not None and getattr(loaded, "ffmpeg_major_version", None):
        return _loaded(torchcodec, ffmpeg, loaded.ffmpeg_major_version)
    libraries = _torchcodec_libraries(spec.submodule_search_locations[0])
    if not libraries:
        torchcodec.problem = f"torchcodec {torchcodec.version} is incomplete (no libtorchcodec_core library)"
        torchcodec.fix = pip_install(requirement) + " --force-reinstall"
        return torchcodec, ffmpeg
    failures = []
    for major, core, ops in libraries:
        try:
            ctypes.CDLL(core)  # what torch.ops.load_library does
            ctypes.CDLL(ops)
        except OSError as exc:
            failures.append((major, str(exc)))
        else:
            return _loaded(torchcodec, ffmpeg, major)
    majors = [major for major, _, _ in libraries]
    ffmpeg.detail = f"torchcodec {torchcodec.version} accepts FFmpeg {min(majors)} to {max(majors)}"
    torch_cuda = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    cuda = _cuda_mismatch(torchcodec, torch_found, torch_cuda, requirement, failures)
    if cuda is not None:
        return cuda, ffmpeg
    torch_symbol = next((m.group(1) for _, error in failures
                         if (m := re.search(r"undefined symbol: (\S*(?:c10|torch|_ZN2at|aoti)\S*)", error))), None)
    if torch_symbol:
        torchcodec.problem = (f"torchcodec {torchcodec.version} does not load with torch {torch_found.version} "
                              f"(undefined symbol {torch_symbol}): they are built for different versions")
        torchcodec.fix = pip_install(requirement)
        return torchcodec, ffmpeg
    missing = [error for _, error in failures
               if "cannot open shared object file" in error and re.search(r"lib(av|sw|postproc)\w*\.so", error)]
    if len(missing) == len(failures):
        ffmpeg.problem = (f"FFmpeg's shared libraries (libavcodec, libavformat, libavutil, ... of FFmpeg "
                          f"{min(majors)} to {max(majors)}, which torchcodec {torchcodec.version} loads) are not found")
        ffmpeg.fix = ffmpeg_fix(majors)
        torchcodec.problem, torchcodec.fix = "torchcodec cannot load without FFmpeg's libraries", ffmpeg.fix
        return torchcodec, ffmpeg
    # FFmpeg is there but something else is wrong: show the error for the FFmpeg found.
    major, error = next(((m, e) for m, e in failures if "cannot open shared object file" not in e
                         or not re.search(r"lib(av|sw|postproc)", e)), failures[0])
    torchcodec.problem = f"torchcodec {torchcodec.version} does not load with FFmpeg {major}: {error[:300]}"
    torchcodec.fix = pip_install(requirement) + " --force-reinstall"
    return torchcodec, ffmpeg


# CUDA's own libraries (a CUDA build of torchcodec needs those of the CUDA it was built
# for, which torch's CUDA build ships and loads) and torch's CUDA half (absent from a
# CPU-only torch).
_CUDA_LIBRARY = re.compile(r"(lib(?:nvrtc|cudart|cublas\w*|cufft|curand|cusparse|cusolver|npp\w*|nvjpeg|nvcuvid|cuda)"
                           r"\.so(?:\.(\d+))?)[\w.]*: cannot open shared object file")
_TORCH_CUDA_LIBRARY = re.compile(r"(lib(?:c10_cuda|torch_cuda)\.so): cannot open shared object file")


def _cuda_mismatch(torchcodec: Finding, torch_found: Finding, cuda: str | None, requirement: str,
                   failures) -> Finding | None:
    """A torchcodec that fails to load because it is built for another CUDA than torch's
    (``cuda``: torch's, as ``torch.version.cuda`` says; None for a CPU-only build)."""
    errors = [error for _, error in failures]
    library = next((m for error in errors if (m := _CUDA_LIBRARY.search(error))), None)
    torch_cuda = next((m for error in errors if (m := _TORCH_CUDA_LIBRARY.search(error))), None)
    if library is None and torch_cuda is None:
        return None
    built_for = (f"CUDA {library.group(2)}" if library is not None and library.group(2) else "CUDA")
    needs = (library or torch_cuda).group(1)
    torch_side = (f"torch {torch_found.version} is built for CUDA {cuda}" if cuda
                  else f"torch {torch_found.version} is a CPU-only build")
    torchcodec.problem = (f"CUDA build mismatch: torchcodec {torchcodec.version} is built for {built_for} "
                          f"(it needs {needs}), but {torch_side}")
    if not _satisfies(torchcodec.version, requirement):
        torchcodec.problem += f"; torchcodec {torchcodec.version} is not the release for this torch either"
    if parse_version(torch_found.version)[:2] < _STABLE_ABI[0]:
        # torchcodec's builds for these on PyPI link no CUDA library at all.
        torchcodec.fix = pip_install(requirement) + " --force-reinstall"
    else:  # PyPI's builds link the CUDA of PyPI's torch: take the build for this torch's CUDA
        index = "cu" + cuda.replace(".", "") if cuda else "cpu"
        torchcodec.fix = (pip_install(requirement) + f" --force-reinstall --index-url "
                          f"https://download.pytorch.org/whl/{index}")
    return torchcodec


def _satisfies(version: str | None, requirement: str) -> bool:
    """Whether ``version`` meets the ``==X.Y.*`` or ``>=X.Y`` of ``requirement`` (else True)."""
    match = re.search(r"(==|>=)([\d.]+)", requirement)
    if version is None or match is None:
        return True
    wanted, found = parse_version(match.group(2)), parse_version(version)
    return found >= wanted if match.group(1) == ">=" else found[:len(wanted)] == wanted


def _loaded(torchcodec: Finding, ffmpeg: Finding, major: int) -> tuple[Finding, Finding]:
    torchcodec.detail = f"loads with this torch, using FFmpeg {major}"
    ffmpeg.version = ffmpeg_version(major) or ffmpeg.version or str(major)
    ffmpeg.detail = f"major {major}, used by torchcodec"
    return torchcodec, ffmpeg


def ffmpeg_version(major: int | None = None) -> str | None:
    """FFmpeg's own version string (``av_version_info``, e.g. "5.1.6-0+deb12u1") of the
    given major version, or of the newest one the dynamic loader finds."""
    for candidate in sorted(_AVUTIL_SONAME, reverse=True) if major is None else [major]:
        try:
            info = ctypes.CDLL(f"libavutil.so.{_AVUTIL_SONAME[candidate]}").av_version_info
        except (OSError, AttributeError, KeyError):
            continue
        info.restype = ctypes.c_char_p
        return info().decode(errors="replace")
    return None


def check_module(name: str, distribution: str, purpose: str, version_of=None) -> Finding:
    found = Finding(name, installed_version(distribution))
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # ImportError, or OSError when its native library is missing
        installed = found.version is not None
        found.problem = (f"{name} {found.version} does not import ({type(exc).__name__}: {exc})" if installed
                         else f"{name} is not installed ({purpose})")
        found.fix = pip_install(distribution) + (" --force-reinstall" if installed else "")
        return found
    found.version = getattr(module, "__version__", found.version)
    found.detail = version_of(module) if version_of else ""
    return found


def check_soundfile() -> Finding:
    return check_module("soundfile", "soundfile", "it decodes WAV, FLAC, OGG and MP3",
                        lambda module: f"libsndfile {getattr(module, '__libsndfile_version__', '?')}")


def check_soxr() -> Finding:
    return check_module("soxr", "soxr", "it resamples audio as librosa does")


def check_qwen_omni(command_line=None) -> Finding | None:
    """What qwen_omni_utils imports as it loads, where it is installed (None where it is
    not): found without importing anything. Required when the command line names an Omni
    model, since ms-swift loads qwen_omni_utils for one; else a problem is a warning."""
    if importlib.util.find_spec(QWEN_OMNI) is None:
        return None
    found = Finding(QWEN_OMNI, installed_version("qwen-omni-utils") or installed_version(QWEN_OMNI))
    found.required = any("omni" in argument.lower() for argument in (sys.argv if command_line is None
                                                                      else command_line))
    missing = [distribution for module, distribution in QWEN_OMNI_IMPORTS.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        why = (" (librosa 1.0 no longer installs it)" if missing == ["audioread"]
               and parse_version(installed_version("librosa")) >= (1,) else "")
        found.problem = (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed{why}: "
                         f"qwen_omni_utils {found.version} imports {'it' if len(missing) == 1 else 'them'} as it "
                         f"loads, and ms-swift loads it for Qwen2.5-Omni and Qwen3-Omni models")
        found.fix = f"{sys.executable} -m pip install " + " ".join(f'"{name}"' for name in missing)
    else:
        found.detail = "imports " + ", ".join(QWEN_OMNI_IMPORTS) + " found"
    return found


# --- the verdict --------------------------------------------------------------------

def needs_of(hosts) -> set[str]:
    return {need for host in (hosts or HOST_NEEDS) for need in HOST_NEEDS.get(host, ())}


def inspect(needs=None) -> list[Finding]:
    """Every piece ``needs`` asks for (all of them by default), checked here and now."""
    needs = needs_of(None) if needs is None else set(needs)
    torch_found = check_torch()
    findings = [torch_found]
    if TORCHCODEC in needs or LEROBOT_VIDEO in needs:
        torchcodec, ffmpeg = check_torchcodec(torch_found)
        if TORCHCODEC not in needs and torchcodec.version is None and importlib.util.find_spec("torchcodec") is None:
            # LeRobot decodes with PyAV when torchcodec is not installed.
            findings.append(check_module("av", "av", "LeRobot decodes with PyAV without torchcodec"))
        else:
            findings += [ffmpeg, torchcodec]  # FFmpeg first: a missing FFmpeg is the cause, not torchcodec
    if SOUNDFILE in needs:
        findings.append(check_soundfile())
    if SOXR in needs:
        findings.append(check_soxr())
    if QWEN_OMNI in needs and (omni := check_qwen_omni()) is not None:
        findings.append(omni)
    return findings


_verdicts: dict[frozenset, ProtectionUnavailable | None] = {}


def _environment_key() -> str:
    """What the libraries found depend on; a child with another environment checks again."""
    seen = "\0".join([sys.executable, sys.prefix, os.environ.get("PYTHONPATH", ""),
                      os.environ.get("LD_LIBRARY_PATH", "")])
    return hashlib.sha1(seen.encode()).hexdigest()[:12]


def _passed_in_environment() -> set[str]:
    needs, _, key = (config.get(config.PREFLIGHT_PASSED) or "").partition("@")
    return set(needs.split(",")) - {""} if key == _environment_key() else set()


def require(hosts=None) -> None:
    """Raise ProtectionUnavailable unless the decoders ``hosts`` use can load here."""
    if not config.preflight():
        return
    needs = needs_of(hosts)
    passed = _passed_in_environment()
    if needs <= passed:
        return
    key = frozenset(needs)
    if key not in _verdicts:
        findings = inspect(needs)
        problem = next((finding for finding in findings if not finding.ok and finding.required), None)
        _verdicts[key] = None if problem is None else ProtectionUnavailable(problem.problem, problem.fix)
        for finding in findings:
            if not finding.ok and not finding.required and problem is None:
                log.warning("swift_safe_media: %s. Fix: %s", finding.problem, finding.fix)
    refusal = _verdicts[key]
    if refusal is not None:
        show_plainly_if_uncaught()
        raise ProtectionUnavailable(refusal.missing, refusal.fix)
    config.put(config.PREFLIGHT_PASSED, f"{','.join(sorted(needs | passed))}@{_environment_key()}")


def show_plainly_if_uncaught() -> None:
    """An uncaught ProtectionUnavailable ends the program with its message alone: the
    traceback through the host's import machinery would bury the fix."""
    previous = sys.excepthook
    if getattr(previous, "_swift_safe_media", False):
        return

    def excepthook(kind, value, traceback):
        if isinstance(value, ProtectionUnavailable):
            print(f"\n{value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    excepthook._swift_safe_media = True
    sys.excepthook = excepthook
