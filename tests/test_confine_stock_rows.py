"""Each row of the coverage table (``docs/ms-swift.md``) whose stock code opens its media by
name, attacked where that stock code opens it (issue 42): ``soundfile.read``
(libsndfile's ``SoundFile``), transformers' ``load_audio`` (torchcodec's ``AudioDecoder``),
``librosa.load`` (``SoundFile``, then audioread's ffmpeg reader), ``whisper.load_audio``
(the ``run`` that starts its ffmpeg), MiniCPM-o's video with audio (decord's
``VideoReader``, then librosa's readers), InternLM-XComposer's own ``ixc_utils.load_video``
(the model's code itself), ``torchaudio.load`` where torchaudio is installed. Each is
reached through its real entry point under ``enable()``: every attack of
:func:`tests.exploit_standin.attack` is refused (a live loopback connection, an exec, a
write, a token file under ``$HOME``, ``/etc/shadow``, the trainer's environment and its
token), and a valid file still gives stock's own result, computed in a process without
protection or stand-ins. Keye-VL and transformers' ``load_video``: ``test_confine_stock``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from . import exploit_openers
from .fresh import ROOT, clean_environment, run_python
from .test_confine_stock import assert_all_refused, pytestmark, targets  # noqa: F401 (the fixture)

ROWS = {"soundfile.read", "transformers.audio_utils.load_audio", "librosa.load", "whisper.load_audio",
        "minicpmo.utils.get_video_frame_audio_segments", "remote code ixc_utils.load_video"}


# torchaudio has no release for the test stack's torch (2.14); LLaMA-Factory's environment has
# its last one (2.11, which reads through torchcodec): the torchaudio row runs there.
LLAMAFACTORY_PYTHON = os.path.join(ROOT, ".venv-llamafactory", "bin", "python")


def with_torchaudio() -> str | None:
    """An interpreter that has torchaudio: this one, else LLaMA-Factory's environment's."""
    if importlib.util.find_spec("torchaudio") is not None:
        return sys.executable
    if os.path.exists(LLAMAFACTORY_PYTHON) and subprocess.run(
            [LLAMAFACTORY_PYTHON, "-c", "import torchaudio, soundfile"], capture_output=True).returncode == 0:
        return LLAMAFACTORY_PYTHON
    return None


def rows_of(mode: str, folder, environment: dict, pythonpath: list[str], cases=(), python=None) -> dict:
    os.makedirs(folder, exist_ok=True)
    done = run_python(module="tests.programs.stock_exploit_rows", args=[mode, folder, *cases], timeout=500,
                      env=clean_environment({**environment, "PYTHONPATH": os.pathsep.join(pythonpath)}),
                      python=python)
    return {row.pop("case"): row for row in map(json.loads, filter(None, done.stdout.splitlines()))}


def check_rows(cases: set, targets, tmp_path, names=(), python=None) -> dict:  # noqa: F811 (the fixture)
    """Runs the cases protected, with the openers taken over, and as stock; checks each."""
    standins = exploit_openers.write_sitecustomize(str(tmp_path / "standins"))
    stock = rows_of("stock", tmp_path / "stock", {}, [ROOT], names, python)
    rows = rows_of("protected", tmp_path / "protected", targets["environment"], [standins, ROOT], names, python)
    assert set(rows) == cases | {"soundfile.read unprotected"}, rows
    for case in cases:
        row = rows[case]
        # The media named for its opener: the opener ran where stock runs, and said what each attack got.
        found = re.search(rf"EXPLOIT RAN {row['opener']} ([RG]+)", str(row["exploit"]))
        assert found and str(row["exploit"]).startswith("MediaDecodeError"), (case, row)
        assert "exploit-" in row["exploit"], (case, row)  # the error names the media
        assert_all_refused(exploit_openers.from_verdicts(found[1]), targets)
        # A valid file: the same opener attacked again (its attacks refused, or it fails), then stock's result.
        assert "result" in row and "result" in stock[case], (case, row.get("error"), stock[case].get("error"))
        assert row["result"] == stock[case]["result"], case
    return rows


def test_each_rows_stock_opener_is_confined_and_still_decodes_as_stock(targets, tmp_path):  # noqa: F811
    rows = check_rows(ROWS, targets, tmp_path)
    # The same opener without protection: its attacks are real and get through.
    loose = rows["soundfile.read unprotected"]["attacks"]
    assert loose["read a token under $HOME"] == "got: 'hf_SECRET'", loose
    assert loose["read the trainer's environment"].startswith("got"), loose
    assert loose["the token in this environment"] == "got: 'hf_SECRET'", loose
    assert loose["write a file"].startswith("got") and loose["run /bin/sh"] == "got: 'exit 0'", loose
    assert sorted(os.listdir(f"{targets['folder']}-loose")) == ["pwned-by-exec", "pwned-by-write"]


def test_torchaudio_load_is_confined_and_still_decodes_as_stock(targets, tmp_path):  # noqa: F811
    python = with_torchaudio()
    if python is None:
        pytest.skip("no environment here has torchaudio (make test builds .venv-llamafactory, which has)")
    check_rows({"torchaudio.load"}, targets, tmp_path, names=["torchaudio.load"], python=python)
