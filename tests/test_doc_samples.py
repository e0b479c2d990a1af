"""The sample outputs the docs show are what the code prints (issue 46, item 4).

- docs/doctor.md's sample of ``swift-safe-media doctor``: the command on the block's first line
  is run here (its environment and flags as written) and the block must equal its standard
  output, line by line, once what varies from machine to machine is normalised (paths of the
  interpreter, versions, numbers, the environment variables withheld from sandboxes).
  ``python tools/doc_samples.py`` rewrites the block from a real run.
- The README's log lines under "When a file goes bad": ms-swift's line is logged here by the
  code that logs it in a run (the ms-swift adapter's wrapper around a twin, its logger and
  ms-swift's format) for a decode the engine really kills at its timeout; LeRobot's by
  LeRobot's substitution (``getitem_or_substitute``) for a sample whose video is a FIFO, which
  LeRobot's decode path refuses. Each documented line must have the shape of the real one:
  equal once paths, numbers and timestamps are normalised.

- docs/doctor.md's refusal: the message ``enable()`` ends a program with when a piece is
  missing, produced here for real in a venv whose torchcodec is 0.10.0 (built for torch 2.10:
  its libraries do not load with this torch), as ``tests/broken_envs.py`` makes it for
  tests/test_preflight.py; equal once paths and versions are normalised.
- docs/doctor.md's ``swift-safe-media doctor --script train.py``: the page's ``train.py``
  (the python block before it) is written to a folder and scanned by the command, in-process;
  the block must equal what it prints, exactly (its paths are relative to that folder).
  ``python tools/doc_samples.py`` rewrites this block too.

The doctor and the refusal run once each, in subprocesses started as the module's first test
begins (the doctor takes about 20 s, the refusal about 5 s, mostly imports), while the other
tests run beside them.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

import swift_safe_media
from swift_safe_media import MediaDecodeTimeout, config

from . import sandboxed

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCTOR_PAGE = ROOT / "docs" / "doctor.md"
DOCTOR_BOUND_S = 240


def fenced_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def doctor_block() -> list[str]:
    """The block of docs/doctor.md whose first line runs ``swift-safe-media doctor`` (not --script)."""
    for block in fenced_blocks(DOCTOR_PAGE.read_text()):
        if block and block[0].startswith("$ ") and "swift-safe-media doctor" in block[0] and "--script" not in block[0]:
            return block
    raise AssertionError("docs/doctor.md has no block that starts with `$ ... swift-safe-media doctor`")


def script_sample(text: str | None = None) -> tuple[str, list[str]]:
    """(the train.py docs/doctor.md shows, the block of ``$ swift-safe-media doctor --script train.py``
    that follows it)."""
    text = DOCTOR_PAGE.read_text() if text is None else text
    command = "$ swift-safe-media doctor --script train.py"
    before, _, _ = text.partition("```\n" + command + "\n")
    assert before != text, f"docs/doctor.md has no block that starts with `{command}`"
    script = before.rsplit("```python\n", 1)[1].split("```\n", 1)[0]
    [block] = [block for block in fenced_blocks(text) if block and block[0] == command]
    return script, block


def doctor_script_output(folder: Path, script: str) -> str:
    """What ``swift-safe-media doctor --script train.py`` prints for ``script``, run in-process
    in ``folder`` with no SWIFT_SAFE_MEDIA_* setting (openers bounded in workers, the default)."""
    import contextlib

    from swift_safe_media import cli

    (folder / "train.py").write_text(script)
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SWIFT_SAFE_MEDIA_BOUND")}
    out, here = io.StringIO(), os.getcwd()
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(out):
            code = cli.main(["doctor", "--script", "train.py"])
    finally:
        os.chdir(here)
        os.environ.update(saved)
    assert code == 0, out.getvalue()
    return out.getvalue().replace(str(folder) + os.sep, "")


def refusal_block() -> list[str]:
    """docs/doctor.md's block of the message a refused run ends with."""
    [block] = [block for block in fenced_blocks(DOCTOR_PAGE.read_text())
               if block and block[0].startswith("swift-safe-media cannot protect this run:")]
    return block


def doctor_command(line: str) -> tuple[dict, list[str]]:
    """(environment additions, argv) of a ``$ VAR=value swift-safe-media doctor ...`` line."""
    words = shlex.split(line[2:])
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:2] == ["swift-safe-media", "doctor"], line
    return env, [str(Path(sys.executable).parent / "swift-safe-media"), *words[1:]]


def normalise(text: str) -> list[str]:
    """What varies between machines and runs, made equal: interpreter paths, other paths,
    versions and numbers, timestamps, the names of withheld environment variables."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\S*/bin/python[\d.]*", "PYTHON", line.rstrip())
        line = re.sub(r"withheld here: [^)]*\)", "withheld here: NAMES)", line)
        line = re.sub(r"(?<![\w.])/[^\s:;,)]+", "PATH", line)
        line = re.sub(r"\d[\w.+-]*", "N", line)
        lines.append(line)
    return lines


def clean_environment(additions: dict) -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWIFT_SAFE_MEDIA")}
    env.update(additions)
    return env


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory):
    """The doctor of the docs' block, started now, read by the test that needs it."""
    env, argv = doctor_command(doctor_block()[0])
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=str(tmp_path_factory.mktemp("doctor")), env=clean_environment(env))
    yield child
    if child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(scope="module")
def refusal_run(tmp_path_factory):
    """``enable()`` in a venv whose torchcodec does not load with this torch, started now."""
    from . import broken_envs

    python, prefix = broken_envs.make("mismatched_torchcodec", str(tmp_path_factory.mktemp("refusal")))
    child = subprocess.Popen(prefix + [python, "-c", "import swift_safe_media; swift_safe_media.enable()"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                             env=broken_envs.scrubbed_environment())
    yield child
    if child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture(autouse=True)
def _start_the_doctor_first(doctor_run, refusal_run):
    """Every test of this module starts the doctor and the refusal (once), so they run beside them."""


def when_a_file_goes_bad() -> list[str]:
    section = README.read_text().split("\n## When a file goes bad\n", 1)[1].split("\n## ", 1)[0]
    [block, *_] = fenced_blocks(section)
    return block


def captured(logger: logging.Logger, formatter: logging.Formatter) -> io.StringIO:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    return stream


def test_the_readme_shows_the_ms_swift_line_a_decode_killed_at_its_timeout_logs(monkeypatch):
    from swift_safe_media import process
    from swift_safe_media.hosts.swift import adapter, inference

    [documented] = [line for line in when_a_file_goes_bad() if "ms-swift takes another sample" in line]
    # No time a busy CPU kept from the sandbox is added to the timeout here (a line that had
    # it would say "not counting N s it waited for a CPU").
    monkeypatch.setenv(config.TIMEOUT_CEILING, "1")
    monkeypatch.setattr(inference.MODE, "name", "train")  # a training run's DataLoader worker
    monkeypatch.setattr(process.current(), "last_logged_failure", None)
    logger = adapter._host_logger()  # ms-swift's own logger, with ms-swift's format
    assert logger.name == "swift", logger
    formatter = next(handler.formatter for handler in logger.handlers if handler.formatter is not None)
    stream = captured(logger, formatter)
    try:
        def twin(path):  # a twin whose decode hangs in native code, holding the GIL
            return swift_safe_media.call(sandboxed.hold_gil_on_locked_mutex, path=path, timeout=1)

        with pytest.raises(MediaDecodeTimeout):
            adapter._call_logging_failures(twin, "/data/clip_0412.mp4")
    finally:
        logger.handlers = [handler for handler in logger.handlers if getattr(handler, "stream", None) is not stream]
    [logged] = [line for line in stream.getvalue().splitlines() if "skipped" in line]
    assert "decode overran its 1 s timeout; sandbox pid" in logged, logged
    assert normalise(documented) == normalise(logged), (documented, logged)


def test_the_readme_shows_the_lerobot_line_a_substituted_sample_logs(tmp_path, monkeypatch):
    from swift_safe_media import process
    from swift_safe_media.hosts.lerobot import decode, substitute
    from swift_safe_media.logs import package_logger

    # This process's error budget and failed files are the test's own, and put back after it.
    monkeypatch.setattr(process.current(), "budget", None)
    monkeypatch.setattr(process.current(), "failed_files", None)

    [documented] = [line for line in when_a_file_goes_bad() if "substituted by sample" in line]
    camera = "observation.images.front"
    (tmp_path / "videos").mkdir()
    os.mkfifo(tmp_path / "videos" / "file-002.mp4")  # opening it would hang: refused before that

    class Meta:
        video_keys = [camera]

        @staticmethod
        def get_video_file_path(episode, key):
            return f"videos/file-{episode:03d}.mp4"

    class Dataset(types.SimpleNamespace):  # what getitem_or_substitute reads of a LeRobotDataset
        def __len__(self):
            return 60

    dataset = Dataset(root=tmp_path, meta=Meta(), hf_dataset=[{"episode_index": i // 10} for i in range(60)])

    def stock_getitem(dataset, idx):  # LeRobot's __getitem__, down to its video decode
        episode = dataset.hf_dataset[idx]["episode_index"]
        path = dataset.root / dataset.meta.get_video_file_path(episode, camera)
        if episode != 2:
            return idx
        return decode.decode_in_sandbox([(str(path), [0.0], 1e-4, "torchcodec", True, False)])

    logger = package_logger()
    formatter = next(handler.formatter for handler in logger.handlers if handler.formatter is not None)
    stream = captured(logger, formatter)
    try:
        substitute_index = substitute.getitem_or_substitute(stock_getitem, dataset, 20)
    finally:
        logger.handlers = [handler for handler in logger.handlers if getattr(handler, "stream", None) is not stream]
    assert dataset.hf_dataset[substitute_index]["episode_index"] != 2
    [logged] = [line for line in stream.getvalue().splitlines() if "substituted by sample" in line]
    assert f"sample 20 (episode 2, camera {camera}, file {tmp_path}/videos/file-002.mp4) failed:" in logged, logged
    assert normalise(documented) == normalise(logged), (documented, logged)


def test_the_doctor_sample_in_the_docs_is_what_the_doctor_prints(doctor_run):
    block = doctor_block()
    try:
        stdout, stderr = doctor_run.communicate(timeout=DOCTOR_BOUND_S)
    except subprocess.TimeoutExpired:
        doctor_run.kill()
        pytest.fail(f"swift-safe-media doctor did not finish within {DOCTOR_BOUND_S} s")
    assert doctor_run.returncode == 0, (stdout + stderr)[-3000:]
    documented, printed = normalise("\n".join(block[1:])), normalise(stdout.rstrip("\n"))
    assert "protection can work here" in stdout and "sample decode   ok" in stdout, stdout
    differing = [f"line {number}: doc {doc!r} / printed {real!r}"
                 for number, (doc, real) in enumerate(zip(documented, printed), 2) if doc != real]
    assert not differing and len(documented) == len(printed), (
        "docs/doctor.md's sample is not what the doctor prints now (python tools/doc_samples.py rewrites it):\n"
        + "\n".join(differing[:10]) + f"\n({len(documented)} lines documented, {len(printed)} printed)")


def test_the_refusal_in_the_docs_is_what_enable_prints(refusal_run):
    try:
        stdout, stderr = refusal_run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        refusal_run.kill()
        pytest.fail("enable() in the venv with a mismatched torchcodec did not end within 120 s")
    assert refusal_run.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr, stderr  # the message alone
    printed = (stdout + stderr).strip("\n")
    assert normalise("\n".join(refusal_block())) == normalise(printed), (refusal_block(), printed)


def test_the_doctor_script_sample_in_the_docs_is_what_doctor_script_prints(tmp_path):
    script, block = script_sample()
    printed = doctor_script_output(tmp_path, script).rstrip("\n").splitlines()
    assert printed == block[1:], (
        "docs/doctor.md's `doctor --script` sample is not what it prints now (python tools/doc_samples.py "
        "rewrites it):\n" + "\n".join(printed))
    # What the page's text around it says of this script: the opener in __init__ and the
    # ffprobe in __getitem__ are named, the opener in __getitem__ (bounded in a worker) is not.
    named = {line.split()[1]: line for line in printed if line.startswith("swift-safe-media: ")}
    lines = script.splitlines()
    assert {"decord.VideoReader" in lines[int(site.split(":")[1]) - 1] for site in named} == {True, False}
    assert any("ClipDataset.__init__ opens media with decord.VideoReader" in line for line in printed), printed
    assert any("opens media with subprocess.run running ffprobe" in line for line in printed), printed
    getitem_opener = next(number for number, line in enumerate(lines, 1)
                          if "decord.VideoReader(self.paths[index])" in line)
    assert f"train.py:{getitem_opener}" not in named, printed


def test_the_normalising_keeps_what_a_reader_relies_on():
    """Numbers and paths are normalised, words are not: a changed message still fails."""
    line = "[WARNING:swift] swift_safe_media: skipped /data/a.mp4: decode overran its 60 s timeout; sandbox pid 57 was killed"
    assert normalise(line) == ["[WARNING:swift] swift_safe_media: skipped PATH: decode overran its N s timeout; "
                               "sandbox pid N was killed"]
    assert normalise(line.replace("overran", "exceeded")) != normalise(line)
    assert normalise("  torch           2.14.0+cu130  [ok]") == ["  torch           N  [ok]"]
    assert normalise("(Python 3.11.7, /work/.venv/bin/python)") == normalise("(Python 3.12.1, /usr/bin/python3)")
