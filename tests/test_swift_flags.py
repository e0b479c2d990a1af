"""The `--safe_media*` flags in ms-swift's real `parse_args` (which every pipeline uses:
sft, pt, rlhf, infer, export), installed by the start-up hook; each case in a fresh
interpreter. The end-to-end tests run them through `swift sft` and a YAML config."""

import json

import pytest

from .fresh import ROOT, clean_environment, run_python

pytest.importorskip("swift.utils", reason="ms-swift is in requirements-test.txt")

def run(case, *args, env=None, check=True):
    """``tests/programs/swift_flags_parse.py`` CASE ARGS, from ``/`` (relative paths resolve there)."""
    return run_python(module="tests.programs.swift_flags_parse", args=[case, *args],
                      env=clean_environment(env, pythonpath=[ROOT]), cwd="/", timeout=120, check=check)


def results(done):
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(150)
def test_flags_parse_apply_reach_the_environment_and_take_precedence():
    done = run("precedence", check=False)
    spawned, infer, users, default, off, from_env, from_flag = results(done)
    assert spawned["remaining"] == [] and spawned["args"] == {"model": "x", "dataloader_multiprocessing_context": "forkserver"}
    assert spawned["enabled"] is True
    assert spawned["env"].items() >= {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "7.0",
                                      "SWIFT_SAFE_MEDIA_MAX_MEMORY_MB": "2048"}.items()
    assert "SWIFT_SAFE_MEDIA_MP_CONTEXT" not in spawned["env"]  # the default, forkserver, is not written
    assert infer["remaining"] == [] and infer["env"]["SWIFT_SAFE_MEDIA_MP_CONTEXT"] == "forkserver"
    assert users["args"]["dataloader_multiprocessing_context"] == "fork"
    assert default["args"]["dataloader_multiprocessing_context"] is None
    assert off["enabled"] is False and off["env"]["SWIFT_SAFE_MEDIA"] == "0"
    assert off["remaining"] == [] and off["args"] == {"model": "y", "dataloader_multiprocessing_context": None}
    assert from_env["env"]["SWIFT_SAFE_MEDIA_TIMEOUT"] == "9"
    assert from_env["args"]["dataloader_multiprocessing_context"] == "forkserver"
    assert from_flag["env"]["SWIFT_SAFE_MEDIA_TIMEOUT"] == "3.0"
    assert done.returncode == 2 and "--safe_media_mp_context: invalid choice: 'threads'" in done.stderr


@pytest.mark.timeout(150)
def test_workers_persist_under_protection_unless_the_user_chose():
    done = run("persistent_workers")
    protected, users, users_equals, no_workers, off = results(done)
    assert protected["args"]["dataloader_persistent_workers"] is True and protected["remaining"] == []
    assert users["args"]["dataloader_persistent_workers"] is False
    assert users_equals["args"]["dataloader_persistent_workers"] is False
    assert no_workers["args"] == {"dataloader_num_workers": 0, "dataloader_persistent_workers": False}
    assert off["args"]["dataloader_persistent_workers"] is False and off["enabled"] is False


@pytest.mark.timeout(150)
def test_never_silent_flags_reach_the_environment():
    done = run("never_silent", check=False)
    given, off = results(done)
    assert given["remaining"] == []
    assert given["env"].items() >= {"SWIFT_SAFE_MEDIA_QUARANTINE": "/runs/q.jsonl",  # absolute: cwd is /
                                    "SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "600.0",
                                    "SWIFT_SAFE_MEDIA_STALL_ACTION": "abort",
                                    "SWIFT_SAFE_MEDIA_STATS_DIR": "/runs/swift_safe_media_stats"}.items()
    assert off["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == ""  # set, and empty: no registry, no default
    assert done.returncode == 2 and "--safe_media_stall_action: invalid choice: 'hang'" in done.stderr


@pytest.mark.timeout(150)
def test_the_registry_defaults_to_the_runs_final_output_dir(tmp_path):
    done = run("output_dir", tmp_path)
    train, infer = results(done)
    folder = f"{tmp_path}/out/v0-20260101-000000/safe_media"
    assert train["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl"
    assert train["env"]["SWIFT_SAFE_MEDIA_STATS_DIR"] == f"{folder}/swift_safe_media_stats"
    assert infer["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl"
    # Through SWIFT_SAFE_MEDIA=1 alone, and never over a registry or stats folder the user named.
    done = run("output_dir_from_env", tmp_path,
               env={"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_STATS_DIR": f"{tmp_path}/stats"})
    from_env, users = results(done)
    assert from_env["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl" and from_env["enabled"]
    assert from_env["env"]["SWIFT_SAFE_MEDIA_STATS_DIR"] == f"{tmp_path}/stats"
    assert users["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{tmp_path}/mine.jsonl"


@pytest.mark.timeout(150)
def test_flags_appear_in_the_command_help():
    done = run("show_help", check=False)
    assert done.returncode == 0
    assert "--dataloader_multiprocessing_context" in done.stdout  # ms-swift's own help first
    for flag in ("--safe_media {true,false}", "--safe_media_timeout SECONDS", "--safe_media_mp_context",
                 "--safe_media_max_memory_mb MB", "--safe_media_quarantine PATH",
                 "--safe_media_stall_timeout SECONDS", "--safe_media_stall_action {log,abort}"):
        assert flag in done.stdout
