"""Pre-flight scan: decode every media item of a dataset through the safe loaders and
report the files that fail, before a run spends GPU hours finding them.

Targets: an ms-swift dataset file (``.jsonl``, ``.json``, ``.csv`` with ``audios`` /
``videos`` / ``images`` columns, or messages whose content names media), a LeRobot
dataset root, or any directory. Decodes run in parallel: ``workers`` threads, each
served by its own sandbox, so a file that hangs costs its timeout and nothing more.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass

from .. import config
from ..confinement import handed
from ..errors import MediaDecodeError

AUDIO_SUFFIXES = {".wav", ".mp3", ".flac", ".ogg", ".opus", ".m4a", ".aac", ".wma"}
VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".ts", ".flv", ".mpg", ".mpeg"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
COLUMNS = {"audios": "audio", "videos": "video", "images": "image"}
TAGS = {"<audio>": "audio", "<video>": "video", "<image>": "image"}
VIDEO_FRAMES = 8  # evenly spaced, first and last included: where lying containers hang


@dataclass
class Item:
    path: str
    kind: str


@dataclass
class Problem:
    path: str
    kind: str
    problem: str
    elapsed: float


def kind_of(path: str) -> str | None:
    suffix = os.path.splitext(path)[1].lower()
    for kind, suffixes in (("audio", AUDIO_SUFFIXES), ("video", VIDEO_SUFFIXES), ("image", IMAGE_SUFFIXES)):
        if suffix in suffixes:
            return kind
    return None


def collect(target: str) -> list[Item]:
    """Media items named by a dataset file, or found under a directory."""
    if os.path.isdir(target):
        return _walk(target)
    base = os.path.dirname(os.path.abspath(target))
    items = []
    for row in _rows(target):
        for column, kind in COLUMNS.items():
            for value in _as_list(row.get(column)):
                if isinstance(value, str) and value:
                    items.append(Item(_resolve(value, base), kind))
    return _unique(items)


def _walk(root: str) -> list[Item]:
    items = []
    for folder, subfolders, names in os.walk(root):
        # A directory named like media is reported as a problem, not descended into.
        for name in sorted(names) + [name for name in subfolders if kind_of(name)]:
            kind = kind_of(name)
            if kind is not None:
                items.append(Item(os.path.join(folder, name), kind))
        subfolders[:] = [name for name in subfolders if not kind_of(name)]
    return sorted(items, key=lambda item: item.path)


def _rows(path: str):
    suffix = os.path.splitext(path)[1].lower()
    with open(path, newline="", encoding="utf-8") as data:
        if suffix == ".jsonl":
            for line in data:
                if line.strip():
                    yield json.loads(line)
        elif suffix == ".json":
            loaded = json.load(data)
            yield from (loaded if isinstance(loaded, list) else [loaded])
        elif suffix == ".csv":
            for row in csv.DictReader(data):
                yield {key: _csv_cell(value) for key, value in row.items()}
        else:
            raise ValueError(f"{path}: not a dataset file (.jsonl, .json, .csv) or a directory")


def _csv_cell(value):
    text = (value or "").strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def _as_list(value):
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _resolve(value: str, base: str) -> str:
    if "://" in value or value.startswith("data:") or os.path.isabs(value):
        return value
    root = os.environ.get("ROOT_IMAGE_DIR")
    candidate = os.path.join(root, value) if root else value
    return candidate if os.path.exists(candidate) else os.path.join(base, value)


def _unique(items):
    seen, unique = set(), []
    for item in items:
        if (item.path, item.kind) not in seen:
            seen.add((item.path, item.kind))
            unique.append(item)
    return unique


def not_regular(path: str) -> str | None:
    """Why a path is no file to decode (FIFO, directory, missing), or None."""
    if "://" in path or path.startswith("data:"):
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot stat: {exc.strerror}"
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"not a regular file ({name})"
    return "not a regular file"


def decode_item(item: Item) -> None:
    """Decode through the same safe loaders training uses; raises on a bad item."""
    from ..decoders import load_audio, load_vllm_video

    if item.kind == "audio":
        load_audio(item.path, 16000)
    elif item.kind == "video":
        load_vllm_video(item.path, VIDEO_FRAMES)
    else:
        from .. import call

        call(_decode_image, item.path)


def _decode_image(path: str):
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.size


def decode_and_discard(item: Item) -> None:
    """Runs in the sandbox: a scan needs to know that an item decodes, not its pixels, so
    none travel back (the loaders' own sandbox calls run in place here)."""
    decode_item(item)


def scan_one(item: Item, check=decode_and_discard) -> Problem | None:
    """Check one item in this process's sandbox pool: None if it decodes, else its Problem.
    ``check`` is a module-level function run in the sandbox on the item."""
    from .. import call

    started = time.monotonic()
    reason = not_regular(item.path)
    if reason is None:
        try:
            # The file goes along open: a confined sandbox reads nothing else by name (handed).
            call(check, Item(handed.hand(item.path), item.kind), path=item.path)
            return None
        except MediaDecodeError as exc:
            reason = f"{type(exc).__name__}: {exc.reason}"
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return Problem(item.path, item.kind, reason, time.monotonic() - started)


def scan(items: list[Item], workers: int, progress=None, check=decode_and_discard) -> tuple[list[Problem], float]:
    """Decode all items with ``workers`` sandboxes; returns the problems and the wall time.
    ``progress(done, total, problems, elapsed)`` is called as items finish."""
    config.put(config.SANDBOXES, max(workers, config.max_sandboxes()))
    problems, started = [], time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(scan_one, item, check) for item in items]
        for done, future in enumerate(as_completed(futures), 1):
            problem = future.result()
            if problem is not None:
                problems.append(problem)
            if progress is not None:
                progress(done, len(items), len(problems), time.monotonic() - started)
    return sorted(problems, key=lambda problem: problem.path), time.monotonic() - started


class ProgressBar:
    """The scan's progress bar on stderr (tqdm): items done, rate, ETA, problems so far.
    Called as ``progress(done, total, problems, elapsed)`` by local and Ray scans alike."""

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="item", file=stream or sys.stderr, dynamic_ncols=True,
                        mininterval=0.2, smoothing=0.1)
        self.bar.set_postfix_str("problems: 0", refresh=False)

    def __call__(self, done: int, total: int, problems: int, elapsed: float) -> None:
        self.bar.set_postfix_str(f"problems: {problems}", refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def format_table(problems: list[Problem]) -> str:
    if not problems:
        return "no problems found"
    rows = [("file", "kind", "problem", "elapsed")] + [
        (p.path, p.kind, p.problem, f"{p.elapsed:.2f} s") for p in problems]
    widths = [min(max(len(row[i]) for row in rows), 100) for i in range(3)]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(cell[:100].ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3])
        if index == 0:
            lines.append("  ".join("-" * width for width in widths) + "  -------")
    return "\n".join(lines)


def report(items, problems, elapsed, workers, timeout) -> dict:
    return {"scanned": len(items), "problems": [asdict(problem) for problem in problems],
            "problem_count": len(problems), "elapsed_s": round(elapsed, 3),
            "items_per_s": round(len(items) / elapsed, 3) if elapsed > 0 else None,
            "workers": workers, "timeout_s": timeout}
