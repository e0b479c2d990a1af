"""The Qwen twin's ``fetch_video`` against stock under ms-swift's vision_process settings.

``python -m tests.programs.qwen_video_settings CLIP`` prints three shapes on one line:
stock ``fetch_video`` after ms-swift's ``patch_qwen_vl_utils``, our twin's after it, and
our twin's before it (as in a spawned worker, which sees only the environment).
"""

from __future__ import annotations

import sys


def main(clip: str) -> None:
    from qwen_vl_utils import vision_process
    from swift.model.models.qwen import patch_qwen_vl_utils
    from swift_safe_media.decoders import qwen as twin

    element = {"video": clip}
    unpatched = twin.fetch_video(dict(element)).shape  # a spawned worker: env only
    patch_qwen_vl_utils(vision_process)                # what ms-swift does in its main process
    stock = vision_process.fetch_video(dict(element)).shape
    ours = twin.fetch_video(dict(element)).shape
    print(tuple(stock), tuple(ours), tuple(unpatched))


if __name__ == "__main__":
    main(sys.argv[1])
