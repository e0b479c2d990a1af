"""A caller that catches the pre-flight refusal of ``enable()``.

``python -m tests.programs.catch_refusal`` calls ``enable()``; on
``ProtectionUnavailable`` it prints ``caught: MISSING | FIX``; then it prints whether
protection is enabled and the ``SWIFT_SAFE_MEDIA`` environment variable children would
inherit.
"""

from __future__ import annotations

import os


def main() -> None:
    import swift_safe_media

    try:
        swift_safe_media.enable()
    except swift_safe_media.ProtectionUnavailable as exc:
        print("caught:", exc.missing, "|", exc.fix)
    print("protected:", swift_safe_media.is_enabled(), "env:", os.environ.get("SWIFT_SAFE_MEDIA"))


if __name__ == "__main__":
    main()
