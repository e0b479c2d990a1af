"""A caller that catches the pre-flight refusal of ``enable()``.

``python -m tests.programs.catch_refusal`` calls ``enable()``; on
``ProtectionUnavailable`` it prints ``caught: MISSING | FIX``; then it prints whether
protection is enabled, the ``SWIFT_SAFE_MEDIA`` environment variable children would
inherit, the other settings in the environment, the processes still running below this
one (``enable()`` starts the warm forkserver and the zygote before its check),
the forkserver ``enable()`` started and whether it still runs, and CPython's
forkserver: its process and preload list.
"""

from __future__ import annotations

import os
from multiprocessing import forkserver


def main() -> None:
    import swift_safe_media
    from swift_safe_media.records import watchdog
    from swift_safe_media import process  # whether a process still exists

    server = forkserver._forkserver
    ensure_running, started = server.ensure_running, []

    def noting_ensure_running():  # CPython's own, observed: which forkserver it started
        ensure_running()
        started.append(server._forkserver_pid)

    server.ensure_running = noting_ensure_running
    try:
        swift_safe_media.enable()
    except swift_safe_media.ProtectionUnavailable as exc:
        print("caught:", exc.missing, "|", exc.fix)
    print("protected:", swift_safe_media.is_enabled(), "env:", os.environ.get("SWIFT_SAFE_MEDIA"))
    print("settings:", sorted(name for name in os.environ if name.startswith("SWIFT_SAFE_MEDIA")))
    # CPython's resource tracker, if anything (its forkserver starts one, and it ends with this process).
    print("children:", sorted(str(watchdog._cmdline(pid)).strip() for pid in watchdog._descendants(os.getpid())))
    print("forkserver started:", started[:1], "alive:", [pid for pid in started[:1] if process.exists(pid)])
    print("forkserver:", server._forkserver_pid, "preload:", server._preload_modules)


if __name__ == "__main__":
    main()
