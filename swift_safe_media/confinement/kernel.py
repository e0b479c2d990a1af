"""The kernel's confinement interfaces, through ctypes: libseccomp (resolving syscall
names, building and exporting a filter), the Landlock system calls, and the prctl and
seccomp calls that install them. No policy here: what is refused is
:mod:`swift_safe_media.confinement.policy`'s to say."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os

# Newer than some libseccomp releases know (Linux 6.13); one number on every
# architecture since the syscall table was unified.
NEWER_SYSCALLS = {"setxattrat": 463, "removexattrat": 466}

# libseccomp (seccomp.h)
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000
SCMP_FLTATR_CTL_TSYNC = 4
SCMP_FLTATR_CTL_OPTIMIZE = 8
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
# kernel ABI
PR_SET_NO_NEW_PRIVS = 38
PR_GET_SECCOMP = 21
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock file-system rights every ABI has.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE = 1 << 14
# The rights a rule on one file (not a folder) may carry.
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE
RULESET_ATTR_SIZE = {1: 8, 2: 8, 3: 8, 4: 16, 5: 16}  # ABI 6 and later: 24


class ArgCompare(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


libc = ctypes.CDLL(None, use_errno=True)
_libseccomp = None


def seccomp_library():
    global _libseccomp
    if _libseccomp is None:
        name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
        lib = ctypes.CDLL(name, use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                               ctypes.c_uint, ctypes.POINTER(ArgCompare)]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        _libseccomp = lib
    return _libseccomp


def syscall_numbers(names) -> dict[str, int]:
    """This architecture's numbers of ``names`` (those it has)."""
    lib = seccomp_library()
    found = {}
    for name in names:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number >= 0:  # negative: a pseudo number, the call does not exist here
            found[name] = number
        elif name in NEWER_SYSCALLS and os.uname().machine in ("x86_64", "aarch64"):
            found[name] = NEWER_SYSCALLS[name]
    return found


def syscall(number, *args) -> int:
    result = libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


# -- what this kernel has ------------------------------------------------------------------

def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock."""
    result = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                          ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(result, 0)


def seccomp_available() -> str | None:
    """None when seccomp filters can be used here, else why not."""
    try:
        seccomp_library()
    except OSError as exc:
        return f"libseccomp not found ({exc})"
    if libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        return "the kernel has no seccomp"
    return None


# -- building ---------------------------------------------------------------------------------

class SeccompFilter:
    """A libseccomp filter context: rules added one by one, then exported as the BPF
    program the kernel takes."""

    def __init__(self, default_action: int):
        self.lib = seccomp_library()
        self.ctx = self.lib.seccomp_init(default_action)
        if not self.ctx:
            raise OSError(errno.ENOMEM, "seccomp_init failed")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.lib.seccomp_release(self.ctx)

    def set_attribute(self, attribute: int, value: int) -> None:
        self.lib.seccomp_attr_set(self.ctx, attribute, value)

    def add(self, action: int, number: int, *compares) -> None:
        """A rule: ``action`` for syscall ``number`` when every (arg, op, a, b) compare holds."""
        array = (ArgCompare * max(len(compares), 1))(*[ArgCompare(*c) for c in compares])
        rc = self.lib.seccomp_rule_add_array(self.ctx, action, number, len(compares), array)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for syscall {number}: {os.strerror(-rc)}")

    def export_bpf(self) -> bytes:
        # Through a pipe, not a file: a file-size limit (`ulimit -f`) would cut a file short
        # and leave a program the kernel refuses. A program is a few KiB; the pipe holds 1 MiB.
        read_end, write_end = os.pipe()
        try:
            try:
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass
            rc = self.lib.seccomp_export_bpf(self.ctx, write_end)
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            os.close(write_end)
            write_end = -1
            chunks = []
            while chunk := os.read(read_end, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            for end in (read_end, write_end):
                if end >= 0:
                    os.close(end)


def filter_program(program: bytes) -> tuple:
    """A filter as the kernel takes it, and the buffer that holds it (keep both)."""
    buffer = ctypes.create_string_buffer(program, len(program))
    return buffer, SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))


def create_landlock_ruleset(abi: int, handled_fs: int, handled_net: int, scoped: int) -> int:
    attr = (ctypes.c_uint64 * 3)(handled_fs, handled_net, scoped)
    return syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(RULESET_ATTR_SIZE.get(abi, 24)),
                   ctypes.c_uint32(0))


def open_rule_path(path: str, rights: int, folder: bool | None = None):
    """A rule allowing ``rights`` beneath ``path`` (a file takes file rights only): the
    path opened here (``O_PATH``) and the rule as the kernel takes it, so that a process
    forked later adds it with one system call; None if the path does not exist. The
    descriptor is the rule's ``parent_fd``: close it once the rule is added."""
    try:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    if not (os.path.isdir(path) if folder is None else folder):
        rights &= FILE_RIGHTS
    return _PathBeneath(rights, target)


def file_rule(fd: int, rights: int):
    """A rule allowing ``rights`` on the one file open as ``fd`` (a copy of it is the
    rule's ``parent_fd``: close that once the rule is added)."""
    return _PathBeneath(rights & FILE_RIGHTS, os.dup(fd))


# -- installing (in the process to confine) ------------------------------------------------

def set_no_new_privs() -> None:
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"PR_SET_NO_NEW_PRIVS: {os.strerror(err)}")


_ADD_RULE = (ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH))


def restrict_self(abi: int, handled_fs: int, handled_net: int, scoped: int, rules) -> None:
    """Build a ruleset from ``rules`` (made by :func:`open_rule_path`) and restrict this
    thread (and the threads it starts) to it."""
    ruleset = create_landlock_ruleset(abi, handled_fs, handled_net, scoped)
    try:
        number, kind = _ADD_RULE
        ruleset_arg, flags = ctypes.c_int(ruleset), ctypes.c_uint32(0)
        for rule in rules:
            if libc.syscall(number, ruleset_arg, kind, ctypes.byref(rule), flags) < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"landlock_add_rule: {os.strerror(err)}")
        syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset_arg, flags)
    finally:
        os.close(ruleset)


def install_seccomp_filter(seccomp_number: int, fprog: SockFprog, flags: int = SECCOMP_FILTER_FLAG_TSYNC) -> int:
    """Install ``fprog`` on every thread; what the kernel returns (a listener, with its flag)."""
    return syscall(seccomp_number, ctypes.c_uint(SECCOMP_SET_MODE_FILTER), ctypes.c_uint(flags), ctypes.byref(fprog))
