"""The `--safe_media*` flags in ms-swift's real `parse_args` (which every pipeline uses:
sft, pt, rlhf, infer, export), installed by the start-up hook; each case in a fresh
interpreter. The end-to-end tests run them through `swift sft` and a YAML config."""

import json
import subprocess
import sys
import textwrap

import pytest

from .fresh import clean_environment

pytest.importorskip("swift.utils", reason="ms-swift is in requirements-test.txt")

PRELUDE = textwrap.dedent("""
    import dataclasses, json, os, sys
    from typing import Literal, Optional
    from swift.utils import parse_args   # the name pipelines/base.py imports

    @dataclasses.dataclass
    class TrainArgs:          # stands in for SftArguments: any dataclass goes through the same parser
        model: str = "m"
        dataloader_multiprocessing_context: Optional[Literal["fork", "spawn", "forkserver"]] = None

    @dataclasses.dataclass
    class InferArgs:          # no DataLoader workers: nothing is added
        model: str = "m"

    @dataclasses.dataclass
    class SftArgs:            # like SftArguments: output_dir gets its versioned folder while parsing
        output_dir: str = "out"

        def __post_init__(self):
            self.output_dir = os.path.abspath(os.path.join(self.output_dir, "v0-20260101-000000"))
            self.training_args = type("TrainingArguments", (), {"output_dir": self.output_dir})()

    def show(args, remaining):
        import swift_safe_media
        print(json.dumps({"args": dataclasses.asdict(args), "remaining": remaining,
                          "enabled": swift_safe_media.is_enabled(),
                          "env": {k: v for k, v in os.environ.items() if k.startswith("SWIFT_SAFE_MEDIA")}}))
""")


def run(body, env=None, check=True):
    child_env = clean_environment(env)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=child_env,
                          capture_output=True, text=True, timeout=120, cwd="/")
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def results(done):
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(150)
def test_flags_parse_apply_reach_the_environment_and_take_precedence():
    done = run("""
        show(*parse_args(TrainArgs, ["--model", "x", "--safe_media", "true", "--safe_media_timeout", "7",
                                     "--safe_media_max_memory_mb", "2048"]))
        show(*parse_args(InferArgs, ["--safe_media_mp_context", "forkserver"]))
        show(*parse_args(TrainArgs, ["--dataloader_multiprocessing_context", "fork"]))  # the user's choice wins
        show(*parse_args(TrainArgs, ["--safe_media_mp_context", "default"]))
        show(*parse_args(TrainArgs, ["--safe_media", "false", "--model", "y"]))  # parses while off
        # environment beats default, flag beats environment
        os.environ.update(SWIFT_SAFE_MEDIA="1", SWIFT_SAFE_MEDIA_TIMEOUT="9", SWIFT_SAFE_MEDIA_MP_CONTEXT="forkserver")
        show(*parse_args(TrainArgs, []))
        show(*parse_args(TrainArgs, ["--safe_media_timeout", "3"]))
        parse_args(TrainArgs, ["--safe_media_mp_context", "threads"])
    """, check=False)
    spawned, infer, users, default, off, from_env, from_flag = results(done)
    assert spawned["remaining"] == [] and spawned["args"] == {"model": "x", "dataloader_multiprocessing_context": "spawn"}
    assert spawned["enabled"] is True
    assert spawned["env"].items() >= {"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_TIMEOUT": "7.0",
                                      "SWIFT_SAFE_MEDIA_MAX_MEMORY_MB": "2048"}.items()
    assert "SWIFT_SAFE_MEDIA_MP_CONTEXT" not in spawned["env"]  # the default, spawn, is not written
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
    done = run("""
        @dataclasses.dataclass
        class WorkerArgs:     # ms-swift 4.0-4.5 default to workers that stop after each epoch and eval
            dataloader_num_workers: Optional[int] = None
            dataloader_persistent_workers: bool = False

        show(*parse_args(WorkerArgs, ["--safe_media", "true"]))
        show(*parse_args(WorkerArgs, ["--dataloader_persistent_workers", "false"]))  # the user's choice wins
        show(*parse_args(WorkerArgs, ["--dataloader_persistent_workers=false"]))
        show(*parse_args(WorkerArgs, ["--dataloader_num_workers", "0"]))  # persistent needs workers
        show(*parse_args(WorkerArgs, ["--safe_media", "false"]))  # off: ms-swift's default
    """)
    protected, users, users_equals, no_workers, off = results(done)
    assert protected["args"]["dataloader_persistent_workers"] is True and protected["remaining"] == []
    assert users["args"]["dataloader_persistent_workers"] is False
    assert users_equals["args"]["dataloader_persistent_workers"] is False
    assert no_workers["args"] == {"dataloader_num_workers": 0, "dataloader_persistent_workers": False}
    assert off["args"]["dataloader_persistent_workers"] is False and off["enabled"] is False


@pytest.mark.timeout(150)
def test_never_silent_flags_reach_the_environment():
    done = run("""
        show(*parse_args(TrainArgs, ["--safe_media", "true", "--safe_media_quarantine", "runs/q.jsonl",
                                     "--safe_media_stall_timeout", "600", "--safe_media_stall_action", "abort"]))
        show(*parse_args(TrainArgs, ["--safe_media_quarantine", "none"]))
        parse_args(TrainArgs, ["--safe_media_stall_action", "hang"])
    """, check=False)
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
    done = run(f"""
        show(*parse_args(SftArgs, ["--safe_media", "true", "--output_dir", "{tmp_path}/out"]))
        show(*parse_args(InferArgs, []))  # set once per process: a later parse keeps it
    """)
    train, infer = results(done)
    folder = f"{tmp_path}/out/v0-20260101-000000/safe_media"
    assert train["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl"
    assert train["env"]["SWIFT_SAFE_MEDIA_STATS_DIR"] == f"{folder}/swift_safe_media_stats"
    assert infer["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl"
    # Through SWIFT_SAFE_MEDIA=1 alone, and never over a registry or stats folder the user named.
    done = run(f"""
        show(*parse_args(SftArgs, ["--output_dir", "{tmp_path}/out"]))
        os.environ["SWIFT_SAFE_MEDIA_QUARANTINE"] = "{tmp_path}/mine.jsonl"
        show(*parse_args(SftArgs, ["--output_dir", "{tmp_path}/other"]))
    """, env={"SWIFT_SAFE_MEDIA": "1", "SWIFT_SAFE_MEDIA_STATS_DIR": f"{tmp_path}/stats"})
    from_env, users = results(done)
    assert from_env["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{folder}/quarantine.jsonl" and from_env["enabled"]
    assert from_env["env"]["SWIFT_SAFE_MEDIA_STATS_DIR"] == f"{tmp_path}/stats"
    assert users["env"]["SWIFT_SAFE_MEDIA_QUARANTINE"] == f"{tmp_path}/mine.jsonl"


@pytest.mark.timeout(150)
def test_flags_appear_in_the_command_help():
    done = run("""
        parse_args(TrainArgs, ["--help"])
    """, check=False)
    assert done.returncode == 0
    assert "--dataloader_multiprocessing_context" in done.stdout  # ms-swift's own help first
    for flag in ("--safe_media {true,false}", "--safe_media_timeout SECONDS", "--safe_media_mp_context",
                 "--safe_media_max_memory_mb MB", "--safe_media_quarantine PATH",
                 "--safe_media_stall_timeout SECONDS", "--safe_media_stall_action {log,abort}"):
        assert flag in done.stdout
