# check.py as a user first writes it: a loader called at the top level, without
# `if __name__ == "__main__":`. Run with SWIFT_SAFE_MEDIA=1 (protection turns on as ms-swift
# is imported) and CLIP naming a video: as a file, with -m, or typed line by line (-c,
# stdin, python -i, IPython), so every line here stands alone. "SCRIPT STARTED pid" is
# printed once per run of the top level: twice if some child ran the script again.
import os
print("SCRIPT STARTED", os.getpid(), flush=True)
from swift.template.vision_utils import load_video_llava
frames = load_video_llava(os.environ["CLIP"])
print("DECODED", len(frames), flush=True)
from swift_safe_media import process
print("SHARED ZYGOTE", process.current().shared_zygote is not None and process.current().shared_zygote.problem, flush=True)
