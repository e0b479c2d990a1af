"""Confinement of decode sandboxes: what an exploited decoder can reach.

A sandbox that runs our decoders is confined before its first call, in three layers
that each hold alone:

- ``no_new_privs``: no set-uid program or file capability can raise its privileges
  (and unprivileged seccomp and Landlock require it);
- a seccomp filter (:mod:`.syscalls`, libseccomp through ctypes) refusing the system calls a decoder
  never needs: sockets other than local stream sockets, connect/bind/listen/accept,
  exec, ptrace and reading other processes' memory, mounts, namespaces, bpf, keyrings,
  kernel modules, kexec/reboot, perf, userfaultfd, io_uring (whose operations would
  bypass the filter);
- Landlock (the best ABI the kernel has) refusing every file write, create, remove,
  rename, link and truncate, TCP bind/connect (ABI 4), abstract Unix sockets and
  signals outside the sandbox (ABI 6), and every read but what decoding needs
  (:mod:`.reads`; the media comes as descriptors, :mod:`.handed`), widened by
  ``SWIFT_SAFE_MEDIA_READ_ROOTS``.

What a sandbox holds and prints besides: :mod:`.environment` (an allow-listed
environment), :mod:`.output` (its stdout and stderr, captured).

A refused call fails with an errno of ``REFUSED_ERRNO_BASE`` + its syscall number
rather than killing the sandbox, so the refusal reaches the caller as an error that
``refusal()`` can name ("sandbox refused connect") whether it surfaced as a Python
``OSError`` or inside an FFmpeg message ("Unknown error 3042"). Landlock refusals are
plain EACCES; ``refusal()`` names them when the file's own permissions would allow the
write. The policy is built once per zygote (``prepare``) and applied in each forked
sandbox (``apply``: its Landlock rules, laid out in the zygote, one system call each, and
its own ``/proc/<pid>``; then the filter); the kernel interfaces are in
:mod:`.kernel`, so confinement costs no start-up time
one can measure.

Two variants, applied by a sandbox of one call as that call begins: one that may read the
files handed with the call by any name (``readable_fds``: stock code that opens its media
by name), and a download's, which may also connect out over TCP and read what resolving
names and checking certificates need (``network``; :data:`NETWORK_FILES`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import sys
from dataclasses import dataclass, field

from .. import config
from . import handed as confine_handed, programs as confine_programs, reads as confine_reads
from . import kernel
from .kernel import landlock_abi, seccomp_available  # noqa: F401  (part of this module's API)
from .syscalls import REFUSED_ERRNO_BASE, REFUSED_SYSCALLS, build_seccomp_program, syscall_numbers  # noqa: F401

log = logging.getLogger("swift_safe_media")

# Landlock rights refused (handled, with no rule allowing them), with the ABI that introduced each.
_FS_WRITE_RIGHTS = (  # (name, bit, abi)
    ("write_file", 1 << 1, 1), ("remove_dir", 1 << 4, 1), ("remove_file", 1 << 5, 1),
    ("make_char", 1 << 6, 1), ("make_dir", 1 << 7, 1), ("make_reg", 1 << 8, 1),
    ("make_sock", 1 << 9, 1), ("make_fifo", 1 << 10, 1), ("make_block", 1 << 11, 1),
    ("make_sym", 1 << 12, 1), ("refer", 1 << 13, 2), ("truncate", 1 << 14, 3),
)
_NET_RIGHTS = (("bind_tcp", 1 << 0, 4), ("connect_tcp", 1 << 1, 4))
_SCOPES = (("abstract_unix_socket", 1 << 0, 6), ("signal", 1 << 1, 6))
# What a download's sandbox reads besides: name resolution and certificate stores.
NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf", "/etc/services",
                 "/etc/protocols", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/run/systemd/resolve")


# -- building the policy (once per zygote) ------------------------------------------------

@dataclass
class Policy:
    """What ``apply`` installs in each sandbox; built by ``prepare``."""

    seccomp_program: bytes | None = None
    seccomp_number: int = -1
    landlock_abi: int = 0
    landlock_access: tuple = ()  # (handled fs rights, handled net rights, scopes)
    landlock_rules: list = field(default_factory=list)  # rules whose O_PATH descriptors stay open
    reads_limited: bool = False  # reads only beneath confine_reads.roots() (and /proc/<pid>)
    read_roots: list[str] | None = None
    missing: list[str] = field(default_factory=list)  # layers this kernel lacks, and why
    # The filter as the kernel takes it, made here so a forked sandbox only passes a pointer.
    _program_buffer: object = None
    _fprog: object = None
    # A download's sandbox (``apply(network=True)``): its filter, and what resolving names and
    # checking certificates read.
    network_programs: tuple = ()  # (buffer, fprog)
    network_rules: list = field(default_factory=list)
    # A sandbox that runs ffmpeg (``apply(scratch=...)``): its filter, and its execute rules.
    exec_programs: tuple = ()  # (buffer, fprog)
    program_rules: list = field(default_factory=list)


def prepare(read_roots: list[str] | None = None, extra_readable=()) -> Policy:
    """Build the seccomp program and the Landlock rules; never raises (a layer that
    cannot be built is listed in ``missing`` and left out)."""
    read_roots = list(read_roots or [])
    policy = Policy(read_roots=read_roots, reads_limited=not confine_reads.reads_anywhere(read_roots))
    problem = seccomp_available()
    if problem is None:
        try:
            policy.seccomp_program = build_seccomp_program()
            policy.seccomp_number = syscall_numbers()["seccomp"]
            policy._program_buffer, policy._fprog = kernel.filter_program(policy.seccomp_program)
            policy.network_programs = kernel.filter_program(build_seccomp_program(network=True))
            policy.exec_programs = kernel.filter_program(build_seccomp_program(programs=True))
        except (OSError, KeyError) as exc:
            problem = f"seccomp filter not built: {exc}"
    if problem:
        policy.missing.append(problem)
    abi = landlock_abi()
    if abi <= 0:
        policy.missing.append("the kernel has no Landlock")
    else:
        try:
            _open_landlock_rules(policy, abi, extra_readable)
            policy.landlock_abi = abi
        except OSError as exc:
            policy.missing.append(f"Landlock ruleset not built: {exc}")
    return policy


def _rights(table, abi: int) -> int:
    bits = 0
    for _, bit, since in table:
        if abi >= since:
            bits |= bit
    return bits


def _open_landlock_rules(policy: Policy, abi: int, extra_readable) -> None:
    """The Landlock rights and rules, their paths opened here (``O_PATH``) once per zygote:
    each sandbox builds its ruleset from them, adding its own ``/proc/<pid>``."""
    handled_fs = _rights(_FS_WRITE_RIGHTS, abi) | kernel.FS_EXECUTE
    reads = kernel.FS_READ_FILE | kernel.FS_READ_DIR
    if policy.reads_limited:
        handled_fs |= reads
    policy.landlock_access = (handled_fs, _rights(_NET_RIGHTS, abi), _rights(_SCOPES, abi))
    # Writing to /dev/null (and GPU device nodes, for users' CUDA decodes) changes nothing.
    wanted = [(device, kernel.FS_WRITE_FILE | (kernel.FS_READ_FILE if policy.reads_limited else 0))
              for device in ["/dev/null", *confine_reads.gpu_devices()]]
    if policy.reads_limited:
        found = confine_reads.roots(policy.read_roots, extra_readable)
        readable = confine_reads.outermost([path for path, _, kind in found if kind != confine_reads.LIST_ONLY])
        wanted += [(path, reads) for path in readable]
        wanted += [(path, kernel.FS_READ_DIR) for path, _, kind in found
                   if kind == confine_reads.LIST_ONLY and not confine_reads.beneath(path, readable)]
    for path, rights in wanted:
        rule = kernel.open_rule_path(path, rights)
        if rule is not None:
            policy.landlock_rules.append(rule)
    if policy.reads_limited:
        policy.network_rules = [rule for rule in (kernel.open_rule_path(path, reads) for path in NETWORK_FILES)
                                if rule is not None]
    policy.program_rules = [rule for rule in (kernel.open_rule_path(path, kernel.FS_EXECUTE | kernel.FS_READ_FILE)
                                              for path in confine_programs.runnable()) if rule is not None]


# -- applying it (in each sandbox) ---------------------------------------------------------

_applied: dict | None = None  # what this process runs under, for status_here()


def apply(policy: Policy, readable_fds=(), network: bool = False, scratch: str | None = None) -> None:
    """Confine this process for good; ``readable_fds``: files (open descriptors) it may read
    besides, by any name (a sandbox for one call of code that opens its media by name);
    ``network``: a download's sandbox, which may also connect out over TCP, and read what
    resolving names and checking certificates need (no bind, no exec, no writes);
    ``scratch``: a sandbox that runs ffmpeg, which may also execute it (and its loader) and
    write in this folder (:mod:`.programs`).
    Raises OSError if a layer the policy has cannot be installed (the sandbox must then not
    serve calls)."""
    global _applied
    kernel.set_no_new_privs()
    unused = ([] if network else policy.network_rules) + ([] if scratch else policy.program_rules)
    for rule in unused:
        os.close(rule.parent_fd)
    if policy.landlock_abi:
        rules = list(policy.landlock_rules) + (policy.network_rules if network else [])
        if scratch:
            rules += policy.program_rules
            folder = kernel.open_rule_path(scratch, _rights(_FS_WRITE_RIGHTS, policy.landlock_abi)
                                           | kernel.FS_READ_FILE | kernel.FS_READ_DIR, True)
            rules += [folder] if folder is not None else []
        if policy.reads_limited:
            rules += [kernel.file_rule(fd, kernel.FS_READ_FILE) for fd in readable_fds]
        own_proc = None
        if policy.reads_limited:
            own_proc = kernel.open_rule_path(f"/proc/{os.getpid()}", kernel.FS_READ_FILE | kernel.FS_READ_DIR, True)
            if own_proc is not None:
                rules.append(own_proc)
        try:
            handled_fs, handled_net, scopes = policy.landlock_access
            if network:
                handled_net &= ~_rights([right for right in _NET_RIGHTS if right[0] == "connect_tcp"], 99)
            kernel.restrict_self(policy.landlock_abi, handled_fs, handled_net, scopes, rules)
        finally:
            for rule in rules:
                os.close(rule.parent_fd)  # this sandbox's copies: the zygote keeps its own
            policy.landlock_rules = policy.network_rules = policy.program_rules = []
    if policy.seccomp_program:
        fprog = policy.network_programs[1] if network else policy.exec_programs[1] if scratch else policy._fprog
        kernel.install_seccomp_filter(policy.seccomp_number, fprog)
    # Imports after this point cannot write their bytecode caches: do not try.
    sys.dont_write_bytecode = True
    _applied = {"seccomp": bool(policy.seccomp_program), "landlock_abi": policy.landlock_abi,
                "read_roots": policy.read_roots, "reads_limited": bool(policy.landlock_abi and policy.reads_limited)}


def status_here() -> dict:
    """What confines the calling process, read back from the kernel (run in a sandbox)."""
    flags = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("NoNewPrivs", "Seccomp", "Seccomp_filters"):
                flags[key] = int(value.split()[0])
    applied = _applied or {"seccomp": False, "landlock_abi": 0, "read_roots": None, "reads_limited": False}
    return {"pid": os.getpid(), "no_new_privs": flags.get("NoNewPrivs") == 1,
            "seccomp": flags.get("Seccomp") == 2, "landlock_abi": applied["landlock_abi"],
            "read_roots": applied["read_roots"], "reads_limited": applied["reads_limited"],
            "environment": sorted(os.environ)}


def status() -> dict:
    """What decode sandboxes started from this process run under (for ``doctor``);
    ``swift-safe-media confinement`` adds what a real sandbox reads back."""
    on = config.confine()
    seccomp_problem = seccomp_available()
    abi = landlock_abi()
    return {
        "enabled": on,
        "no_new_privs": on,
        "seccomp": on and seccomp_problem is None,
        "landlock_abi": abi if on else 0,
        "read_roots": config.read_roots() if on else None,
        "reads": describe_reads() if on else None,
        "environment": describe_environment() if on else None,
        "refused": describe_refused() if on else None,
        "missing": [p for p in (seccomp_problem, None if abi else "the kernel has no Landlock") if p],
    }


def describe_reads() -> dict:
    """What a confined sandbox started from here may read (for doctor and the CLI)."""
    roots = config.read_roots()
    if abi_reads_unlimited(roots):
        return {"limited": False, "why": "SWIFT_SAFE_MEDIA_READ_ROOTS includes / (reads anywhere)"
                if roots else "the kernel has no Landlock"}
    return {"limited": True, "media": "the files handed to each decode, as open descriptors",
            "own_proc": "/proc/<sandbox pid> (its /proc/self), no other process's",
            "roots": {path: why for path, why, _ in confine_reads.roots(roots)}}


def abi_reads_unlimited(roots) -> bool:
    return landlock_abi() <= 0 or confine_reads.reads_anywhere(roots)


def opens_by_name() -> bool:
    """Whether a confined sandbox can open a media file by its name. Where reads are limited
    it cannot (the media comes as a descriptor, and Landlock refuses reopening it through
    /proc/self/fd): code we do not own that opens the file natively by name (the stock
    entry points of :mod:`..decoders.stock`, LLaMA-Factory's plugins) then runs in an
    unconfined sandbox, still isolated, bounded and with the allow-listed environment."""
    return abi_reads_unlimited(config.read_roots())


def describe_environment() -> dict:
    """The environment policy: what sandboxes keep, and the names (never values) withheld here."""
    from . import environment as confine_env

    return {"kept": "allow-list: locale, thread-pool and FFmpeg variables, the hosts' decode settings, "
                    "SWIFT_SAFE_MEDIA_*, plus SWIFT_SAFE_MEDIA_SANDBOX_ENV",
            "kept_here": sorted(confine_env.allowed()), "withheld_here": confine_env.withheld()}


def warn_once_if_missing() -> None:
    """Log once per run (child processes inherit the mark) which layers are missing."""
    if config.get(config.CONFINE_WARNED) or not config.confine():
        return
    config.put(config.CONFINE_WARNED, True)
    missing = status()["missing"]
    if missing:
        log.warning("swift_safe_media: decode sandboxes run without part of their confinement: %s",
                    "; ".join(missing))


# -- naming a refusal ----------------------------------------------------------------------

# How the refused errno shows in messages: Python's "[Errno 3042]", strerror's
# "Unknown error 3042", FFmpeg's "Error number -3042 occurred".
_ERRNO_IN_TEXT = re.compile(r"(?:Errno |Unknown error |Error number -?)(\d{4})")
_PATH_IN_TEXT = re.compile(r"(/[^\s:'\",]+)")


def refusal(exc: BaseException) -> str | None:
    """"connect", "a file write (/x)" ...: what confinement refused, if that is why
    ``exc`` (or an exception it was raised from) happened; else None."""
    if not _applied:
        return None
    names = None
    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        numbers = []
        if isinstance(exc, OSError) and exc.errno is not None:
            numbers.append(exc.errno)
        numbers += [int(n) for n in _ERRNO_IN_TEXT.findall(str(exc))]
        for number in numbers:
            syscall = number - REFUSED_ERRNO_BASE
            if 0 <= syscall < 4096 - REFUSED_ERRNO_BASE:
                if names is None:
                    names = {n: name for name, n in syscall_numbers().items()}
                return names.get(syscall, f"syscall {syscall}")
        if isinstance(exc, PermissionError) and exc.filename is not None:
            if _applied["reads_limited"] and _unreadable_but_for_landlock(exc.filename):
                return f"a file access outside {config.READ_ROOTS} and the media handed to the decode ({exc.filename})"
            if (_writable_but_for_landlock(exc.filename) and not _handed_media(exc.filename)) or (
                    exc.filename2 is not None and _writable_but_for_landlock(exc.filename2)):
                target = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
                return f"a file write ({target})"
        elif isinstance(exc, PermissionError) and exc.errno == errno.EACCES and _applied["landlock_abi"]:
            return "a file write"  # os.mkfifo, os.mknod and others name no file
        elif _applied["reads_limited"] and "Permission denied" in str(exc):
            # A native library that opened a file by name ("Could not open input file: /x ...")
            for path in _PATH_IN_TEXT.findall(str(exc)):
                if _unreadable_but_for_landlock(path):
                    return f"a file access outside {config.READ_ROOTS} and the media handed to the decode ({path})"
        exc = exc.__cause__ or exc.__context__
    return None


def _unreadable_but_for_landlock(path) -> bool:
    path = os.fspath(path)
    if not os.access(path, os.R_OK):
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def _handed_media(path) -> bool:
    """Whether ``path`` is a file handed with the call: decoders read it, so their own
    "permission denied" on it (FFmpeg's concat demuxer refusing an unsafe entry, say) is
    theirs, not a write we refused."""
    try:
        found = os.stat(path)
    except (OSError, TypeError, ValueError):
        return False
    for fd in confine_handed.handed_fds():
        try:
            if os.path.samestat(os.fstat(fd), found):
                return True
        except OSError:
            continue
    return False


def _writable_but_for_landlock(path) -> bool:
    """access() checks the file's own permissions only, not Landlock."""
    path = os.fspath(path)
    if os.path.lexists(path) and os.access(path, os.W_OK, follow_symlinks=False):
        return True
    parent = os.path.dirname(os.path.abspath(path))
    return os.access(parent, os.W_OK)


def describe_refused() -> dict:
    """The refused syscalls and Landlock rights, as this kernel gets them (for `swift-safe-media confinement` and doctor)."""
    abi = landlock_abi()
    return {
        "syscalls": list(REFUSED_SYSCALLS) + [
            "socket/socketpair other than AF_UNIX, or SOCK_DGRAM",
            "clone with namespace flags", "clone3 (ENOSYS: glibc falls back to clone)"],
        "landlock_fs": [name for name, _, since in _FS_WRITE_RIGHTS if abi >= since] + ["execute"],
        "landlock_net": [name for name, _, since in _NET_RIGHTS if abi >= since],
        "landlock_scopes": [name for name, _, since in _SCOPES if abi >= since],
    }
