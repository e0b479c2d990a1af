"""Opens by name brokered by the caller (issue 45, ``confinement/broker.py``): one pooled,
confined sandbox serves call after call of code that opens its media by name, and may read
each call's own files, by any name the kernel resolves to them, and nothing else: not the
files of the calls before, not a secret, not a file opened for writing. A sandbox that
floods its caller with opens still ends at its timeout; one that leaves its files open is
replaced before it runs out of descriptors; one started by exec (a zygote with a thread) is
brokered as one forked; where a sandbox cannot listen for its opens (a seccomp listener above
it already: a container's supervisor) calls get a sandbox each.
The attacks of issue 42 are in ``test_confine_stock.py``, run both ways."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from swift_safe_media import MediaDecodeTimeout
from swift_safe_media.confinement import broker, policy as confine
from swift_safe_media.engine import calls as engine, per_call

from .fresh import ROOT, clean_environment, run_python
from .test_confine_stock import accepted, assert_all_refused, read_then_attack, targets, video  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(confine.landlock_abi() < 1 or broker.why_not() is not None,
                                reason=f"opens are not brokered here: {broker.why_not()}")


@pytest.fixture
def files(video, tmp_path):
    """The clip, a copy of it, a symlink to the clip, hard links to it (one of the same name in
    another folder, one by another name), a secret beside them."""
    other = tmp_path / "other.mp4"
    shutil.copy(video, other)
    (tmp_path / "link.mp4").symlink_to(video)
    (tmp_path / "elsewhere").mkdir()
    os.link(video, tmp_path / "elsewhere" / os.path.basename(video))
    os.link(video, tmp_path / "renamed.mp4")
    (tmp_path / "secret.txt").write_text("hf_SECRET")
    return {"clip": video, "other": str(other), "link": str(tmp_path / "link.mp4"),
            "hard": str(tmp_path / "elsewhere" / os.path.basename(video)), "renamed": str(tmp_path / "renamed.mp4"),
            "secret": str(tmp_path / "secret.txt")}


def native_open(media, name, how="open"):
    """In the sandbox: open ``name`` as native code would (libc, not Python's ``open``), read
    its first bytes, close it. Returns ``"read <bytes>"`` or ``"refused <errno name>"``."""
    import ctypes
    import errno
    import struct

    from swift_safe_media.confinement import handed

    libc = ctypes.CDLL(None, use_errno=True)
    flags = {"write": os.O_WRONLY, "create": os.O_RDONLY | os.O_CREAT, "nofollow": os.O_RDONLY | os.O_NOFOLLOW}
    if how == "openat2":
        open_how = ctypes.create_string_buffer(struct.pack("=QQQ", os.O_RDONLY | os.O_CLOEXEC, 0, 0), 24)
        fd = libc.syscall(437, -100, name.encode(), open_how, 24)
    elif how == "relative":
        os.chdir(os.path.dirname(name))
        fd = libc.open(os.path.basename(name).encode(), os.O_RDONLY)
    elif how == "own descriptor":
        fd = libc.open(f"/proc/self/fd/{handed.handed_fd(media)}".encode(), os.O_RDONLY)
    elif how == "/dev/fd":
        fd = libc.open(f"/dev/fd/{handed.handed_fd(media)}".encode(), os.O_RDONLY)
    else:
        fd = libc.open(name.encode(), flags.get(how, os.O_RDONLY), 0o600)
    if fd < 0:
        return f"refused {errno.errorcode[ctypes.get_errno()]}"
    try:
        return f"read {os.pread(fd, 8, 0)!r}"
    finally:
        os.close(fd)


def opens_and_pid(media, names, how="open"):
    return os.getpid(), [native_open(media, name, how) for name in names]


def test_one_sandbox_serves_calls_on_other_files_each_reading_only_its_own(files, fresh_engine):
    head = f"read {open(files['clip'], 'rb').read(8)!r}"
    first, seen = engine.call(opens_and_pid, files["clip"], [files["clip"], files["other"], files["secret"]],
                              confine=engine.BY_NAME)
    assert seen == [head, "refused EACCES", "refused EACCES"]
    second, seen = engine.call(opens_and_pid, files["other"], [files["other"], files["clip"], files["secret"]],
                               confine=engine.BY_NAME)
    assert second == first  # the same sandbox: the clip, handed to the call before, is not readable now
    assert seen == [head, "refused EACCES", "refused EACCES"]
    # The names a library reaches the handed file by read it: the same name elsewhere (a hard
    # link), relative ones, openat2, its own descriptors; handed a symlink, the symlink and the
    # file it leads to. A name ending otherwise is not looked up (a hard link renamed; the
    # symlink, handed the file): the sandbox's own open, refused.
    for how, name in (("open", files["hard"]), ("openat2", files["clip"]), ("relative", files["clip"]),
                      ("own descriptor", files["clip"]), ("/dev/fd", files["clip"])):
        pid, seen = engine.call(opens_and_pid, files["clip"], [name], how, confine=engine.BY_NAME)
        assert (pid, seen) == (first, [head]), (how, name)
    assert engine.call(opens_and_pid, files["link"], [files["link"], files["clip"], files["other"]],
                       confine=engine.BY_NAME) == (first, [head, head, "refused EACCES"])
    assert engine.call(opens_and_pid, files["clip"], [files["link"]], confine=engine.BY_NAME) == \
        (first, ["refused EACCES"])
    assert engine.call(opens_and_pid, files["clip"], [files["renamed"]], confine=engine.BY_NAME) == \
        (first, ["refused EACCES"])
    # What the call's own sandbox would refuse, this one refuses: a link not followed, a write, a new file.
    for how, name, refused in (("nofollow", files["link"], "refused ELOOP"), ("write", files["clip"], "refused EACCES"),
                               ("create", files["clip"] + ".new", "refused EACCES")):
        assert engine.call(opens_and_pid, files["clip"], [name], how, confine=engine.BY_NAME) == (first, [refused]), how
    assert not os.path.exists(files["clip"] + ".new")
    # One batch's calls may each read the batch's files, as one sandbox per batch could.
    batch = engine.call_each(native_open, [(files["clip"], files["clip"]), (files["other"], files["other"])],
                             [files["clip"], files["other"]], confine=engine.BY_NAME)
    assert batch == [head, head]
    assert engine.get_engine(engine.BY_NAME).stats["sandboxes_started"] == 1


def test_attacks_are_refused_in_a_sandbox_that_served_calls_before(files, targets, fresh_engine):  # noqa: F811
    pids = set()
    for media in (files["clip"], files["other"], files["clip"]):
        pid, (head, attacks) = engine.call(pid_read_then_attack, media, confine=engine.BY_NAME)
        pids.add(pid)
        assert head == open(media, "rb").read(8)
        assert_all_refused(attacks, targets)
    assert len(pids) == 1


def pid_read_then_attack(media):
    return os.getpid(), read_then_attack(media)


def open_for_ever(media, name):
    while True:
        native_open(media, name)


def test_a_flood_of_opens_ends_at_the_timeout_and_the_next_call_reads(files, fresh_engine):
    """Each open waits on the caller, which answers it as it waits for the reply: the clock
    still runs, and a sandbox that does nothing but open is killed at its timeout. The engine
    is started first: its start-up (seconds on a loaded machine) is not the call's to bound."""
    assert engine.call(native_open, files["clip"], files["clip"], confine=engine.BY_NAME).startswith("read")
    started = time.monotonic()
    with pytest.raises(MediaDecodeTimeout) as caught:
        engine.call(open_for_ever, files["clip"], files["secret"], timeout=1.0, confine=engine.BY_NAME)
    assert caught.value.path == files["clip"] and time.monotonic() - started < 8, caught.value
    assert engine.call(native_open, files["clip"], files["clip"], confine=engine.BY_NAME).startswith("read")


def leave_open(media):
    import ctypes

    fd = ctypes.CDLL(None).open(media.encode(), os.O_RDONLY)
    return os.getpid(), fd, len(os.listdir("/proc/self/fd"))


def test_a_sandbox_that_leaves_files_open_is_replaced_before_it_runs_out(files, fresh_engine):
    """Code we do not own may leave a file open each call (a sandbox per call never
    noticed): the pooled sandbox is replaced once it holds so many descriptors."""
    seen = [engine.call(leave_open, files["clip"], confine=engine.BY_NAME) for _ in range(per_call.MOST_DESCRIPTORS + 40)]
    assert all(fd >= 0 for _, fd, _ in seen)
    assert len({pid for pid, _, _ in seen}) == 2
    assert max(count for _, _, count in seen) <= per_call.MOST_DESCRIPTORS + 4  # its request's and listdir's own


CANNOT_LISTEN = r"""
import ctypes, json, os, sys
from swift_safe_media.confinement import broker, kernel
from swift_safe_media.engine import calls as engine
from tests.test_open_broker import opens_and_pid

# A seccomp listener of our own, as a container's supervisor holds: the sandboxes below
# inherit it, and the kernel gives a process one listener in its ancestry at most.
kernel.set_no_new_privs()
with kernel.SeccompFilter(kernel.SCMP_ACT_ALLOW) as program:
    program.add(broker.SCMP_ACT_NOTIFY, kernel.syscall_numbers(["acct"])["acct"])
    _, fprog = kernel.filter_program(program.export_bpf())
kept = kernel.syscall(kernel.syscall_numbers(["seccomp"])["seccomp"], ctypes.c_uint(1),
                      ctypes.c_uint(broker.SECCOMP_FILTER_FLAG_NEW_LISTENER), ctypes.byref(fprog))
first = engine.call(opens_and_pid, sys.argv[1], [sys.argv[1], sys.argv[3]], confine=engine.BY_NAME)
second = engine.call(opens_and_pid, sys.argv[2], [sys.argv[2], sys.argv[1]], confine=engine.BY_NAME)
print(json.dumps({"first": first, "second": second, "brokered": engine.get_engine(engine.BY_NAME).brokered}))
"""


def test_where_a_sandbox_cannot_listen_calls_get_a_sandbox_each(files):
    done = run_python(code=CANNOT_LISTEN, args=[files["clip"], files["other"], files["secret"]], timeout=180)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    head = f"read {open(files['clip'], 'rb').read(8)!r}"
    assert found["brokered"] is False
    assert found["first"][1] == [head, "refused EACCES"] and found["second"][1] == [head, "refused EACCES"]
    assert found["first"][0] != found["second"][0]
    assert "could not listen for its opens; code that opens its media by name gets a sandbox per call" in done.stderr


BY_EXEC = r"""
import json, sys
from swift_safe_media.engine import calls as engine
from tests.test_open_broker import opens_and_pid

first = engine.call(opens_and_pid, sys.argv[1], [sys.argv[1], sys.argv[2]], confine=engine.BY_NAME)
second = engine.call(opens_and_pid, sys.argv[2], [sys.argv[2], sys.argv[1]], confine=engine.BY_NAME)
print(json.dumps({"first": first, "second": second, "brokered": engine.get_engine(engine.BY_NAME).brokered}))
"""


def test_a_sandbox_started_by_exec_is_brokered_too(files, tmp_path):
    """A zygote whose preload started a thread starts its sandboxes by exec (seconds each):
    the brokered one is started once and serves call after call, as confined."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    env = clean_environment({"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]),
                             "SWIFT_SAFE_MEDIA_PRELOAD": "numpy,starts_a_thread"})
    done = run_python(code=BY_EXEC, args=[files["clip"], files["other"]], env=env, timeout=180)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    head = f"read {open(files['clip'], 'rb').read(8)!r}"
    assert "starting sandboxes by exec" in done.stderr, done.stderr[-2000:]
    assert found["brokered"] is True and found["first"][0] == found["second"][0]
    assert found["first"][1] == [head, "refused EACCES"] and found["second"][1] == [head, "refused EACCES"]
