"""The caller unpickles a sandbox's replies with an allow-list (reply_unpickler): a reply
an exploited decoder crafted runs nothing in the trainer. Each attack is a function run
through ``call`` in a real confined sandbox that writes its own pickle straight to the
reply socket; the caller raises the typed error, the payload's marker file never appears,
the sandbox is killed, and the next decode works."""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeCrash, call
from swift_safe_media.engine import pickling
from swift_safe_media.decoders.videoinfo import VideoInfo
from swift_safe_media.errors import MediaDecodeError
from swift_safe_media.confinement.reply_unpickler import RefusedReply, ReplyUnpickler

from . import media_corpus, reply_attacks
from .conftest import wait_until_dead

pytestmark = pytest.mark.timeout(300)

REFUSED = {"os.system": "os.system", "posix.system": "posix.system", "subprocess.Popen": "subprocess.Popen",
           "builtins.eval": "builtins.eval",
           "an allowed module's pickle.loads": "swift_safe_media.engine.pickling.pickle.loads",
           "an allowed module's os.system": "swift_safe_media.confinement.handed.os.system",
           "an error reply's exception": "os.system"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return media_corpus.session_corpus(tmp_path_factory)


def _wait_for(path: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


@pytest.mark.parametrize("how", reply_attacks.ATTACKS)
def test_each_payload_runs_when_unpickled_the_plain_way(tmp_path, how):
    """The control: these bytes are live; a plain unpickler in a fresh interpreter runs them."""
    marker = str(tmp_path / "ran")
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=reply_attacks.payload(how, marker), cwd=tmp_path, timeout=120, capture_output=True)
    assert _wait_for(marker, 10), f"the {how} payload did not run under a plain unpickler"


@pytest.mark.parametrize("how", reply_attacks.ATTACKS)
def test_a_crafted_reply_is_refused_and_runs_nothing_in_the_caller(tmp_path, corpus, how):
    clip = corpus["pcm_16k_stereo.wav"]
    before = safe.load_audio(clip, 16000)
    marker = str(tmp_path / "ran")
    with pytest.raises(MediaDecodeCrash) as caught:
        call(reply_attacks.send_crafted_reply, how, marker, path=clip, timeout=60)
    error = caught.value
    assert error.path == clip and clip in str(error)
    assert f"global {REFUSED[how]} " in error.reason and "refused to unpickle" in error.reason
    pid = int(re.search(r"sandbox pid (\d+)", error.reason).group(1))
    assert not wait_until_dead([pid], within=10), "the sandbox that sent it still runs"
    assert not _wait_for(marker, 1.0), f"the {how} payload ran in the caller"
    after = safe.load_audio(clip, 16000)  # the next decode works, in a fresh sandbox
    np.testing.assert_array_equal(np.asarray(after[0]), np.asarray(before[0]))


def test_a_type_of_the_users_own_comes_back_once_named(monkeypatch):
    with pytest.raises(MediaDecodeCrash, match="SWIFT_SAFE_MEDIA_REPLY_GLOBALS"):
        call(reply_attacks.judge, 3)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_REPLY_GLOBALS", "tests.reply_attacks:Verdict")
    verdict = call(reply_attacks.judge, 3)
    assert type(verdict) is reply_attacks.Verdict and verdict.frames == 3


def test_a_module_the_user_allowed_whole_gives_only_what_it_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_REPLY_GLOBALS", "tests.reply_attacks:*,swift_safe_media.confinement.handed:*")
    assert type(call(reply_attacks.judge, 2)) is reply_attacks.Verdict
    marker = str(tmp_path / "ran")
    with pytest.raises(MediaDecodeCrash, match=r"global swift_safe_media\.confinement\.handed\.os\.system "):
        call(reply_attacks.send_crafted_reply, "an allowed module's os.system", marker, timeout=60)
    assert not _wait_for(marker, 1.0)


def test_an_error_of_the_users_own_comes_back_as_itself_without_running_its_code():
    with pytest.raises(reply_attacks.PickyError) as caught:
        call(reply_attacks.fail_picky, "clip.mp4", 2)
    assert caught.value.frames == 2 and str(caught.value) == "clip.mp4: 2 frames is too few"


def _through(obj):
    stream = io.BytesIO()
    pickling.Pickler(stream, protocol=5).dump(obj)
    return ReplyUnpickler(io.BytesIO(stream.getvalue())).load()


def test_what_replies_are_made_of_comes_back_unchanged():
    import torch
    from PIL import Image

    frames = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    info = VideoInfo(num_frames=2, fps=25.0, duration=0.08, width=6, height=4)
    error = MediaDecodeError("clip.mp4", "decode failed: bad header", 0.5)
    error.fault = "machine"
    reply = {"frames": frames, "strided": frames.transpose(0, 3, 1, 2),
             "tensor": torch.ones(2, 3, dtype=torch.bfloat16),
             "image": Image.fromarray(frames[0]), "info": info, "error": error, "objects": np.array([1, "a"], object),
             "scalars": (np.float32(1.5), 3, 2.5, "s", b"b", None, True), "shape": torch.Size([2, 3])}
    back = _through(reply)
    np.testing.assert_array_equal(back["frames"], frames)
    np.testing.assert_array_equal(back["strided"], frames.transpose(0, 3, 1, 2))
    assert back["tensor"].dtype == torch.bfloat16 and torch.equal(back["tensor"], reply["tensor"])
    assert np.array_equal(np.asarray(back["image"]), frames[0])
    assert back["info"] == info and back["scalars"] == reply["scalars"] and back["shape"] == reply["shape"]
    assert str(back["error"]) == str(error) and back["error"].fault == "machine"
    assert back["objects"].tolist() == [1, "a"]


def test_numpy_is_never_asked_for_an_object_array_over_raw_memory():
    """``numpy.ndarray`` called itself would view the reply's bytes as object pointers."""
    forged = b"\x80\x05" + reply_attacks._global("numpy", "ndarray") + pickle.dumps(
        ((2,), np.dtype(object), b"\x41" * 16), protocol=5)[2:-1] + b"R."
    with pytest.raises(RefusedReply, match="does not rebuild"):
        ReplyUnpickler(io.BytesIO(forged)).load()
    strided = b"\x80\x05" + reply_attacks._global("swift_safe_media.engine.pickling", "_rebuild_strided_array") + \
        pickle.dumps((np.zeros(16, np.uint8), "|O", (2,), (8,)), protocol=5)[2:-1] + b"R."
    with pytest.raises(RefusedReply, match="object array"):
        ReplyUnpickler(io.BytesIO(strided)).load()


def test_nothing_a_reply_names_is_imported():
    assert "antigravity" not in sys.modules
    with pytest.raises(RefusedReply, match=r"global antigravity\.fly "):
        ReplyUnpickler(io.BytesIO(b"\x80\x04" + reply_attacks._global("antigravity", "fly") + b".")).load()
    assert "antigravity" not in sys.modules


def test_a_reply_that_sets_a_class_attribute_is_refused_and_the_class_put_back():
    """pickle's BUILD applied to an allowed class itself would set the class's attributes in
    the trainer."""
    before = dict(vars(VideoInfo))
    state = pickle.dumps((None, {"__eq__": None, "planted": 1}), protocol=4)[2:-1]
    stream = b"\x80\x04" + reply_attacks._global("swift_safe_media.decoders.videoinfo", "VideoInfo") + state + b"b."
    with pytest.raises(RefusedReply, match="changed the class swift_safe_media.decoders.videoinfo.VideoInfo"):
        ReplyUnpickler(io.BytesIO(stream)).load()
    assert dict(vars(VideoInfo)) == before


def test_a_name_is_never_resolved_through_a_lazy_modules_getattr(monkeypatch):
    import types

    lazy = types.ModuleType("lazy_module_for_reply_test")
    lazy.__getattr__ = lambda name: pytest.fail(f"{name} resolved through the module's __getattr__")
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)
    with pytest.raises(RefusedReply, match="is not allowed in a reply"):
        ReplyUnpickler(io.BytesIO(b"\x80\x04" + reply_attacks._global(lazy.__name__, "Anything") + b".")).load()
