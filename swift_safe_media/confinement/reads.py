"""What a confined sandbox may read: what decoding needs, and nothing else by default.

Landlock allows reads (files and directory listings) only beneath these roots
(:func:`roots`), each with the reason it is there (``doctor`` and ``swift-safe-media
confinement`` show them):

- the Python installation (``sys.prefix``, the standard library, site-packages), so that a
  sandbox can still import lazily; of an import path outside it (the script's folder, the
  working directory ``python -c`` puts on ``sys.path``, ``PYTHONPATH``: folders that may
  also hold datasets) only its code: the folder's listing, its modules, and its packages;
- the shared libraries: ``/usr``, ``/lib*``, ``LD_LIBRARY_PATH`` and the folder of every
  library mapped into the zygote when it built the policy (torch's, FFmpeg's, ...);
- the few system files decoding reads: the loader's cache, locale and time zone, ``/dev/null``
  and the random devices, CPU counts (``/proc/cpuinfo``, ``/sys/devices/system/cpu``, the
  cgroup's quota) and, on a GPU host, the GPU's device nodes and driver files;
- the sandbox's own ``/proc/<pid>`` (``/proc/self``), added in each sandbox
  (:func:`.confine.apply`): no other process's ``/proc`` entry, the trainer's included;
- ``SWIFT_SAFE_MEDIA_READ_ROOTS``, where a user's decoder needs more (``/``: anywhere).

The media itself is not among them: the caller opens each file it hands to a decode and
passes the descriptor along (:mod:`.handed`), as Android's media extractor gets its input.
No root is the home folder or one above it (a ``sys.path`` entry that is, say the home
folder of a script run from there, is left out): ``~/.cache/huggingface`` and the like
stay unreadable.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32")
SYSTEM_FILES = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone",
    "/etc/locale.alias", "/etc/locale.conf", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group", "/etc/mime.types",
    "/etc/fonts", "/etc/os-release", "/etc/alternatives",
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
    "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/filesystems", "/proc/sys/vm/overcommit_memory",
    "/proc/sys/kernel/random",
    "/sys/devices/system/cpu", "/sys/devices/system/node", "/sys/fs/cgroup", "/sys/kernel/mm/transparent_hugepage",
)
# Only where an NVIDIA or DRM device exists: what CUDA and VA-API read as they start.
GPU_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/dri", "/proc/driver/nvidia",
             "/sys/bus/pci", "/sys/devices", "/sys/module/nvidia")
ANYWHERE = "/"


def gpu_devices() -> list[str]:
    return [*glob.glob("/dev/nvidia[0-9]*"), *glob.glob("/dev/dri/renderD*")]


def reads_anywhere(read_roots) -> bool:
    return any(os.path.realpath(root) == ANYWHERE for root in read_roots or ())


LIST_ONLY = "list"  # a folder whose names may be listed, its files not read (an import path's)
CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth", ".zip", ".egg")


def roots(read_roots=(), extra_readable=()) -> list[tuple[str, str, str]]:
    """(path, why, kind) for every root a confined sandbox may read below (kind "read"),
    or only list (``LIST_ONLY``): real paths, existing ones only, each once."""
    found: dict[str, tuple[str, str]] = {}

    def add(path, why, kind="read"):
        if not path or not os.path.exists(path):
            return
        real = os.path.realpath(path)
        if real not in found and not _holds_home(real):
            found[real] = (why, kind)

    for root in read_roots or ():
        if os.path.exists(root):
            found.setdefault(os.path.realpath(root), ("SWIFT_SAFE_MEDIA_READ_ROOTS", "read"))
    installation = [sys.prefix, sys.base_prefix, sys.exec_prefix,
                    *[sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")]]
    for path in installation:
        add(path, "the Python installation")
    # Import paths outside the installation (the script's folder, the working directory of
    # `python -c`, PYTHONPATH) may hold datasets: only their code is readable.
    inside = [os.path.realpath(path) for path in (*installation, *SYSTEM_DIRS) if path]
    package = sys.modules["swift_safe_media"].__file__  # the folder that holds the package
    for path, why in [(os.path.dirname(os.path.dirname(os.path.abspath(package))), "this package"),
                      *[(path, "an import path") for path in sys.path],
                      *[(path, "the caller's script") for path in extra_readable]]:
        if path and os.path.isdir(path) and not beneath(os.path.realpath(path), inside):
            for code, kind in _code_in(path):
                add(code, f"{why} (its Python code only)", kind)
        else:
            add(path, why)
            for target in _link_targets(path):  # a site-packages whose entries link elsewhere
                add(target, f"{why} (where its links lead)")
    for path in SYSTEM_DIRS:
        add(path, "the shared libraries")
    for path in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        add(path, "LD_LIBRARY_PATH")
    for path in _mapped_library_folders():
        add(path, "a folder of a loaded library")
    for path in SYSTEM_FILES:
        add(path, "read by the decoding libraries")
    if gpu_devices():
        for path in (*gpu_devices(), *GPU_FILES):
            add(path, "the GPU")
    return [(path, why, kind) for path, (why, kind) in found.items()]


def _code_in(folder: str):
    """An import path's folder (listed only), its modules, and its packages (folders with
    an ``__init__.py``) and ``__pycache__``."""
    yield folder, LIST_ONLY
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_file() and entry.name.endswith(CODE_SUFFIXES):
            yield entry.path, "read"
        elif entry.is_dir() and (entry.name == "__pycache__" or os.path.exists(os.path.join(entry.path, "__init__.py"))):
            yield entry.path, "read"


def _link_targets(folder: str) -> list[str]:
    """Where the symbolic links directly in ``folder`` lead (a venv that links its packages)."""
    try:
        return [os.path.realpath(entry.path) for entry in os.scandir(folder) if entry.is_symlink()]
    except OSError:
        return []


def beneath(path: str, folders) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


def outermost(paths) -> list[str]:
    """``paths`` less those beneath another of them (a rule on the outer one covers them)."""
    kept: list[str] = []
    for path in sorted(dict.fromkeys(paths), key=len):
        if not beneath(path, kept):
            kept.append(path)
    return kept


def _holds_home(path: str) -> bool:
    """True for the home folder and every folder above it (``/`` included)."""
    home = os.path.realpath(os.path.expanduser("~"))
    return path == home or home.startswith(path.rstrip("/") + "/")


def _mapped_library_folders() -> list[str]:
    """The folders of the shared libraries mapped into this process."""
    folders = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                    path = parts[5].strip()
                    if not path.endswith("(deleted)"):
                        folders.append(os.path.dirname(path))
    except OSError:
        pass
    return list(dict.fromkeys(folders))
