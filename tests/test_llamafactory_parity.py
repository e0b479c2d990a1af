"""LLaMA-Factory's media reads under protection give stock's outputs bit for bit: every
plugin class that reads media itself (and so every plugin inheriting from one), over the
corpus's videos (h264 with B-frames, VP9, MJPEG, VFR, odd sizes, one frame, ...), audios
(PCM at four rates, MP3, FLAC, Opus, AAC) and images (RGB, RGBA, grey, tall), the Qwen
video metadata, and a real Qwen2.5-Omni processor's inputs to the model. Run in
LLaMA-Factory 0.9.5's own environment (tests/programs/llamafactory_parity.py)."""

from __future__ import annotations

import json
import os

import pytest

from . import media_corpus
from .fresh import clean_environment, run_python
from .test_llamafactory_train import VENV

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                reason=f"{VENV} is missing: `make test` builds it")


@pytest.mark.timeout(600)
def test_every_llamafactory_media_read_is_stock_bit_for_bit(tmp_path_factory):
    corpus = media_corpus.session_corpus(tmp_path_factory)
    corpus_dir = os.path.dirname(next(iter(corpus.values())))
    processor_dir = tmp_path_factory.mktemp("omni_processor")
    run_python(code=f"from tests import tiny_models; tiny_models._processor({str(processor_dir)!r})",
               python=str(VENV / "bin" / "python"), env=clean_environment({"HF_HUB_OFFLINE": "1"}), timeout=240)
    done = run_python(module="tests.programs.llamafactory_parity", args=[corpus_dir, processor_dir], timeout=540,
                      python=str(VENV / "bin" / "python"), env=clean_environment({"HF_HUB_OFFLINE": "1"}))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    differing = [label for label, equal in result["equal"].items() if not equal]
    assert not differing, differing
    assert len(result["equal"]) >= 80 and "qwen2_omni _get_mm_inputs" in result["equal"], sorted(result["equal"])
    assert result["decodes"] >= len(result["equal"]), result  # the protected reads ran in the sandbox
