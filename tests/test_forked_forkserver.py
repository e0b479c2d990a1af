"""The warm forkserver forked from the trainer (issue 45): where protection is asked for
while the trainer has one thread (``enable()`` before the trainer's imports, or a host's
first import under ``SWIFT_SAFE_MEDIA=1`` or with its flag on the command line), the
forkserver is a fork of the trainer and shares its torch (with the flag, its template
imports the forkserver's preload while the trainer goes on to ``enable()``, and where the
trainer has imported more by then and may still fork, a fresh template forked then takes its
place, sharing those modules too); it has one thread as it forks, its workers start with one
thread and may import from threads; the trainer's thread pools are as without it, and its
objects of the moment of the fork are frozen, so that its collections leave the pages it
shares unwritten. Where the trainer already runs a thread (but one a fork leaves safe:
jemalloc's), the forkserver is started by exec as before. Real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from swift_safe_media import config
from swift_safe_media.process import FORKSERVER_NAME

from .fresh import ROOT, clean_environment

CASES = {"forked": ([], {}), "off": ([], {config.FORKSERVER_FROM_TRAINER: "0"}),
         "thread": (["thread"], {}), "host": (["host"], {"SWIFT_SAFE_MEDIA": "1"}),
         "ahead": (["ahead", "--safe_media", "true"], {}), "early": (["early", "--safe_media", "true"], {}),
         "again": (["again", "--safe_media", "true"], {}),
         # numpy 2.5's OpenBLAS does not export how to stop its pool: here numpy 2.4's, its name not found
         "hidden": ([], {"HIDE_OPENBLAS_SHUTDOWN": "1"}), "hidden_thread": (["thread"], {"HIDE_OPENBLAS_SHUTDOWN": "1"})}
AHEAD = "tests.programs.imported_ahead"  # the last of the forkserver's preload: it logs who imports it


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case's program, side by side: (its JSON, its stderr)."""
    started = {}
    logs = tmp_path_factory.mktemp("imported_ahead")
    for case, (args, env) in CASES.items():
        env = {**env, config.WORKER_PRELOAD: AHEAD, "IMPORTED_AHEAD_LOG": str(logs / f"{case}.jsonl")}
        environment = clean_environment({config.LOG_LEVEL: "DEBUG", **env}, warm_start=True)
        started[case] = subprocess.Popen([sys.executable, "-m", "tests.programs.forked_forkserver", *args],
                                         cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    found = {}
    for case, child in started.items():
        stdout, stderr = child.communicate(timeout=240)
        assert child.returncode == 0, (case, stderr[-3000:])
        found[case] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
    return found


def _workers_are_clean_forks_of(found: dict) -> None:
    items = found["items"]
    assert sorted(item["index"] for item in items) == [0, 1, 2, 3]
    assert {item["ppid"] for item in items} == {found["forkserver"]}
    # The forkserver had one thread when it forked them, and each started with one.
    assert {item["forkserver_threads"] for item in items} == {"1"}
    assert [item["threads"] for item in sorted(items, key=lambda item: item["index"])][:2] == [1, 1]
    assert all(item["thread_imported"] for item in items)  # no import lock held for good
    assert len({item["sandbox"] for item in items}) == 2  # decoded in a sandbox per worker


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["forked", "host", "ahead", "early", "hidden"])
def test_a_trainer_with_one_thread_forks_its_warm_forkserver(runs, case):
    found, stderr = runs[case]
    assert found["forkserver_ppid"] == found["trainer"]
    assert found["forkserver_name"] == FORKSERVER_NAME
    assert found["forkserver_command"] == found["trainer_command"]  # a fork: no exec
    # numpy 2.5's OpenBLAS stops its pool only at the fork: the trainer counts its threads again after it.
    assert "template of the warm forkserver forked" in stderr, stderr[-3000:]
    assert re.search(r"the trainer had 1 thread(, OpenBLAS's pool stopped by the fork itself)?\)", stderr), stderr[-3000:]
    assert found["forkserver_threads"] == 1
    _workers_are_clean_forks_of(found)
    # The preload imported once, in the forkserver; the workers found it there.
    assert [line["pid"] for line in found["imported_ahead"]] == [found["forkserver"]], found["imported_ahead"]
    assert {tuple(item["hosts"]) for item in found["items"]} == ({()} if case in ("forked", "hidden") else {("swift",)})
    assert not any(item["trainer_only"] for item in found["items"])
    assert found["usr1_caught"] == {"trainer": True, "forkserver": False}  # as an exec leaves handlers


@pytest.mark.timeout(300)
def test_a_fresh_template_is_forked_once_the_trainer_has_imported_its_host(runs):
    """``--safe_media true``, and by ``enable()`` the trainer has imported ms-swift and more,
    with pyarrow's allocator thread running: a second template is forked then (that thread
    is safe across fork), the first one goes, and the forkserver and its workers have what
    the trainer imported in between without importing it (shared, not a second copy), the
    host protected in them as before."""
    found, stderr = runs["again"]
    forked = [int(pid) for pid in re.findall(r"template of the warm forkserver forked.*?\(pid (\d+)", stderr)]
    assert len(forked) == 2 and "forked again, the trainer having imported more" in stderr, stderr[-3000:]
    assert "jemalloc_bg_thd" in found["trainer_threads"]
    assert "the trainer had 1 thread and jemalloc_bg_thd, which fork leaves safe)" in stderr, stderr[-3000:]
    assert found["forkserver"] == forked[1] and forked[0] not in found["children"]
    assert found["forkserver_ppid"] == found["trainer"] and found["forkserver_threads"] == 1
    _workers_are_clean_forks_of(found)
    assert all(item["trainer_only"] for item in found["items"])
    assert {tuple(item["hosts"]) for item in found["items"]} == {("swift",)}
    assert found["imported_ahead"][-1]["pid"] == found["forkserver"]  # the forkserver's preload, in it
    assert found["imported_ahead"][-1]["settings_came"]
    assert found["usr1_caught"] == {"trainer": True, "forkserver": False}  # as an exec leaves handlers


@pytest.mark.timeout(300)
def test_the_template_imports_the_forkserver_preload_while_the_trainer_goes_on(runs):
    """``--safe_media true`` on ms-swift's command line: the template forked as ms-swift begins
    importing imports the forkserver's preload (ms-swift's data stack, the user's modules)
    before ``enable()`` sends its orders, under the environment of the fork; once it is the
    forkserver, ms-swift is protected in all it forks, as if it had imported it then."""
    found, stderr = runs["ahead"]
    imported = found["imported_ahead"]
    assert len(imported) == 1 and imported[0]["at"] < found["enabled_at"], (imported, found["enabled_at"])
    assert not imported[0]["settings_came"]  # before the orders: the trainer's environment of the fork
    assert "the warm forkserver could not import" not in stderr, stderr[-3000:]


@pytest.mark.timeout(300)
def test_an_openblas_pool_that_stops_only_at_the_fork_is_counted_out_just_after_it(runs):
    """The pool of an OpenBLAS that does not export how to stop it (numpy 2.5's) runs as the
    trainer counts its threads: the trainer forks, and OpenBLAS's own fork handler stops the
    pool; the trainer then has one thread, and keeps the template. Its pool is as without the
    fork (it starts again at its next use)."""
    found, stderr = runs["hidden"]
    assert "the trainer had 1 thread, OpenBLAS's pool stopped by the fork itself)" in stderr, stderr[-3000:]
    assert found["pools"] == runs["off"][0]["pools"] and found["torch_threads"] == runs["off"][0]["torch_threads"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["off", "thread", "hidden_thread"])
def test_otherwise_the_warm_forkserver_is_started_by_exec(runs, case):
    """With another thread of the trainer's own, where the pool stops only at the fork too: the
    template forked to count the threads again is ended, and the forkserver is started by exec."""
    found, stderr = runs[case]
    assert "multiprocessing.forkserver import main" in " ".join(found["forkserver_command"])
    assert found["forkserver_name"] != FORKSERVER_NAME
    assert "template of the warm forkserver forked" not in stderr
    why = "SWIFT_SAFE_MEDIA_FORKSERVER_FROM_TRAINER=0" if case == "off" else "the trainer has 2 threads"
    assert f"the warm forkserver will be started by exec: {why}" in stderr, stderr[-3000:]
    _workers_are_clean_forks_of(found)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["ahead", "early"])
def test_a_thread_started_after_the_hosts_first_import_keeps_the_first_template(runs, case):
    found, stderr = runs[case]
    assert "the template forked as the host began importing stays: the trainer has 2 threads" in stderr, stderr[-3000:]
    assert "forked again" not in stderr


@pytest.mark.timeout(300)
def test_the_trainers_thread_pools_are_as_without_the_fork(runs):
    """torch's intra-op threads and OpenBLAS's and OpenMP's pools, as the trainer has them
    when the forkserver is started by exec (nothing of the trainer's then changes)."""
    forked, _ = runs["forked"]
    off, _ = runs["off"]
    assert forked["torch_threads"] == off["torch_threads"]
    assert forked["pools"] == off["pools"] and any(name == "openblas" for name, _ in forked["pools"])


@pytest.mark.timeout(300)
def test_the_trainers_collections_leave_the_pages_it_shares_with_the_forkserver():
    """Forked from the trainer, the forkserver shares the pages of every object the trainer
    had then; a full collection in the trainer writes each such object's header, and so would
    copy those pages (Python's advice: freeze before a fork without exec). Frozen, they stay
    shared; with the setting off, or where the forkserver is started by exec (nothing shared),
    nothing is frozen."""
    runs = {case: subprocess.Popen([sys.executable, "-m", "tests.programs.collection_after_fork"], cwd=ROOT,
                                   env=clean_environment(env, warm_start=True), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for case, env in {"frozen": {}, "unfrozen": {config.FREEZE_TRAINER_OBJECTS: "0"},
                              "exec": {config.FORKSERVER_FROM_TRAINER: "0"}}.items()}
    found = {}
    for case, child in runs.items():
        stdout, stderr = child.communicate(timeout=240)
        assert child.returncode == 0, (case, stderr[-3000:])
        found[case] = json.loads(stdout.strip().splitlines()[-1])
    assert FORKSERVER_NAME in found["frozen"]["children"] and FORKSERVER_NAME in found["unfrozen"]["children"], found
    assert FORKSERVER_NAME not in found["exec"]["children"], found
    # torch's objects alone: some 30 MB of pages copied by one collection where not frozen.
    assert found["unfrozen"]["copied_kb"] > 10_000, found
    assert found["frozen"]["copied_kb"] < found["unfrozen"]["copied_kb"] / 10, found
    assert found["frozen"]["frozen"] > 10_000, found
    assert found["unfrozen"]["frozen"] == 0 and found["exec"]["frozen"] == 0, found
