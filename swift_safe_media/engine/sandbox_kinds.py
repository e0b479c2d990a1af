"""Which kind of sandbox a call gets, and what a sandbox holds before its call.

- **Kinds**: confined (the default: the media comes as descriptors), unconfined (what a
  user asks for, code that runs programs), ``BY_NAME``: confined, one sandbox per call, which
  may open the call's own files by name, for code we do not own that opens its media
  natively by name (stock's loaders, LLaMA-Factory's readers: :func:`by_name`), and
  ``NETWORK``: a download's, confined but for connecting out, one per call, and
  ``PROGRAMS``: as ``BY_NAME``, but it may run ffmpeg and write in a folder of its own.
- **Set-ups** (:func:`set_up_sandboxes`): run in each pooled sandbox before its first call
  (imports a host needs there).
- **Imports before fork** (:func:`import_before_fork`): what the zygote imports before it
  forks a sandbox for one call, which would otherwise import it every call.
"""

from __future__ import annotations

import os
import stat

from .. import config
from ..confinement import handed, policy as confine, reads as confine_reads
from ..errors import MediaDecodeError

_sandbox_setups: list = []


def set_up_sandboxes(fn) -> None:
    """Run ``fn()`` (a module-level function) once in each sandbox of this process before
    the sandbox's first call, replacements included: imports a host needs there, say.
    It runs under the start-up timeout (``SWIFT_SAFE_MEDIA_START_TIMEOUT``), not the
    call's, and is not counted as a decode."""
    if fn not in _sandbox_setups:
        _sandbox_setups.append(fn)


def sandbox_setups() -> tuple:
    """The functions registered with :func:`set_up_sandboxes`, in order."""
    return tuple(_sandbox_setups)


# Confinement of a pool's sandboxes: confined (True), unconfined (False), or BY_NAME:
# confined, each sandbox serving one call whose own files it may open by name (code we do
# not own opens its media natively by name: stock's loaders, LLaMA-Factory's readers).
BY_NAME = "by name"
# A download's sandbox: confined as BY_NAME, but it may connect out (TCP) and read what
# resolving names and checking certificates need; one per call too.
NETWORK = "network"
# For stock code that runs the ffmpeg program: confined as BY_NAME, but it may run ffmpeg
# (and its loader) and write in a folder of its own (confinement/programs.py); one per call.
PROGRAMS = "by name, running ffmpeg"
PER_CALL = (BY_NAME, NETWORK, PROGRAMS)

_imports_before_fork: list[tuple[str, str | None]] = []


def import_before_fork(module: str, path: str | None = None) -> None:
    """Have the zygote import ``module`` (found on ``path`` too, a folder put last on its
    import path: a model's own code, say) before it forks a sandbox for a call ``BY_NAME``
    (such a sandbox serves one call: an import there would cost every call). Setups
    registered with :func:`set_up_sandboxes` do not run in those sandboxes."""
    if (module, path) not in _imports_before_fork:
        _imports_before_fork.append((module, path))


def imports_before_fork() -> tuple[tuple[str, str | None], ...]:
    return tuple(_imports_before_fork)


def by_name(runs_ffmpeg: bool = False, files=()) -> bool | str:
    """The confinement for a call of code we do not own that opens its media (``files``) by
    name: the pooled confined sandboxes where those may read them (reads anywhere, or every
    file beneath a folder of ``SWIFT_SAFE_MEDIA_READ_ROOTS``: a sandbox per call costs 25-150
    ms more), else ``BY_NAME``; for code that runs the ffmpeg program, ``PROGRAMS`` (its
    grants are per call)."""
    if runs_ffmpeg:
        return PROGRAMS
    if confine.opens_by_name():
        return True
    roots = [os.path.realpath(root) for root in config.read_roots() or ()]
    named = [os.path.realpath(name) for name in files if isinstance(name, (str, os.PathLike))]
    if roots and named and len(named) == len(files) and all(confine_reads.beneath(name, roots) for name in named):
        return True
    return BY_NAME


def forget_sandbox_setup(fn) -> None:
    """Undo :func:`set_up_sandboxes` for sandboxes started from now on."""
    if fn in _sandbox_setups:
        _sandbox_setups.remove(fn)


def refuse_what_cannot_be_handed(names) -> frozenset | None:
    """Before a call ``BY_NAME``: a named file that exists but is not a regular file (a FIFO,
    a device, a socket: stock would wait on it for ever) fails here, named, as the twins'
    guards fail it; its sandbox could not read it anyway. Returns what that sandbox is
    confined to read, as (device, inode) pairs (a kept sandbox is matched on them:
    :mod:`.per_call`), or None where that cannot be told (nothing named, a name gone)."""
    grants: set | None = set()
    for name in names:
        try:
            found = os.stat(name)
        except (OSError, TypeError, ValueError):
            grants = None
            continue
        if not stat.S_ISREG(found.st_mode) and not stat.S_ISDIR(found.st_mode):
            raise MediaDecodeError(name, f"not a regular file ({handed.special_kind(found.st_mode)})")
        if grants is not None:
            grants.add((found.st_dev, found.st_ino))
    return frozenset(grants) if grants else None
