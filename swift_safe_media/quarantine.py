"""Quarantine registry: a file that timed out, crashed its sandbox or failed to decode
is recorded once, and later calls for the same unchanged file are refused at once, in
every worker, rank and restart that shares the registry.

The registry is an append-only JSON Lines file (``SWIFT_SAFE_MEDIA_QUARANTINE``). Each
record is appended with one ``write`` under an exclusive ``flock``, so concurrent
writers on one host, or on nodes sharing a filesystem that honours locks, never
interleave; a torn last line (a writer killed mid-write) is skipped on read. A registry
that cannot be written (disk full, read-only) is reported once and training goes on.

A registry made with :meth:`Registry.in_memory` keeps its records in this process only
(no file, no log line of its own): LeRobot's adapter remembers so the files that failed
in a worker, to substitute their later samples at once.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import threading

from . import config
from .config import QUARANTINE  # noqa: F401 (its name, where callers look)
from .errors import MediaQuarantined

log = logging.getLogger("swift_safe_media")


def _identity(path: str):
    """(real path, size, mtime) of a regular file, or None: a changed file is a new file."""
    try:
        real = os.path.realpath(path)
        status = os.stat(real)
    except (OSError, ValueError):
        return None
    return real, status.st_size, status.st_mtime_ns


class Registry:
    def __init__(self, registry_path: str | None):
        self.registry_path = registry_path  # None: in memory only
        self._entries: dict[tuple, dict] = {}
        self._read_up_to = 0
        self._lock = threading.Lock()
        self._write_failed = False

    @classmethod
    def in_memory(cls) -> "Registry":
        return cls(None)

    def __len__(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._entries)

    def _identity(self, path: str):
        identity = _identity(path)
        if identity is None and self.registry_path is None:
            # Remembered by name in memory: a path that cannot be looked at failed too.
            return os.path.realpath(path), None, None
        return identity

    def _refresh(self) -> None:
        if self.registry_path is None:
            return
        try:
            size = os.path.getsize(self.registry_path)
        except OSError:
            return
        if size <= self._read_up_to:
            return
        with open(self.registry_path, "rb") as registry:
            registry.seek(self._read_up_to)
            data = registry.read(size - self._read_up_to)
        complete = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        for line in data[:complete].splitlines():
            try:
                entry = json.loads(line)
                self._entries[(entry["path"], entry["size"], entry["mtime_ns"])] = entry
            except (ValueError, KeyError, TypeError):
                continue  # torn by a writer that died mid-line
        self._read_up_to += complete

    def lookup(self, path: str) -> dict | None:
        identity = self._identity(path)
        if identity is None:
            return None
        with self._lock:
            self._refresh()
            return self._entries.get(identity)

    def check(self, path: str) -> None:
        """Raise MediaQuarantined if this unchanged file failed before."""
        entry = self.lookup(path)
        if entry is not None:
            raise MediaQuarantined(path, f"quarantined after an earlier {entry['kind']} "
                                         f"(recorded {entry['time']} on {entry['host']}, rank {entry['rank']}): "
                                         f"{entry['reason']}")

    def record(self, path: str, kind: str, reason: str, elapsed: float | None) -> None:
        identity = self._identity(path)
        if identity is None:
            return
        real, size, mtime_ns = identity
        entry = {"path": real, "size": size, "mtime_ns": mtime_ns, "kind": kind, "reason": reason,
                 "elapsed": None if elapsed is None else round(elapsed, 3),
                 "host": socket.gethostname(), "rank": int(os.environ.get("RANK", 0)), "pid": os.getpid(),
                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if self.registry_path is None:
            with self._lock:
                self._entries[identity] = entry
            return
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
        try:
            directory = os.path.dirname(os.path.abspath(self.registry_path))
            os.makedirs(directory, exist_ok=True)
            descriptor = os.open(self.registry_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
                end = os.fstat(descriptor).st_size
                if end and os.pread(descriptor, 1, end - 1) != b"\n":
                    line = b"\n" + line  # a writer died mid-line: keep its torn bytes apart
                if os.write(descriptor, line) != len(line):
                    raise OSError("short write")
            finally:
                os.close(descriptor)  # releases the lock
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                log.warning("swift_safe_media: cannot write the quarantine registry %s (%s); "
                            "training goes on without recording", self.registry_path, exc)
            return
        with self._lock:
            self._entries[(real, size, mtime_ns)] = entry
        log.warning("swift_safe_media: quarantined %s after %s %s: %s", path,
                    "an" if kind[0] in "aeiou" else "a", kind, reason)


_registries: dict[str, Registry] = {}
_registries_lock = threading.Lock()


def current() -> Registry | None:
    """The registry named by the environment, or None when quarantine is off."""
    registry_path = config.get(QUARANTINE)
    if not registry_path:
        return None
    with _registries_lock:
        registry = _registries.get(registry_path)
        if registry is None:
            registry = _registries[registry_path] = Registry(registry_path)
        return registry
