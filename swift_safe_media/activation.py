"""``enable`` / ``disable`` / ``is_enabled``: the package-level switch.

Settings are written to the environment, the single source of truth, so DataLoader
workers, ``swift sft``'s child processes and sandboxes all see the same values; the
start-up hook (``swift_safe_media.pth``) turns the package on in every child where
``SWIFT_SAFE_MEDIA=1``.
"""

from __future__ import annotations

import os

from . import config, process
from .patching import host_adapters as integrations
from .engine import run_folders, sandbox
from .patching import import_hooks as _imports


def enable(*, timeout: float | None = None, max_memory_mb: int | None = None,
           mp_context: str | None = None, stall_timeout: float | None = None,
           stall_action: str | None = None, quarantine: str | None = None, hosts=None) -> None:
    """Protect media decoding in this process and in every child it starts.

    Raises ProtectionUnavailable, before anything is patched, when the decoders of
    ``hosts`` cannot load here (checked once per run: see ``preflight``); what it had
    started by then is stopped, and the environment children inherit is as it was.
    Calling it again (with a registry known only later, say) updates the settings."""
    from .checks import preflight, user_code
    from .workers import forkserver as warm_start, respawn as worker_respawn, start as worker_start
    from .records import watchdog

    config.write(timeout=timeout, max_memory_mb=max_memory_mb, mp_context=mp_context,
                 stall_timeout=stall_timeout, stall_action=stall_action, quarantine=quarantine)
    config.validate()  # every setting: a bad value fails here, not inside a worker
    before = config.snapshot()
    config.put(config.ENABLED, True)
    if _starts_runs():
        run_folders.sweep()  # what runs killed with their zygotes left in the temporary folder
    _choose_stats_dir()
    if _starts_runs():
        # First, in the background: the warm forkserver's imports (seconds) overlap the
        # pre-flight check's (torch, a second or two) and then the run's own set-up.
        warm_start.start(hosts)
    try:
        preflight.require(hosts)  # decoders that cannot load stop the run here, not in every worker
    except BaseException:  # refused (ProtectionUnavailable), or interrupted: nothing of ours stays
        warm_start.withdraw()
        config.restore(before)
        raise
    integrations.enable_hosts(hosts)
    watchdog.install()
    worker_start.install()
    worker_respawn.install()
    user_code.warn_unbounded_openers(in_trainer=_starts_runs())  # once: openers enable() cannot bound


_chosen_stats_dir: str | None = None


def _choose_stats_dir() -> None:
    """Per-process decode statistics go next to the quarantine registry, else to a
    fresh temporary folder; workers inherit the choice through the environment. A
    folder chosen here follows the registry when it is set later (ms-swift's default
    registry is known only once its output directory is); one the user set stays."""
    global _chosen_stats_dir
    current = config.get(config.STATS_DIR)
    if current and current != _chosen_stats_dir:
        return
    registry = config.get(config.QUARANTINE)
    if registry:
        wanted = os.path.join(os.path.dirname(os.path.abspath(registry)), "swift_safe_media_stats")
    elif current:
        return
    else:
        # Ours: removed as this process exits, or by its zygote if it is killed (run_folders).
        wanted = run_folders.make("stats")
    if current and current != wanted and current in run_folders.owned():
        try:
            os.rmdir(current)  # the temporary folder it replaces, if nothing was written there yet
        except OSError:
            pass  # it goes at exit, with what was written there
        else:
            run_folders.forget(current)
    config.put(config.STATS_DIR, wanted)
    _chosen_stats_dir = config.get(config.STATS_DIR)


def disable() -> None:
    """Undo what ``enable`` did here (the hosts' own loaders, torch's own DataLoader: how
    its workers start, its iteration without the watchdog, its workers left dead when
    killed), and keep children from turning protection on."""
    from .workers import forkserver as warm_start, respawn as worker_respawn, start as worker_start
    from .records import watchdog

    config.put(config.ENABLED, False)
    integrations.disable_hosts()
    watchdog.uninstall()
    worker_respawn.uninstall()
    worker_start.uninstall()  # torch's DataLoader is torch's own again
    warm_start.stop()


def is_enabled() -> bool:
    return bool(integrations.enabled_hosts())


_flags_watched: set[str] = set()  # hosts whose flag modules are watched (import hooks live for the process too)


def on_host_imported(host: str) -> None:
    """Called by the start-up hook (``_swift_safe_media_startup``) as a host package
    begins importing: its flags parse from now on, and ``SWIFT_SAFE_MEDIA=1`` turns
    protection on for it."""
    adapter = integrations.adapter_for(host)
    if host not in _flags_watched:  # a forkserver forked from this process sees the host begin again
        _flags_watched.add(host)
        for module_name in adapter.FLAG_MODULES:
            _imports.when_imported(module_name, lambda _module: adapter.register_flags())
    state = config.enabled_by_environment()
    if adapter.is_launcher():
        process.current().dataloader_workers_expected = False  # its child runs them
    if state:
        if _starts_runs():
            enable(hosts=[host])  # the run's stats folder, the watchdog
        else:
            integrations.enable_hosts([host])
    elif state is None and adapter.command_line_asks_for_protection() and _starts_runs():
        from .checks import preflight
        from .workers import forkserver as warm_start

        warm_start.fork_ahead(host)  # while this process has one thread (the host's imports start some); not in a launcher
        preflight.require([host])  # now, not after the host's imports: protection that cannot work stops at once


def _starts_runs() -> bool:
    """False in a DataLoader worker, a sandbox or the warm forkserver: they join their parent's run."""
    import multiprocessing

    from .workers import forkserver as warm_start

    return (multiprocessing.parent_process() is None and not _being_started_by_multiprocessing()
            and not sandbox.in_sandbox() and not warm_start.in_forkserver())


def _being_started_by_multiprocessing() -> bool:
    """A spawned or forkserver child while it imports the parent's main module and
    unpickles its target: ``parent_process()`` is set only after that, so a host imported
    then (``lerobot-train``'s console script imports the whole trainer) would otherwise
    take the child for a new run and start a forkserver and a zygote of its own."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))
