"""A quarantine-registry writer posing as one host of a cluster whose filesystem refuses
``flock``. Run by test_quarantine in its own UTS and PID namespaces (``unshare``), so it
has its own hostname and is pid 1 like every other writer:

    python -m tests.registry_writer REGISTRY HOSTNAME FILE_LIST GO_FILE ROUNDS

It sets the hostname, installs a seccomp filter under which the kernel answers every
``flock(2)`` with ENOLCK (what Lustre without ``-o flock`` or NFS without lockd answer),
checks that ``flock`` really fails, says "ready", waits for GO_FILE, then records every
file in FILE_LIST ROUNDS times.
"""

import ctypes
import errno
import fcntl
import os
import platform
import socket
import sys
import time

# (audit arch, flock syscall number) per machine
_FLOCK_SYSCALL = {"x86_64": (0xC000003E, 73), "aarch64": (0xC00000B7, 32)}
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def refuse_flock() -> None:
    """From now on flock(2) returns ENOLCK in this process, from the kernel itself."""
    arch, number = _FLOCK_SYSCALL[platform.machine()]
    code = [(_LD_W_ABS, 0, 0, 4),        # seccomp_data.arch
            (_JEQ_K, 0, 3, arch),        # another ABI: allow
            (_LD_W_ABS, 0, 0, 0),        # seccomp_data.nr
            (_JEQ_K, 0, 1, number),
            (_RET_K, 0, 0, _RET_ERRNO | errno.ENOLCK),
            (_RET_K, 0, 0, _RET_ALLOW)]
    instructions = (_Instruction * len(code))(*[_Instruction(*op) for op in code])
    program = _Program(len(code), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                                                  ctypes.byref(program), 0, 0):
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")


def flock_refused(folder: str) -> bool:
    probe = os.path.join(folder, f"probe-{socket.gethostname()}-{os.urandom(4).hex()}")
    with open(probe, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:
            return exc.errno == errno.ENOLCK
        finally:
            os.unlink(probe)
    return False


def main(registry_path, hostname, file_list, go_file, rounds) -> None:
    socket.sethostname(hostname)  # our own UTS namespace: other writers keep theirs
    refuse_flock()
    if not flock_refused(os.path.dirname(go_file)):
        sys.exit("flock still works here")
    from swift_safe_media.records.quarantine import Registry

    print(f"ready {socket.gethostname()} pid {os.getpid()}", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.005)
    registry = Registry(registry_path)
    files = open(file_list).read().split()
    for round_ in range(int(rounds)):
        for path in files:
            registry.record(path, "error", f"{hostname} round {round_} " + "x" * 300, 0.5)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
