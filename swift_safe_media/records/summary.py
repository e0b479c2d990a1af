"""Run summary: what decoding cost and what failed, across every process of the run.

Each process that calls the engine (the trainer, every DataLoader worker) keeps its
own counters and writes them to ``stats-<pid>.json`` in the run's stats folder
(``SWIFT_SAFE_MEDIA_STATS_DIR``, which ``enable`` sets and workers inherit): a failure
at once, other counts at most once a second and at most a second late (while it holds
some back, a ``pending-<pid>`` file says so, and a final summary waits for it). A worker
of a process pool (``datasets.map``'s, ms-swift's and LLaMA-Factory's preprocessing) writes
every count at once: the pool ends it with SIGTERM, which runs no exit hook. ``collect``
merges them: decodes, timeouts, crashes, quarantined hits, other errors, machine faults
(the file's failures apart from the machine's), latency
p50/p99, the slowest files (each once: its worst time and how often it was decoded),
and the step each rank's trainer reached.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import random
import sys
import threading
import time

from .. import config, process
from ..config import STATS_DIR, SUMMARY_STEPS  # noqa: F401 (their names, where callers look)

log = logging.getLogger("swift_safe_media")

# "machine": a machine fault retried in a fresh sandbox; "machine_skipped": one that failed
# its retries too, so the sample was skipped (neither is the file's, neither quarantines)
OUTCOMES = ("ok", "timeout", "crash", "quarantined", "error", "machine", "machine_skipped")
FAILURES = ("timeout", "crash", "quarantined", "error", "machine", "machine_skipped", "workers_replaced")
_SAMPLE_SIZE = 4096  # latencies kept per process (reservoir), enough for p99
_SLOWEST = 10  # files listed in the summary
# Files each process keeps for that list, by worst time: a bounded table, since a dataset
# may have millions. A file's count is exact unless it was pushed out and came back.
_SLOW_FILES_KEPT = 64
FLUSH_EVERY_S = 1.0
_PENDING = "pending-"  # pending-<pid>: that process holds counts it has not written yet


class Recorder:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, f"stats-{os.getpid()}.json")
        # Exists while counts are held back (see record): a final summary waits for it.
        self.pending_path = os.path.join(directory, f"{_PENDING}{os.getpid()}")
        self._marked = False
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.latencies: list[float] = []
        self.seen = 0
        self.slow_files: dict[str, list] = {}  # path: [worst elapsed, its outcome, decodes]
        self.step: int | None = None  # in a trainer process: the training step reached
        self.rows_failed = 0  # rows (requests) a command answered or left out for their media
        self.workers_replaced = 0  # DataLoader workers killed from outside and replaced (machine faults)
        self.last_flush = 0.0
        self.writes_at_once = in_a_pool_worker()
        self._pending: threading.Timer | None = None
        self._lock = threading.Lock()

    def record(self, path, outcome: str, elapsed: float) -> None:
        with self._lock:
            self.counts[outcome] += 1
            self.seen += 1
            if len(self.latencies) < _SAMPLE_SIZE:
                self.latencies.append(elapsed)
            else:
                slot = random.randrange(self.seen)
                if slot < _SAMPLE_SIZE:
                    self.latencies[slot] = elapsed
            if path is not None:  # else counted, but no file to name among the slowest
                self._note_slow_file(str(path), outcome, elapsed)
            # A failure is written at once. Other counts go out within a second: a worker
            # may idle between batches and then be killed (a DataLoader's idle workers at
            # the end), never reaching an exit hook; a pool's worker, at once.
            if outcome != "ok" or self.writes_at_once or time.monotonic() - self.last_flush >= FLUSH_EVERY_S:
                self._flush()
            else:
                if not self._marked:
                    self._mark_pending()
                if self._pending is None:
                    self._pending = threading.Timer(FLUSH_EVERY_S, self._flush_pending)
                    self._pending.daemon = True
                    self._pending.start()

    def _note_slow_file(self, path: str, outcome: str, elapsed: float) -> None:
        kept = self.slow_files.get(path)
        if kept is not None:
            kept[2] += 1
            if elapsed > kept[0]:
                kept[0], kept[1] = elapsed, outcome
            return
        if len(self.slow_files) >= _SLOW_FILES_KEPT:
            fastest = min(self.slow_files, key=lambda kept_path: self.slow_files[kept_path][0])
            if self.slow_files[fastest][0] >= elapsed:
                return
            del self.slow_files[fastest]
        self.slow_files[path] = [elapsed, outcome, 1]

    def _mark_pending(self) -> None:
        try:
            open(self.pending_path, "w").close()
            self._marked = True
        except OSError:
            pass

    def _flush_pending(self) -> None:
        with self._lock:
            self._pending = None
            self._flush()

    def note_step(self, step: int) -> None:
        with self._lock:
            self.step = step
            self._flush()

    def note_failed_row(self) -> None:
        with self._lock:
            self.rows_failed += 1
            self._flush()

    def note_worker_replaced(self) -> None:
        with self._lock:
            self.workers_replaced += 1
            self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        self.last_flush = time.monotonic()
        state = {"pid": os.getpid(), "counts": self.counts, "seen": self.seen, "latencies": self.latencies,
                 "rows_failed": self.rows_failed, "workers_replaced": self.workers_replaced,
                 "slow_files": {path: list(kept) for path, kept in self.slow_files.items()}}
        if self.step is not None:
            state.update(rank=process.rank(), step=self.step)
        partial = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(partial, "w") as out:
                json.dump(state, out)
            os.replace(partial, self.path)  # readers never see half a file
            if self._marked:
                self._marked = False
                os.unlink(self.pending_path)
        except OSError:
            pass


def in_a_pool_worker() -> bool:
    """Whether this process is a worker of a ``multiprocessing`` (or dill's ``multiprocess``,
    ``datasets.map``'s) ``Pool``. ``Pool.__exit__`` terminates its workers with SIGTERM as
    soon as the last result is in, often within a second of their last decode, and a
    terminated process runs neither atexit nor multiprocessing's exit hooks."""
    for name in ("multiprocessing", "multiprocess"):
        module = sys.modules.get(name)
        try:
            if module is not None and "PoolWorker" in module.current_process().name:
                return True  # the pool names them "<Fork|Spawn|ForkServer>PoolWorker-<n>"
        except Exception:  # fail open: held back a second, as any other process
            pass
    return False


def recorder() -> Recorder | None:
    """This process's recorder for the run, or None when no stats folder is set."""
    directory = config.get(STATS_DIR)
    if not directory:
        return None
    recorders = process.current().recorders  # a forked child starts its own file
    found = recorders.get(directory)
    if found is None:
        os.makedirs(directory, exist_ok=True)
        found = recorders[directory] = Recorder(directory)
        # The last second of counts: atexit in a plain process, and multiprocessing's own
        # exit hooks in a DataLoader worker, which ends without running atexit.
        atexit.register(found.flush)
        multiprocessing.util.Finalize(found, found.flush, exitpriority=10)
    return found


def flush() -> None:
    for found in list(process.current().recorders.values()):
        found.flush()


def note_step(step: int) -> None:
    """Record the training step this process (one rank's trainer) has reached."""
    found = recorder()
    if found is not None:
        found.note_step(step)


def note_failed_row() -> None:
    """Count a row (a request) whose media failed and that the command answered with an
    error or left out (inference, serving, export, rollouts)."""
    found = recorder()
    if found is not None:
        found.note_failed_row()


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def collect(directory: str | None = None) -> dict:
    """Merge every process's stats in the run's folder."""
    flush()
    directory = directory or config.get(STATS_DIR)
    counts, latencies, processes, steps, rows_failed = dict.fromkeys(OUTCOMES, 0), [], 0, {}, 0
    workers_replaced = 0
    slow_files: dict[str, list] = {}  # path: [worst elapsed, its outcome, decodes], over processes
    for name in sorted(os.listdir(directory)) if directory and os.path.isdir(directory) else []:
        if not (name.startswith("stats-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as stats:
                state = json.load(stats)
        except (OSError, ValueError):
            continue
        processes += 1
        for outcome in OUTCOMES:
            counts[outcome] += state["counts"].get(outcome, 0)
        latencies += state["latencies"]
        rows_failed += state.get("rows_failed", 0)
        workers_replaced += state.get("workers_replaced", 0)
        for path, (elapsed, outcome, decodes) in state.get("slow_files", {}).items():
            merged = slow_files.setdefault(path, [elapsed, outcome, 0])
            merged[2] += decodes
            if elapsed > merged[0]:
                merged[0], merged[1] = elapsed, outcome
        if "step" in state:
            steps[str(state["rank"])] = max(state["step"], steps.get(str(state["rank"]), 0))
    return {"decodes": sum(counts.values()), **counts, "rows_failed": rows_failed,
            "workers_replaced": workers_replaced, "processes": processes,
            "latency_p50_s": _percentile(latencies, 0.50), "latency_p99_s": _percentile(latencies, 0.99),
            # Each file once: its worst decode (time and outcome) and how many decodes it had.
            "slowest": [{"path": path, "elapsed_s": round(elapsed, 3), "outcome": outcome, "count": decodes}
                        for path, (elapsed, outcome, decodes) in
                        sorted(slow_files.items(), key=lambda item: item[1][0], reverse=True)[:_SLOWEST]],
            "steps_by_rank": dict(sorted(steps.items(), key=lambda item: int(item[0])))}


def format_summary(summary: dict, step=None) -> str:
    def seconds(value):
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    head = "swift_safe_media summary" + (f" at step {step}" if step is not None else "")
    # A DataLoader worker killed from outside and replaced is a machine fault too.
    machine = summary.get("machine", 0) + summary.get("machine_skipped", 0) + summary.get("workers_replaced", 0)
    lines = [f"{head}: {summary['decodes']} decodes, {summary['ok']} ok, {summary['timeout']} timeouts, "
             f"{summary['crash']} crashes, {summary['quarantined']} quarantined, {summary['error']} errors, "
             f"{machine} machine faults ({summary.get('machine_skipped', 0)} samples skipped); "
             f"latency p50 {seconds(summary['latency_p50_s'])}, p99 {seconds(summary['latency_p99_s'])}"
             + (f"; {summary['rows_failed']} rows failed" if summary.get("rows_failed") else "")]
    for entry in summary["slowest"][:5]:
        times = "1 decode" if entry["count"] == 1 else f"{entry['count']} decodes"
        lines.append(f"  slow: {entry['path']} worst {entry['elapsed_s']:.2f} s ({entry['outcome']}), {times}")
    return "\n".join(lines)


def write_summary(path: str, step=None) -> dict:
    """Log the merged summary (INFO when nothing failed, else WARNING) and write it as
    JSON to ``path``."""
    summary = collect()
    failed = any(summary.get(outcome, 0) for outcome in FAILURES)
    log.log(logging.WARNING if failed else logging.INFO, format_summary(summary, step))
    try:
        with open(path, "w") as out:
            json.dump(dict(summary, step=step), out, indent=2)
    except OSError as exc:
        log.warning("swift_safe_media: cannot write the run summary %s: %s", path, exc)
    return summary


SUMMARY_FILE = "safe_media_summary.json"


def summary_steps() -> int:
    """Batches between summaries in hosts that count batches themselves (LeRobot); 0: only at the end."""
    return config.get(SUMMARY_STEPS)


def summary_path() -> str | None:
    """Where the JSON summary goes: next to the quarantine registry, else into the stats folder."""
    registry = config.get(config.QUARANTINE)
    folder = os.path.dirname(os.path.abspath(registry)) if registry else config.get(STATS_DIR)
    return os.path.join(folder, SUMMARY_FILE) if folder else None


_final_reported = False
_reports_at_exit = False


def report(step=None, final: bool = False) -> dict | None:
    """Log the run summary and write it to :func:`summary_path`; None when no run is recorded.
    A ``final`` one first waits for the last counts of workers and other ranks."""
    global _final_reported
    path = summary_path()
    if path is None:
        return None
    if final:
        _final_reported = True
        wait_for_held_back_counts(FLUSH_EVERY_S + 0.5)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return write_summary(path, step)


def wait_for_held_back_counts(limit: float) -> None:
    """Until no other process of the run holds counts back (DataLoader workers, other
    ranks): each writes them within ``FLUSH_EVERY_S``, and marks that it has some. A
    process killed meanwhile leaves its mark: after ``limit``, nothing it held back can
    still be on its way."""
    directory = config.get(STATS_DIR)
    if not directory:
        return
    mine = f"{_PENDING}{os.getpid()}"
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if not any(name.startswith(_PENDING) and name != mine for name in os.listdir(directory)):
                return
        except OSError:
            return
        time.sleep(0.05)


def report_at_exit(step_reached) -> None:
    """Once per process: the final summary at exit, unless the host gave one already (it
    did not if training died: a spent error budget, say). ``step_reached()`` names the step."""
    global _reports_at_exit
    if not _reports_at_exit:
        _reports_at_exit = True
        atexit.register(_report_at_exit, step_reached)


def _report_at_exit(step_reached) -> None:
    if not _final_reported:
        report(step=step_reached(), final=True)


def step_noted() -> int | None:
    """The training step this process last noted (:func:`note_step`)."""
    found = recorder()
    return None if found is None else found.step
