"""The error budget in ms-swift's real ``LazyLLMDataset``, in the encoding process, with
the real, patched ``load_audio`` (protection comes from ``SWIFT_SAFE_MEDIA=1`` and the
budget settings in the environment).

``python -m tests.programs.swift_budget_rows CASE PATH...`` prints one JSON line per step:

- ``spent BAD``: a dataset of five copies of BAD; the outcome of its row 0 (a value, or the
  exception's type and message), then whether ``encode_func`` is ours again;
- ``fraction BAD GOOD``: a dataset of BAD and GOOD; the outcome of reading row 0 40 times,
  then 80 more times.
"""

from __future__ import annotations

import json
import sys

import swift_safe_media  # noqa: F401  (loaded before ms-swift, as a training script would)
from datasets import Dataset
from swift.dataset import LazyLLMDataset
from swift.template import vision_utils


def encode(row, return_length=False):   # what template.encode does with an audio row
    return {"samples": len(vision_utils.load_audio(row["audio"], 16000))}


def dataset(*paths):
    return LazyLLMDataset(Dataset.from_list([{"audio": path} for path in paths]), encode, random_state=0)


def outcome(call):
    try:
        return {"ok": call()}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}


def main(case: str, paths: list[str]) -> None:
    if case == "spent":
        (bad,) = paths
        rows = dataset(bad, bad, bad, bad, bad)
        print(json.dumps(outcome(lambda: rows[0])))
        print(json.dumps({"encode_func restored": rows.encode_func is encode}))
    elif case == "fraction":
        bad, good = paths
        mixed = dataset(bad, good)
        print(json.dumps(outcome(lambda: [mixed[0]["samples"] for _ in range(40)])))
        print(json.dumps(outcome(lambda: [mixed[0]["samples"] for _ in range(80)])))
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
