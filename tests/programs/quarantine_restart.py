"""A restarted process refuses a file the registry quarantined in an earlier one.

``python -m tests.programs.quarantine_restart FIFO`` calls ``sandboxed.open_fifo(FIFO)``
with protection (the registry comes from ``SWIFT_SAFE_MEDIA_QUARANTINE``) and prints
``refused PATH`` when the call is refused as quarantined.
"""

from __future__ import annotations

import sys


def main(fifo: str) -> None:
    from swift_safe_media import MediaQuarantined, call
    from tests import sandboxed

    try:
        call(sandboxed.open_fifo, fifo, timeout=30)
    except MediaQuarantined as exc:
        print("refused", exc.path)


if __name__ == "__main__":
    main(sys.argv[1])
