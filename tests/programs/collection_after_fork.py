"""A trainer that turns protection on while it has one thread (its warm forkserver's
template is forked from it, torch imported), then runs a full collection.

``python -m tests.programs.collection_after_fork`` prints one JSON object: how many of the
trainer's objects were frozen since it started, how many kB of its memory the collection made
its own (pages it shared with the forkserver's family, copied as the collector wrote to them:
``Private_Dirty`` before and after), and the names of the trainer's children then (the
template, or the forkserver it became).
"""

from __future__ import annotations

import gc
import json
import os

import swift_safe_media

from tests import proc_table


def private_dirty_kb() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith("Private_Dirty:"))


def main() -> None:
    frozen_at_start = gc.get_freeze_count()  # Python 3.12 freezes some of its own (375) as it starts
    swift_safe_media.enable()
    before = private_dirty_kb()
    gc.collect()
    copied = private_dirty_kb() - before
    table = proc_table.process_table()
    children = sorted(row.name for row in table.values() if row.parent == os.getpid())
    print(json.dumps({"frozen": gc.get_freeze_count() - frozen_at_start, "copied_kb": copied, "children": children}))


if __name__ == "__main__":
    main()
