"""Functions the engine tests run inside sandboxes (module level, so they pickle by name)."""

import ctypes
import os
import signal
import subprocess
import threading
import time

import numpy as np

from swift_safe_media import call, isolated


def add(a, b):
    return a + b


def sandbox_pid():
    return os.getpid()


def process_facts():
    return {"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
            "threads": len(os.listdir("/proc/self/task")),
            "omp": os.environ.get("OMP_NUM_THREADS")}


def decode_threads():
    """The thread budget as a decode in this sandbox sees it."""
    import sys

    from swift_safe_media import config

    torch = sys.modules.get("torch")
    return {"threads": config.decoder_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.get_num_threads() if torch is not None else None}


def tagged_array(tag, n=1 << 18):
    return np.full(n, tag, dtype=np.int64), os.getpid()


def echo(value):
    return value


def raise_value_error(message):
    raise ValueError(message)


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(a)
        self.lock = threading.Lock()


def raise_unpicklable():
    raise Unpicklable("cannot cross", 2)


def hold_gil_on_locked_mutex():
    """pthread_mutex_lock on a mutex this thread already holds: blocks forever, and
    ctypes.PyDLL keeps the GIL for the whole call, so no Python code runs again."""
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed == PTHREAD_MUTEX_INITIALIZER on glibc
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def spin_holding_gil(library_path):
    ctypes.PyDLL(library_path).spin_forever()


def open_fifo(path):
    with open(path, "rb") as fifo:
        return fifo.read()


def segfault():
    ctypes.string_at(0)


def exit_with(code):
    os._exit(code)


def memory_bomb():
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


def torch_memory_bomb():
    import torch

    return torch.empty(1 << 40, dtype=torch.uint8)


def sleep_with_helper(pid_file, seconds=1000):
    """Starts a helper child that ignores SIGTERM (like ffmpeg blocked on a FIFO), then blocks."""
    helper = subprocess.Popen(["sh", "-c", f"trap '' TERM; sleep {seconds}"])
    with open(pid_file, "w") as out:
        out.write(str(helper.pid))
    time.sleep(seconds)


def fork_helper():
    """Forks a helper that ignores SIGTERM (a confined sandbox cannot exec one); returns its pid."""
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(1000)
        os._exit(0)
    return pid


def nested_call():
    return call(sandbox_pid), os.getpid()


@isolated(timeout=2)
def decorated_load(path, scale=1):
    return os.getpid(), path, scale


def rich_result():
    import torch
    from PIL import Image

    frames = np.arange(4 * 64 * 96 * 3, dtype=np.uint8).reshape(4, 64, 96, 3)
    return {
        "array": frames,
        "strided": frames.transpose(0, 3, 1, 2),
        "tensor": torch.from_numpy(frames.copy()).permute(0, 3, 1, 2),
        "bf16": torch.linspace(0, 1, 70000, dtype=torch.bfloat16),
        "images": [Image.fromarray(frame) for frame in frames],
        "gray": Image.fromarray(frames[0, :, :, 0]),
        "small": np.arange(5),
        "meta": {"fps": 29.97, "name": "clip.mp4"},
    }


def big_frames(height, width, count=32):
    return np.ones((count, height, width, 3), dtype=np.uint8)


def raise_decode_error(path):
    from swift_safe_media import MediaDecodeError

    raise MediaDecodeError(None, "no video stream")


def arena_counts():
    from swift_safe_media.engine import sandbox

    return sandbox.arena.counts()


def filled_frames(value, count=8):
    return np.full((count, 360, 640, 3), value, dtype=np.uint8)


def frames_written_in_place(value, count=8, then=None):
    """Frames made as a decode makes them: in the shared memory the result goes back
    through (``sandbox.result_buffer``). ``then``: "raise" after writing them, or "copy"
    (return a copy, leaving the written block unsent)."""
    from swift_safe_media.engine import sandbox

    shape = (count, 360, 640, 3)
    frames = np.frombuffer(sandbox.result_buffer(int(np.prod(shape))), np.uint8).reshape(shape)
    frames[:] = value
    if then == "raise":
        raise ValueError("failed after writing its frames")
    return frames.copy() if then == "copy" else frames


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def hang_on(path, hang_for):
    """Returns ``path``, unless it is ``hang_for``: then hangs holding the GIL."""
    if path == hang_for:
        hold_gil_on_locked_mutex()
    return path


def fail_on(path, fail_for):
    if path == fail_for:
        raise ValueError(f"cannot decode {path}")
    return path


_setups_run = 0


def slow_setup():
    """A sandbox setup that takes longer than the calls' timeout in the test."""
    global _setups_run
    time.sleep(1.5)
    _setups_run += 1


def setups_run():
    return _setups_run


def burn_cpu(seconds):
    """Compute for ``seconds`` of CPU time (a decode that needs that much), then return it."""
    started = time.process_time()
    while time.process_time() - started < seconds:
        pass
    return time.process_time() - started
