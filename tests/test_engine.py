"""The engine against real failures: GIL-holding native calls, FIFOs, segfaults,
memory bombs, threads, DataLoader workers and a parent killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import swift_safe_media
from swift_safe_media import (MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout,
                              MediaQuarantined, call, isolated)
from swift_safe_media import config
from swift_safe_media.engine.calls import RemoteTraceback, get_engine

from . import sandboxed
from .fresh import ROOT, run_python
from .conftest import children_of, process_state, wait_until_dead

SLACK = 0.5  # the bound: the error arrives within timeout + 0.5 s


def timed_failure(expected, fn, *args, timeout=1.0, **kwargs):
    started = time.monotonic()
    with pytest.raises(expected) as caught:
        call(fn, *args, timeout=timeout, **kwargs)
    return caught.value, time.monotonic() - started


def assert_engine_usable(previous_pid=None):
    pid = call(sandboxed.sandbox_pid, timeout=5)
    if previous_pid is not None:
        assert pid != previous_pid, "a killed sandbox must be replaced, not reused"
    assert call(sandboxed.add, 2, 3, timeout=5) == 5


def test_result_round_trip():
    assert call(sandboxed.add, 1, 2) == 3
    assert call(sandboxed.echo, {"a": [1, 2], "b": "x"}) == {"a": [1, 2], "b": "x"}


def test_sandbox_is_persistent_and_isolated(fresh_engine, monkeypatch):
    monkeypatch.setenv(config.THREADS, "1")  # no thread pool of its own: any thread would be inherited
    first, second = call(sandboxed.process_facts), call(sandboxed.process_facts)
    assert first["pid"] == second["pid"] != os.getpid()
    assert first["pgid"] == first["pid"], "the sandbox leads its own process group"
    assert first["threads"] == 1 and first["omp"] == "1"
    zygote = get_engine()._link.zygote.process
    assert first["ppid"] == zygote.pid
    with open(f"/proc/{zygote.pid}/cmdline", "rb") as cmdline:
        assert b"zygote_main" in cmdline.read(), "the zygote is a fresh interpreter, not a fork"
    assert len(os.listdir(f"/proc/{zygote.pid}/task")) == 1


def test_native_call_holding_the_gil_times_out():
    previous = call(sandboxed.sandbox_pid)
    error, elapsed = timed_failure(MediaDecodeTimeout, sandboxed.hold_gil_on_locked_mutex,
                                   path="/data/clip_a.mp4")
    assert elapsed < 1.0 + SLACK
    assert "/data/clip_a.mp4" in str(error) and error.path == "/data/clip_a.mp4"
    assert "timeout" in error.reason and error.elapsed >= 1.0
    assert_engine_usable(previous)


def test_native_busy_loop_holding_the_gil_times_out(spin_library, readable, monkeypatch):
    readable(os.path.dirname(spin_library))
    # How soon the kill comes, so no time waiting for a CPU is added to the timeout on
    # this busy machine (the fair clock has its own tests: test_machine_faults.py).
    monkeypatch.setenv(config.TIMEOUT_CEILING, "1")
    error, elapsed = timed_failure(MediaDecodeTimeout, sandboxed.spin_holding_gil, spin_library)
    assert elapsed < 1.0 + SLACK
    assert spin_library in str(error), "the first path-like argument names the media"
    assert_engine_usable()


def test_fifo_without_writer_times_out(fifo):
    error, elapsed = timed_failure(MediaDecodeTimeout, sandboxed.open_fifo, fifo)
    assert elapsed < 1.0 + SLACK and error.path == fifo and fifo in str(error)
    assert_engine_usable()


def test_helper_processes_die_with_the_sandbox():
    helper = call(sandboxed.fork_helper)
    timed_failure(MediaDecodeTimeout, sandboxed.sleep_then_pid, 1000)
    assert wait_until_dead([helper], within=2.0) == {}, "the helper ignored SIGTERM; SIGKILL to the group must reach it"


def test_helper_programs_die_with_an_unconfined_sandbox(tmp_path):
    # A user's own function that needs programs runs unconfined (confine=False).
    pid_file = tmp_path / "helper.pid"
    timed_failure(MediaDecodeTimeout, sandboxed.sleep_with_helper, str(pid_file), confine=False)
    helper = int(pid_file.read_text())
    assert wait_until_dead([helper], within=2.0) == {}, "the helper ignored SIGTERM; SIGKILL to the group must reach it"


def test_segfault_is_a_crash():
    previous = call(sandboxed.sandbox_pid)
    error, elapsed = timed_failure(MediaDecodeCrash, sandboxed.segfault, path="clip_b.mkv")
    assert "SIGSEGV" in error.reason and "clip_b.mkv" in str(error)
    assert_engine_usable(previous)


def test_exit_code_is_reported():
    error, _ = timed_failure(MediaDecodeCrash, sandboxed.exit_with, 3)
    assert "exited with code 3" in error.reason
    assert_engine_usable()


@pytest.mark.parametrize("bomb", [sandboxed.memory_bomb, sandboxed.torch_memory_bomb])
def test_memory_bomb_hits_the_cap(bomb, fresh_engine, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MAX_MEMORY_MB", "512")
    error, _ = timed_failure(MediaDecodeError, bomb, timeout=30, path="bomb.flac")
    assert type(error) is MediaDecodeError
    assert "memory limit of 512 MB" in error.reason and "bomb.flac" in str(error)
    assert_engine_usable()


def test_exception_comes_back_as_itself_with_its_traceback():
    with pytest.raises(ValueError, match="bad frame 7") as caught:
        call(sandboxed.raise_value_error, "bad frame 7")
    cause = caught.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "raise_value_error" in str(cause) and "sandboxed.py" in str(cause)
    assert_engine_usable()


def test_unpicklable_exception_is_wrapped_with_type_and_traceback():
    with pytest.raises(MediaDecodeError) as caught:
        call(sandboxed.raise_unpicklable, path="clip_c.mp4")
    message = str(caught.value)
    assert "Unpicklable" in message and "cannot cross" in message and "raise_unpicklable" in message
    assert "clip_c.mp4" in message


def test_decode_error_raised_inside_gets_path_and_elapsed():
    with pytest.raises(MediaDecodeError) as caught:
        call(sandboxed.raise_decode_error, "/media/clip_d.mp4")
    assert caught.value.path == "/media/clip_d.mp4" and caught.value.elapsed is not None


def test_errors_carry_path_reason_and_pickle():
    import pickle

    for kind in (MediaDecodeError, MediaDecodeTimeout, MediaDecodeCrash, MediaQuarantined):
        error = kind("/x/y.mp4", "some reason", 1.5)
        assert isinstance(error, MediaDecodeError)
        assert "/x/y.mp4" in str(error) and "some reason" in str(error)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is kind and (again.path, again.reason, again.elapsed) == ("/x/y.mp4", "some reason", 1.5)


def test_concurrent_threads_never_mix_results():
    results, errors = {}, []

    def worker(tag):
        try:
            for _ in range(15):
                values, _pid = call(sandboxed.tagged_array, tag)
                assert values.shape == (1 << 18,) and (values == tag).all()
            results[tag] = True
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and sorted(results) == [0, 1, 2, 3]


def mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            if start <= address < end:
                return line.strip()
    return ""


def test_large_results_arrive_through_shared_memory():
    import torch
    from PIL import Image

    result = call(sandboxed.rich_result)
    expected = sandboxed.rich_result()
    assert np.array_equal(result["array"], expected["array"])
    assert mapping_of(result["array"].ctypes.data).endswith("/memfd:swift-safe-media (deleted)"), \
        "the array views the sandbox's shared memory, not a copy"
    assert result["array"].flags.writeable
    assert result["strided"].strides == expected["strided"].strides
    assert np.array_equal(result["strided"], expected["strided"])
    assert result["tensor"].stride() == expected["tensor"].stride()
    assert torch.equal(result["tensor"], expected["tensor"])
    assert result["bf16"].dtype == torch.bfloat16 and torch.equal(result["bf16"], expected["bf16"])
    assert all(isinstance(image, Image.Image) for image in result["images"])
    assert [np.asarray(i).tolist() for i in result["images"]] == [np.asarray(i).tolist() for i in expected["images"]]
    assert result["gray"].mode == "L" and np.array_equal(np.asarray(result["gray"]), np.asarray(expected["gray"]))
    assert np.array_equal(result["small"], expected["small"]) and result["meta"] == expected["meta"]


def test_unpicklable_function_is_refused_in_the_caller():
    with pytest.raises(TypeError, match="module-level function"):
        call(lambda: 1)


def test_isolated_decorator():
    pid, path, scale = sandboxed.decorated_load("clip_e.mp4", scale=2)
    assert pid != os.getpid() and (path, scale) == ("clip_e.mp4", 2)
    assert sandboxed.decorated_load.__name__ == "decorated_load"

    @isolated
    def local():  # a local function cannot be sent to a sandbox
        return 1

    with pytest.raises(TypeError):
        local()


def test_call_inside_a_sandbox_runs_in_place():
    inner, outer = call(sandboxed.nested_call)
    assert inner == outer != os.getpid()


def test_default_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_TIMEOUT", "0.7")
    started = time.monotonic()
    with pytest.raises(MediaDecodeTimeout, match="0.7 s"):
        call(sandboxed.hold_gil_on_locked_mutex)
    assert time.monotonic() - started < 0.7 + SLACK


def test_forked_child_starts_its_own_sandbox():
    parent_sandbox = call(sandboxed.sandbox_pid)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read_end)
            child_sandbox = call(sandboxed.sandbox_pid, timeout=60)
            os.write(write_end, str(child_sandbox).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child_sandbox = int(pipe.read() or 0)
    os.waitpid(pid, 0)
    assert child_sandbox and child_sandbox != parent_sandbox
    assert call(sandboxed.sandbox_pid) == parent_sandbox, "the child must leave the parent's sandbox alone"


def test_threads_in_the_zygote_switch_sandboxes_to_exec(fresh_engine, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_PRELOAD", "numpy,tests.thread_starter")
    facts = call(sandboxed.process_facts, timeout=60)
    with open(f"/proc/{facts['pid']}/cmdline", "rb") as cmdline:
        assert b"exec_sandbox_main" in cmdline.read()
    assert facts["threads"] == 2  # only the preloaded module's own thread
    error, _ = timed_failure(MediaDecodeTimeout, sandboxed.hold_gil_on_locked_mutex)
    assert call(sandboxed.add, 1, 1, timeout=60) == 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_dataloader_workers_each_get_a_sandbox(start_method, fifo):
    import torch.utils.data

    from .loader_datasets import SandboxedDataset

    parent_sandbox = call(sandboxed.sandbox_pid)
    dataset = SandboxedDataset(8, fifo_index=5, fifo=fifo)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context=start_method)
    items = list(loader)
    assert [item["index"] for item in items] == list(range(8))
    for item in items:
        if item["index"] == 5:
            assert item["error"].startswith("MediaDecodeTimeout") and fifo in item["error"]
        else:
            assert item["value"] == item["index"] * 2
    sandboxes = {item["worker"]: item["sandbox"] for item in items if item["index"] != 5}
    assert len(sandboxes) == 2 and len(set(sandboxes.values())) == 2
    assert parent_sandbox not in sandboxes.values()




@pytest.mark.parametrize("busy", [True, False])
def test_sigkill_of_the_parent_leaves_no_orphans(tmp_path, busy):
    pid_file = tmp_path / "helper.pid"
    victim = subprocess.Popen([sys.executable, "-m", "tests.programs.engine_kill_target", str(pid_file),
                               "busy" if busy else "idle"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        zygote, sandbox = map(int, victim.stdout.readline().split())
        watched = [zygote, sandbox]
        if busy:
            deadline = time.monotonic() + 10
            while not pid_file.exists() or not pid_file.read_text():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            watched.append(int(pid_file.read_text()))
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        assert wait_until_dead(watched, within=3.0) == {}
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.serial  # /dev/shm is every process's: run alone, nothing else's blocks come and go
def test_clean_exit_leaves_no_processes_or_shared_memory():
    before = set(os.listdir("/dev/shm"))
    done = run_python(module="tests.programs.engine_clean_exit", env=dict(os.environ), timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    zygote, sandbox = map(int, done.stdout.split())
    assert wait_until_dead([zygote, sandbox], within=3.0) == {}
    # Other tests running beside this one (joblib's loky in LLaMA-Factory's runs) make
    # semaphores of their own meanwhile: only what is not theirs counts.
    assert {name for name in set(os.listdir("/dev/shm")) - before if not name.startswith("sem.loky-")} == set()


def test_shutdown_reaps_everything(fresh_engine):
    call(sandboxed.add, 1, 1)
    zygote = get_engine()._link.zygote.process.pid
    swift_safe_media.shutdown()
    assert process_state(zygote) is None
    ours = []
    for child in children_of(os.getpid()):
        with open(f"/proc/{child}/cmdline", "rb") as cmdline:
            if b"swift_safe_media" in cmdline.read():
                ours.append(child)
    assert ours == []


def test_shared_blocks_are_reused_only_after_the_caller_drops_them():
    import gc

    swift_safe_media.shutdown()
    first = call(sandboxed.filled_frames, 1)
    assert call(sandboxed.arena_counts) == (1, 0)
    second = call(sandboxed.filled_frames, 2)  # `first` is alive: a new block, not its memory
    assert call(sandboxed.arena_counts) == (2, 0)
    assert (first == 1).all() and (second == 2).all()
    del first
    gc.collect()
    third = call(sandboxed.filled_frames, 3)  # reuses the block `first` gave back
    assert call(sandboxed.arena_counts) == (2, 0)
    assert (second == 2).all() and (third == 3).all()
    del second, third
    gc.collect()
    assert call(sandboxed.arena_counts) == (0, 2)


def test_a_result_written_into_shared_memory_is_sent_without_a_copy():
    import gc

    swift_safe_media.shutdown()
    first = call(sandboxed.frames_written_in_place, 1)
    assert (first == 1).all() and not first.flags["OWNDATA"]
    assert call(sandboxed.arena_counts) == (1, 0)  # the block written is the one sent: no second block
    with pytest.raises(ValueError, match="failed after writing its frames"):
        call(sandboxed.frames_written_in_place, 2, then="raise")
    assert call(sandboxed.arena_counts) == (1, 1)  # the failed call's block is idle again
    copied = call(sandboxed.frames_written_in_place, 3, then="copy")  # written, but a copy is sent
    assert call(sandboxed.arena_counts) == (2, 1) and (copied == 3).all()
    again = call(sandboxed.frames_written_in_place, 4)  # lent while `first` and `copied` are alive
    assert (first == 1).all() and (copied == 3).all() and (again == 4).all()
    del first, copied, again
    gc.collect()
    assert call(sandboxed.arena_counts) == (0, 3)
    fifth = call(sandboxed.frames_written_in_place, 5)  # reuses an idle block
    assert (fifth == 5).all() and call(sandboxed.arena_counts) == (1, 2)


def test_a_killed_zygote_is_restarted(fresh_engine):
    call(sandboxed.add, 1, 1)
    zygote = get_engine()._link.zygote.process
    zygote.kill()
    zygote.wait()
    # The idle sandbox died with its zygote (PR_SET_PDEATHSIG); the next call notices both.
    assert call(sandboxed.add, 2, 2, timeout=60) == 4
    assert get_engine()._link.zygote.process.pid != zygote.pid


def test_more_sandboxes_run_threads_in_parallel(fresh_engine, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_SANDBOXES", "2")
    call(sandboxed.add, 0, 0)  # start the zygote outside the timing
    pids, threads = [], []
    for _ in range(2):
        threads.append(threading.Thread(target=lambda: pids.append(call(sandboxed.sleep_then_pid, 1.0))))
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(set(pids)) == 2 and time.monotonic() - started < 1.9


def test_a_package_folder_in_the_callers_directory_does_not_shadow_the_zygotes(tmp_path, monkeypatch,
                                                                             fresh_engine):
    """The zygote starts as ``python -c``, which puts its working directory first on
    sys.path; it must import the package the caller imported, not a folder of that name."""
    shadow = tmp_path / "swift_safe_media"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadow package was imported')\n")
    monkeypatch.chdir(tmp_path)
    assert swift_safe_media.call(os.getpid) != os.getpid()
