"""Confinement without exceptions (issue 42): the sandboxes that run stock's own code,
which opens its media by name, are confined as the twins' are, and may read the files
handed with the call, by name, and no other media (``engine.BY_NAME``). Where the kernel
can (Linux >= 5.14), one pooled sandbox serves call after call and its caller answers its
opens (``confinement/broker.py``, issue 45); else (``SWIFT_SAFE_MEDIA_OPEN_BROKER=0`` here) a
call gets a sandbox of its own, confined as the call begins with one more Landlock rule per
file. Real attacks from stand-ins of the library openers (:mod:`tests.exploit_standin`): a
live loopback listener, /bin/sh, a write, a token file under ``$HOME``, ``/etc/shadow``, the
trainer's environment."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest

from swift_safe_media import MediaDecodeError, MediaDecodeTimeout
from swift_safe_media.confinement import broker, policy as confine
from swift_safe_media.engine import calls as engine

from . import exploit_standin
from .fresh import ROOT, clean_environment, run_python
from .swift_scenario import _ffmpeg

pytestmark = pytest.mark.skipif(confine.landlock_abi() < 1 or confine.seccomp_available() is not None,
                                reason="the kernel lacks Landlock or seccomp")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("stock_media") / "clip.mp4"
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=160x120:rate=10:duration=1", "-c:v", "libx264",
            "-pix_fmt", "yuv420p", str(path))
    return str(path)


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """What the attacks aim at: a live listener, a folder, a token file under a home folder,
    this process (the trainer), a secret in its environment."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_SECRET")
    folder = tmp_path / "target"
    folder.mkdir()
    (tmp_path / "target-loose").mkdir()
    environment = {"EXPLOIT_PORT": str(listener.getsockname()[1]), "EXPLOIT_FOLDER": str(folder),
                   "EXPLOIT_HOME": str(home), "EXPLOIT_TRAINER": str(os.getpid()),
                   exploit_standin.SECRET_ENV: "hf_SECRET",
                   "SWIFT_SAFE_MEDIA_SANDBOX_ENV": "EXPLOIT_PORT,EXPLOIT_FOLDER,EXPLOIT_HOME,EXPLOIT_TRAINER"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    yield {"listener": listener, "folder": folder, "environment": environment}
    listener.close()


def accepted(listener) -> bool:
    try:
        conn, _ = listener.accept()
    except OSError:
        return False
    conn.close()
    return True


def assert_all_refused(attacks: dict, targets) -> None:
    assert len(attacks) == 7, attacks
    assert all(outcome.startswith("refused") for outcome in attacks.values()), attacks
    assert os.listdir(targets["folder"]) == []
    assert not accepted(targets["listener"])


def read_then_attack(media_path):
    """In a sandbox for one call: the file opened by name, as stock does, then every attack."""
    with open(media_path, "rb") as media:
        head = media.read(8)
    return head, exploit_standin.attack()


@pytest.fixture
def per_call(monkeypatch):
    """Opens by name not brokered: a sandbox per call, as on a kernel before 5.14."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_OPEN_BROKER", "0")


@pytest.fixture(params=["brokered", "per call"])
def either_way(request, monkeypatch):
    if request.param == "per call":
        monkeypatch.setenv("SWIFT_SAFE_MEDIA_OPEN_BROKER", "0")
    elif broker.why_not():
        pytest.skip(broker.why_not())
    return request.param


def test_a_call_by_name_reads_its_own_file_and_nothing_else(video, targets, fresh_engine, either_way):
    head, attacks = engine.call(read_then_attack, video, confine=engine.BY_NAME)
    assert head == open(video, "rb").read(8)
    assert_all_refused(attacks, targets)
    assert engine.get_engine(engine.BY_NAME).brokered is (either_way == "brokered")
    # The next call (in the same sandbox where brokered, in a new one per call) may not read
    # the file handed before: a call handed another file may not read this one.
    with pytest.raises(MediaDecodeError) as caught:
        engine.call(read_then_attack, video, path="/datasets/other.mp4", confine=engine.BY_NAME)
    assert caught.value.path == "/datasets/other.mp4" and "sandbox refused a file access" in str(caught.value)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sandbox_by_name_serves_the_next_call_on_the_same_files_only(video, tmp_path, fresh_engine, per_call):
    """A host reads one file several times in a row (LLaMA-Factory: a row's frames, its
    stream metadata, its audio): the sandbox confined for those files is kept for the next
    call on exactly them; a call on any other set of files gets one of its own, and the
    kept one is ended (engine/per_call.py)."""
    other = str(tmp_path / "other.mp4")
    shutil.copy(video, other)
    first = engine.call(os.getpid, path=video, confine=engine.BY_NAME)
    assert engine.call(os.getpid, path=video, confine=engine.BY_NAME) == first
    both = set(engine.call_each(os.getpid, [(), ()], [video, other], confine=engine.BY_NAME))
    assert len(both) == 1
    both = both.pop()
    alone = engine.call(os.getpid, path=other, confine=engine.BY_NAME)
    assert len({first, both, alone}) == 3  # a subset of the files is not the same files
    assert engine.call(os.getpid, path=video, confine=engine.BY_NAME) not in {first, both, alone}
    deadline = time.monotonic() + 10  # ended once a call on other files came (its zygote reaps it)
    while time.monotonic() < deadline and _exists(first):
        time.sleep(0.05)
    assert not _exists(first), f"the kept sandbox {first} outlived the call on other files"
    # A kept sandbox still reads only its own file.
    engine.call(read_then_attack, video, confine=engine.BY_NAME)
    with pytest.raises(MediaDecodeError, match="sandbox refused a file access"):
        engine.call(read_then_attack, other, path=video, confine=engine.BY_NAME)


def test_files_beneath_the_read_roots_use_the_pooled_confined_sandbox(video, targets, fresh_engine, monkeypatch):
    """Naming the dataset's folder in SWIFT_SAFE_MEDIA_READ_ROOTS trades the sandbox per call
    (25-150 ms a call) for the pooled confined one, which may read that folder: the same
    sandbox serves call after call, and every attack is still refused."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_READ_ROOTS", os.path.dirname(video))
    kind = engine.by_name(files=[video])
    assert kind is True and engine.by_name(files=[video, "/etc/hostname"]) == engine.BY_NAME
    assert engine.by_name(runs_ffmpeg=True, files=[video]) == engine.PROGRAMS
    first, attacks = engine.call(read_then_attack_and_pid, video, confine=kind)
    second, _ = engine.call(read_then_attack_and_pid, video, confine=kind)
    assert first == second
    assert_all_refused(attacks, targets)


def read_then_attack_and_pid(media_path):
    return os.getpid(), read_then_attack(media_path)[1]


def started_and_setting(name):
    """In a sandbox: its pid, when it started (clock ticks since boot), a setting's value."""
    with open("/proc/self/stat") as stat:
        started = int(stat.read().rsplit(")", 1)[1].split()[19])
    return os.getpid(), started, os.environ.get(name)


def ticks_since_boot() -> float:
    with open("/proc/uptime") as uptime:
        return float(uptime.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def test_the_next_calls_sandbox_is_forked_ahead_and_follows_the_environment(video, tmp_path, fresh_engine,
                                                                            monkeypatch, per_call):
    """A call by name on other files takes a sandbox forked while the call before it ran
    (the fork of a zygote full of imports is off the call's path); a sandbox forked, or
    kept for the same files, before the sandbox's environment changed is ended, never used."""
    other = str(tmp_path / "other.mp4")
    shutil.copy(video, other)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_SANDBOX_ENV", "SPARE_PROBE")
    monkeypatch.setenv("SPARE_PROBE", "before")
    first, _, seen = engine.call(started_and_setting, "SPARE_PROBE", path=video, confine=engine.BY_NAME)
    assert seen == "before"
    time.sleep(0.5)
    asked = ticks_since_boot()
    second, started, seen = engine.call(started_and_setting, "SPARE_PROBE", path=other, confine=engine.BY_NAME)
    assert second != first and seen == "before"
    assert started < asked - 0.2 * os.sysconf("SC_CLK_TCK"), (started, asked)  # ready before it was asked for
    monkeypatch.setenv("SPARE_PROBE", "after")
    third, _, seen = engine.call(started_and_setting, "SPARE_PROBE", path=other, confine=engine.BY_NAME)
    assert third not in (first, second) and seen == "after"


def zygotes_here() -> list[int]:
    children = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listed:
            children += [int(pid) for pid in listed.read().split()]
    names = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                names[pid] = comm.read().strip()
        except OSError:
            pass
    return [pid for pid, name in names.items() if name == "ssm-zygote"]


def test_every_kind_of_sandbox_forks_from_one_zygote(video, fresh_engine):
    """Pooled confined, unconfined, one per call by name, a download's: one zygote serves
    them all, so a kind's first call never waits for a zygote of its own to start."""
    pids = {engine.call(os.getpid, path=video, confine=kind)
            for kind in (True, False, engine.BY_NAME, engine.NETWORK)}
    assert len(pids) == 4
    assert len(zygotes_here()) == 1, zygotes_here()


def ffmpeg_then_attack(media_path, loader):
    """In a sandbox that runs ffmpeg (whisper's, librosa's audioread): ffmpeg decodes the
    file, a temporary file is written, then every attack; last, the dynamic loader (which
    such a sandbox may run) runs /bin/sh, whose write must still be refused."""
    import subprocess
    import tempfile

    frame = subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-i", media_path, "-frames:v", "1",
                            "-f", "rawvideo", "-pix_fmt", "rgb24", "-"], capture_output=True, check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".wav") as temporary:
        temporary.write(b"RIFF")
        scratch = os.path.dirname(temporary.name)
    folder = os.environ["EXPLOIT_FOLDER"]
    by_loader = subprocess.run([loader, "/bin/sh", "-c", f"echo pwned > {folder}/pwned-by-loader"],
                               capture_output=True, text=True)
    return len(frame), scratch, exploit_standin.attack(), by_loader.returncode, by_loader.stderr


def test_a_sandbox_that_runs_ffmpeg_runs_it_and_stays_confined(video, targets, fresh_engine):
    """``engine.PROGRAMS`` (whisper's and MiniCPM-o's loaders, librosa's audioread
    fallback): ffmpeg runs, temporary files go to a folder of the call's own, removed after
    it; every attack is still refused, /bin/sh run directly too; what the dynamic loader
    starts keeps the whole confinement (its write is refused)."""
    from swift_safe_media.confinement import programs

    loader = next(path for path in programs.runnable() if os.path.basename(path).startswith("ld-"))
    size, scratch, attacks, loader_exit, loader_error = engine.call(
        ffmpeg_then_attack, video, loader, path=video, confine=engine.PROGRAMS)
    assert size == 160 * 120 * 3
    assert os.path.basename(os.path.dirname(scratch)).startswith("swift-safe-media-scratch-")
    assert not os.path.exists(scratch)  # removed after the call
    assert attacks.pop("run /bin/sh").startswith("refused: PermissionError"), attacks
    attacks["loader"] = "refused" if loader_exit != 0 else "got through"
    assert len(attacks) == 7 and all(outcome.startswith("refused") for outcome in attacks.values()), attacks
    assert "Permission denied" in loader_error and os.listdir(targets["folder"]) == []
    assert not accepted(targets["listener"])


def imageio_ffmpeg_audio(media_path):
    """What moviepy does to read a video's audio: imageio-ffmpeg's ffmpeg, as 16 kHz samples."""
    import subprocess

    import imageio_ffmpeg

    exe = imageio_ffmpeg.get_ffmpeg_exe()
    return exe, subprocess.run([exe, "-nostdin", "-loglevel", "error", "-i", media_path, "-vn", "-f", "s16le",
                                "-ac", "1", "-ar", "16000", "-"], capture_output=True, check=True).stdout


def test_a_sandbox_that_runs_ffmpeg_runs_the_one_imageio_ffmpeg_picks(fresh_engine):
    """moviepy and imageio run imageio-ffmpeg's ffmpeg (the build its wheel bundles), not the
    one on PATH; MiniCPM-o reads a video's audio through moviepy where librosa 1.0 refuses the
    file. Refused it, imageio-ffmpeg took PATH's ffmpeg, another version: samples one step
    apart from stock's. A real clip of another project (Big Buck Bunny, AAC)."""
    clip = os.path.join(ROOT, "tests", "data", "bigbuckbunny.mp4")
    exe, samples = engine.call(imageio_ffmpeg_audio, clip, path=clip, confine=engine.PROGRAMS)
    stock_exe, stock_samples = imageio_ffmpeg_audio(clip)
    assert exe == stock_exe and os.path.basename(os.path.dirname(stock_exe)) == "binaries", (exe, stock_exe)
    assert len(stock_samples) > 16000 and samples == stock_samples


def test_stock_code_behind_the_entry_points_is_confined_and_still_decodes(video, targets, tmp_path):
    standins = exploit_standin.write_standins(str(tmp_path / "standins"))
    done = run_python(module="tests.programs.stock_exploit", args=[video], timeout=300,
                      env=clean_environment({**targets["environment"],
                                             "PYTHONPATH": os.pathsep.join([standins, ROOT])}))
    rows = {row.pop("case"): row for row in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert set(rows) == {"keye_vl_utils.fetch_video", "transformers.load_video decord",
                         "keye_vl_utils.fetch_video unprotected"}, done.stderr[-3000:]
    keye = rows["keye_vl_utils.fetch_video"]
    assert keye["same"] is True
    assert_all_refused(keye["attacks"], targets)
    assert rows["transformers.load_video decord"] == {"frames": 4, "same": True}, rows
    # The same stand-in without protection: the attacks are real and get through.
    loose = rows["keye_vl_utils.fetch_video unprotected"]["attacks"]
    assert loose["read a token under $HOME"] == "got: 'hf_SECRET'", loose
    assert loose["write a file"].startswith("got") and loose["run /bin/sh"] == "got: 'exit 0'", loose
    assert sorted(os.listdir(f"{targets['folder']}-loose")) == ["pwned-by-exec", "pwned-by-write"]


def test_cli_and_doctor_list_each_decode_path_confined_or_why_not():
    done = run_python(module="swift_safe_media.cli", args=["confinement"], timeout=240)
    paths = json.loads(done.stdout)["decode_paths"]
    by_name = "confined: it may read the call's own files by name, no other media"
    how = f" (a sandbox per call: {broker.why_not()})" if broker.why_not() else \
        " (a pooled sandbox, its opens of them answered by the caller)"
    for name in ("transformers.video_utils.load_video", "transformers.audio_utils.load_audio",
                 "keye_vl_utils.vision_process.fetch_video", "soundfile.read", "torchaudio.load",
                 "torchvision.io.video.read_video", "LLaMA-Factory's mm_plugin readers"):
        assert paths[name] == by_name + how, (name, paths)
    for name in ("whisper.audio.load_audio", "librosa.core.audio.load", "minicpmo.utils.get_video_frame_audio_segments"):
        assert paths[name] == by_name + (" (a sandbox per call); it may run the ffmpeg program (its loader too: what "
                                         "runs stays confined) and write in a folder of its own"), (name, paths)
    assert [name for name, how in paths.items() if how.startswith("not")] == []
    assert paths["a LeRobot dataset streamed from the Hub"].startswith("confined but for connecting out: "), paths
    from swift_safe_media.checks import doctor

    line = doctor.decode_paths()
    assert line.startswith(f"{len(paths)} confined; not confined: none ("), line


def test_a_downloads_sandbox_reaches_the_network_and_nothing_else(targets, fresh_engine):
    """``engine.NETWORK`` (every download: ``fetch``, stock given a URL): it may connect out,
    as a download must; exec, writes, the token under $HOME, /etc/shadow, the trainer's
    environment stay refused."""
    for _ in range(2):  # its sandbox is pooled: the second call's, already confined, holds as the first's
        attacks = engine.call(exploit_standin.attack, path="http://127.0.0.1/clip.mp4", confine=engine.NETWORK)
        assert attacks.pop("connect to a loopback listener") == "got: 'sent'", attacks
        assert accepted(targets["listener"])
        assert len(attacks) == 6 and all(outcome.startswith("refused") for outcome in attacks.values()), attacks
        assert os.listdir(targets["folder"]) == []
    assert engine.get_engine(engine.NETWORK).stats["sandboxes_started"] == 1


def hub_token_here():
    from huggingface_hub import constants, get_token

    return get_token(), constants.HF_TOKEN_PATH


def test_a_downloads_sandbox_gets_no_hub_token_and_still_works(targets, fresh_engine, monkeypatch):
    """The Hub's client reads its token file whenever no token is in the environment: in a
    download's sandbox (a dataset streamed from the Hub) that read is refused, which would
    fail a public file's read too; the client is pointed at no file instead. A token named in
    SWIFT_SAFE_MEDIA_SANDBOX_ENV is the sandbox's."""
    import huggingface_hub  # noqa: F401  (in the zygote too, as the hosts import it, read once)

    monkeypatch.setenv("HOME", targets["environment"]["EXPLOIT_HOME"])  # where its token file is
    monkeypatch.delenv(exploit_standin.SECRET_ENV)
    token, where = engine.call(hub_token_here, path="hf://datasets/x/y/v.mp4", confine=engine.NETWORK)
    assert token is None and not os.path.exists(where), (token, where)
    monkeypatch.setenv(exploit_standin.SECRET_ENV, "hf_NAMED")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_SANDBOX_ENV", exploit_standin.SECRET_ENV)
    engine.shutdown()
    assert engine.call(hub_token_here, path="hf://datasets/x/y/v.mp4", confine=engine.NETWORK)[0] == "hf_NAMED"
