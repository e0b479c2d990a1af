"""Confinement, second round (issue #37): from inside a confined sandbox, an exploited
decoder reads nothing but its media and what decoding needs, holds no secret, and cannot
write into the trainer's log. The trainer here has tokens in its environment and a token
file under ``$HOME/.cache/huggingface``, as real runs do; every attack runs in a real
sandbox, through the engine and after a real decode by each twin family."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import swift_safe_media
import swift_safe_media.decoders as safe
from swift_safe_media import MediaDecodeError, call
from swift_safe_media.confinement import policy as confine, handed

from . import media_corpus, secrets_attacks
from .fresh import ROOT, clean_environment, run_python

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(confine.landlock_abi() < 1 or confine.seccomp_available() is not None,
                       reason="the kernel lacks Landlock or seccomp"),
]

TOKENS = {"HF_TOKEN": "hf_issue37_not_a_real_token", "WANDB_API_KEY": "wandb_issue37_fake",
          "AWS_SECRET_ACCESS_KEY": "aws_issue37_fake"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return media_corpus.session_corpus(tmp_path_factory)


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """A trainer's surroundings: tokens in its environment, a token file in its home, a
    second dataset folder; the engine (re)started with them."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(TOKENS["HF_TOKEN"])
    other = tmp_path / "other_dataset"
    other.mkdir()
    (other / "private_clip.mp4").write_bytes(b"another dataset's private bytes")
    monkeypatch.setenv("HOME", str(home))
    for name, value in TOKENS.items():
        monkeypatch.setenv(name, value)
    swift_safe_media.shutdown()
    yield {"home": str(home), "other": str(other / "private_clip.mp4"), "pid": os.getpid()}
    swift_safe_media.shutdown()


def assert_contained(found: dict) -> None:
    table = "\n".join(f"  {name:32} {outcome}" for name, outcome in found.items())
    for name, outcome in found.items():
        if name in ("/proc/self/environ", "os.environ"):
            assert outcome == "got: []", f"{name} holds a token:\n{table}"
        else:
            assert outcome.startswith("refused: PermissionError"), f"{name} was not refused:\n{table}"
    assert len(found) == 8


def assert_nothing_reached_the_log(capfd) -> None:
    out, err = capfd.readouterr()
    assert secrets_attacks.MARKER not in out and secrets_attacks.MARKER not in err
    assert len(out) + len(err) < 10000, "the sandbox's 2 MB of output reached the trainer's streams"


def test_attacks_through_the_engine_are_contained(trainer, capfd):
    found = call(secrets_attacks.steal, trainer["home"], trainer["other"], trainer["pid"], timeout=60)
    assert_contained(found)
    assert_nothing_reached_the_log(capfd)


# One twin of every loader family (and audio, and a video given as image files), with
# the arguments after the media.
TWINS = {
    "decord": ("load_video_internvl", "h264_noaudio.mp4", (None, 8)),
    "pyav": ("load_video_llava", "h264_aac_bframes.mp4", ()),
    "opencv": ("load_vllm_video", "vp9.webm", (8,)),
    "moviepy": ("load_video_ovis2", "h264.mov", (8,)),
    "torchcodec": ("fetch_video", "h264_noaudio.mp4", ()),
    "soundfile": ("load_audio", "pcm_16k_stereo.wav", (16000,)),
    "audio in a container": ("load_audio", "aac_44k_stereo.m4a", (16000,)),
}


def _media(loader, path):
    return {"video": path, "nframes": 4} if loader == "fetch_video" else path


@pytest.mark.parametrize("family", sorted(TWINS))
def test_a_real_decode_works_and_its_sandbox_is_contained(trainer, corpus, capfd, family):
    loader, name, args = TWINS[family]
    expected = getattr(safe, loader)(_media(loader, corpus[name]), *args)  # through the engine, handed
    expected = expected[0] if isinstance(expected, tuple) else expected
    # The file handed to the call as the engine hands it to a twin's own sandbox call.
    decoded, found = call(secrets_attacks.decode_then_steal, loader, _media(loader, handed.hand(corpus[name])), args,
                          trainer["home"], trainer["other"], trainer["pid"], timeout=120)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(expected))
    assert_contained(found)
    assert_nothing_reached_the_log(capfd)


def test_a_video_given_as_image_files_decodes_through_the_stock_code(trainer, tmp_path, capfd):
    from PIL import Image

    frames = []
    for index in range(4):
        frames.append(str(tmp_path / f"frame{index}.png"))
        Image.fromarray(np.full((56, 84, 3), 40 * index, np.uint8)).save(frames[-1])
    video = safe.fetch_video({"video": frames})  # the stock qwen code opens each file by name, in the sandbox
    assert video.shape[0] == 4 and int(video[3].float().mean()) != int(video[0].float().mean())
    decoded, found = call(secrets_attacks.decode_then_steal, "fetch_video",
                          {"video": [handed.hand(frame) for frame in frames]}, (),
                          trainer["home"], trainer["other"], trainer["pid"], timeout=120)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(video))
    assert_contained(found)
    assert_nothing_reached_the_log(capfd)


def test_what_a_failed_call_printed_comes_back_escaped_and_capped_in_its_error(capfd):
    with pytest.raises(ValueError, match="decoder gave up") as caught:
        call(secrets_attacks.print_and_fail, 1 << 20)
    notes = [note for note in caught.value.__notes__ if note.startswith("sandbox output: ")]
    assert len(notes) == 1
    note = notes[0]
    assert "\\x1b[2J\\nswift_safe_media summary: all good\\n" in note  # escaped: one line, no escape sequence
    assert "\x1b" not in note and "\n" not in note
    assert len(note) < 4096 + 100 and note.endswith("...(cut)")
    assert "all good" not in capfd.readouterr().err


def test_a_media_error_carries_the_output_in_its_message():
    path = "/datasets/scraped/clip_0042.mp4"
    with pytest.raises(MediaDecodeError) as caught:
        call(secrets_attacks.print_media_error, path=path)
    assert caught.value.path == path
    assert "sandbox output: [mov @ 0x1] moov atom not found\\n" in str(caught.value)
    # A call that succeeds: what it printed is dropped, not carried into the next call's error.
    call(secrets_attacks.print_then_return)
    with pytest.raises(MediaDecodeError) as caught:
        call(secrets_attacks.print_media_error, path=path)
    assert "succeeded" not in str(caught.value)


def test_zygote_and_sandbox_hold_no_token(trainer, monkeypatch):
    # A token on the command line too (`swift sft --hub_token ...`): the sandbox's sys.argv withholds it.
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--hub_token", TOKENS["HF_TOKEN"], "--max_tokens", "5"])
    facts = call(secrets_attacks.sandbox_environment)
    assert TOKENS["HF_TOKEN"] not in facts["argv"] and facts["argv"][-4:] == ["--hub_token", "<withheld>",
                                                                             "--max_tokens", "5"]
    for names in (facts["environ"], facts["initial"]):
        assert not set(TOKENS) & set(names), names
    # The zygote, read from outside: its initial environment block holds none either.
    with open(f"/proc/{facts['ppid']}/environ", "rb") as block:
        assert not any(value.encode() in block.read() for value in TOKENS.values())


def test_a_zygote_forked_from_the_warm_forkserver_is_scrubbed():
    """The warm forkserver holds the trainer's environment; the zygote forked from it
    empties os.environ and zeroes its initial environment block before it serves."""
    env = clean_environment(dict(TOKENS), warm_start=True)
    done = run_python(module="tests.programs.warm_secrets", env=env, timeout=240)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["started_by"] == "fork_zygote" and found["problem"] is None, found
    assert found["zygote_block_has_token"] is False and found["zygote_block_bytes"] > 0
    for names in (found["sandbox"]["environ"], found["sandbox"]["initial"]):
        assert not set(TOKENS) & set(names), names
    assert "LANG" in found["sandbox"]["environ"] or "PATH" in found["sandbox"]["environ"]


def test_sandbox_env_keeps_what_a_user_names(monkeypatch, fresh_engine):
    monkeypatch.setenv("MY_DECODER_PLUGIN_DIR", "/opt/plugins")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_SANDBOX_ENV", "MY_DECODER_PLUGIN_DIR")
    assert "MY_DECODER_PLUGIN_DIR" in call(secrets_attacks.sandbox_environment)["environ"]


def test_read_roots_slash_reads_anywhere_again(trainer, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_READ_ROOTS", "/")
    swift_safe_media.shutdown()
    found = call(secrets_attacks.steal, trainer["home"], trainer["other"], trainer["pid"], timeout=60)
    assert found["other dataset folder"].startswith("got: ")  # widened, as asked
    assert found["os.environ"] == "got: []"  # the environment stays allow-listed


def test_cli_and_doctor_show_the_read_and_environment_policy(trainer, monkeypatch):
    for number in range(40):  # as on a CI machine: dozens of names sorting before HF_TOKEN
        monkeypatch.setenv(f"A_CI_VARIABLE_{number:02d}", "x")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "swift_safe_media.cli", "confinement"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = json.loads(done.stdout)
    assert shown["reads"]["limited"] and "/proc/<sandbox pid>" in shown["reads"]["own_proc"]
    assert "handed" in shown["reads"]["media"] and any("Python" in why for why in shown["reads"]["roots"].values())
    assert "HF_TOKEN" in shown["environment"]["withheld_here"]
    assert shown["sandbox"]["reads_limited"] and "HF_TOKEN" not in shown["sandbox"]["environment"]
    from swift_safe_media.checks import doctor

    line = doctor.confinement()
    assert "reads only the media handed to each decode" in line and "HF_TOKEN" in line
    assert "A_CI_VARIABLE_39" not in line and " more" in line  # cut short, the credentials kept
