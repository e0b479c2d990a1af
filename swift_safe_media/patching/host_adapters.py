"""Host-framework adapters: the protocol every host's folder fills in
(:class:`HostAdapter`), the registry adapters put themselves in (:func:`register`), and
turning hosts on and off as they are imported.

A host is one folder, ``swift_safe_media/hosts/<host>/``, whose ``adapter.py`` fills in
the protocol and ends with ``ADAPTER = register(ModuleAdapter(sys.modules[__name__]))``; the folder's
name is the host's top-level import name (docs/how-it-works.md#a-new-host). The core asks
the registry, never an adapter's module: :func:`adapter_for` loads a host's adapter by
that convention the first time it is asked for.

The targets are data: a table of :class:`.targets.Target` rows (functions and methods
alike) in a :class:`.targets.Patches`, which provides ``patch`` / ``unpatch`` /
``is_patched``. ``patch`` fails open: if it raises, the host is restored, one warning is
logged, and training goes on without protection rather than not at all.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil

from .. import config
from . import import_hooks as _imports
from .versions import installed_version, parse_version  # noqa: F401 (the adapters' and checks' import)

log = logging.getLogger("swift_safe_media")

ENABLED = config.ENABLED

_enabled_hosts: set[str] = set()
_warned: set[str] = set()


def env_state() -> bool | None:
    """True/False when ``SWIFT_SAFE_MEDIA`` turns the package on/off, None when unset."""
    return config.enabled_by_environment()


def in_supported_range(adapter, version: str | None) -> bool:
    """Whether ``version`` of the adapter's host is installed and inside its ``SUPPORTED``."""
    lowest, first_unsupported = adapter.SUPPORTED
    return version is not None and lowest <= parse_version(version) < first_unsupported


def is_supported(adapter) -> bool:
    version = adapter.get_version()
    if not in_supported_range(adapter, version):
        _warn_once(adapter.HOST, f"swift_safe_media: {adapter.DISTRIBUTION} {version} is outside the "
                                 f"supported range {supported_range(adapter.SUPPORTED)}; leaving it untouched")
        return False
    reason = adapter.unsupported()
    if reason:
        _warn_once(adapter.HOST, f"swift_safe_media: {adapter.DISTRIBUTION} {version}: {reason}; "
                                 f"leaving it untouched: none of its decoding is protected")
        return False
    return True


def supported_range(supported) -> str:
    lowest, first_unsupported = supported
    return f">={'.'.join(map(str, lowest))},<{'.'.join(map(str, first_unsupported))}"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


class HostAdapter:
    """What a host's adapter provides. The first eight are required; the rest are optional
    hooks whose defaults here do nothing."""

    HOST: str  # the host's top-level import name (its folder under hosts/)
    DISTRIBUTION: str  # its package name, as pip knows it
    SUPPORTED: tuple[tuple[int, ...], tuple[int, ...]]  # (lowest, first_unsupported) versions
    TRIGGER_MODULES: tuple[str, ...]  # modules whose import (re)applies the patch

    def get_version(self) -> str | None:
        """The installed host version, or None."""
        raise NotImplementedError

    def patch(self) -> None:
        """Idempotent; patches what of the target table is loaded now."""
        raise NotImplementedError

    def unpatch(self) -> None:
        """Restores exactly (and undoes anything else ``patch`` registered)."""
        raise NotImplementedError

    def is_patched(self) -> bool:
        raise NotImplementedError

    # Optional: the host's command-line flags (``hosts/flags.py``), added once one of
    # FLAG_MODULES is imported; they must parse even while the package is off.
    FLAG_MODULES: tuple[str, ...] = ()

    def register_flags(self) -> None:
        """No flags of its own."""

    # Optional: modules DataLoader workers need to unpickle the host's dataset, imported
    # once by the warm forkserver (workers/forkserver.py).
    WORKER_PRELOAD: tuple[str, ...] = ()

    # Optional: False where the host hands its loaders a start method's context of their own,
    # so that no holding server holds their objects: what ``from_pretrained`` loads is then
    # not held ahead for them either (workers/loaded_ahead.py).
    LOADERS_HELD: bool = True

    def worker_start_method(self, loader) -> str | None:
        """The start method this host prefers for ``loader`` (row 1 of the decision in
        workers/start_method.py), or None to leave it to the other rows."""
        return None

    def command_line_asks_for_protection(self) -> bool:
        """True when this process's command line turns protection on, so the decoders are
        checked as the host starts importing."""
        return False

    def is_launcher(self) -> bool:
        """True in a process that only starts the run's processes (ms-swift's ``swift sft``
        runs its training script in a child): it gets no warm forkserver."""
        return False

    def unsupported(self) -> str | None:
        """Why the installed version, inside SUPPORTED, cannot be patched (its layout is
        none the adapter declares), or None. Either way it is left untouched, with one warning."""
        return None


REQUIRED = ("HOST", "DISTRIBUTION", "SUPPORTED", "TRIGGER_MODULES", "get_version", "patch", "unpatch",
            "is_patched")
OPTIONAL = ("FLAG_MODULES", "register_flags", "WORKER_PRELOAD", "LOADERS_HELD", "worker_start_method",
            "command_line_asks_for_protection", "is_launcher", "unsupported")


class ModuleAdapter(HostAdapter):
    """An adapter written as a module, as ours are: its module-level names fill in the
    protocol, what it lacks keeps :class:`HostAdapter`'s default, and its other names
    (``TARGETS``, ``PATCHES``, ...) are found on the adapter too, read when asked (a
    module may compute some, such as LeRobot's ``TRIGGER_MODULES``, from what is installed)."""

    def __init__(self, module):
        self._module = module
        self.__name__ = module.__name__

    def __getattribute__(self, name):
        # Read from the module each time (a test may replace a module's function).
        if name in REQUIRED or name in OPTIONAL:
            module = object.__getattribute__(self, "_module")
            if name in REQUIRED or name in vars(module):
                return getattr(module, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)


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


HOSTS_PACKAGE = "swift_safe_media.hosts"
_registry: dict[str, HostAdapter] = {}


def register(adapter: HostAdapter) -> HostAdapter:
    """Put ``adapter`` in the registry (an adapter module's last line), checked against the
    protocol: a TypeError names what it lacks."""
    host = getattr(adapter, "HOST", None)
    if host is not None:
        # In first: checking may look at the installed host, whose start-up hook asks for this adapter.
        _registry[host] = adapter
    try:
        check_adapter(getattr(adapter, "_module", adapter))
    except TypeError:
        _registry.pop(host, None)
        raise
    return adapter


def known_hosts() -> list[str]:
    """The hosts with a folder under hosts/, and any other adapter registered."""
    spec = importlib.util.find_spec(HOSTS_PACKAGE)
    folders = [found.name for found in pkgutil.iter_modules(spec.submodule_search_locations) if found.ispkg]
    return sorted(set(folders) | set(_registry))


def adapter_for(host: str) -> HostAdapter:
    """The registered adapter of ``host``, loaded from its folder the first time it is asked for."""
    if host not in _registry:
        importlib.import_module(f"{HOSTS_PACKAGE}.{host}.adapter")  # registers itself
    return _registry[host]


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
    for host in hosts or known_hosts():
        if host in _enabled_hosts:
            continue
        _enabled_hosts.add(host)
        for module_name in adapter_for(host).TRIGGER_MODULES:
            _imports.when_imported(module_name, lambda _module, host=host: _apply(host))
        # A release that moved every module of the table would fire none of those: as the host's
        # package is imported, the modules gone from it are named (moved_targets).
        _imports.when_imported(host, lambda _module, host=host: _name_modules_gone(host))


def _name_modules_gone(host: str) -> None:
    adapter = adapter_for(host)
    if not in_supported_range(adapter, adapter.get_version()) or adapter.unsupported():
        return  # named as its modules are imported (is_supported), or not this host's package
    adapter.PATCHES.warn_what_moved()


def disable_hosts() -> None:
    from . import media_libraries as media

    media.disable()
    for host in list(_enabled_hosts):
        _enabled_hosts.discard(host)
        adapter = adapter_for(host)
        for module_name in (*adapter.TRIGGER_MODULES, host):
            _imports.clear(module_name)
        adapter.unpatch()


def hosts_worker_start_method(loader) -> str | None:
    """The start method an enabled host's adapter prefers for ``loader``, or None (the
    decision is :mod:`..workers.start_method`'s)."""
    for host in sorted(_enabled_hosts):
        method = adapter_for(host).worker_start_method(loader)
        if method:
            return method
    return None


def enabled_hosts() -> set[str]:
    return set(_enabled_hosts)


def loaders_may_be_held() -> bool:
    """False where a host patched here hands its loaders a context of their own (``LOADERS_HELD``)."""
    return all(adapter_for(host).LOADERS_HELD for host in patched_hosts())


def patched_hosts() -> set[str]:
    """The enabled hosts whose code is patched now: imported in this process, not only awaited."""
    return {host for host in _enabled_hosts if adapter_for(host).is_patched()}
