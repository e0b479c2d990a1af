"""The ``--safe_media*`` flags in ms-swift's real ``parse_args``, installed by the start-up
hook, over stand-in argument dataclasses.

``python -m tests.programs.swift_flags_parse CASE [TMP]`` parses a series of command lines
and prints one JSON line per parse (the parsed arguments, what was left, whether
protection is enabled, the ``SWIFT_SAFE_MEDIA*`` environment). CASE is one of:

- ``precedence``: flags, the user's own choices, environment vs default vs flag; ends with
  an invalid ``--safe_media_mp_context`` (argparse exits 2);
- ``persistent_workers``: when DataLoader workers are made persistent;
- ``never_silent``: the registry and stall flags; ends with an invalid stall action;
- ``output_dir TMP``: the registry's default under the run's output dir ``TMP/out``;
- ``output_dir_from_env TMP``: the same under ``SWIFT_SAFE_MEDIA=1``, then with a registry
  the user named;
- ``show_help``: ``--help`` (argparse prints it and exits 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
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


@dataclasses.dataclass
class WorkerArgs:         # ms-swift 4.0-4.5 default to workers that stop after each epoch and eval
    dataloader_num_workers: Optional[int] = None
    dataloader_persistent_workers: bool = False


def show(args, remaining):
    import swift_safe_media
    print(json.dumps({"args": dataclasses.asdict(args), "remaining": remaining,
                      "enabled": swift_safe_media.is_enabled(),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("SWIFT_SAFE_MEDIA")}}))


def precedence():
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


def persistent_workers():
    show(*parse_args(WorkerArgs, ["--safe_media", "true"]))
    show(*parse_args(WorkerArgs, ["--dataloader_persistent_workers", "false"]))  # the user's choice wins
    show(*parse_args(WorkerArgs, ["--dataloader_persistent_workers=false"]))
    show(*parse_args(WorkerArgs, ["--dataloader_num_workers", "0"]))  # persistent needs workers
    show(*parse_args(WorkerArgs, ["--safe_media", "false"]))  # off: ms-swift's default


def never_silent():
    show(*parse_args(TrainArgs, ["--safe_media", "true", "--safe_media_quarantine", "runs/q.jsonl",
                                 "--safe_media_stall_timeout", "600", "--safe_media_stall_action", "abort"]))
    show(*parse_args(TrainArgs, ["--safe_media_quarantine", "none"]))
    parse_args(TrainArgs, ["--safe_media_stall_action", "hang"])


def output_dir(tmp):
    show(*parse_args(SftArgs, ["--safe_media", "true", "--output_dir", f"{tmp}/out"]))
    show(*parse_args(InferArgs, []))  # set once per process: a later parse keeps it


def output_dir_from_env(tmp):
    show(*parse_args(SftArgs, ["--output_dir", f"{tmp}/out"]))
    os.environ["SWIFT_SAFE_MEDIA_QUARANTINE"] = f"{tmp}/mine.jsonl"
    show(*parse_args(SftArgs, ["--output_dir", f"{tmp}/other"]))


def show_help():
    parse_args(TrainArgs, ["--help"])


CASES = {case.__name__: case for case in (precedence, persistent_workers, never_silent, output_dir,
                                           output_dir_from_env, show_help)}


if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
