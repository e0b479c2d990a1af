"""The command line as if Ray were not installed.

``python -m tests.programs.cli_without_ray ARGS...`` hides ``ray`` from imports, then runs
``swift-safe-media ARGS...`` and exits with its status.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    sys.modules["ray"] = None  # as if Ray were not installed
    from swift_safe_media.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
