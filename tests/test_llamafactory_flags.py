"""``safe_media: true`` and the other ``safe_media_*`` keys through LLaMA-Factory's real
argument parsing (``get_train_args``: OmegaConf, then ``HfArgumentParser``, which refuses
unknown keys), in LLaMA-Factory 0.9.5's own environment: in the YAML, as a ``key=value``
override after it, on a plain ``--key value`` command line, and through ``SWIFT_SAFE_MEDIA=1``.
Each case runs in a fresh interpreter (tests/programs/llamafactory_flags.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .fresh import clean_environment, run_python
from .test_llamafactory_train import VENV

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                reason=f"{VENV} is missing: `make test` builds it")

BASE = {"stage": "sft", "do_train": True, "finetuning_type": "lora", "dataset": "any", "template": "qwen2_omni",
        "report_to": "none", "use_cpu": True}


def parse(tmp_path: Path, yaml: dict | None, *args: str, env: dict | None = None) -> dict:
    output_dir = tmp_path / "out"
    settings = {**BASE, "model_name_or_path": str(tmp_path), "output_dir": str(output_dir)}
    argv = list(args)
    if yaml is not None:
        config = tmp_path / "run.yaml"
        config.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in {**settings, **yaml}.items()))
        argv.insert(0, str(config))
    else:
        argv = [f"--{key}={value}" for key, value in settings.items()] + argv
    done = run_python(module="tests.programs.llamafactory_flags", args=argv, timeout=240, python=str(VENV / "bin" / "python"),
                      env=clean_environment({"HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1", **(env or {})}))
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_safe_media_in_the_yaml_turns_protection_on_with_the_registry_under_output_dir(tmp_path):
    state = parse(tmp_path, {"safe_media": True, "safe_media_timeout": 7, "safe_media_stall_timeout": 0})
    assert state["error"] is None and state["enabled"] and state["patched"], state
    settings = state["settings"]
    assert settings["SWIFT_SAFE_MEDIA"] == "1" and settings["SWIFT_SAFE_MEDIA_TIMEOUT"] == "7", settings
    assert settings["SWIFT_SAFE_MEDIA_STALL_TIMEOUT"] == "0"
    assert settings["SWIFT_SAFE_MEDIA_QUARANTINE"] == str(tmp_path / "out" / "safe_media" / "quarantine.jsonl")


@pytest.mark.timeout(300)
def test_a_key_value_override_after_the_yaml_turns_it_on(tmp_path):
    state = parse(tmp_path, {}, "safe_media=true", "safe_media_quarantine=none")
    assert state["error"] is None and state["enabled"] and state["patched"], state
    assert state["settings"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == ""  # none: no registry


@pytest.mark.timeout(300)
def test_a_plain_command_line_and_the_environment(tmp_path):
    state = parse(tmp_path, None, "--safe_media", "true", "--safe_media_timeout", "9")
    assert state["error"] is None and state["enabled"] and state["settings"]["SWIFT_SAFE_MEDIA_TIMEOUT"] == "9", state
    by_environment = parse(tmp_path, {}, env={"SWIFT_SAFE_MEDIA": "1"})
    assert by_environment["error"] is None and by_environment["enabled"] and by_environment["patched"], by_environment
    assert by_environment["settings"]["SWIFT_SAFE_MEDIA_QUARANTINE"].startswith(str(tmp_path / "out"))


@pytest.mark.timeout(300)
def test_without_the_flag_or_with_it_false_nothing_is_patched_and_the_keys_still_parse(tmp_path):
    for yaml in ({}, {"safe_media": False, "safe_media_timeout": 3}):
        state = parse(tmp_path, yaml)
        assert state["error"] is None and not state["enabled"] and not state["patched"], (yaml, state)
        assert state["settings"].get("SWIFT_SAFE_MEDIA") in (None, "0"), state


@pytest.mark.timeout(300)
def test_a_misspelt_key_is_refused_as_llamafactory_refuses_any_unknown_key(tmp_path):
    state = parse(tmp_path, {"safe_media": True, "safe_media_timout": 7})
    assert state["error"] and "safe_media_timout" in state["error"], state
