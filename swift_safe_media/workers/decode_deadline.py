"""A decode that a user's own code makes in a DataLoader worker ends within the timeout:
both ends of the protocol.

The openers of :mod:`..patching.media_openers` (decord, PyAV, OpenCV, torchcodec, imageio,
moviepy) decode in the worker itself, natively, where a hang may hold the GIL: nothing in
the worker can end it. So the worker says what it is doing and the trainer ends it.

- **Worker end.** Each call of an opener, or of a method of what it opened, *marks* the
  worker's slot: a small file named by the worker's pid in the trainer's deadline folder
  (``SWIFT_SAFE_MEDIA_DEADLINE_DIR``) holding when, which opener, which file, and which
  mark of the task it is. The task's end (torch's fetcher returns or raises) clears it.
  A mark is one write of ~100 bytes; the same file marked again within 0.2 s is not
  written again (the trainer allows that much more).
- **Trainer end.** While it waits for a batch (``_try_get_data``, :mod:`.respawn`), a mark
  older than the timeout (plus the time the worker was kept from a CPU, as a sandbox's
  :class:`..engine.fair_clock.FairClock`) gets its worker SIGKILLed, named in the log and
  counted (the quarantine registry, where one is set, then refuses the file at once).
  A map-style dataset's worker is replaced and its tasks are sent again (:mod:`.respawn`);
  the task that hung goes with a note (:class:`Retried`), and in it the mark that hung
  raises :class:`..errors.MediaDecodeTimeout` naming the file instead of opening it again,
  where the user's ``__getitem__`` can catch it (or :func:`..skip_bad_samples` replaces
  the sample). A new worker cannot resume an ``IterableDataset``'s stream: the trainer
  raises the error naming the file, and the other workers' streams go on.

A decode in the trainer itself (a DataLoader with ``num_workers=0``) cannot be ended this
way: it is named once in the log, with how to bound it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

from .. import config, process
from ..engine import fair_clock
from ..errors import MediaDecodeTimeout

log = logging.getLogger("swift_safe_media")

REWRITE_AFTER_S = 0.2  # a mark of the same file within this is not written again
GRACE_S = REWRITE_AFTER_S + 0.05  # what the trainer allows beyond the timeout for that


# -- the notes that travel ----------------------------------------------------------------
@dataclass(frozen=True)
class Hung:
    """One mark at which a worker was killed: in the task sent again it raises instead."""
    mark: int  # which mark of its task (1: the first)
    media: str  # the file, or what stood for it ("<BytesIO>")
    named: bool  # media is a file's name (matched by name, not by its mark's number)
    opener: str
    reason: str

    def matches(self, mark: int, media: str) -> bool:
        return media == self.media and (self.named or mark == self.mark)

    def error(self) -> MediaDecodeTimeout:
        return MediaDecodeTimeout(self.media, f"{self.reason}; refused now, without opening it again")


@dataclass(frozen=True)
class Retried:
    """A task's sampler index, sent again after its worker was killed at a hung decode."""
    index: object
    hung: tuple


def media_of(source) -> tuple[str, bool]:
    """(how a source is named in a mark, whether that is a file's name)."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source), True
    if isinstance(source, bytes):
        return source.decode(errors="replace"), True
    if isinstance(source, int):
        return f"<camera {source}>", False
    name = getattr(source, "name", None)
    if isinstance(name, str) and name:
        return name, True
    return f"<{type(source).__name__}>", False


# -- worker end ------------------------------------------------------------------------
class Slot:
    """This worker's slot: the marks of the task in progress."""

    def __init__(self, folder: str, timeout: float):
        self.file = os.path.join(folder, str(os.getpid()))
        self.timeout = timeout
        self.marks = 0
        self.hung: tuple = ()
        self._written: tuple | None = None  # (media, opener, when) last written

    def mark(self, opener: str, source, opening: bool = True) -> None:
        media, named = media_of(source)
        self.marks += 1
        for hung in self.hung:
            if hung.matches(self.marks, media):
                raise hung.error()
        if named and opening:  # the registry is looked at as a file is opened, not at each frame
            _refuse_if_quarantined(media)
        now = time.monotonic()
        written = self._written
        if written and written[0] == media and written[1] == opener and now - written[2] < REWRITE_AFTER_S:
            return
        times = " ".join(map(str, fair_clock.this_thread_at_start() or ()))  # the trainer's clock counts from these
        text = (f"{now:.6f} {time.clock_gettime(time.CLOCK_BOOTTIME):.6f} {self.marks} {self.timeout!r} {times}\n"
                f"{opener}\n{media}")
        try:
            descriptor = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(descriptor, text.encode(errors="replace"))
            finally:
                os.close(descriptor)
        except OSError:  # the folder is gone (the trainer ended): nothing to tell
            return
        self._written = (media, opener, now)

    def begin(self, hung: tuple) -> None:
        self.marks, self.hung = 0, hung

    def end(self) -> None:
        self.marks, self.hung = 0, ()
        if self._written is not None:
            self._written = None
            try:
                os.unlink(self.file)
            except OSError:
                pass


class InTrainer:
    """Where no worker end applies (the trainer, a sandbox): a fetch's decodes are named."""

    def __init__(self):
        self.fetching = 0
        self.named: set[str] = set()

    def mark(self, opener: str, source, opening: bool = True) -> None:
        library = opener.split(".")[0]
        if self.fetching and library not in self.named and process.rank() == 0:
            self.named.add(library)  # once per library: its methods' calls say no more
            log.warning("swift-safe-media: %s decodes %s in a DataLoader with num_workers=0, in the training "
                        "process itself, where its decodes cannot be ended: a hang there stalls the run. Give the "
                        "DataLoader num_workers >= 1 (each worker's decodes are then bounded by the timeout), or "
                        "run the decode with @swift_safe_media.isolated (docs/engine.md)", opener,
                        media_of(source)[0])


def _refuse_if_quarantined(media: str) -> None:
    from ..records import quarantine

    registry = quarantine.current()
    if registry is not None:
        registry.check(media)


class Unwatched:
    """A DataLoader worker whose trainer watches no marks (an unprotected trainer's)."""

    fetching = 0

    def mark(self, opener: str, source, opening: bool = True) -> None:
        pass


def slot():
    """This process's :class:`Slot` in a DataLoader worker of a protected trainer, an
    :class:`Unwatched` in another worker, else its :class:`InTrainer`."""
    state = process.current()
    if state.deadline_slot is None:
        worker_module = sys.modules.get("torch.utils.data._utils.worker")
        if worker_module is None or worker_module.get_worker_info() is None:
            state.deadline_slot = InTrainer()
        else:
            folder = config.get(config.DEADLINE_DIR)
            state.deadline_slot = Slot(folder, config.get(config.TIMEOUT)) if folder and os.path.isdir(folder) \
                else Unwatched()
    return state.deadline_slot


def mark(opener: str, source, opening: bool = True) -> None:
    """An opener (``opening``) or a method of what it opened is called on ``source``:
    fails open, except for a decode refused (a file that hung or was quarantined)."""
    try:
        here = slot()
    except Exception:
        return
    here.mark(opener, source, opening)


def fetch_bounding_decodes(original, fetcher, possibly_batched_index):
    """torch's ``_MapDatasetFetcher.fetch`` / ``_IterableDatasetFetcher.fetch``: a task's
    marks are its own (cleared as it ends); a task sent again knows which mark hung."""
    here = slot()
    hung = ()
    if type(possibly_batched_index) is Retried:
        hung, possibly_batched_index = possibly_batched_index.hung, possibly_batched_index.index
    if not isinstance(here, Slot):
        here.fetching += 1
        try:
            return original(fetcher, possibly_batched_index)
        finally:
            here.fetching -= 1
    here.begin(hung)
    try:
        return original(fetcher, possibly_batched_index)
    finally:
        here.end()


# -- trainer end -----------------------------------------------------------------------
@dataclass(frozen=True)
class Mark:
    started: float  # time.monotonic() of the mark, in the worker (the clock is the machine's)
    started_boot: float
    number: int
    timeout: float
    opener: str
    media: str
    start_times: tuple | None = None  # the marking thread's, as fair_clock.this_thread_at_start reads them

    @classmethod
    def read(cls, file: str) -> "Mark | None":
        try:
            with open(file, "rb") as slot_file:
                text = slot_file.read().decode(errors="replace")
            head, opener, media = text.split("\n", 2)
            started, boot, number, timeout, *times = head.split()
            return cls(float(started), float(boot), int(number), float(timeout), opener, media,
                       tuple(map(int, times)) if len(times) == 4 else None)
        except (OSError, ValueError):  # none, or being written: read again at the next look
            return None

    @property
    def named(self) -> bool:
        return not (self.media.startswith("<") and self.media.endswith(">"))


class Deadlines:
    """The trainer's watch over one iterator's workers' slots."""

    def __init__(self, folder: str):
        self.folder = folder
        self._clocks: dict = {}  # (pid, mark) -> FairClock

    def overdue(self, iterator) -> list[tuple[int, Mark, object]]:
        """(worker id, mark, its clock) of each active worker past its mark's deadline."""
        found, now = [], time.monotonic()
        for worker_id, worker in enumerate(iterator._workers):
            if not iterator._workers_status[worker_id] or worker.pid is None:
                continue
            mark = Mark.read(os.path.join(self.folder, str(worker.pid)))
            # from half its time on, the worker's threads are read (a decoder's end before the deadline)
            if mark is None or now < mark.started + (mark.timeout + GRACE_S) / 2:
                continue
            key = (worker.pid, mark)
            clock = self._clocks.get(key)
            if clock is None:
                # begun where the worker marked it: its first reading is due now
                clock = self._clocks[key] = fair_clock.FairClock(worker.pid, mark.timeout + GRACE_S,
                                                                 config.get(config.TIMEOUT_CEILING), mark.started,
                                                                 mark.started_boot, mark.start_times)
            if now >= clock.wake_at() and not clock.tick():
                found.append((worker_id, mark, clock))
        return found

    def anything_marked(self) -> bool:
        try:
            return any(True for _ in os.scandir(self.folder))
        except OSError:
            return False


def deadlines() -> Deadlines | None:
    folder = config.get(config.DEADLINE_DIR)
    return Deadlines(folder) if folder and config.get(config.BOUND_OPENERS) else None


def prepare_folder() -> None:
    """In a trainer about to start DataLoader workers: the folder their slots go in,
    known to them through the environment (removed as the trainer exits)."""
    if not config.get(config.BOUND_OPENERS):
        return
    folder = config.get(config.DEADLINE_DIR)
    if folder and os.path.isdir(folder):
        return
    from ..engine import run_folders

    config.put(config.DEADLINE_DIR, run_folders.make("deadline"))


def end_overdue(iterator, replacing, watch: Deadlines) -> None:
    """Kill each worker past its deadline; replace it (map-style), or raise the error
    naming the file (an IterableDataset, or a worker that could not be replaced)."""
    for worker_id, mark, clock in watch.overdue(iterator):
        worker = iterator._workers[worker_id]
        pid = worker.pid
        reason = (f"{mark.opener} overran its {mark.timeout:g} s timeout{clock.describe()} in DataLoader worker "
                  f"{worker_id} (pid {pid}), which was killed")
        elapsed = time.monotonic() - mark.started
        _kill_with_its_programs(pid)
        if replacing is not None:
            replacing.deadline_kills.add(pid)
        worker.join(5.0)
        try:
            os.unlink(os.path.join(watch.folder, str(pid)))
        except OSError:
            pass
        _count(mark, reason, elapsed, capped=clock.capped)
        hung = Hung(mark.number, mark.media, mark.named, mark.opener, reason)
        if replacing is not None and _replace(replacing, iterator, worker_id, hung):
            continue
        iterator._workers_status[worker_id] = False  # its tasks are skipped (torch's _next_data)
        _forget_pid(iterator)
        log.error("swift_safe_media: %s: %s; a new worker cannot take over its tasks (%s), so the error is "
                  "raised here", mark.media, reason, "an IterableDataset's stream cannot resume"
                  if replacing is None or replacing.iterable else "it could not be replaced")
        raise MediaDecodeTimeout(mark.media, reason, elapsed)


def _replace(replacing, iterator, worker_id: int, hung: Hung) -> bool:
    """Replace a worker killed at a hung decode (:mod:`.respawn`): the task it was on is
    sent again with ``hung``. Whether it was replaced."""
    if replacing.iterable or iterator._shutdown:
        return False
    pending = getattr(iterator._index_queues[worker_id], "pending", ())
    task = next((task for task, _ in pending if len(iterator._task_info.get(task, ())) == 1), None)
    if task is not None:
        replacing.hung[task] = replacing.hung.get(task, ()) + (hung,)
    return replacing.replace_failing_open(iterator, worker_id, hung.reason, hung=hung)


def _kill_with_its_programs(pid: int) -> None:
    """SIGKILL a worker and what it started (an ffmpeg program moviepy or imageio-ffmpeg
    runs, blocked on the same file, would outlive it). The worker goes first: killed after
    its program, it could wake to that program's end and run the user's ``except`` (a
    spurious error logged for a task sent again). Its programs are listed before, as they
    are reparented once it is gone. Its sandboxes are not its children: each ends as its
    caller is gone."""
    from ..records.watchdog import _descendants

    for number in [pid, *_descendants(pid)]:
        try:
            os.kill(number, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _count(mark: Mark, reason: str, elapsed: float, capped: bool) -> None:
    from ..records import quarantine, summary

    registry, stats = quarantine.current(), summary.recorder()
    if registry is not None and mark.named:
        registry.record(mark.media, "timeout", reason, elapsed, ambiguous=capped)
    if stats is not None:
        stats.record(mark.media, "timeout", elapsed)


def _forget_pid(iterator) -> None:
    """torch's SIGCHLD check looks only at the workers still running."""
    from torch.utils.data import _utils

    _utils.signal_handling._remove_worker_pids(id(iterator))
    _utils.signal_handling._set_worker_pids(
        id(iterator), tuple(w.pid for i, w in enumerate(iterator._workers) if iterator._workers_status[i]))
