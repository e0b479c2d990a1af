"""Start-up hook, imported by ``swift_safe_media.pth`` in every interpreter.

Cheap (no import beyond ``os`` and ``sys``), run-once and failing open: it only
watches for a host framework (ms-swift, LeRobot, LLaMA-Factory) to begin importing, then hands over
to ``swift_safe_media.activation``, which reads ``SWIFT_SAFE_MEDIA`` and the flags.
"""

import os
import sys

_HOSTS = ("swift", "lerobot", "llamafactory")


class _HostWatcher:
    """A meta-path finder that finds nothing; it notices a host's first import."""

    def __init__(self):
        self.pending = set(_HOSTS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.pending:
            self.announce(fullname)
        return None

    def announce(self, host):
        """``host`` begins importing; or, in a warm forkserver whose template imported it
        ahead (before the trainer's settings came), it has been imported."""
        self.pending.discard(host)
        if not self.pending:
            sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]
        try:
            from swift_safe_media import activation

            activation.on_host_imported(host)
        except Exception as exc:  # never break the user's interpreter...
            if type(exc).__name__ == "ProtectionUnavailable":
                raise  # ...except to stop a run that asked for protection it cannot have
            print(f"swift_safe_media: start-up hook skipped for {host}: {exc!r}", file=sys.stderr)


def install() -> None:
    if getattr(sys, "_swift_safe_media_watcher", None) is not None:
        return
    if any(name in sys.modules for name in _HOSTS):
        return  # too late to watch; enable() explicitly
    sys._swift_safe_media_watcher = watcher = _HostWatcher()
    sys.meta_path.insert(0, watcher)


def answer_stack_dumps() -> None:
    """A spawned DataLoader worker of a watched run prints its stacks on request."""
    import faulthandler
    import signal

    # The same signal as swift_safe_media.records.watchdog.DUMP_SIGNAL (this module imports no package code).
    faulthandler.register(signal.SIGRTMIN + 7, file=sys.stderr, all_threads=True, chain=False)


# The two settings read here are declared in swift_safe_media/config.py (STARTUP_HOOK,
# INFLIGHT_DIR); they are read raw because this module must import nothing of the package.
if os.environ.get("SWIFT_SAFE_MEDIA_STARTUP_HOOK", "1") != "0":
    try:
        install()
        if os.environ.get("SWIFT_SAFE_MEDIA_INFLIGHT_DIR"):
            answer_stack_dumps()
    except Exception:
        pass
