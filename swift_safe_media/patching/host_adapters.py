"""Host-framework adapters, applied when their host is imported.

Each adapter module (one per host, dd-trace style) provides:

- ``HOST``: the host's top-level import name; ``DISTRIBUTION``: its package name;
- ``SUPPORTED``: ``(lowest, first_unsupported)`` version tuples, declared once;
- ``TRIGGER_MODULES``: modules whose import (re)applies the patch;
- ``get_version()``: the installed host version, or None;
- ``patch()`` / ``unpatch()`` / ``is_patched()``: idempotent; ``unpatch`` restores exactly
  (and undoes anything else ``patch`` registered);
- optionally ``register_flags()`` with ``FLAG_MODULES``: adds the host's command-line
  flags (:mod:`.flags`) once one of those modules is imported; they must parse even
  while the package is off, so a command line that has them never breaks;
- optionally ``WORKER_PRELOAD``: modules DataLoader workers need to unpickle the host's
  dataset, imported once by the warm forkserver (:mod:`..warm_start`);
- optionally ``worker_start_method(loader)``: the start method the host's DataLoader
  ``loader`` should start its workers with, or None to leave it; asked as the loader
  starts its workers: row 1 of the decision in :mod:`..workers.start_method`;
- optionally ``command_line_asks_for_protection()``: True when this process's command
  line turns protection on, so the decoders are checked as the host starts importing;
- optionally ``unsupported()``: why the installed version, inside ``SUPPORTED``, cannot be
  patched (its layout is none the adapter declares), or None. Either way it is left
  untouched as a whole, with one warning.

The targets are data: a table of :class:`._patching.Target` rows (functions and methods
alike) in a :class:`._patching.Patches`, which provides ``patch`` / ``unpatch`` /
``is_patched``. The protocol is checked when an adapter is first loaded.

``patch`` fails open: if it raises, the host is restored, one warning is logged, and
training goes on without protection rather than not at all.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re

from .. import config
from . import import_hooks as _imports

log = logging.getLogger("swift_safe_media")

ADAPTERS = {
    "swift": "swift_safe_media.hosts.swift.adapter",
    "lerobot": "swift_safe_media.hosts.lerobot.adapter",
    "llamafactory": "swift_safe_media.hosts.llamafactory.adapter",
}

ENABLED = config.ENABLED

_enabled_hosts: set[str] = set()
_warned: set[str] = set()


def env_state() -> bool | None:
    """True/False when ``SWIFT_SAFE_MEDIA`` turns the package on/off, None when unset."""
    return config.enabled_by_environment()


def parse_version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or "")[:3])


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported(adapter) -> bool:
    version = adapter.get_version()
    lowest, first_unsupported = adapter.SUPPORTED
    if not (version is not None and lowest <= parse_version(version) < first_unsupported):
        _warn_once(adapter.HOST, f"swift_safe_media: {adapter.DISTRIBUTION} {version} is outside the "
                                 f"supported range {_range(adapter.SUPPORTED)}; leaving it untouched")
        return False
    reason = getattr(adapter, "unsupported", lambda: None)()
    if reason:
        _warn_once(adapter.HOST, f"swift_safe_media: {adapter.DISTRIBUTION} {version}: {reason}; "
                                 f"leaving it untouched")
        return False
    return True


def _range(supported) -> str:
    lowest, first_unsupported = supported
    return f">={'.'.join(map(str, lowest))},<{'.'.join(map(str, first_unsupported))}"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


REQUIRED = ("HOST", "DISTRIBUTION", "SUPPORTED", "TRIGGER_MODULES", "get_version", "patch", "unpatch",
            "is_patched")
_checked: set[str] = set()


def adapter_for(host: str):
    """The adapter module of ``host``, checked against the protocol above when first loaded."""
    adapter = importlib.import_module(ADAPTERS[host])
    if adapter.__name__ not in _checked:
        check_adapter(adapter)
        _checked.add(adapter.__name__)
    return adapter


def check_adapter(adapter) -> None:
    """Raise TypeError naming what an adapter module lacks of the protocol."""
    missing = [name for name in REQUIRED if not hasattr(adapter, name)]
    missing += [name for name in ("get_version", "patch", "unpatch", "is_patched")
                if hasattr(adapter, name) and not callable(getattr(adapter, name))]
    if hasattr(adapter, "register_flags") and not getattr(adapter, "FLAG_MODULES", ()):
        missing.append("FLAG_MODULES (register_flags needs them)")
    lowest, first_unsupported = getattr(adapter, "SUPPORTED", ((), ()))
    if not (isinstance(lowest, tuple) and isinstance(first_unsupported, tuple) and lowest < first_unsupported):
        missing.append("SUPPORTED as (lowest, first_unsupported) version tuples")
    if missing:
        raise TypeError(f"swift_safe_media: adapter {adapter.__name__} does not follow the adapter "
                        f"protocol: {', '.join(missing)}")


def _apply(host: str) -> None:
    if host not in _enabled_hosts:
        return
    adapter = adapter_for(host)
    if not is_supported(adapter):
        return
    try:
        adapter.patch()
    except Exception:
        log.exception("swift_safe_media: could not patch %s; it runs unprotected", adapter.DISTRIBUTION)
        try:
            adapter.unpatch()
        except Exception:
            log.exception("swift_safe_media: could not restore %s", adapter.DISTRIBUTION)


def enable_hosts(hosts=None) -> None:
    from . import media_libraries as media

    media.enable()  # the media libraries' entry points, with any host or none
    for host in hosts or ADAPTERS:
        if host in _enabled_hosts:
            continue
        _enabled_hosts.add(host)
        for module_name in adapter_for(host).TRIGGER_MODULES:
            _imports.when_imported(module_name, lambda _module, host=host: _apply(host))


def disable_hosts() -> None:
    from . import media_libraries as media

    media.disable()
    for host in list(_enabled_hosts):
        _enabled_hosts.discard(host)
        adapter = adapter_for(host)
        for module_name in adapter.TRIGGER_MODULES:
            _imports.clear(module_name)
        adapter.unpatch()


def hosts_worker_start_method(loader) -> str | None:
    """The start method an enabled host's adapter prefers for ``loader``, or None (the
    decision is :mod:`..workers.start_method`'s)."""
    for host in sorted(_enabled_hosts):
        choose = getattr(adapter_for(host), "worker_start_method", None)
        method = choose(loader) if choose is not None else None
        if method:
            return method
    return None


def enabled_hosts() -> set[str]:
    return set(_enabled_hosts)
