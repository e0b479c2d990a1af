"""A parent that enables protection, then starts ``tests.programs.preflight_child``.

``python -m tests.programs.preflight_parent`` prints ``parent inspected: N`` (its own
pre-flight verdicts), then runs the child (a plain subprocess, as ``swift sft`` starts its
training process), which prints its own count; exits non-zero if the child fails.
"""

from __future__ import annotations

import subprocess
import sys


def main() -> None:
    import swift_safe_media
    from swift_safe_media.checks import preflight

    swift_safe_media.enable()
    print("parent inspected:", len(preflight._verdicts))
    sys.stdout.flush()
    subprocess.run([sys.executable, "-m", "tests.programs.preflight_child"], check=True)


if __name__ == "__main__":
    main()
