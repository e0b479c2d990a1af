"""The Qwen twin honours the vision_process settings ms-swift applies from the
environment (FPS_MAX_FRAMES, VIDEO_MAX_TOKEN_NUM, ...), like stock does."""

import os
import subprocess

import pytest

from .fresh import ROOT, run_python




@pytest.mark.timeout(240)
def test_fetch_video_follows_ms_swift_settings(tmp_path):
    clip = tmp_path / "clip.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "testsrc2=size=320x240:rate=30:duration=10",
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", str(clip)], check=True)
    env = dict(os.environ, FPS_MAX_FRAMES="8", VIDEO_MAX_TOKEN_NUM="64", FORCE_QWENVL_VIDEO_READER="torchcodec",
               PYTHONPATH=ROOT)
    done = run_python(module="tests.programs.qwen_video_settings", args=[clip], env=env, cwd=str(tmp_path),
                      timeout=200)
    stock, ours, unpatched = done.stdout.strip().splitlines()[-1].split(") (")
    assert stock.strip("()") == ours.strip("()") == unpatched.strip("()")
    assert stock.strip("(").startswith("8,"), "FPS_MAX_FRAMES=8 caps the frame count"
