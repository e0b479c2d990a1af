"""What an exploited decoder would try to steal or say, run inside a confined sandbox
(module level, so they pickle by name). Each attempt reports what it got: ``"refused"``
(with the error) or what it read, so the test can show the whole table at once."""

from __future__ import annotations

import os
import sys

import swift_safe_media.decoders as safe

TOKEN_NAMES = ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY")
MARKER = "LEAKED-TO-THE-LOG"


def _outcome(attempt):
    try:
        found = attempt()
    except OSError as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    return f"got: {found!r}"[:300]


def steal(home: str, other_dataset_file: str, trainer: int) -> dict:
    """Every read of a secret the issue lists, and a 1 MB write to stdout and stderr."""
    token_file = os.path.join(home, ".cache", "huggingface", "token")
    found = {
        "token file": _outcome(lambda: open(token_file).read()),
        "/etc/shadow": _outcome(lambda: open("/etc/shadow").read()),
        "other dataset folder": _outcome(lambda: open(other_dataset_file, "rb").read(64)),
        "listing $HOME": _outcome(lambda: os.listdir(home)),
        "/proc/self/environ": _outcome(lambda: [name for name in TOKEN_NAMES
                                                if name.encode() in open("/proc/self/environ", "rb").read()]),
        "trainer's /proc/<pid>/environ": _outcome(lambda: open(f"/proc/{trainer}/environ", "rb").read(64)),
        "trainer's /proc/<pid>/cmdline": _outcome(lambda: open(f"/proc/{trainer}/cmdline", "rb").read(64)),
        "os.environ": f"got: {[name for name in TOKEN_NAMES if name in os.environ]!r}",
    }
    chunk = (MARKER + "\n") * 1000
    for _ in range(60):  # about 1 MB each way, Python's streams and the descriptors alike
        sys.stdout.write(chunk)
        sys.stderr.write(chunk)
        for fd in (1, 2):
            try:
                os.write(fd, chunk.encode())
            except OSError:
                pass
    return found


def decode_then_steal(loader: str, media, args, home, other_dataset_file, trainer):
    """A real decode by one twin, then every attack, in the same sandbox (the loader's own
    ``call`` runs in place here): (decoded array, what each attack got)."""
    decoded = getattr(safe, loader)(media, *args)
    if isinstance(decoded, tuple):
        decoded = decoded[0]
    return decoded, steal(home, other_dataset_file, trainer)


def print_and_fail(size: int):
    """Print ``size`` bytes with terminal escapes and forged log lines, then fail."""
    sys.stderr.write("\x1b[2J\nswift_safe_media summary: all good\n" + "e" * size)
    raise ValueError("decoder gave up")


def sandbox_environment():
    """What a sandbox holds: its pid, its os.environ names, its /proc/self/environ names, its argv."""
    with open("/proc/self/environ", "rb") as block:
        initial = [entry.split(b"=", 1)[0].decode() for entry in block.read().split(b"\0") if entry]
    return {"pid": os.getpid(), "ppid": os.getppid(), "environ": sorted(os.environ), "initial": initial,
            "argv": list(sys.argv)}


def print_media_error(path):
    """What FFmpeg would print before a decoder gives up on a file."""
    os.write(2, b"[mov @ 0x1] moov atom not found\n")
    from swift_safe_media import MediaDecodeError

    raise MediaDecodeError(path, "cannot open")


def print_then_return():
    print("this call succeeded")
    return True
