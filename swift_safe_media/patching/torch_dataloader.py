"""torch's DataLoader, patched as every host is: a table of :class:`.targets.Target` rows,
applied once torch's ``torch.utils.data.dataloader`` is imported (now, if it is), and
restored exactly by ``disable()``.

The rows come in groups, each patched while what it serves is on: ``worker start`` (how
the workers start, :mod:`..workers.start`, whenever protection is on), ``worker restart``
(a worker killed from outside is replaced, :mod:`..workers.respawn`, whenever protection
is on), ``held arguments`` (a loader's dataset and ``collate_fn`` unpickled ahead as the
loader is made, :mod:`..workers.hold_ahead`, whenever protection is on), ``decode deadline`` (a worker's task clears its decode marks as it ends,
:mod:`..workers.decode_deadline`, unless ``SWIFT_SAFE_MEDIA_BOUND_OPENERS=0``), ``typed errors``
(a worker's ``MediaDecodeError`` reaches the trainer as itself, :mod:`..workers.typed_errors`,
whenever protection is on) and ``stall watch`` (each batch tells the stall watchdog, :mod:`..records.watchdog`,
only while a stall timeout is set).
"""

from __future__ import annotations

import sys

from . import import_hooks
from .targets import Patches, Target

MODULE = "torch.utils.data.dataloader"
SCOPE = ("torch.utils.data", "torch._utils")
_RESPAWN = "swift_safe_media.workers.respawn"
_ITERATOR = "_MultiProcessingDataLoaderIter"
_DEADLINE = "swift_safe_media.workers.decode_deadline"
_ERRORS = "swift_safe_media.workers.typed_errors"
_HELD = "swift_safe_media.workers.hold_ahead"

TARGETS = {
    "worker start": (
        Target(MODULE, "DataLoader._get_iterator", "swift_safe_media.workers.start:get_iterator_deciding_start"),
    ),
    "held arguments": (
        Target(MODULE, "DataLoader.__init__", f"{_HELD}:loader_init_holding_ahead"),
    ),
    "worker restart": (
        Target(MODULE, f"{_ITERATOR}._reset", f"{_RESPAWN}:reset_remembering_indices"),
        Target(MODULE, f"{_ITERATOR}._try_get_data", f"{_RESPAWN}:get_data_replacing_workers"),
        # torch's SIGCHLD handler looks this name up in its module each time it runs.
        Target("torch.utils.data._utils.signal_handling", "_error_if_any_worker_fails",
               f"{_RESPAWN}:error_if_a_worker_failed_for_good"),
        Target("torch.utils.data._utils.pin_memory", "_pin_memory_loop",
               "swift_safe_media.workers.queues:pin_memory_loop_handing_on_unreadable_results"),
    ),
    "decode deadline": (
        Target("torch.utils.data._utils.fetch", "_MapDatasetFetcher.fetch", f"{_DEADLINE}:fetch_bounding_decodes"),
        Target("torch.utils.data._utils.fetch", "_IterableDatasetFetcher.fetch",
               f"{_DEADLINE}:fetch_bounding_decodes"),
    ),
    "typed errors": (
        Target("torch._utils", "ExceptionWrapper.__init__", f"{_ERRORS}:wrapper_keeping_media_errors"),
        Target("torch._utils", "ExceptionWrapper.reraise", f"{_ERRORS}:reraise_media_errors"),
    ),
    "stall watch": (
        Target(MODULE, "_BaseDataLoaderIter.__next__", "swift_safe_media.records.watchdog:next_watched"),
    ),
}

_patches = {group: Patches(SCOPE, targets, {}, label=f"torch's DataLoader, {group}") for group, targets in TARGETS.items()}
_wanted: set[str] = set()
_hooked = False


def patch(group: str) -> None:
    """Patch ``group``'s rows now, or as soon as torch's DataLoader is imported."""
    global _hooked
    _wanted.add(group)
    if MODULE not in sys.modules:  # a module of the table gone from this torch is named now, not never
        _patches[group].warn_what_moved()
    if not _hooked:
        _hooked = True
        import_hooks.when_imported(MODULE, _apply)  # applies now if torch's DataLoader is loaded
    elif MODULE in sys.modules:
        _apply(sys.modules[MODULE])


def unpatch(group: str | None = None) -> None:
    """Restore ``group``'s rows (every group's by default) to torch's own."""
    for name in ([group] if group else list(_patches)):
        _wanted.discard(name)
        _patches[name].unpatch()


def is_patched(group: str) -> bool:
    return _patches[group].is_patched()


def _apply(_module) -> None:
    for group in sorted(_wanted):
        _patches[group].patch()
