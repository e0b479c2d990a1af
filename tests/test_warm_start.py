"""The warm start (issue #17): DataLoader workers fork from a preloaded, single-threaded
forkserver, and one zygote per process that enables protection serves it and all its
workers, each with sandboxes of its own. Real workers, real zygotes, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from swift_safe_media import config
from swift_safe_media.engine import shared_zygote, zygote

from .fresh import ROOT, clean_environment, run_python


def _run(case: str, method: str = "ours", env: dict | None = None, python: str | None = None):
    done = run_python(module="tests.programs.warm_workers", args=[case, method],
                      env=clean_environment(env, warm_start=True), timeout=240, python=python)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _gone(pids, within=10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.timeout(300)
def test_workers_fork_from_the_warm_forkserver_and_share_one_zygote():
    found, stderr = _run("shared")
    items, parent = found["items"], found["parent"]
    assert [item["index"] for item in items] == list(range(6))
    assert "swift_safe_media" not in stderr or "WARNING" not in stderr, stderr[-2000:]
    workers = {item["worker"]["pid"] for item in items}
    assert len(workers) == 2
    # Forked by the forkserver (a child of the parent), not by the parent: nothing of the
    # parent's threads or locks; one thread when the worker starts.
    assert {item["worker"]["ppid"] for item in items} == {found["forkserver"]} != {parent["pid"]}
    assert all(item["threads_at_start"] == 1 for item in items)
    # One zygote: every sandbox's parent, the parent's own included; a sandbox per worker.
    assert {item["sandbox"]["ppid"] for item in items} == {parent["sandbox"]["ppid"]} == {found["zygote"]}
    by_worker = {}
    for item in items:
        by_worker.setdefault(item["worker"]["pid"], set()).add(item["sandbox"]["pid"])
    assert all(len(sandboxes) == 1 for sandboxes in by_worker.values())
    assert len(set.union(*by_worker.values()) | {parent["sandbox"]["pid"]}) == 3
    # What changed after enable() reaches workers and their sandboxes.
    assert all(item["worker"]["late"] == "set after enable" for item in items)
    assert all(item["sandbox"]["late"] == "set after enable" for item in items)
    assert all(item["sandbox"]["max_pixels"] == 12345 for item in items)
    # Forked from the warm forkserver: glibc's mmap threshold is fixed
    # (SWIFT_SAFE_MEDIA_WORKER_MMAP_THRESHOLD_KB), so a worker's freed frames go back to
    # the system; the trainer keeps glibc's sliding threshold.
    assert all(item["worker"]["maps_large_blocks"] and item["sandbox"]["maps_large_blocks"] for item in items)
    assert not parent["maps_large_blocks"]
    # Nothing outlives the run.
    assert _gone([found["zygote"], *workers, *(item["sandbox"]["pid"] for item in items)])


@pytest.mark.timeout(300)
def test_workers_read_their_arguments_side_by_side_while_the_loader_goes_on():
    """A worker's arguments (dataset, collate_fn) are written to it by a thread: ``iter``
    returns before any worker has unpickled them (here it cannot: their unpickling waits
    for a file created after ``iter`` returns; with CPython's own launch ``iter`` waited
    out each worker's 20 s), and every item is as the dataset gives it. No holding server here
    (``workers.held_arguments``): its unpickling would wait for the gate too, and torch's start
    asks for the pids, which it gives once it has unpickled."""
    found, stderr = _run("slow_arguments", env={"SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD": "0"})
    assert found["context"] == "WarmForkServerContext"
    assert found["iter_seconds"] < 10, found["iter_seconds"]
    assert [item["index"] for item in found["items"]] == [0, 1, 2, 3]
    assert {item["gate"] for item in found["items"]} == {"opened"}
    assert {item["payload_bytes"] for item in found["items"]} == {2 << 20}
    assert {item["ppid"] for item in found["items"]} == {found["forkserver"]}


@pytest.mark.timeout(300)
def test_a_workers_start_waits_for_no_fork_and_its_pid_is_read_when_asked_for():
    """The launch returns without waiting for the forkserver to fork the worker (here it
    cannot: it is stopped), and the pid, read off the sentinel later, is the child's own;
    ``join`` with a timeout, exit codes and ``terminate`` read as CPython's; a worker whose
    forkserver died before forking it reads as exited with 255, and asking for its pid raises
    EOFError, as CPython's ``start()`` would have."""
    found, stderr = _run("pid_on_demand")
    assert found["start_seconds"] < 10, found
    assert found["unread_after_start"] == [True, True, True], found
    assert found["alive_while_stopped"] == [True, True, True], found
    assert found["reported"] == {str(pid): found["forkserver"] for pid in found["pids"]}, found
    assert found["join_seconds"] >= 0.25 and found["alive_after_join"], found
    assert found["exitcodes"] == [3, -15], found
    assert str(found["orphan_pid"]).startswith("EOFError"), found
    assert found["orphan_exitcode"] == 255, found


@pytest.mark.timeout(300)
def test_workers_of_a_loader_drawn_by_lerobots_cycle_get_every_check_of_a_warm_start():
    """LeRobot's adapter chooses the start method before the worker-start checks run, so
    its workers are forked from the warm forkserver and adopt what changed after enable()
    (they once kept the forkserver's copy of the environment)."""
    pytest.importorskip("lerobot")
    found, stderr = _run("lerobot_cycle")
    assert found["start_method"] == "forkserver", stderr[-2000:]
    items = found["items"]
    # From the server holding its dataset (workers.held_arguments), itself forked from the warm
    # forkserver. The dataset's class is of __main__: the server imports the script first where
    # the forkserver did not.
    servers = dict(zip(found["holding_servers"], found["holding_why_not"]))
    [holding] = [pid for pid, why_not in servers.items() if why_not is None] or [servers]
    assert {item["worker"]["ppid"] for item in items} == {holding}, servers
    assert all(item["threads_at_start"] == 1 for item in items)
    assert all(item["worker"]["late"] == "set after enable" for item in items)
    assert all(item["sandbox"]["late"] == "set after enable" for item in items)


@pytest.mark.timeout(300)
def test_enable_before_lerobot_is_imported_starts_the_warm_start_once():
    """``enable(hosts=["lerobot"])`` at the top of a script, in LeRobot's own environment (the
    start-up hook installed): an import the warm start makes before its fork asked where
    LeRobot is, the hook took that for LeRobot's import and ran its ``enable()`` inside the
    first one, and the two starts made two shared zygotes. The workers then used the second,
    started by exec: 2 s more to the first batch, 190 MB more."""
    python = os.path.join(ROOT, ".venv-lerobot", "bin", "python")
    if not os.path.exists(python):
        pytest.skip(".venv-lerobot is missing: `make test` builds it")
    found, stderr = _run("lerobot_cycle", python=python)
    assert found["start_method"] == "forkserver", stderr[-2000:]
    assert found["zygote_started_by"] == "fork_zygote" and found["zygotes_of_the_trainer"] == []
    assert {item["sandbox"]["ppid"] for item in found["items"]} == {found["zygote"]}


@pytest.mark.timeout(300)
def test_nothing_outlives_a_sigkilled_trainer_whose_workers_are_idle():
    """Torch's workers watch only their own parent; forked from the forkserver, that is
    the forkserver, which CPython keeps alive as long as any child holds its end of the
    pipe. The warm forkserver dies with the trainer, and so everything else does."""
    done = run_python(module="tests.programs.warm_workers", args=["trainer_killed"],
                      env=clean_environment(warm_start=True), timeout=240, check=False)
    assert done.returncode == -9, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["workers"]) == 2 and found["sandboxes"]
    # torch's workers look at their parent every 5 s (MP_STATUS_CHECK_INTERVAL).
    assert _gone([found["forkserver"], found["zygote"], *found["workers"], *found["sandboxes"]], within=30), \
        [pid for pid in [found["forkserver"], found["zygote"], *found["workers"]] if _state(pid) != "Z"]


@pytest.mark.timeout(300)
def test_a_zero_mmap_threshold_leaves_glibcs_own_in_workers():
    found, _ = _run("shared", env={"SWIFT_SAFE_MEDIA_WORKER_MMAP_THRESHOLD_KB": "0"})
    assert len(found["items"]) == 6
    assert not any(item["worker"]["maps_large_blocks"] or item["sandbox"]["maps_large_blocks"]
                   for item in found["items"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ours", "spawn", "fork"])
def test_a_lock_held_in_the_parent_is_not_inherited_by_workers(method):
    """A parent thread holds a lock while the workers start (as a decoder's futex may be):
    forked workers inherit it held for ever; ours, like spawned ones, start clean."""
    found, _ = _run("held_lock", method)
    got = [item["got_lock"] for item in found["items"]]
    assert got == ([False, False] if method == "fork" else [True, True])


@pytest.mark.timeout(300)
def test_a_thread_in_the_forkserver_means_spawned_workers_and_a_warning():
    """A preloaded module that starts a thread leaves the forkserver unsafe to fork from:
    workers are spawned instead, with one warning naming the threads."""
    found, stderr = _run("shared", env={config.WORKER_PRELOAD: "tests.thread_starter"})
    assert "the warm forkserver has 2 threads after its imports" in stderr
    assert "DataLoader workers are spawned instead" in stderr
    items = found["items"]
    assert [item["index"] for item in items] == list(range(6))
    assert all(item["worker"]["ppid"] == found["parent"]["pid"] for item in items)  # spawned by the parent
    assert all(item["sandbox"]["late"] == "set after enable" for item in items)  # decoded in sandboxes


@pytest.mark.timeout(300)
def test_a_killed_shared_zygote_is_replaced_by_one_of_the_callers_own():
    found, stderr = _run("zygote_dies")
    assert found["before"]["ppid"] == found["zygote"]
    assert found["after"]["ppid"] != found["zygote"]
    assert "the shared zygote is not answering" in stderr


@pytest.mark.timeout(300)
def test_a_forked_child_that_exits_leaves_the_shared_zygote_alone():
    """multiprocessing's at-exit handler in a child of os.fork finds the parent's daemon
    children in its copy of their list and terminates them: it sent the zygote SIGTERM."""
    found, stderr = _run("child_exits")
    assert found["child_status"] == 0 and "can only join a child process" not in found["child_stderr"]
    assert found["zygote_state"] and not found["zygote_state"].startswith("Z")
    assert found["before"]["ppid"] == found["after"]["ppid"] == found["zygote"]
    assert "the shared zygote is not answering" not in stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("expected", ["workers", "unknown", "none"])
def test_a_run_without_workers_gets_the_zygote_and_no_forkserver(expected):
    """`swift infer` has no DataLoader workers: its zygote starts early all the same (by
    exec), but no forkserver imports the data stack for nothing."""
    found, _ = _run("what_starts", expected)
    assert found["problem"] is None and found["sandbox_parent"] == found["zygote"]
    if expected == "none":
        assert found["forkserver"] is None and found["zygote_started_by"] == "popen_zygote"
    else:
        assert found["forkserver"] is not None and found["zygote_started_by"] == "fork_zygote"


@pytest.mark.timeout(120)
def test_a_callers_sandboxes_die_with_its_connection(monkeypatch):
    """A worker that dies (its connection closes) takes its sandboxes with it; other
    callers of the same zygote keep theirs; the owner's exit ends everything."""
    monkeypatch.setenv(config.PRELOAD, "numpy")
    owner = shared_zygote.SharedZygote(confined=True)
    try:
        owner.start()
        assert owner.ready.wait(60) and owner.problem is None
        first, second = zygote.Zygote.connect(owner.address), zygote.Zygote.connect(owner.address)
        deadline = time.monotonic() + 30
        one, two = first.spawn(0, deadline), second.spawn(0, deadline)
        assert _state(one.pid) != "Z" and _state(two.pid) != "Z"
        intruder = zygote.Zygote.connect(owner.address)
        with pytest.raises(EOFError):  # another caller's sandbox: the zygote hangs up on it
            intruder.reap(one.pid, deadline)
        assert os.path.exists(f"/proc/{one.pid}") and _state(one.pid) != "Z"
        first.close()
        assert _gone([one.pid])
        assert _state(two.pid) not in ("Z",) and os.path.exists(f"/proc/{two.pid}")
        three = second.spawn(0, deadline)
        assert second.reap(three.pid, deadline)[0] != -1  # its own: killed and collected
        assert _gone([three.pid])
    finally:
        owner.close()
    assert _gone([owner.pid, two.pid])
    assert not os.path.exists(owner.folder)


def test_only_the_owners_user_may_connect(tmp_path):
    """The socket lives in a folder only its owner may enter."""
    owner = shared_zygote.SharedZygote(confined=True)
    try:
        assert os.stat(owner.folder).st_mode & 0o777 == 0o700
        assert shared_zygote.shared_address(True) == owner.address
        assert shared_zygote.shared_address(False) == owner.address  # it also forks unconfined sandboxes
    finally:
        owner.close()
    assert shared_zygote.shared_address(True) is None
    with pytest.raises(OSError):
        zygote.Zygote.connect(owner.address)


MAIN_SCRIPT = '''
"""A training script whose top level {what}."""
import json
import os
import sys

import imported_by_main  # notes each process that imports it
from torch.utils.data import DataLoader, Dataset

import swift_safe_media
{extra}

class Rows(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.getpid()


def main():
    swift_safe_media.enable(hosts=[])
    from multiprocessing import forkserver

    loader = DataLoader(Rows(), batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    workers = sorted(set(int(pid) for pid in loader))
    print(json.dumps({{"trainer": os.getpid(), "workers": workers,
                      "forkserver": forkserver._forkserver._forkserver_pid,
                      "forked": open(f"/proc/{{forkserver._forkserver._forkserver_pid}}/comm").read().strip()
                                == "ssm-forkserver",
                      "zygote": swift_safe_media.process.current().shared_zygote.pid}}))


if __name__ == "__main__":
    main()
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.parametrize("top_level", ["defines", "calls"])
def test_the_forkserver_imports_a_main_script_that_only_defines_once_for_all_workers(tmp_path, how, top_level):
    """Every forkserver child imports the trainer's main script before it runs (the shared
    zygote excepted: it needs nothing of it, and an unguarded script would decode in it,
    issue 26). When its top level only imports and defines, the warm forkserver imports it
    once and its children find it there; a script that calls something at its top level is
    left to each worker."""
    extra = "sys.stderr.write('top level ran\\n')" if top_level == "calls" else ""
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(MAIN_SCRIPT.format(what=top_level, extra=extra))
    marker = tmp_path / "imported_by.txt"
    (tmp_path / "imported_by_main.py").write_text(
        "import os\nwith open(os.environ['IMPORTED_BY'], 'a') as notes:\n    notes.write(f'{os.getpid()}\\n')\n")
    program = ["-m", "trainer.train"] if how == "module" else [str(package / "train.py")]
    env = clean_environment({"IMPORTED_BY": str(marker), "PYTHONPATH": str(tmp_path)}, warm_start=True)
    done = subprocess.run([sys.executable, *program], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    importers = [int(line) for line in marker.read_text().split()]
    assert len(found["workers"]) == 2
    # A forkserver forked from the trainer (forked_forkserver) has the module imported already.
    trainer = [found["trainer"]]
    if top_level == "defines":
        expected = trainer if found["forked"] else [*trainer, found["forkserver"]]
    else:
        expected = trainer if found["forked"] else [*trainer, *found["workers"]]
        assert done.stderr.count("top level ran") == 3, done.stderr[-2000:]  # the trainer and each worker
    assert sorted(importers) == sorted(expected), done.stderr[-2000:]
    assert "WARNING" not in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_main_script_whose_imports_start_a_thread_gets_spawned_workers_and_a_warning_naming_it(tmp_path):
    """Importing the main script in the forkserver is checked like its other imports: a
    thread started by it means spawned workers and one warning that says where the thread
    came from and how to leave the script to the workers."""
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT.format(what="imports a module that starts a thread", extra="import starts_a_thread"))
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    (tmp_path / "imported_by_main.py").write_text(
        "import os\nwith open(os.environ['IMPORTED_BY'], 'a') as notes:\n    notes.write(f'{os.getpid()}\\n')\n")
    env = clean_environment({"IMPORTED_BY": str(tmp_path / "imported_by.txt"), "PYTHONPATH": str(tmp_path)},
                            warm_start=True)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "the warm forkserver has 2 threads after its imports" in done.stderr
    assert f"(1 started by importing the main script; {config.FORKSERVER_IMPORTS_MAIN}=0 leaves it" in done.stderr
    assert "DataLoader workers are spawned instead" in done.stderr
    importers = [int(line) for line in (tmp_path / "imported_by.txt").read_text().split()]
    # Spawned workers import the script themselves, as spawn does.
    assert sorted(importers) == sorted([found["trainer"], found["forkserver"], *found["workers"]])
