"""The ms-swift adapter against the real ms-swift: each import / enable / disable order in
a fresh interpreter, every alias site of every patched loader checked by identity."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .fresh import clean_environment

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

# Runs in the child: the state of every (module, name) of the patch table and of every
# module of the adapter's scope that holds a copy of a host loader.
PRELUDE = textwrap.dedent("""
    import json, os, sys
    import swift_safe_media
    from swift_safe_media.integrations import swift as adapter
    from swift_safe_media.integrations._patching import original_of

    def state():
        import qwen_omni_utils, qwen_vl_utils, swift.template.templates.qwen, swift.template.base
        sites = {}
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith(adapter.SCOPE) or module is None:
                continue
            for host_module, name in [(target.module, target.name) for target in adapter.TARGETS
                                      if not target.is_method]:
                value = getattr(module, name, None)
                stock = getattr(sys.modules[host_module], name, None)
                if stock is None:
                    continue  # not in this ms-swift version
                stock = original_of(stock) or stock
                if value is stock:
                    sites[f"{module_name}.{name}"] = "stock"
                elif original_of(value) is stock:
                    sites[f"{module_name}.{name}"] = "safe"
        return sites

    def report(label):
        print(label, json.dumps(state(), sort_keys=True, separators=(",", ":")), swift_safe_media.is_enabled(), flush=True)
""")

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


def run(body, env=None):
    child_env = clean_environment(env)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=child_env,
                          capture_output=True, text=True, timeout=150, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
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
    results, stderr = run(f"""
        swift_safe_media.enable(timeout=5, hosts=["swift"])
        report("enabled")
        from swift.template.templates import qwen
        try:
            qwen.load_audio({str(fifo)!r}, 16000)
        except swift_safe_media.MediaDecodeError as exc:
            print("raised", "{{}}", exc.path == {str(fifo)!r})
    """)
    sites, enabled = results["enabled"]
    assert enabled
    all_are(sites, "safe")
    assert results["raised"][1] is True
    assert f"swift_safe_media: skipped {fifo}: " in stderr and "after" in stderr


@pytest.mark.timeout(200)
def test_enable_after_swift_import_disable_enable_double_enable_restores_exactly():
    """Under SWIFT_SAFE_MEDIA=0 (off at start-up); an explicit enable() still wins."""
    results, _ = run("""
        report("stock")
        import swift.template.vision_utils as vision_utils, qwen_vl_utils.vision_process as vision_process
        before = {name: id(getattr(vision_utils, name)) for name in dir(vision_utils) if name.startswith("load_")}
        before_fetch = id(vision_process.fetch_video)
        swift_safe_media.enable(hosts=["swift"])
        swift_safe_media.enable(hosts=["swift"])
        report("enabled_twice")
        swift_safe_media.disable()
        after = {name: id(getattr(vision_utils, name)) for name in dir(vision_utils) if name.startswith("load_")}
        assert before == after and before_fetch == id(vision_process.fetch_video)
        report("disabled")
        swift_safe_media.enable(hosts=["swift"])
        report("enabled_again")
        import swift.template.templates.valley  # imported after the patch: copies the safe one
        report("late_import")
    """, env={"SWIFT_SAFE_MEDIA": "0"})
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
    results, _ = run("""
        import qwen_omni_utils, qwen_vl_utils
        report("plain")
    """, env={"SWIFT_SAFE_MEDIA": "1"})
    all_are(results["plain"][0], "safe")


@pytest.mark.timeout(200)
def test_outside_the_supported_range_one_warning_and_host_untouched():
    results, stderr = run("""
        adapter.get_version = lambda: "3.9.0"
        swift_safe_media.enable(hosts=["swift"])
        import importlib, swift.template.vision_utils
        importlib.reload(swift.template.vision_utils)
        report("unsupported")
    """)
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
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent("""
        import swift
        assert swift.__file__.startswith(sys.argv[1]), swift.__file__
        report("older")
        from swift.utils import parse_args
        print("flag", original_of(parse_args) is not None, adapter.get_version())
    """), older_swift], env={**os.environ, "PYTHONPATH": older_swift, "SWIFT_SAFE_MEDIA": "1"},
        capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
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
# Qwen2-VL/Omni templates, so without the adapter every worker would get the whole model.
TEMPLATE_IN_A_WORKER = textwrap.dedent("""
    import copy, json, pickle, sys
    from multiprocessing import context, reduction
    from torch.utils.data import DataLoader, Dataset
    from swift.dataset.utils import LazyLLMDataset
    from swift.model import get_processor
    from swift.template import get_template

    class Probe(Dataset):  # what the worker holds: its template's model, and a row encoded by it
        def __init__(self, dataset):
            self.dataset = dataset
        def __len__(self):
            return 1
        def __getitem__(self, index):
            return {"model_in_worker": self.dataset.encode_func.__self__.model is not None,
                    "encoded": sorted(self.dataset[index])}

    def spawn_pickled_size(value):  # what multiprocessing writes for a spawned child
        context.set_spawning_popen(object())
        try:
            return len(reduction.ForkingPickler.dumps(value))
        finally:
            context.set_spawning_popen(None)

    if __name__ == "__main__":
        from transformers import Qwen2_5OmniForConditionalGeneration
        import swift
        model_dir = sys.argv[1]
        template = get_template(get_processor(model_dir, model_type="qwen2_5_omni", download_model=False))
        template.set_mode("train")
        template.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir)  # as ms-swift's sft does
        rows = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}]
        dataset = LazyLLMDataset(rows, template.encode)
        loader = DataLoader(Probe(dataset), batch_size=None, num_workers=1, multiprocessing_context="spawn")
        print(json.dumps({"swift": swift.__file__, "uses_model": template.use_model,
                          "weights": sum(p.numel() * p.element_size() for p in template.model.parameters()),
                          "spawn_pickled": spawn_pickled_size(dataset), "pickled": len(pickle.dumps(dataset)),
                          "copy_keeps_model": copy.copy(template).model is template.model,
                          **next(iter(loader))}))
""")


@pytest.mark.timeout(400)
def test_older_swift_ships_the_template_to_spawned_workers_without_the_model(older_swift, tmp_path):
    from . import tiny_models

    model_dir = tiny_models.build(str(tmp_path / "tiny"))
    script = tmp_path / "template_in_a_worker.py"
    script.write_text(TEMPLATE_IN_A_WORKER)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    done = subprocess.run([sys.executable, str(script), model_dir], capture_output=True, text=True, timeout=350,
                          env={**env, "PYTHONPATH": older_swift, "SWIFT_SAFE_MEDIA": "1"}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["swift"].startswith(older_swift) and found["uses_model"]
    assert found["pickled"] > found["weights"] > 10_000_000  # a plain pickle (copy, save) still holds the model
    assert found["spawn_pickled"] < found["weights"] / 4  # a spawned worker gets the template without it
    assert found["copy_keeps_model"] and not found["model_in_worker"]
    assert "input_ids" in found["encoded"]  # and encodes with it (ms-swift's dummy model, as on 4.6)
