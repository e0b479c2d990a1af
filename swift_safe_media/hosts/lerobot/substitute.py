"""Skip-and-substitute for LeRobot's datasets: a sample whose video fails to decode
(error, timeout, crash) is replaced by another, and one warning names the episode,
camera key, file and reason of every file that failed on the way.

- ``LeRobotDataset.__getitem__`` (so ``MultiLeRobotDataset`` too, which reads its
  datasets' items): another sample, chosen deterministically from the index, the same on
  every rank and run, so batch counts stay equal across ranks.
- ``StreamingLeRobotDataset.make_frame``: the next frame of the same shard stands in (a
  stream has no index to draw from).

Files that failed are remembered per process (an in-memory quarantine registry), so
later samples from them are substituted at once instead of paying a timeout again;
:mod:`swift_safe_media.records.budget` stops the run when too much fails.
"""

from __future__ import annotations

import logging
import random

from ...engine import calls as engine
from ...records.budget import ErrorBudgetExceeded, process_budget
from ...errors import FILE, MediaDecodeError
from .decode import failed_files

log = logging.getLogger("swift_safe_media")

# An exception raised by a patched decode carries the video's path under this name.
VIDEO_ATTRIBUTE = engine.FAILED_PATH


class _Failures:
    """The failed candidates of one sample, each failed file named once: a file that only
    ever fails as a substitute is named as surely as the sample's own."""

    def __init__(self):
        self.first_by_path: dict[str, str] = {}  # path: the first failure's description
        self.more_by_path: dict[str, int] = {}  # path: further candidates that failed on it

    def __bool__(self):
        return bool(self.first_by_path)

    def add(self, path: str, failure: str) -> None:
        if path in self.first_by_path:
            self.more_by_path[path] = self.more_by_path.get(path, 0) + 1
        else:
            self.first_by_path[path] = failure

    def named(self) -> str:
        def more(path):
            count = self.more_by_path.get(path, 0)
            return f" (and {count} more sample{'s' if count > 1 else ''} of this file)" if count else ""

        return "; ".join(failure + more(path) for path, failure in self.first_by_path.items())

    def count(self, path: str, failure: str, budget) -> None:
        """Add one failed candidate; when the budget is exhausted, name every failure first."""
        self.add(path, failure)
        try:
            budget.failure(failure)
        except ErrorBudgetExceeded:
            # The budget's error names the last failure: the others are named here.
            log.warning("swift_safe_media: %s; no substitute for this sample", self.named())
            raise

    def substituted(self, idx, candidate) -> None:
        if self:
            log.warning("swift_safe_media: %s; sample %s substituted by sample %s", self.named(), idx, candidate)


def _failed_path(exc: Exception) -> str | None:
    """The video a failure is pinned on, recorded as failed here; None: not a decode failure."""
    path = getattr(exc, VIDEO_ATTRIBUTE, None)
    if path is not None and isinstance(exc, MediaDecodeError) and exc.fault == FILE \
            and failed_files().lookup(path) is None:  # a machine fault is no reason to avoid the file
        failed_files().record(path, "error", describe(exc), exc.elapsed, ambiguous=exc.ambiguous)
    return path


# -- map-style: LeRobotDataset.__getitem__ -------------------------------------------------
def getitem_or_substitute(stock_getitem, dataset, idx):
    """Return ``dataset[idx]``, or, if its video cannot be decoded, another sample."""
    if isinstance(idx, slice):  # LeRobot 0.6 reads a slice item by item, through this method
        return stock_getitem(dataset, idx)
    budget = process_budget()
    failed = failed_files()
    failures = _Failures()
    for candidate in _candidates(dataset, idx):
        known_bad = _known_bad_video(dataset, candidate, failed) if len(failed) else None
        if known_bad is None:
            try:
                item = stock_getitem(dataset, candidate)
            except Exception as exc:
                path = _failed_path(exc)
                if path is None:
                    raise
                failure = _describe_sample(dataset, candidate, path, describe(exc))
            else:
                budget.success()
                failures.substituted(idx, candidate)
                return item
        else:
            path, entry = known_bad
            failure = _describe_sample(dataset, candidate, path, f"file failed earlier: {entry['reason']}")
        failures.count(path, failure, budget)


def _candidates(dataset, idx):
    """``idx``, then other indices in a fixed order drawn from ``idx`` (the same on every
    rank and run, spread over the dataset rather than the bad sample's neighbours)."""
    yield idx
    size = len(dataset)
    draw = random.Random(idx)
    while True:
        candidate = draw.randrange(size)
        if candidate != idx or size == 1:
            yield candidate


def _videos_of(dataset, idx) -> tuple[int, dict[str, str]]:
    """The episode of sample ``idx`` and its video file per camera key."""
    episode = int(dataset.hf_dataset[idx]["episode_index"])
    return episode, {key: str(dataset.root / dataset.meta.get_video_file_path(episode, key))
                     for key in dataset.meta.video_keys}


def _known_bad_video(dataset, idx, failed) -> tuple[str, dict] | None:
    """(path, its record) of a video of sample ``idx`` that failed before, if any."""
    ensure_loaded = getattr(dataset, "_ensure_hf_dataset_loaded", None)  # 0.4 - 0.5.0; later: a property
    if ensure_loaded is not None:
        ensure_loaded()
    _, videos = _videos_of(dataset, idx)
    for path in videos.values():
        entry = failed.lookup(path)
        if entry is not None:
            return path, entry
    return None


def _describe_sample(dataset, idx, path, reason) -> str:
    try:
        episode, videos = _videos_of(dataset, idx)
        camera = next((key for key, video in videos.items() if video == path), "?")
    except Exception:  # the description must never hide the failure itself
        episode, camera = "?", "?"
    return f"sample {idx} (episode {episode}, camera {camera}, file {path}) failed: {reason}"


def describe(exc, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(exc).__name__}: {first}"


# -- streaming: StreamingLeRobotDataset.make_frame ---------------------------------------------
class _Recorded:
    """The shard iterator ``make_frame`` reads, recording the last row it handed out (to
    name a failed sample); everything else goes to the iterator itself."""

    def __init__(self, iterator):
        self._iterator, self.last = iterator, None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self._iterator)
        return self.last

    def __getattr__(self, name):
        return getattr(self._iterator, name)


def make_frame_or_substitute(stock_make_frame, dataset, dataset_iterator):
    """``make_frame``, or, when the frame's video cannot be decoded, the next frame of the
    same shard in its place (a stream has no index to draw a substitute from). The end of
    the shard ends it as stock does."""
    budget = process_budget()
    failures = _Failures()
    recorded = _Recorded(dataset_iterator)
    first = None
    while True:
        try:
            frames = list(stock_make_frame(dataset, recorded))
        except Exception as exc:
            path = _failed_path(exc)
            if path is None:  # the shard's end (LeRobot's own signal), or not a decode failure
                if failures:
                    log.warning("swift_safe_media: %s; no substitute for sample %s (its shard ended)",
                                failures.named(), first)
                raise
            sample = _row_index(recorded.last)
            first = sample if first is None else first
            camera = next((key for key in dataset.meta.video_keys
                           if str(dataset.meta.get_video_file_path(_row_episode(recorded.last), key)) in path), "?")
            failures.count(path, f"sample {sample} (episode {_row_episode(recorded.last)}, camera {camera}, "
                                 f"file {path}) failed: {describe(exc)}", budget)
            continue
        budget.success()
        failures.substituted(first, _row_index(recorded.last))
        yield from frames
        return


def _row_index(row):
    try:
        return int(row["index"])
    except Exception:
        return "?"


def _row_episode(row):
    try:
        return int(row["episode_index"])
    except Exception:
        return "?"
