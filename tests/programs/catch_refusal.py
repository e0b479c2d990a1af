"""A caller that catches the pre-flight refusal of ``enable()``.

``python -m tests.programs.catch_refusal`` calls ``enable()``; on
``ProtectionUnavailable`` it prints ``caught: MISSING | FIX``; then it prints whether
protection is enabled, the ``SWIFT_SAFE_MEDIA`` environment variable children would
inherit, the other settings in the environment, the processes still running that this
one started (``enable()`` starts the warm forkserver and the zygote before its check),
the forkserver ``enable()`` started and whether it still runs, and CPython's
forkserver: its process and preload list.
"""

from __future__ import annotations

import os
from multiprocessing import forkserver


def main() -> None:
    import swift_safe_media

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
    print("children:", sorted(_children()))  # CPython's resource tracker, if anything (it starts one for its forkserver)
    print("forkserver started:", started[:1], "alive:", [pid for pid in started[:1] if _alive(pid)])
    print("forkserver:", server._forkserver_pid, "preload:", server._preload_modules)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children() -> list[str]:
    """What the processes this one started and that still run are running."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as children:
            for pid in children.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    found.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip())
    return found


if __name__ == "__main__":
    main()
