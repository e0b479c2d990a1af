"""The upstream series in patches/ apply to the pristine PyPI sdists, pass their own new tests,
and turn a repro that hangs stock into a bounded, named error (or a correct decode).

Three series: ms-swift 4.6.0 and LeRobot 0.4.4 run in this interpreter; LeRobot 0.6.1 needs
Python 3.12 and runs in ``.venv-lerobot-0.6/`` (LeRobot 0.6.1's own pins, built by ``make test``),
with pytest copied in from this environment. Each host runs from its tree on PYTHONPATH, before
the installed one. The sdists are downloaded once per session (``pip download --no-binary :all:``;
set UPSTREAM_SDIST_DIR to a folder that already holds them to work offline). The slow parts (the
hosts' test runs and the repros, each a fresh interpreter that imports the host) are started
together in one session fixture and awaited by the tests, so the file stays within a few
minutes on 2 cores.
"""

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
HANG_BOUND_S = 20  # a stock decode still running this long after it started is stuck (it blocks forever)


@dataclass(frozen=True)
class Series:
    package: str
    version: str
    patches: Path
    python: str  # the interpreter the host runs in
    tests: tuple  # the series' own new tests, relative to the tree
    src: str = ""  # the package root inside the tree ("src" for a src layout)

    @property
    def stem(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}"


LEROBOT_TESTS = ("tests/datasets/test_video_decode_timeout.py", "tests/datasets/test_skip_failed_items.py")
LEROBOT06_PYTHON = ROOT / ".venv-lerobot-0.6" / "bin" / "python"
SERIES = {
    "ms-swift": Series("ms-swift", "4.6.0", PATCHES / "ms-swift", sys.executable, (
        "tests/general/test_media_decode_timeout.py", "tests/general/test_video_backend.py",
        "tests/general/test_audio_no_audioread.py")),
    "lerobot-0.4.4": Series("lerobot", "0.4.4", PATCHES / "lerobot" / "0.4.4", sys.executable, LEROBOT_TESTS, "src"),
    "lerobot-0.6.1": Series("lerobot", "0.6.1", PATCHES / "lerobot" / "0.6.1", str(LEROBOT06_PYTHON), LEROBOT_TESTS,
                            "src"),
}
LEROBOT_SERIES = [name for name in SERIES if name.startswith("lerobot-")]
# The pure-Python test tools copied into the Python 3.12 environment for the series' own tests.
PYTEST_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout")

pytestmark = [
    pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed"),
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]


def _ffmpeg(*args):
    subprocess.run(["ffmpeg", "-v", "error", "-y", *map(str, args)], check=True, timeout=120)


def _sdist(series: Series, folder: Path) -> Path:
    local = os.environ.get("UPSTREAM_SDIST_DIR")
    if local and (Path(local) / f"{series.stem}.tar.gz").exists():
        return Path(local) / f"{series.stem}.tar.gz"
    # --python-version: LeRobot 0.5+ declares Requires-Python >= 3.12, this interpreter may be older.
    python_version = subprocess.run([series.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-binary", ":all:", "--python-version", python_version, "-d", str(folder),
         f"{series.package}=={series.version}"],
        capture_output=True, text=True, timeout=240)
    archive = folder / f"{series.stem}.tar.gz"
    if out.returncode or not archive.exists():
        pytest.skip(f"cannot download the {series.package}=={series.version} sdist: {out.stderr.strip()[-300:]}")
    return archive


def _apply_series(series: Series, archive: Path, folder: Path):
    """Unpack the pristine tree twice; apply the series to the second copy, patch by patch."""
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "pristine", filter="data")
    pristine = folder / "pristine" / series.stem
    patched = folder / "patched" / series.stem
    shutil.copytree(pristine, patched)
    patches = sorted(series.patches.glob("*.patch"))
    assert patches, f"no patches in {series.patches}"
    # Outside any repository, git apply patches the tree it runs in; never let it find an enclosing one.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(patched.parent))
    for patch in patches:
        for check in (["--check"], []):
            out = subprocess.run(["git", "apply", *check, str(patch)], cwd=patched, env=env, capture_output=True,
                                 text=True)
            assert out.returncode == 0, f"git apply {' '.join(check)} {patch.name} failed:\n{out.stderr}"
    return pristine, patched


def _env(*paths: Path, **extra) -> dict:
    # SWIFT_SAFE_MEDIA=0: our own start-up hook must leave the host modules alone here.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), SWIFT_SAFE_MEDIA="0", PYTHONUNBUFFERED="1",
                **extra)


def _copy_pytest(target: Path) -> Path:
    """This environment's pytest and its pure-Python dependencies, as files (with their metadata, so
    pytest-timeout registers), for an interpreter of another Python version that has none."""
    for name in PYTEST_DISTRIBUTIONS:
        distribution = importlib.metadata.distribution(name)
        for file in distribution.files:
            if file.parts[0] == ".." or "__pycache__" in file.parts:  # console scripts, byte code
                continue
            (target / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file.locate(), target / file)
    return target


class Job:
    """A fresh interpreter running in its own session, output to a file."""

    def __init__(self, folder: Path, name: str, cmd: list, cwd: Path, env: dict):
        self.log = folder / f"{name}.log"
        self._file = open(self.log, "w")
        self.process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.log.name} did not finish in {timeout}s:\n{self.output()[-3000:]}")

    def wait_for(self, marker: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while marker not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{self.log.name}: no {marker!r}:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        return time.monotonic()

    def kill(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._file.close()

    def result(self) -> dict:
        for line in self.output().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        pytest.fail(f"{self.log.name} printed no RESULT:\n{self.output()[-3000:]}")

    def results(self) -> list:
        return [json.loads(line[len("RESULT "):]) for line in self.output().splitlines() if line.startswith("RESULT ")]


# The repros, run by path with the host tree alone on PYTHONPATH (see their docstrings). LeRobot's is the
# script upstream_pr/lerobot.md shows maintainers.
SWIFT_REPRO = str(ROOT / "tests" / "programs" / "swift_decode_repro.py")
LEROBOT_REPRO = ROOT / "upstream_pr" / "lerobot_repro.py"


def _lerobot_missing(series: Series, src: Path):
    """Why LeRobot's dataset code cannot run here, or None."""
    if not Path(series.python).exists():
        return f"{series.python} is missing: `make test` builds it"
    out = subprocess.run([series.python, "-c", "import lerobot.datasets.lerobot_dataset"], env=_env(src),
                         capture_output=True, text=True, timeout=180)
    return None if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def upstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream")
    trees, missing = {}, {}
    for name, series in SERIES.items():
        if name in LEROBOT_SERIES and not Path(series.python).exists():
            missing[name] = f"{series.python} is missing: `make test` builds it"
            continue
        trees[name] = _apply_series(series, _sdist(series, folder / "sdist"), folder / name)

    media = folder / "media"
    media.mkdir()
    # Good data that hangs decord: a stream copy cut at a non-keyframe of a long-GOP source carries an edit
    # list; decord counts ~45% more frames than decode and get_batch spins forever on the missing ones.
    source, cut = media / "long_gop.mp4", media / "cut.mp4"
    _ffmpeg("-f", "lavfi", "-i", "testsrc=size=160x120:rate=30:duration=20", "-pix_fmt", "yuv420p", "-g", "600",
            source)
    _ffmpeg("-ss", "4.5", "-t", "10", "-i", source, "-c", "copy", cut)
    wav = media / "a.wav"
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=1", wav)

    swift_pristine, swift_patched = trees["ms-swift"]
    py = sys.executable
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=240"]
    swift = SERIES["ms-swift"]
    jobs = {
        "swift_tests": Job(folder, "swift_tests", [py, *pytest_args, *swift.tests], swift_patched,
                           _env(swift_patched)),
        "swift_stock": Job(folder, "swift_stock", [py, SWIFT_REPRO, "stock", str(cut)], folder,
                           _env(swift_pristine)),
        "swift_patched": Job(folder, "swift_patched", [py, SWIFT_REPRO, "patched", str(cut), str(wav)],
                             folder, _env(swift_patched, SWIFT_MEDIA_DECODE_TIMEOUT="10")),
    }
    for name in LEROBOT_SERIES:
        if name in missing:
            continue
        series, (pristine, patched) = SERIES[name], trees[name]
        missing[name] = _lerobot_missing(series, patched / series.src)
        if missing[name]:
            continue
        # Another Python than ours has no pytest of its own: copy ours in, after the host tree on the path.
        tools = [] if series.python == sys.executable else [_copy_pytest(folder / f"{name}-pytest")]
        jobs[f"{name}_tests"] = Job(folder, f"{name}_tests", [series.python, *pytest_args, *series.tests], patched,
                                    _env(patched / series.src, *tools))
        jobs[f"{name}_stock"] = Job(folder, f"{name}_stock", [
            series.python, LEROBOT_REPRO, "--no-spin", "--wait", str(HANG_BOUND_S)], folder,
            _env(pristine / series.src))
        jobs[f"{name}_patched"] = Job(folder, f"{name}_patched", [
            series.python, LEROBOT_REPRO, "--timeout", "3", "--wait", "240"], folder, _env(patched / series.src))
    yield {"trees": trees, "jobs": jobs, "missing": missing}
    for job in jobs.values():
        job.kill()


def _lerobot_jobs(upstream, name):
    if upstream["missing"].get(name):
        pytest.skip(f"LeRobot's dataset code does not run here ({upstream['missing'][name]})")
    return upstream["jobs"]


def _files(tree: Path) -> dict:
    return {str(p.relative_to(tree)): p.read_bytes() for p in tree.rglob("*") if p.is_file()}


@pytest.mark.timeout(600)
def test_series_apply_to_pristine_sdists(upstream):
    assert set(upstream["trees"]) | {name for name, why in upstream["missing"].items() if why} == set(SERIES)
    for name, (pristine, patched) in upstream["trees"].items():
        expected = set()
        for patch in sorted(SERIES[name].patches.glob("*.patch")):
            text = patch.read_text()
            assert text.startswith("From ") and "Subject: [PATCH" in text, f"{patch.name}: not git format-patch"
            expected |= {line.split(" b/", 1)[1] for line in text.splitlines() if line.startswith("diff --git ")}
        before, after = _files(pristine), _files(patched)
        changed = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
        # every file the series names changed, and nothing else
        assert changed == expected, (name, changed ^ expected)


@pytest.mark.timeout(300)
def test_ms_swift_new_tests_pass(upstream):
    job = upstream["jobs"]["swift_tests"]
    rc = job.wait(280)
    out = job.output()
    assert rc == 0, out[-4000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]


@pytest.mark.timeout(300)
def test_ms_swift_repro_hangs_stock_and_is_bounded_patched(upstream):
    stock = upstream["jobs"]["swift_stock"]
    started = stock.wait_for("DECODING", 240)
    while time.monotonic() - started < HANG_BOUND_S and stock.process.poll() is None:
        time.sleep(0.5)
    hung = stock.process.poll() is None
    stock.kill()
    assert hung and "RETURNED" not in stock.output(), \
        f"stock load_video_cogvlm2 returned within {HANG_BOUND_S}s:\n{stock.output()[-2000:]}"

    patched = upstream["jobs"]["swift_patched"]
    assert patched.wait(280) == 0, patched.output()[-3000:]
    res = patched.result()
    # decord still cannot decode it, but the call now ends at the timeout with the file named ...
    assert "did not finish within 10.0s" in res["decord"] and "cut.mp4" in res["decord"], res
    assert res["decord_s"] < 10 + 30, res
    # ... and with torchcodec the same good clip decodes: 24 frames of the frames that exist
    assert res["torchcodec_shape"] == [3, 24, 120, 160], res


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", LEROBOT_SERIES)
def test_lerobot_new_tests_pass(upstream, name):
    job = _lerobot_jobs(upstream, name)[f"{name}_tests"]
    rc = job.wait(460)
    out = job.output()
    assert rc == 0, out[-4000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", LEROBOT_SERIES)
def test_lerobot_repro_hangs_stock_and_is_bounded_patched(upstream, name):
    jobs = _lerobot_jobs(upstream, name)
    stock = jobs[f"{name}_stock"]
    assert stock.wait(460) == 0, stock.output()[-3000:]
    good, stuck, good_again = stock.results()
    assert good["outcome"] == "frames" and good["detail"] == [2, 3, 48, 64], good
    assert stuck["file"] == "stuck.mp4" and stuck["outcome"] == "still running", stuck
    # VideoDecoderCache opened the FIFO under its lock: the good file, cached already, waits behind it
    assert good_again["file"] == "good.mp4" and good_again["outcome"] == "still running", good_again

    patched = jobs[f"{name}_patched"]
    assert patched.wait(460) == 0, patched.output()[-3000:]
    good, spin, stuck, good_again = patched.results()
    assert good["outcome"] == good_again["outcome"] == "frames", (good, good_again)
    assert good["detail"] == good_again["detail"] == [2, 3, 48, 64], (good, good_again)
    for bad in (spin, stuck):  # a decoder spinning in native code and a read that never returns, alike
        assert bad["outcome"] == "VideoDecodeTimeoutError", bad
        assert f"/{bad['file']} at timestamps" in bad["detail"] and "did not finish within 3.0s" in bad["detail"], bad
        assert bad["seconds"] < 3 + 90, bad  # its time includes a replacement worker's start-up (slow under load)


def test_lerobot_pr_text_shows_the_repro_it_was_tested_with():
    assert LEROBOT_REPRO.read_text() in (ROOT / "upstream_pr" / "lerobot.md").read_text()
