"""Quarantine registry: a file that timed out, crashed its sandbox or failed to decode
is recorded once, and later calls for the same unchanged file are refused at once, in
every worker, rank, node and restart that shares the registry.

Layout, for a configured path ``DIR/quarantine.jsonl`` (``SWIFT_SAFE_MEDIA_QUARANTINE``):

- ``DIR/quarantine.jsonl.d/`` is the registry folder. Each writer (one process on one
  host) appends JSON Lines to its own file there, ``<host>-rank<RANK>-pid<PID>-<random>.jsonl``,
  created at its first record. One writer per file means no cross-process lock at all,
  so it works where ``flock`` is refused or unreliable (Lustre without ``-o flock``, NFS
  without lockd) and a frozen writer holds nobody up. The random part keeps apart two
  processes that share a hostname and a pid (containers with host networking).
- ``DIR/quarantine.jsonl`` itself, the single file older versions wrote under ``flock``,
  is still read (never written), so an old registry keeps refusing what it recorded.

Readers take the union of all these files, reading only what each has grown by since
the last look. A torn last line (a writer killed mid-write) is skipped; a file that is
replaced or shrinks is read again from the start, and bytes that are not there yet (a
short read, or NULs where another node's write is not visible yet) are read again at
the next look. A registry that cannot be written (disk full, read-only) is reported
once and training goes on.

What a file needs before it is recorded (the proof rule, see docs/never-silent.md): one
failure of the file's kind (a decode error, a signal the decode raised, its memory cap,
a timeout while its sandbox ran or waited on it), or two where the first was ambiguous
(``MediaDecodeError.ambiguous``: a timeout the ceiling cut short while the CPU was
starved); a process remembers its ambiguous failures until the second.
The machine's failures are never recorded. ``swift-safe-media quarantine forget``
appends a ``forgotten`` record, which drops what was recorded for that file version
until then, in every reader.

A registry made with :meth:`Registry.in_memory` keeps its records in this process only
(no file, no log line of its own): LeRobot's adapter remembers so the files that failed
in a worker, to substitute their later samples at once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
import threading

from .. import config, process
from ..config import QUARANTINE  # noqa: F401 (its name, where callers look)
from ..errors import MediaQuarantined

log = logging.getLogger("swift_safe_media")

WRITERS_FOLDER_SUFFIX = ".d"
_UNSEEN_RETRIES = 3  # looks at bytes that are not visible yet before they count as torn


def _identity(path: str):
    """(real path, size, mtime) of a regular file, or None: a changed file is a new file."""
    try:
        real = os.path.realpath(path)
        status = os.stat(real)
    except (OSError, ValueError):
        return None
    return real, status.st_size, status.st_mtime_ns


def writers_folder(registry_path: str) -> str:
    """The folder of per-writer files for a configured registry path."""
    return os.fspath(registry_path) + WRITERS_FOLDER_SUFFIX


def registry_files(registry_path: str) -> list[str]:
    """Every file a reader takes the union of: the single-file form, then each writer's."""
    registry_path = os.fspath(registry_path)
    folder = writers_folder(registry_path)
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".jsonl"))
    except OSError:
        names = []
    return [registry_path] + [os.path.join(folder, name) for name in names]


def entries(registry_path: str) -> list[dict]:
    """Every complete record of a registry, duplicates included, file by file (for tools and tests)."""
    found = []
    for path in registry_files(registry_path):
        try:
            with open(path, "rb") as registry:
                data = registry.read()
        except OSError:
            continue
        for line in data[:data.rfind(b"\n") + 1].splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue  # torn
    return found


class _Source:
    """How far one registry file has been read."""

    def __init__(self, file_id):
        self.file_id, self.offset, self.unseen_looks = file_id, 0, 0


def _host_label() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"


class Registry:
    def __init__(self, registry_path: str | None):
        self.registry_path = None if registry_path is None else os.fspath(registry_path)  # None: in memory
        self.folder = None if registry_path is None else writers_folder(self.registry_path)
        self._entries: dict[tuple, dict] = {}
        self._forgotten: dict[tuple, str] = {}  # file version -> when it was forgotten (ISO time)
        self._suspects: set[tuple] = set()  # failed once, ambiguously, in this process
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._writer: tuple[int, str] | None = None  # (pid, file): a forked child gets its own
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

    # -- reading ------------------------------------------------------------------
    def _refresh(self) -> None:
        if self.registry_path is None:
            return
        for path in registry_files(self.registry_path):
            self._read_new(path)

    def _read_new(self, path: str) -> None:
        try:
            status = os.stat(path)
        except OSError:
            return
        file_id = (status.st_dev, status.st_ino)
        source = self._sources.get(path)
        if source is None or source.file_id != file_id or status.st_size < source.offset:
            source = self._sources[path] = _Source(file_id)  # new, replaced or cut: from the start
        want = status.st_size - source.offset
        if want <= 0:
            return
        try:
            with open(path, "rb") as registry:
                registry.seek(source.offset)
                data = registry.read(want)
        except OSError:
            return
        complete = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        lines = data[:complete].split(b"\n")[:-1]
        consumed = 0
        for line in lines:
            if b"\0" in line and source.unseen_looks < _UNSEEN_RETRIES:
                # Another node's write is not visible here yet (a hole reads as NULs): look again.
                source.unseen_looks += 1
                break
            source.unseen_looks = 0
            consumed += len(line) + 1
            self._add(line)
        source.offset += consumed

    def _add(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
            key = (entry["path"], entry["size"], entry["mtime_ns"])
            when = str(entry["time"])
        except (ValueError, KeyError, TypeError):
            return  # torn by a writer that died mid-line
        if entry.get("forgotten"):
            self._forgotten[key] = max(when, self._forgotten.get(key, ""))
            if key in self._entries and self._entries[key]["time"] <= self._forgotten[key]:
                del self._entries[key]
        elif when > self._forgotten.get(key, ""):
            self._entries[key] = entry

    def current(self) -> list[dict]:
        """The records in force: one per file version, none that was forgotten."""
        with self._lock:
            self._refresh()
            return list(self._entries.values())

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

    # -- writing ------------------------------------------------------------------
    def writer_file(self) -> str:
        """This process's own file in the registry folder."""
        pid = os.getpid()
        if self._writer is None or self._writer[0] != pid:
            name = f"{_host_label()}-rank{process.rank()}-pid{pid}-{os.urandom(4).hex()}.jsonl"
            self._writer = (pid, os.path.join(self.folder, name))
        return self._writer[1]

    def record(self, path: str, kind: str, reason: str, elapsed: float | None, ambiguous: bool = False) -> None:
        """Quarantine ``path`` after a failure of its own; an ``ambiguous`` one only if the
        file failed (in this process) before."""
        identity = self._identity(path)
        if identity is None:
            return
        if ambiguous and identity not in self._suspects:
            self._suspects.add(identity)
            if self.registry_path is not None:
                log.warning("swift_safe_media: not quarantined yet: %s (%s: %s) proves nothing on its own; "
                            "a second failure will", path, kind, reason)
            return
        if identity in self._suspects:
            reason += " (its second failure)"
        self._write(identity, {"kind": kind, "reason": reason, "elapsed": None if elapsed is None else round(elapsed, 3)})
        if self.registry_path is not None and not self._write_failed:
            log.warning("swift_safe_media: quarantined %s after %s %s (the file's fault): %s", path,
                        "an" if kind[0] in "aeiou" else "a", kind, reason)

    def forget(self, path: str) -> bool:
        """Stop refusing the current version of ``path`` (False if it was not recorded)."""
        identity = self._identity(path)
        if identity is None or self.lookup(path) is None:
            return False
        self._suspects.discard(identity)
        self._write(identity, {"forgotten": True})
        return True

    def _write(self, identity, fields: dict) -> None:
        real, size, mtime_ns = identity
        entry = {"path": real, "size": size, "mtime_ns": mtime_ns, **fields,
                 "host": socket.gethostname(), "rank": process.rank(), "pid": os.getpid(),
                 "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
        if self.registry_path is not None:
            try:
                with self._write_lock:  # threads of this process share its file
                    self._append(line)
            except OSError as exc:  # the machine's fault: costs no sample, and records nothing
                if not self._write_failed:
                    self._write_failed = True
                    log.warning("swift_safe_media: cannot write the quarantine registry %s (%s), a machine "
                                "fault; training goes on without recording", self.registry_path, exc)
                return
        with self._lock:
            self._add(line)

    def _append(self, line: bytes) -> None:
        """One ``write`` in O_APPEND mode to a file no other process writes: no lock needed."""
        os.makedirs(self.folder, exist_ok=True)
        descriptor = os.open(self.writer_file(), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(descriptor).st_size
            if end and os.pread(descriptor, 1, end - 1) != b"\n":
                line = b"\n" + line  # an earlier write of ours was cut short: keep it apart
            if os.write(descriptor, line) != len(line):
                raise OSError("short write")
        finally:
            os.close(descriptor)


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
