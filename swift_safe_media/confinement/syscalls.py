"""The seccomp filter of a confined sandbox: the system calls a decoder never needs,
refused with an errno that names them (``REFUSED_ERRNO_BASE`` + the syscall number), built
with libseccomp (:mod:`.kernel`) once per zygote. A download's sandbox gets the same filter
less what reaching the network takes (``build_seccomp_program(network=True)``); a sandbox
that runs ffmpeg, less ``execve`` (``programs=True``: Landlock limits what it may run)."""

from __future__ import annotations

import errno

from . import kernel

# Errno of a refused call: this base plus the syscall number (below 4096, so libc and
# Python still read it as an error number).
REFUSED_ERRNO_BASE = 3000

# Refused outright (the names are resolved by libseccomp for this architecture).
REFUSED_SYSCALLS = (
    # network: only the inherited socketpair to the caller is used
    "connect", "bind", "listen", "accept", "accept4",
    # other programs
    "execve", "execveat",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise",
    # changing files' metadata, which Landlock does not cover (content changes it refuses)
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr", "lremovexattr",
    "fremovexattr", "removexattrat", "utime", "utimes", "futimesat", "utimensat",
    # mounts and namespaces
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel interfaces a decoder never needs
    "bpf", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "perf_event_open",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff", "acct",
    "quotactl", "syslog", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname",
)

_AF_UNIX = 1
_SOCK_DGRAM = 2
_SOCK_TYPE_MASK = 0xF
# clone flags that create namespaces; clone3 hides its flags in memory a filter
# cannot read, so it gets ENOSYS and glibc falls back to clone.
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                          0x20000000, 0x40000000, 0x00000080)  # NEWNS CGROUP UTS IPC USER PID NET TIME


def _refused(number: int) -> int:
    return kernel.SCMP_ACT_ERRNO | (REFUSED_ERRNO_BASE + number)


def syscall_numbers() -> dict[str, int]:
    """This architecture's numbers of the refused syscalls (those it has)."""
    return kernel.syscall_numbers(REFUSED_SYSCALLS + ("socket", "socketpair", "clone", "clone3", "seccomp"))


def build_seccomp_program(network: bool = False, programs: bool = False) -> bytes:
    """The filter of every confined sandbox; with ``network``, that of a download's sandbox:
    it may also open network sockets and connect (never bind, listen or accept); with
    ``programs``, that of a sandbox that runs ffmpeg: it may exec (Landlock says what)."""
    allowed = {"connect"} if network else {"execve", "execveat"} if programs else set()
    numbers = syscall_numbers()
    with kernel.SeccompFilter(kernel.SCMP_ACT_ALLOW) as program:
        # Every thread, also those a preloaded library started (the exec fallback).
        program.set_attribute(kernel.SCMP_FLTATR_CTL_TSYNC, 1)
        # A binary search over syscall numbers rather than a list: fewer instructions run
        # on every system call (libseccomp >= 2.5; older ones keep the list).
        program.set_attribute(kernel.SCMP_FLTATR_CTL_OPTIMIZE, 2)
        for name in REFUSED_SYSCALLS:
            if name in numbers and name not in allowed:
                program.add(_refused(numbers[name]), numbers[name])
        for name in () if network else ("socket", "socketpair"):
            # Local stream sockets only: no network family, no datagram to a named socket.
            program.add(_refused(numbers[name]), numbers[name], (0, kernel.SCMP_CMP_NE, _AF_UNIX, 0))
            program.add(_refused(numbers[name]), numbers[name],
                        (1, kernel.SCMP_CMP_MASKED_EQ, _SOCK_TYPE_MASK, _SOCK_DGRAM))
        for flag in _CLONE_NAMESPACE_FLAGS:
            program.add(_refused(numbers["clone"]), numbers["clone"], (0, kernel.SCMP_CMP_MASKED_EQ, flag, flag))
        if "clone3" in numbers:
            program.add(kernel.SCMP_ACT_ERRNO | errno.ENOSYS, numbers["clone3"])
        return program.export_bpf()
