"""A loader's dataset and ``collate_fn`` unpickled ahead by a holding server its workers fork from
(``workers.held_arguments``): real workers from the real warm forkserver, a real fast tokenizer.

What must hold: the workers get what unpickling the bytes gives (the ids the trainer encodes;
the dataset and ``collate_fn`` still share one tokenizer; the trainer's environment as it is at
the start), they fork from the server only while the objects pickle as they did when the
loader was made, and anything else (objects changed, a server killed, a ``worker_init_fn``
that could share objects, the switch off) starts them as before, from the warm forkserver.
"""

from __future__ import annotations

import json
import pickle
import re
import socket
import types

import pytest

from swift_safe_media.workers import held_arguments, hold_ahead

from .fresh import clean_environment, run_python


def run_case(case: str, *args, **extra) -> dict:
    return run_case_logged(case, *args, **extra)[0]


def run_case_logged(case: str, *args, **extra) -> tuple[dict, str]:
    """What the case found, and its stderr (our log)."""
    done = run_python(module="tests.programs.held_workers", args=[case, *args],
                      env=clean_environment(extra, warm_start=True), timeout=240)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def serves_from_the_warm_forkserver_or_said_why_not(server: dict, forkserver: int) -> bool:
    """A loader's server started from the warm forkserver (its parent among what was loaded gone):
    it serves, or it said why it cannot (there, the model's modules it imports start threads)."""
    if server["why_not"] is None:
        return server["parent"] == forkserver
    return server["why_not"].startswith("its server could not hold them")


def items(found: dict) -> list[dict]:
    return [item for epoch in found["epochs"] for item in epoch]


def assert_as_the_trainer_encodes(found: dict) -> None:
    for epoch in found["epochs"]:
        assert [item["ids"] for item in epoch] == found["expected"]
    for item in items(found):
        assert item["shared"] and item["same_dataset"], item  # one tokenizer, one dataset, as unpickled
        assert item["setting"] == "set after the loader was made", item


@pytest.mark.timeout(300)
@pytest.mark.parametrize("classes", ["__main__", "module"])
def test_workers_fork_from_the_server_that_unpickled_their_dataset_ahead_in_every_epoch(classes):
    found = run_case("held", *(["module"] if classes == "module" else []))
    assert_as_the_trainer_encodes(found)
    [server] = found["servers"]
    assert server["why_not"] is None and server["alive"] and server["threads"] == 1, server
    assert {item["ppid"] for item in items(found)} == {server["pid"]}
    # Two epochs, two workers each: four workers, all forked from the one server.
    assert len({item["pid"] for item in items(found)}) == 4
    # The server reaps them and says their codes, as CPython's does; torch's join at an epoch's end
    # reads them (it read None in 1 of 5 runs to 4 of 6, where it took a pidfd's word that the worker had ended).
    assert found["exit_codes"] == [[0, 0], [0, 0]]
    # Their launches carry references without the bytes the server holds (the server forks them).
    assert [to_server for to_server, _ in found["launches"]] == [True] * 4
    assert all(size < server["bytes"] for _, size in found["launches"]), (found["launches"], server["bytes"])
    # Each start pickles the dataset once to compare it with the server's bytes, and the launches
    # carry references. The start's check reads those bytes, but for classes of __main__ (it pickles
    # them itself, to name them).
    assert found["pickled_at_start"] == ([1, 1] if classes == "module" else [2, 2])


@pytest.mark.timeout(300)
def test_a_dataset_changed_after_its_loader_was_made_is_unpickled_by_the_workers_as_it_is_now():
    found = run_case("changed")
    assert_as_the_trainer_encodes(found)  # the ids of the changed texts
    assert {item["ppid"] for item in items(found)} == {found["forkserver"]}
    assert found["exit_codes"] == [[0, 0]]  # read through the warm forkserver, as torch's join left them
    [made] = found["servers_made"]
    assert found["servers"] == []  # ended, and forgotten
    assert found["pickled_at_start"] == [4]  # compared with the server's bytes, the check's own pickle, 2 launches
    with pytest.raises(FileNotFoundError):
        open(f"/proc/{made['pid']}/status").close()


@pytest.mark.timeout(300)
def test_workers_whose_server_was_killed_start_from_the_warm_forkserver():
    found = run_case("server_killed")
    assert_as_the_trainer_encodes(found)
    assert {item["ppid"] for item in items(found)} == {found["forkserver"]}
    [server] = found["servers"]
    assert not server["alive"] and "gone" in server["why_not"], server


@pytest.mark.timeout(300)
def test_workers_started_while_their_server_unpickles_are_queued_and_forked_by_it_once_it_has():
    found = run_case("slow")  # the server takes 1.5 s to unpickle: torch's start waits for the pids
    assert_as_the_trainer_encodes(found)
    [server] = found["servers"]
    assert {item["ppid"] for item in items(found)} == {server["pid"]}


@pytest.mark.timeout(300)
def test_workers_queued_in_a_server_that_dies_unpickling_start_from_the_warm_forkserver():
    found, stderr = run_case_logged("server_dies")
    assert_as_the_trainer_encodes(found)
    assert {item["ppid"] for item in items(found)} == {found["forkserver"]}
    assert stderr.count("holding server did not start it") == 2, stderr[-3000:]
    # Sent to the server without the bytes, then again to the warm forkserver with them.
    launches = found["launches"]
    assert sorted(to_server for to_server, _ in launches) == [False, False, True, True], launches
    sizes = {to_server: [size for sent, size in launches if sent is to_server] for to_server in (True, False)}
    assert min(sizes[False]) > max(sizes[True]), launches
    assert found["servers"] == []  # ended and forgotten: a later start does not queue there


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, extra", [("unplain_init", {}),
                                         ("held", {"SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD": "0"})])
def test_no_server_where_the_objects_could_be_shared_with_the_init_or_it_is_switched_off(case, extra):
    found = run_case(case, **extra)
    assert_as_the_trainer_encodes(found)
    assert found["servers_made"] == [] and found["servers"] == []
    assert {item["ppid"] for item in items(found)} == {found["forkserver"]}
    assert found["pickled_at_start"] == [3] * len(found["epochs"])  # the start's check and 2 launches


def test_the_fingerprint_is_the_launch_bytes_and_none_where_descriptors_are_handed_over():
    unit = ({"a": [1, 2]}, "collate")
    assert held_arguments.fingerprint(unit) == held_arguments.fingerprint(({"a": [1, 2]}, "collate"))
    assert pickle.loads(held_arguments.fingerprint(unit)) == unit
    left, right = socket.socketpair()
    with left, right:  # a socket pickles as a descriptor handed to the child
        assert held_arguments.fingerprint(({"socket": left}, None)) is None


def test_a_reference_launched_elsewhere_unpickles_its_bytes_once_for_both_parts():
    shared = ["one object"]
    data = pickle.dumps(({"rows": shared}, {"rows": shared}))
    dataset = held_arguments.held_part("not-held-here", 0, data)
    collate_fn = held_arguments.held_part("not-held-here", 1, data)
    assert dataset["rows"] is collate_fn["rows"] and dataset["rows"] == shared
    held_arguments._HELD.pop("not-held-here")


def test_a_reference_without_its_bytes_outside_its_server_raises_naming_why():
    with pytest.raises(RuntimeError, match="without its dataset's bytes"):
        held_arguments.held_part("not-held-here", 0, None)
    assert "not-held-here" not in held_arguments._HELD


def test_only_an_init_that_shares_nothing_is_plain():
    import functools

    assert hold_ahead._plain(None) and hold_ahead._plain(len) and hold_ahead._plain(run_case)
    assert hold_ahead._plain(functools.partial(run_case, "held", extra=1))
    assert not hold_ahead._plain(functools.partial(run_case, ["a list"]))
    assert not hold_ahead._plain(object()) and not hold_ahead._plain(types.MethodType(run_case, object()))


@pytest.mark.timeout(300)
def test_a_server_that_cannot_hold_them_stays_as_that_answer_and_the_workers_unpickle_in_every_epoch():
    found = run_case("refused")  # their unpickling raises in the server only
    assert_as_the_trainer_encodes(found)
    assert {item["ppid"] for item in items(found)} == {found["forkserver"]}
    assert len({item["pid"] for item in items(found)}) == 4
    # One server for the two epochs' starts: it said no once, and no other was made for the objects.
    [server] = found["servers"]
    assert "not in a holding server" in server["why_not"] and not server["alive"], server
    assert not server["keeps_bytes"]
    assert found["pickled_at_start"] == [3, 3]  # the check and 2 launches: never again for the server


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ahead", ["1", "0"])
def test_a_dataset_class_of_a_script_the_forkserver_did_not_import_is_held_by_a_server_that_imported_it(tmp_path, ahead):
    runs = tmp_path / "runs"
    done = run_python(module="tests.programs.held_main", env=clean_environment(
        {"HELD_MAIN_RUNS": str(runs), "SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD": ahead}, warm_start=True), timeout=240)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(sample["square"] for sample in found["samples"]) == [0, 1, 4, 9]
    parents = {sample["ppid"] for sample in found["samples"]}
    ran_elsewhere = [run for run in found["ran"] if run["pid"] != found["trainer"]]
    # The second loader's workers import the script themselves, as ever: its server needs nothing of it.
    plain_workers = [pid for pid, _ in found["plain_workers"]]
    assert len(plain_workers) == 2
    if ahead == "1":
        server, plain_server = found["servers"]
        assert server["why_not"] is None and parents == {server["pid"]}, found
        assert plain_server["why_not"] is None and {ppid for _, ppid in found["plain_workers"]} == {plain_server["pid"]}
        # The script's top level ran once more, in the server, as a worker runs it; its workers found it imported.
        assert ran_elsewhere[0] == {"pid": server["pid"], "name": held_arguments.SERVER_NAME}, found
        assert sorted(run["pid"] for run in ran_elsewhere[1:]) == sorted(plain_workers), found
    else:  # each worker from the forkserver imports the script itself
        assert found["servers"] == [] and parents == {found["forkserver"]}
        workers = {sample["pid"] for sample in found["samples"]} | set(plain_workers)
        assert sorted(run["pid"] for run in ran_elsewhere) == sorted(workers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, extra", [("tokenizer", {}), ("tokenizer_changed", {}), ("tokenizer_killed", {}),
                                         ("tokenizer", {"SWIFT_SAFE_MEDIA_LOADS_AHEAD": "0"})])
def test_what_from_pretrained_loads_is_held_ahead_by_servers_the_loaders_server_forks_from(case, extra):
    found = run_case(case, **extra)
    assert_as_the_trainer_encodes(found)
    forkserver, ahead, servers = found["forkserver"], found["loaded_ahead"], found["servers"]
    # In each worker: the keys under which a server holds its tokenizer object alone, and the
    # modules a server imported ahead.
    held_as = {tuple(item["tokenizer_held_as"]) for item in items(found)}
    imported = {tuple(item["modules_imported_ahead"]) for item in items(found)}
    if extra:  # switched off: nothing ahead, the loader's server forks from the warm forkserver and imports
        assert ahead == [] and found["tokenizer_key"] is None and held_as == {()} and imported == {()}
        assert [server["parent"] for server in servers] in ([forkserver], [])
        return
    tokenizer_server, modules_server = ahead  # the tokenizer's load, then the image processor's
    assert tokenizer_server["key"] == found["tokenizer_key"]
    if case == "tokenizer_killed":  # the loader's server (if it serves) starts from the warm forkserver
        assert not tokenizer_server["alive"] and not modules_server["alive"], ahead
        # Killed before a launch reached it ("its server is gone") or while one did: both send the workers on.
        assert re.search(r"gone|ended before it forked", modules_server["why_not"]), modules_server
        for server in servers:
            assert serves_from_the_warm_forkserver_or_said_why_not(server, forkserver), server
        assert {item["ppid"] for item in items(found)} <= {forkserver} | {server["pid"] for server in servers}
        assert held_as == {(tokenizer_server["key"],)} and imported == {()}  # it unpickled the bytes referred to
        return
    for server in ahead:
        assert server["alive"] and server["threads"] == 1 and server["why_not"] is None, server
    assert tokenizer_server["parent"] == forkserver and modules_server["parent"] == tokenizer_server["pid"]
    # The loader's server, a fork of the newest: the tokenizer unpickled and the image processor's
    # module imported before it unpickled the dataset. Its workers, forks of it.
    [server] = servers
    assert server["why_not"] is None and server["parent"] == modules_server["pid"]
    assert {item["ppid"] for item in items(found)} == {server["pid"]}
    [modules] = imported
    assert set(IMAGE_MODULES) <= set(modules), modules
    # A token added after the load: the tokenizer pickled in full, the workers' own.
    assert held_as == ({()} if case == "tokenizer_changed" else {(tokenizer_server["key"],)})


@pytest.mark.timeout(300)
def test_a_loaders_server_sent_to_a_server_that_died_before_forking_it_starts_from_the_warm_forkserver():
    found, stderr = run_case_logged("tokenizer_parent_killed")
    assert_as_the_trainer_encodes(found)
    # The loader's server was sent to the newest server of what was loaded, which took the request
    # and died. As the loader's start asks whether it serves, it is sent on to the warm forkserver
    # with its descriptors (the trainer had closed its own once it was sent), and answers: it serves,
    # or says why it cannot (here: threads its imports started). Not "it ended before it had
    # unpickled them", which is what it said when the descriptors sent on were the closed ones.
    [server] = found["servers"]
    assert serves_from_the_warm_forkserver_or_said_why_not(server, found["forkserver"]), server
    serving = server["why_not"] is None
    assert server["alive"] or not serving, server
    assert {item["ppid"] for item in items(found)} == ({server["pid"]} if serving else {found["forkserver"]})
    assert "a holding server's holding server did not start it" in stderr, stderr[-3000:]


IMAGE_MODULES = ("transformers.models.qwen2_vl", "transformers.models.qwen2_vl.configuration_qwen2_vl",
                 "transformers.models.qwen2_vl.image_processing_qwen2_vl")


@pytest.mark.timeout(300)
def test_nothing_is_held_ahead_where_a_host_hands_its_loaders_their_own_context():
    found = run_case("tokenizer_swift")  # ms-swift imported and patched: no loader's server would fork from them
    assert_as_the_trainer_encodes(found)
    assert found["loaded_ahead"] == [] and found["tokenizer_key"] is None
