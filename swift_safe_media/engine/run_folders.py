"""The temporary folders a run makes, and their removal however the run ends.

A training process (a rank) that enables protection makes up to five folders in the
temporary directory: the shared zygote's socket folder (``swift-safe-media-zygote-*``),
the run's statistics when no registry says where (``swift-safe-media-stats-*``), the
stall watchdog's in-flight records (``swift-safe-media-inflight-*``), its workers'
decode marks (``swift-safe-media-deadline-*``) and its sandboxes' scratch folders. Each is made by
:func:`make`, and removed

- by the process that made it, as it exits normally (at exit, or earlier by its owner);
- by its zygote when that process is SIGKILLed: a zygote outlives its caller, sees its
  control connection close, and is told which folders are the caller's
  (:func:`owned`, sent with the zygote's preparation and again as the list changes); it
  removes them once the caller is dead (:func:`remove_after_death`);
- by the next protected run on the machine when both died at once (a job's whole process
  group killed): each folder holds a lock file (``LOCK``), locked (``flock``) by the
  process that made it, and so by its forked children, for as long as they live;
  :func:`sweep` removes our folders whose lock no live process holds. A folder without
  one (made by an older version, or being made now) is never swept.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import stat
import tempfile
import time

from .. import process

PREFIX = "swift-safe-media-"
KINDS = ("zygote", "stats", "inflight", "scratch", "deadline")
# A Unix socket's path has at most 107 bytes; a long TMPDIR (a job scheduler's, a test's)
# leaves no room, so a socket's folder then goes where it fits.
SOCKET_NAME = "zygote.sock"
_SOCKET_PATH_MAX = 107 - len("/" + SOCKET_NAME)
_FALLBACK_BASES = ("/tmp", "/dev/shm")
LOCK = ".swift-safe-media-lock"


def make(kind: str, for_socket: bool = False) -> str:
    """A new private folder (mode 0700) ``swift-safe-media-<kind>-*`` owned by this process:
    locked while it (or a forked child) lives, removed when it exits or dies."""
    if kind not in KINDS:
        raise ValueError(kind)
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=_base(kind) if for_socket else None)
    process.current().temporary_folders[folder] = _lock(folder)
    creator = os.getpid()
    # At exit, in the process that made it (not in a forked child, which only shares it).
    atexit.register(lambda: os.getpid() == creator and release(folder))
    _tell_zygote()
    return folder


def scratch_for_call() -> str:
    """A new folder for one sandbox's temporary files (see :mod:`..confinement.programs`),
    inside this process's ``swift-safe-media-scratch-*``; remove it with
    :func:`remove_scratch` after the call (the parent goes as :func:`make`'s folders go)."""
    state = process.current()
    if state.scratch_folder is None or not os.path.isdir(state.scratch_folder):
        state.scratch_folder = make("scratch")
    return tempfile.mkdtemp(prefix="call-", dir=state.scratch_folder)


def remove_scratch(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _lock(folder: str) -> int:
    """The descriptor holding ``folder``'s lock file, locked before the file has its name
    (so a sweep never finds it unlocked while we live), or -1 where ``flock`` fails (the
    zygote and the exit hook still remove the folder; a sweep leaves it alone)."""
    partial = os.path.join(folder, LOCK + ".new")
    try:
        lock = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        os.rename(partial, os.path.join(folder, LOCK))
    except OSError:
        os.close(lock)
        return -1
    return lock


def _base(kind: str) -> str:
    for parent in (tempfile.gettempdir(), *_FALLBACK_BASES):
        if len(os.path.join(parent, f"{PREFIX}{kind}-12345678")) <= _SOCKET_PATH_MAX:
            return parent
    raise OSError("no temporary folder with a path short enough for a Unix socket")


def release(folder: str) -> None:
    """Remove a folder :func:`make` made here, now (its owner is done with it)."""
    shutil.rmtree(folder, ignore_errors=True)
    forget(folder)


def forget(folder: str) -> None:
    """Stop owning ``folder`` without removing it (it is the user's now, or not ours)."""
    lock = process.current().temporary_folders.pop(folder, None)
    if lock is not None and lock >= 0:
        os.close(lock)
    if lock is not None:
        _tell_zygote()


def owned() -> list[str]:
    """The folders this process made and still owns (a forked child owns none)."""
    return list(process.current().temporary_folders)


def _tell_zygote() -> None:
    """The shared zygote this process started removes these if this process is killed."""
    shared = process.current().shared_zygote
    if shared is not None:
        shared.remove_if_caller_dies(owned())


# -- the zygote's side ----------------------------------------------------------------
def is_ours(folder: str) -> bool:
    """A folder of ours to remove: named by :func:`make`, a real folder, this user's."""
    try:
        found = os.lstat(folder)
    except OSError:
        return False
    name = os.path.basename(os.path.normpath(folder))
    return (stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()
            and any(name.startswith(f"{PREFIX}{kind}-") for kind in KINDS))


def remove(folders) -> None:
    for folder in folders:
        if is_ours(folder):
            shutil.rmtree(folder, ignore_errors=True)


def is_dead(pid: int) -> bool:
    """Gone, or a zombie (dead, not yet collected by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as found:
            return found.read().rsplit(")", 1)[1].split()[0] in ("Z", "X", "x")
    except (OSError, IndexError):
        return True


def remove_after_death(pid: int, folders, patience: float = 2.0) -> bool:
    """Remove ``folders`` once ``pid`` is dead (its connection closes as it dies, a moment
    before it is); a caller still alive after ``patience`` seconds keeps them."""
    if not folders:
        return False
    deadline = time.monotonic() + patience
    while not is_dead(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    remove(folders)
    return True


# -- the next run's side --------------------------------------------------------------
def sweep() -> list[str]:
    """Remove our folders in the temporary directories whose lock no live process holds
    (their makers died with their zygotes); returns them. Folders of live runs stay."""
    removed = []
    for base in dict.fromkeys((tempfile.gettempdir(), *_FALLBACK_BASES)):
        try:
            names = [name for name in os.listdir(base) if name.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            folder = os.path.join(base, name)
            if folder in process.current().temporary_folders or not is_ours(folder):
                continue
            try:
                lock = os.open(os.path.join(folder, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # no lock file: not one to judge
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its run is alive (or the file system cannot tell: leave it)
            else:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            finally:
                os.close(lock)
    return removed
