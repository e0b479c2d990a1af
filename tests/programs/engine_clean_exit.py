"""A caller that exits normally after a large (shared-memory) result.

``python -m tests.programs.engine_clean_exit`` fetches 32 frames of 360x640 through a
sandbox, then prints ``ZYGOTE_PID SANDBOX_PID`` and exits; the test checks both die and
nothing is left in /dev/shm.
"""

from __future__ import annotations


def main() -> None:
    from swift_safe_media import call
    from swift_safe_media.engine.calls import get_engine
    from tests import sandboxed

    frames = call(sandboxed.big_frames, 360, 640)
    assert frames.shape == (32, 360, 640, 3)
    print(get_engine()._link.zygote.process.pid, call(sandboxed.sandbox_pid), flush=True)


if __name__ == "__main__":
    main()
