"""A caller to be killed with SIGKILL: its zygote, sandbox and helpers must die with it.

``python -m tests.programs.engine_kill_target PID_FILE busy|idle`` starts a sandbox and
prints ``ZYGOTE_PID SANDBOX_PID``; with ``busy`` it also forks a helper in the sandbox,
writes the helper's pid to PID_FILE and blocks in a 600 s sandboxed call; then it sleeps.
"""

from __future__ import annotations

import sys
import time


def main(pid_file: str, mode: str) -> None:
    from swift_safe_media import call
    from swift_safe_media.engine.calls import get_engine
    from tests import sandboxed

    sandbox = call(sandboxed.sandbox_pid)
    print(get_engine()._link.zygote.process.pid, sandbox, flush=True)
    if mode == "busy":
        helper = call(sandboxed.fork_helper)  # a confined sandbox cannot write the pid file itself
        with open(pid_file, "w") as out:
            out.write(str(helper))
        call(sandboxed.sleep_then_pid, 600, timeout=600)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
