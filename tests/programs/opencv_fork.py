"""A user's training script that uses OpenCV in the trainer while its DataLoader's workers
read video with OpenCV too (issue 43, item 4: the futex deadlock of OpenCV in forked workers).

``python -m tests.programs.opencv_fork CLIP STREAM``. Before the DataLoader starts, a thread
of the trainer opens STREAM with ``cv2.VideoCapture``: a live stream that does not answer
(here a FIFO nobody writes), so the thread waits inside OpenCV's FFmpeg open, holding what
OpenCV holds there. Then a DataLoader with 2 workers (the platform's default start method,
``fork`` on Linux before Python 3.14, as stock) reads frames of CLIP with ``cv2.VideoCapture``
in each sample. ``PROTECT=1`` calls ``swift_safe_media.enable()`` first.

It prints (each line one write): ``WORKER pid ppid parent's-command`` from each worker as it
starts; then ``FRAMES n crc`` (the samples' checksum) and ``TRAINER pid``, or, when the
DataLoader's ``timeout`` (TIMEOUT seconds) ends the loop, ``STUCK pid syscall`` for each worker
(``/proc/PID/syscall``: the number of the call it is blocked in, 202 a futex on x86-64) and
``TIMED OUT``. It leaves with ``os._exit``: the stuck workers are the caller's to end.
"""

import os
import sys
import threading
import time
import zlib

import cv2
from torch.utils.data import DataLoader, Dataset

import swift_safe_media

SAMPLES = 8


def say(*words) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


def frames(path: str) -> list:
    capture = cv2.VideoCapture(path)
    read = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        read.append(frame)
    capture.release()
    return read


class Clip(Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return zlib.crc32(frames(self.path)[index * 5].tobytes())


def announce(worker_id):
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
        command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    with open(f"/proc/{parent}/comm") as comm:
        command = f"{comm.read().strip()} {command}"  # a warm forkserver forked from the trainer is named
    say("WORKER", os.getpid(), parent, command.replace(" ", "_")[:300])


def open_stream(url: str, opened: threading.Event) -> None:
    opened.set()
    try:
        cv2.VideoCapture(url)  # waits for the stream
    except Exception as exc:  # (bounded, it may fail: the thread only has to hold OpenCV a while)
        say("STREAM", type(exc).__name__)


def main():
    clip, stream = sys.argv[1], sys.argv[2]
    if os.environ.get("PROTECT") == "1":
        swift_safe_media.enable(timeout=30)
    opened = threading.Event()
    threading.Thread(target=open_stream, args=(stream, opened), daemon=True).start()
    opened.wait()
    time.sleep(1)  # well inside OpenCV's open by now
    loader = DataLoader(Clip(clip), batch_size=2, num_workers=2, worker_init_fn=announce,
                        timeout=float(os.environ["TIMEOUT"]))
    batches = iter(loader)
    sums = []
    try:
        for batch in batches:
            sums += batch.tolist()
    except RuntimeError as exc:  # the DataLoader's own timeout
        for pid in [worker.pid for worker in batches._workers]:
            try:
                with open(f"/proc/{pid}/syscall") as syscall:
                    say("STUCK", pid, syscall.read().split()[0])
            except OSError as missing:
                say("STUCK", pid, type(missing).__name__)
        say("TIMED OUT", exc)
        os._exit(0)
    say("FRAMES", len(sums), zlib.crc32(repr(sums).encode()))
    say("TRAINER", os.getpid())
    os._exit(0)  # the stream's thread still waits in OpenCV


if __name__ == "__main__":
    main()
