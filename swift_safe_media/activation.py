"""``enable`` / ``disable`` / ``is_enabled``: the package-level switch.

Settings are written to the environment, the single source of truth, so DataLoader
workers, ``swift sft``'s child processes and sandboxes all see the same values; the
start-up hook (``swift_safe_media.pth``) turns the package on in every child where
``SWIFT_SAFE_MEDIA=1``.
"""

from __future__ import annotations

import os
import tempfile

from . import config


def enable(*, timeout: float | None = None, max_memory_mb: int | None = None,
           mp_context: str | None = None, stall_timeout: float | None = None,
           stall_action: str | None = None, quarantine: str | None = None, hosts=None) -> None:
    """Protect media decoding in this process and in every child it starts.

    Calling it again (with a registry known only later, say) updates the settings."""
    from . import integrations, watchdog

    config.write(timeout=timeout, max_memory_mb=max_memory_mb, mp_context=mp_context,
                 stall_timeout=stall_timeout, stall_action=stall_action, quarantine=quarantine)
    os.environ[integrations.ENABLED] = "1"
    _choose_stats_dir()
    integrations.enable_hosts(hosts)
    watchdog.install()


_chosen_stats_dir: str | None = None


def _choose_stats_dir() -> None:
    """Per-process decode statistics go next to the quarantine registry, else to a
    fresh temporary folder; workers inherit the choice through the environment. A
    folder chosen here follows the registry when it is set later (ms-swift's default
    registry is known only once its output directory is); one the user set stays."""
    global _chosen_stats_dir
    from . import quarantine, summary

    current = os.environ.get(summary.STATS_DIR)
    if current and current != _chosen_stats_dir:
        return
    registry = os.environ.get(quarantine.QUARANTINE, "").strip()
    if registry:
        wanted = os.path.join(os.path.dirname(os.path.abspath(registry)), "swift_safe_media_stats")
    elif current:
        return
    else:
        wanted = tempfile.mkdtemp(prefix="swift-safe-media-stats-")
    if current and current != wanted:
        try:
            os.rmdir(current)  # the temporary folder it replaces, if nothing was written there yet
        except OSError:
            pass
    os.environ[summary.STATS_DIR] = _chosen_stats_dir = wanted


def disable() -> None:
    """Restore the hosts' own loaders here, and keep children from turning protection on."""
    from . import integrations

    os.environ[integrations.ENABLED] = "0"
    integrations.disable_hosts()


def is_enabled() -> bool:
    from . import integrations

    return bool(integrations.enabled_hosts())
