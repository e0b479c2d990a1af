"""The ms-swift adapter against the real ms-swift: each import / enable / disable order in
a fresh interpreter, every alias site of every patched loader checked by identity."""

import json
import os
import subprocess
import sys

import pytest

from .fresh import ROOT, clean_environment, run_python

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

# Alias sites ms-swift 4.6.0 has: the defining module, base, and templates that copy names.
EXPECTED_ALIASES = {
    "swift.template.base.load_audio", "swift.template.templates.qwen.load_audio",
    "swift.template.templates.qwen.load_video_ovis2", "swift.template.templates.qwen.load_video_ovis2_5",
    "swift.template.templates.llava.load_video_llava", "swift.template.templates.internvl.load_video_internvl",
    "swift.template.templates.glm.load_video_cogvlm2", "swift.template.templates.glm.load_video_hf",
    "swift.template.templates.mplug.load_video_minicpmv_mplug_owl3",
    "swift.template.templates.minicpm.load_video_minicpmv_mplug_owl3", "swift.template.templates.minicpm.load_audio",
    "swift.template.templates.gemma.load_audio", "swift.template.templates.gemma.load_vllm_video",
    "swift.template.templates.mimo.load_audio",
    "qwen_vl_utils.fetch_video", "qwen_vl_utils.vision_process.fetch_video",
    "qwen_omni_utils.fetch_video", "qwen_omni_utils.v2_5.fetch_video", "qwen_omni_utils.v2_5.vision_process.fetch_video",
    "qwen_omni_utils.process_audio_info", "qwen_omni_utils.v2_5.process_audio_info",
    "qwen_omni_utils.v2_5.audio_process.process_audio_info",
}
EXPECTED_SITES = EXPECTED_ALIASES | {f"swift.template.vision_utils.{name}" for name in (
    "load_audio", "load_video_internvl", "load_video_cogvlm2", "load_video_llava", "load_video_minicpmv_mplug_owl3",
    "load_video_valley", "load_video_ovis2", "load_video_ovis2_5", "load_video_hf", "load_vllm_video")}


def run(case, *args, env=None):
    """``tests/programs/swift_patching_orders.py`` CASE ARGS from ``/``: the sites at each label."""
    done = run_python(module="tests.programs.swift_patching_orders", args=[case, *args],
                      env=clean_environment(env, pythonpath=[ROOT]), cwd="/", timeout=150)
    results = {}
    for line in done.stdout.splitlines():
        label, sites, enabled = line.split(" ", 2)
        results[label] = (json.loads(sites), enabled == "True")
    return results, done.stderr


def all_are(sites, value):
    assert set(sites) >= EXPECTED_SITES, sorted(EXPECTED_SITES - set(sites))
    wrong = {site: state for site, state in sites.items() if state != value}
    assert not wrong, wrong


@pytest.mark.timeout(200)
def test_enable_before_swift_import_patches_every_alias_and_bad_media_raises(tmp_path):
    fifo = tmp_path / "clip.wav"
    os.mkfifo(fifo)
    results, stderr = run("enable_first", fifo)
    sites, enabled = results["enabled"]
    assert enabled
    all_are(sites, "safe")
    assert results["raised"][1] is True
    assert f"swift_safe_media: skipped {fifo}: " in stderr and "after" in stderr


@pytest.mark.timeout(200)
def test_enable_after_swift_import_disable_enable_double_enable_restores_exactly():
    """Under SWIFT_SAFE_MEDIA=0 (off at start-up); an explicit enable() still wins."""
    results, _ = run("enable_after", env={"SWIFT_SAFE_MEDIA": "0"})
    all_are(results["stock"][0], "stock")
    all_are(results["enabled_twice"][0], "safe")
    all_are(results["disabled"][0], "stock")
    assert results["disabled"][1] is False
    all_are(results["enabled_again"][0], "safe")
    all_are(results["late_import"][0], "safe")


@pytest.mark.timeout(200)
def test_startup_hook_with_SWIFT_SAFE_MEDIA_1_patches_swift_and_qwen_utils_imported_first():
    """Nothing but the installed .pth and the environment; the Qwen utils imported before
    swift (the start-up watcher only watches swift) are patched when swift arrives."""
    results, _ = run("startup_hook", env={"SWIFT_SAFE_MEDIA": "1"})
    all_are(results["plain"][0], "safe")


@pytest.mark.timeout(200)
def test_outside_the_supported_range_one_warning_and_host_untouched():
    results, stderr = run("unsupported")
    assert stderr.count("ms-swift 3.9.0 is outside the supported range >=4.0,<5.0") == 1
    assert set(results["unsupported"][0].values()) == {"stock"}


OLDER_SWIFT = "4.2.2"  # an older 4.x next to the pinned 4.6.0: installed on the side, --no-deps


@pytest.fixture(scope="module")
def older_swift():
    target = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), f"ms-swift-{OLDER_SWIFT}")
    if not os.path.isdir(os.path.join(target, "swift")):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
                               f"ms-swift=={OLDER_SWIFT}"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"cannot install ms-swift {OLDER_SWIFT}: {done.stderr[-500:]}")
    return target


@pytest.mark.timeout(400)
def test_older_swift_4_2_2_is_patched_at_every_alias_and_takes_the_flags(older_swift):
    done = run_python(module="tests.programs.swift_patching_orders", args=["older", older_swift],
                      env={**os.environ, "PYTHONPATH": os.pathsep.join([older_swift, ROOT]), "SWIFT_SAFE_MEDIA": "1"},
                      cwd="/", timeout=300)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    sites = json.loads(lines["older"].rsplit(" ", 1)[0])
    assert lines["flag"] == f"True {OLDER_SWIFT}"
    not_in_4_2_2 = {site for site in EXPECTED_SITES if site.endswith("load_vllm_video")}
    not_in_4_2_2.add("swift.template.templates.mimo.load_audio")
    missing = EXPECTED_SITES - not_in_4_2_2 - set(sites)
    assert not missing, sorted(missing)
    assert set(sites.values()) == {"safe"}


# A spawned worker receives LazyLLMDataset(dataset, template.encode) pickled. ms-swift 4.6's
# Template.__getstate__ drops the model; 4.2.2 has none, and sets template.model for the
# Qwen2-VL/Omni templates, so without the adapter every worker would get the whole model
# (tests/programs/template_in_a_worker.py).


@pytest.mark.timeout(400)
def test_older_swift_ships_the_template_to_spawned_workers_without_the_model(older_swift, tmp_path):
    from . import tiny_models

    model_dir = tiny_models.build(str(tmp_path / "tiny"))
    done = run_python(module="tests.programs.template_in_a_worker", args=[model_dir], timeout=350, cwd=str(tmp_path),
                      env=clean_environment({"SWIFT_SAFE_MEDIA": "1"}, pythonpath=[older_swift, ROOT]))
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["swift"].startswith(older_swift) and found["uses_model"]
    assert found["pickled"] > found["weights"] > 10_000_000  # a plain pickle (copy, save) still holds the model
    assert found["spawn_pickled"] < found["weights"] / 4  # a spawned worker gets the template without it
    assert found["copy_keeps_model"] and not found["model_in_worker"]
    assert "input_ids" in found["encoded"]  # and encodes with it (ms-swift's dummy model, as on 4.6)
