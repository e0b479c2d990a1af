import os
import subprocess
import time

import pytest

import swift_safe_media

from .fresh import is_ours as _ours


@pytest.fixture(autouse=True)
def settings_of_this_test_only():
    """The package's settings live in the environment (``enable()`` and ``config.write``
    put them there for child processes): what a test sets there is undone after it, so that
    no test runs with a registry or a timeout an earlier test left, whichever tests share
    its pytest process (`make test` runs files in two)."""
    before = {name: value for name, value in os.environ.items() if _ours(name)}
    yield
    for name in [name for name in os.environ if _ours(name)]:
        if name not in before:
            del os.environ[name]
    os.environ.update(before)


@pytest.fixture
def fresh_engine():
    """A new zygote and sandbox for a test that changes settings read at start-up."""
    swift_safe_media.shutdown()
    yield
    swift_safe_media.shutdown()


@pytest.fixture
def readable(monkeypatch):
    """``readable(folder, ...)``: confined sandboxes may read these folders too (a test of
    hangs that opens a FIFO or loads a library by name, which confinement would refuse
    first); the engine restarts (the zygote builds its read rules as it starts) before the
    test goes on."""

    def allow(*folders):
        monkeypatch.setenv("SWIFT_SAFE_MEDIA_READ_ROOTS", os.pathsep.join(str(folder) for folder in folders))
        swift_safe_media.shutdown()
        swift_safe_media.call(os.getpid)  # started again before the test times anything

    yield allow
    swift_safe_media.shutdown()


@pytest.fixture(scope="session")
def spin_library(tmp_path_factory):
    """A native busy loop; called through ctypes.PyDLL it spins while holding the GIL."""
    folder = tmp_path_factory.mktemp("native")
    source = folder / "spin.c"
    source.write_text("void spin_forever(void) { volatile unsigned long n = 0; for (;;) n++; }\n")
    library = folder / "libspin.so"
    subprocess.run(["cc", "-O0", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return str(library)


@pytest.fixture
def fifo(tmp_path, readable):
    """A FIFO no one writes to: opening it hangs. Its folder is readable to confined
    sandboxes, which would otherwise refuse the open before it could hang."""
    readable(tmp_path)
    path = tmp_path / "clip.wav"
    os.mkfifo(path)
    return str(path)


def process_state(pid: int):
    """'R', 'S', ... for a live process, 'Z' for a zombie, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def wait_until_dead(pids, within: float) -> dict:
    """Return the pids still running (not gone, not a zombie) after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = {pid: process_state(pid) for pid in pids}
        alive = {pid: state for pid, state in alive.items() if state not in (None, "Z", "X")}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found
