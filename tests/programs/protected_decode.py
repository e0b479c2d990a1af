"""One protected decode in a fresh interpreter, for tests of what it leaves behind.

``python -m tests.programs.protected_decode CLIP`` enables protection with no host,
decodes CLIP with the Llava loader and asserts it has frames.
"""

from __future__ import annotations

import sys


def main(clip: str) -> None:
    import swift_safe_media

    swift_safe_media.enable(hosts=[])
    from swift_safe_media.decoders import load_video_llava

    assert load_video_llava(clip).shape[0] > 0


if __name__ == "__main__":
    main(sys.argv[1])
