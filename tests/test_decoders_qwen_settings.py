"""The Qwen twin honours the vision_process settings ms-swift applies from the
environment (FPS_MAX_FRAMES, VIDEO_MAX_TOKEN_NUM, ...), like stock does."""

import os
import subprocess
import sys
import textwrap

import pytest

from .fresh import ROOT


SCRIPT = textwrap.dedent("""
    import sys
    from qwen_vl_utils import vision_process
    from swift.model.models.qwen import patch_qwen_vl_utils
    from swift_safe_media.decoders import qwen as twin
    clip = sys.argv[1]
    element = {"video": clip}
    unpatched = twin.fetch_video(dict(element)).shape  # a spawned worker: env only
    patch_qwen_vl_utils(vision_process)                # what ms-swift does in its main process
    stock = vision_process.fetch_video(dict(element)).shape
    ours = twin.fetch_video(dict(element)).shape
    print(tuple(stock), tuple(ours), tuple(unpatched))
""")


@pytest.mark.timeout(240)
def test_fetch_video_follows_ms_swift_settings(tmp_path):
    clip = tmp_path / "clip.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "testsrc2=size=320x240:rate=30:duration=10",
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", str(clip)], check=True)
    env = dict(os.environ, FPS_MAX_FRAMES="8", VIDEO_MAX_TOKEN_NUM="64", FORCE_QWENVL_VIDEO_READER="torchcodec",
               PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(clip)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    stock, ours, unpatched = done.stdout.strip().splitlines()[-1].split(") (")
    assert stock.strip("()") == ours.strip("()") == unpatched.strip("()")
    assert stock.strip("(").startswith("8,"), "FPS_MAX_FRAMES=8 caps the frame count"
