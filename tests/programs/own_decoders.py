"""A user's own training script that decodes with the media libraries themselves (decord,
PyAV, OpenCV, torchcodec, imageio, moviepy) in a DataLoader with 2 workers.

``python -m tests.programs.own_decoders MEDIA_DIR protect|stock CASE...`` prints one JSON
line per case: ``{"case", "items", "errors", "seconds"}``, where ``items`` are the samples'
checksums in order (-1 where the dataset skipped a sample on ``MediaDecodeError``) and
``errors`` what was caught. ``protect`` calls ``swift_safe_media.enable(timeout=TIMEOUT)``
first; ``stock`` does not (its DataLoaders get a ``timeout``, so a hang ends as torch's
error). The bad files in MEDIA_DIR hang their decoder (an HLS playlist whose segment is a
FIFO, a FIFO posing as a file); the valid ones are other projects' public test assets.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

PROTECT = sys.argv[2] == "protect"
TIMEOUT = 5.0  # generous: a valid decode on a busy 2-core machine (ffmpeg programs included) fits
# moviepy probes and reads through ffmpeg programs, whose wait for a CPU a worker's clock does not count.
SLOW_TIMEOUT = {"moviepy": 15.0}
STOCK_TIMEOUT = 6  # DataLoader(timeout=) in stock: a hang ends as torch's error
if PROTECT:
    import swift_safe_media

    swift_safe_media.enable(timeout=TIMEOUT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info  # noqa: E402

MEDIA = sys.argv[1]
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
VIDEOS = [os.path.join(DATA, name) for name in ("nasa_13013_rotated.mp4", "h265_video.mp4")]
AUDIO = [os.path.join(DATA, name) for name in ("bell.oga", "lame.mp3")]
HLS = os.path.join(MEDIA, "playlist.mp4")  # its segment is a FIFO with no writer
FIFO_VIDEO = os.path.join(MEDIA, "fifo.mp4")
FIFO_AUDIO = os.path.join(MEDIA, "fifo.wav")


def checksum(array) -> int:
    return zlib.crc32(np.ascontiguousarray(array).tobytes())


def read_decord(path):
    import decord

    return decord.VideoReader(path).get_batch([0, 1]).asnumpy()


def read_av(path):
    import av

    with av.open(path) as container:
        frames = [frame.to_ndarray() for frame, _ in zip(container.decode(audio=0), range(3))]
    return np.concatenate(frames, axis=-1)


def read_cv2(path):
    import cv2

    capture = cv2.VideoCapture(path)
    ok, frame = capture.read()
    capture.release()
    if not ok:
        raise ValueError(f"OpenCV read no frame of {path}")
    return frame


def read_torchcodec(path):
    from torchcodec.decoders import VideoDecoder

    return VideoDecoder(path).get_frames_at([0, 1]).data.numpy()


def read_imageio(path):
    import imageio.v3 as iio

    return iio.imread(path, index=0, plugin="pyav")


def read_moviepy(path):
    from moviepy.video.io.VideoFileClip import VideoFileClip

    clip = VideoFileClip(path, audio=False)
    try:
        return clip.get_frame(0)
    finally:
        clip.close()


def read_holding_gil(path):
    """decord, as read_decord; the file MEDIA/gil.mp4 (a valid clip) then hangs the worker
    in a native call that keeps the GIL."""
    from tests.sandboxed import hold_gil_on_locked_mutex

    frames = read_decord(path)
    if os.path.basename(path) == "gil.mp4":
        hold_gil_on_locked_mutex()
    return frames


READERS = {"decord": read_decord, "av": read_av, "cv2": read_cv2, "torchcodec": read_torchcodec,
           "imageio": read_imageio, "moviepy": read_moviepy, "gil": read_holding_gil}
BAD = {"decord": HLS, "av": FIFO_AUDIO, "cv2": FIFO_VIDEO, "torchcodec": HLS, "imageio": FIFO_VIDEO,
       "moviepy": FIFO_VIDEO, "gil": os.path.join(MEDIA, "gil.mp4")}


class Clips(Dataset):
    """The user's dataset: a sample whose decode fails is skipped (-1), as docs/engine.md shows."""

    def __init__(self, reader, files):
        self.reader, self.files, self.errors = reader, files, []

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        try:
            return checksum(READERS[self.reader](self.files[index]))
        except Exception as error:  # noqa: BLE001 -- the user's choice: MediaDecodeError and the libraries' own
            print(json.dumps({"skipped": index, "type": type(error).__name__, "error": str(error)[:400]}),
                  flush=True)
            return -1


class Unskipped(Clips):
    def __getitem__(self, index):
        return checksum(READERS[self.reader](self.files[index]))


class Stream(IterableDataset):
    """Each worker decodes its half of the files in turn."""

    def __init__(self, files):
        self.files = files

    def __iter__(self):
        info = get_worker_info()
        for index in range(info.id, len(self.files), info.num_workers):
            yield checksum(read_decord(self.files[index]))


def files_for(reader: str) -> list[str]:
    valid = AUDIO if reader == "av" else VIDEOS
    return [valid[0], valid[1], BAD[reader], valid[0], valid[1], valid[0]]


def loader(dataset, hangs: bool = True, **options):
    if hangs and not PROTECT:
        options.setdefault("timeout", STOCK_TIMEOUT)
    return DataLoader(dataset, num_workers=2, **options)


def run(case: str) -> dict:
    items, errors = [], []
    if case in READERS:
        if PROTECT and case in SLOW_TIMEOUT:  # its valid decodes wait on ffmpeg programs, slow on a busy machine
            import swift_safe_media

            swift_safe_media.enable(timeout=SLOW_TIMEOUT[case])
        try:
            items = [int(x) for batch in loader(Clips(case, files_for(case)), batch_size=2) for x in batch]
        finally:
            if PROTECT and case in SLOW_TIMEOUT:
                swift_safe_media.enable(timeout=TIMEOUT)
    elif case == "valid":  # every reader on valid files only: stock's checksums
        for reader in READERS:
            if reader != "gil":
                valid = AUDIO if reader == "av" else VIDEOS
                items += [int(x) for batch in loader(Clips(reader, valid * 2), False, batch_size=2) for x in batch]
    elif case == "skip_wrapper":
        from swift_safe_media import skip_bad_samples

        dataset = skip_bad_samples(Unskipped("decord", files_for("decord")))
        items = [int(x) for batch in loader(dataset, batch_size=2) for x in batch]
    elif case == "fork":
        dataset = Clips("decord", files_for("decord"))
        items = [int(x) for batch in loader(dataset, batch_size=2, multiprocessing_context="fork") for x in batch]
    elif case == "stream":
        batches = iter(loader(Stream([VIDEOS[0], HLS, VIDEOS[1], VIDEOS[0], VIDEOS[0], VIDEOS[1]]), batch_size=None))
        while True:
            try:
                items.append(int(next(batches)))
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001 -- what reaches the training loop
                errors.append(f"{type(error).__name__}: {error}")
    elif case == "two_epochs":  # with a quarantine registry: the second epoch refuses the file at once
        import swift_safe_media

        swift_safe_media.enable(timeout=TIMEOUT, quarantine=os.path.join(MEDIA, "registry", "quarantine.jsonl"))
        batches = loader(Clips("decord", files_for("decord")), batch_size=2)
        for epoch in range(2):
            started = time.monotonic()
            items.append([int(x) for batch in batches for x in batch])
            errors.append(round(time.monotonic() - started, 2))
    elif case == "raised":  # no skipping in the dataset: what reaches the training loop
        try:
            for batch in loader(Unskipped("decord", files_for("decord")), batch_size=2):
                items += [int(x) for x in batch]
        except Exception as error:  # noqa: BLE001 -- the training loop's view
            errors.append({"type": type(error).__name__, "path": getattr(error, "path", None),
                           "runtime_error": isinstance(error, RuntimeError),
                           "notes": "\n".join(getattr(error, "__notes__", []))[:2000]})
    elif case == "in_trainer":
        items = [int(x) for batch in DataLoader(Clips("decord", VIDEOS), batch_size=2) for x in batch]
    return {"case": case, "items": items, "errors": errors}


if __name__ == "__main__":
    for name in sys.argv[3:]:
        started = time.monotonic()
        try:
            result = run(name)
        except Exception as error:  # noqa: BLE001 -- reported, the next case runs
            result = {"case": name, "items": None, "errors": [f"{type(error).__name__}: {str(error)[-600:]}"]}
        result["seconds"] = round(time.monotonic() - started, 2)
        print(json.dumps(result), flush=True)
