"""ms-swift templates that read their model while they encode (issue 27).

``Template.__getstate__`` drops the model, so DataLoader workers started by the warm
forkserver (protection's default) or spawn get ``model=None``; stock ms-swift forks its
workers on Linux and they find the trainer's model. Which templates those are is read
from ms-swift's source (``swift_safe_media.hosts.swift.templates``); for them the
adapter has the DataLoader fork its workers, one warning says so, and each decode still
runs in a sandbox of the clean zygote. Here: the full list in ms-swift 4.6.0, and ms-swift's
real template classes with stand-in models through a real DataLoader with two workers,
stock against protected, tensor by tensor."""

import json
import os

import pytest

from .fresh import ROOT, clean_environment, run_python
from .swift_scenario import _ffmpeg

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")
torch = pytest.importorskip("torch")

# Every ms-swift 4.6.0 template class whose worker-side code (encode, data_collator and all
# they reach) reads self.model directly, and where. The issue listed the first read of each
# family; the scan adds Ovis2, CogVLM2-Video's own _encode, MiniCPM-V 2.5 (its non-slice
# path), XComposer2-4KHD and 2.5, and Valley's process_images.
MODEL_READERS_4_6_0 = {
    "CogTemplate": ("CogTemplate._encode",),
    "Cog2VideoTemplate": ("Cog2VideoTemplate._encode",),
    "InternLMXComposer2Template": ("InternLMXComposer2Template._encode",),
    "InternLMXComposer2_4khdTemplate": ("InternLMXComposer2Template._encode",),
    "InternLMXComposer2_5Template": ("InternLMXComposer2Template._encode",),
    "LLavaTemplate": ("LLavaTemplate._encode",),
    "MiMoV2Template": ("MiMoV2Template._encode",),
    "MiniCPMVTemplate": ("MiniCPMVTemplate._encode",),
    "MiniCPMV2_5Template": ("MiniCPMVTemplate._encode",),
    "Ovis1_6Template": ("Ovis1_6Template._encode",),
    "Ovis2Template": ("Ovis1_6Template._encode",),
    "StepAudioTemplate": ("StepAudioTemplate.replace_tag",),
    "ValleyTemplate": ("ValleyTemplate.preprocess_images", "ValleyTemplate.process_images"),
    "YiVLTemplate": ("YiVLTemplate._encode",),
}
# Templates that reach the model only through ms-swift's _get_model(), which builds a dummy
# model (no weights) where there is none: their workers keep the protected start method.
DUMMY_MODEL_USERS = ("Qwen2VLTemplate", "Qwen2_5OmniTemplate", "Qwen3OmniTemplate", "Qwen3VLTemplate",
                     "Ovis2_5Template", "GLM4VTemplate")

SCAN = """
import json
from swift.template.base import Template
import swift.template.templates  # every family's module: all of ms-swift's template classes
from swift_safe_media.hosts.swift.templates import model_reads_in_workers

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

print(json.dumps({cls.__name__: [cls.use_model, model_reads_in_workers(cls)] for cls in subclasses(Template)}))
"""


@pytest.mark.timeout(200)
def test_every_template_reading_its_model_in_workers_is_found():
    done = run_python(code=SCAN, env=clean_environment(pythonpath=[ROOT]), timeout=180)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) > 100  # every template class ms-swift defines was read
    readers = {name: tuple(reads) for name, (_, reads) in found.items() if reads}
    assert readers == MODEL_READERS_4_6_0
    assert all(found[name][0] for name in readers)  # each one is given the model (use_model)
    for name in DUMMY_MODEL_USERS:
        assert found[name] == [True, []], name


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Three PNGs (ms-swift loads images itself), three H.264 clips (CogVLM2-Video's
    load_video_cogvlm2: decord stock, a sandbox protected) and three 16 kHz WAVs
    (Qwen2.5-Omni's load_audio: librosa stock, a sandbox protected)."""
    from PIL import Image
    import numpy as np

    folder = tmp_path_factory.mktemp("model_templates")
    rng = np.random.default_rng(0)
    for index in range(3):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(folder / f"img_{index}.png")
        _ffmpeg("-f", "lavfi", "-i", f"testsrc2=size=64x48:rate=10:duration={2 + index}",
                "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(folder / f"clip_{index}.mp4"))
        _ffmpeg("-f", "lavfi", "-i", f"sine=frequency={300 + 100 * index}:sample_rate=16000:duration=1",
                "-c:a", "pcm_s16le", str(folder / f"tone_{index}.wav"))
    return folder


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from . import tiny_models

    return tiny_models.build(str(tmp_path_factory.mktemp("omni") / "tiny_qwen2_5_omni"))


def run(mode, out, media, omni=None, warm_start=True):
    args = [mode, out, media] + ([omni] if omni else [])
    done = run_python(module="tests.programs.model_templates", args=args, cwd="/", timeout=300,
                      env=clean_environment({"HF_HUB_OFFLINE": "1", "MODELSCOPE_OFFLINE": "1"}, pythonpath=[ROOT],
                                            warm_start=warm_start))
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["template"]: line for line in lines}, done.stderr


def assert_same(stock, protected, where):
    if isinstance(stock, torch.Tensor):
        assert isinstance(protected, torch.Tensor), where
        assert (stock.dtype, stock.shape) == (protected.dtype, protected.shape), where
        assert torch.equal(stock, protected), where
    elif isinstance(stock, dict):
        assert stock.keys() == protected.keys(), where
        for key in stock:
            assert_same(stock[key], protected[key], f"{where}.{key}")
    elif isinstance(stock, (list, tuple)):
        assert len(stock) == len(protected), where
        for index, (left, right) in enumerate(zip(stock, protected)):
            assert_same(left, right, f"{where}[{index}]")
    else:
        assert stock == protected, where


@pytest.mark.timeout(600)
def test_protected_workers_encode_what_stock_workers_do(media, omni, tmp_path):
    stock, _ = run("stock", tmp_path, media, omni, warm_start=False)
    protected, log = run("protected", tmp_path, media, omni)
    families = ("minicpmv", "ovis1_6", "cogvlm2", "cogvlm2_video", "ixcomposer2")
    assert set(stock) == set(protected) == set(families) | {"qwen2_5_omni"}
    # Qwen2.5-Omni reaches its model through _get_model(): its workers keep the forkserver.
    assert protected["qwen2_5_omni"]["none_forked_from_trainer"] and protected["qwen2_5_omni"]["rows"] == 3
    assert stock["qwen2_5_omni"]["forked_from_trainer"] and protected["qwen2_5_omni"]["sandboxed_decodes"]
    assert "Qwen2_5OmniTemplate reads the model" not in log
    for family in families:
        assert stock[family]["rows"] == protected[family]["rows"] == 3
        assert protected[family]["start_method"] == "forkserver"  # what ms-swift's DataLoader was given
        assert protected[family]["forked_from_trainer"], family  # and its workers forked, as stock's
    assert protected["cogvlm2_video"]["sandboxed_decodes"]  # the clips were decoded in sandboxes
    assert not stock["cogvlm2_video"]["sandboxed_decodes"]
    for name in ("MiniCPMVTemplate", "Ovis1_6Template", "CogTemplate", "Cog2VideoTemplate",
                 "InternLMXComposer2Template"):
        assert log.count(f"ms-swift's {name} reads the model while it encodes") == 1, log[-3000:]
    assert "workers fork from the trainer, as stock ms-swift's do" in log
    assert_same(torch.load(tmp_path / "stock.pt", weights_only=False),
                torch.load(tmp_path / "protected.pt", weights_only=False), "batches")


@pytest.mark.timeout(300)
def test_a_start_method_the_user_named_is_kept(media, tmp_path):
    """Named by the user (--dataloader_multiprocessing_context forkserver): kept, with a
    warning; the workers get the template without its model, as stock's would."""
    results, log = run("named_forkserver", tmp_path, media)
    assert "'NoneType' object has no attribute 'transform'" in results["minicpmv"]["error"]
    assert "MiniCPMVTemplate reads the model while it encodes (MiniCPMVTemplate._encode)" in log
    assert "the start method named for this run" in log
