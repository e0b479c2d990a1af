"""WebDataset shards of audio, decoded in a user's own pipeline under ``enable()`` (issue 43,
item 4). Two tar shards made here (WAV and FLAC members made by ffmpeg, and one FLAC member
whose header is followed by garbage) are read by the real ``webdataset.WebDataset`` in a torch
DataLoader with 2 workers, one shard each (``tests/programs/user_shards.py``), four ways users
write it: ``soundfile.read(io.BytesIO(bytes))`` in a ``.map``, the same inside webdataset's own
``.decode`` (a ``wds.handle_extension`` handler), webdataset's own audio decoder
``.decode(wds.torch_audio)`` (``torchaudio.load`` on a temporary file), and
``torchaudio.load(io.BytesIO(bytes))`` in a ``.map``. Each runs as stock (no ``enable()``) and
protected, in fresh interpreters.

Protected, every valid member gives stock's samples; every decode went through the bounded
entry point (the stand-in, and the run's summary counts each decode: 5 ok, 1 error); the bad
member raises ``MediaDecodeError`` (webdataset's ``DecodingError`` around it, for ``.decode``),
carrying stock's own error and naming the member (``<shard>:<key>.<field>``, found as the
sample that holds the ``BytesIO``'s bytes, and webdataset's own key, shard and field), and the
user's handler skips it as it skips stock's error. A member's bytes cannot hang a decoder the
way a FIFO does (a tar member is a regular file's bytes; webdataset skips other members): the
timeout of these entry points on a stalled read is shown by tests/test_run_modes.py (torchrun)
and tests/test_coverage.py (each entry point on a FIFO).

torchaudio has no release for this environment's torch (2.14): its two ways run in LLaMA-Factory's
environment (torchaudio 2.11), with the webdataset pinned here put on its path (pure Python).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from .fresh import ROOT, clean_environment

wds_spec = importlib.util.find_spec("webdataset")
if wds_spec is None:
    pytest.skip("webdataset is pinned in requirements-test.txt (issue 43)", allow_module_level=True)

LLAMAFACTORY_PYTHON = os.path.join(ROOT, ".venv-llamafactory", "bin", "python")
MODES = {"soundfile-map": "soundfile.read", "soundfile-decode": "soundfile.read",
         "torch_audio-decode": "torchaudio.load", "torchaudio-map": "torchaudio.load"}
BAD = ("shard-000001.tar", "shard1/clip1", "flac")  # its shard, key and field
RUN_BOUND_S = 150
AT_ONCE = 4


def _ffmpeg_tone(path: str, frequency: int) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-f", "lavfi", "-i",
                    f"sine=frequency={frequency}:sample_rate=16000:duration=0.5", path], check=True, timeout=60)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """shard-000000.tar and shard-000001.tar, three samples each (``shard<N>/clip<I>``: .wav,
    .flac, .wav); shard 1's FLAC keeps its first 64 bytes (the stream header) and then garbage."""
    folder, made = tmp_path_factory.mktemp("shards"), tmp_path_factory.mktemp("made")
    for shard in range(2):
        with tarfile.open(folder / f"shard-{shard:06d}.tar", "w") as tar:
            for index in range(3):
                field = "wav" if index % 2 == 0 else "flac"
                path = str(made / f"{shard}-{index}.{field}")
                _ffmpeg_tone(path, 220 + 110 * index + 55 * shard)
                data = open(path, "rb").read()
                if (f"shard-{shard:06d}.tar", f"shard{shard}/clip{index}", field) == BAD:
                    data = data[:64] + bytes(range(256)) * 8
                member = tarfile.TarInfo(f"shard{shard}/clip{index}.{field}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    return str(folder)


def with_torchaudio() -> str | None:
    """An interpreter that has torchaudio: this one, else LLaMA-Factory's environment's."""
    if importlib.util.find_spec("torchaudio") is not None:
        return sys.executable
    if os.path.exists(LLAMAFACTORY_PYTHON) and subprocess.run(
            [LLAMAFACTORY_PYTHON, "-c", "import torchaudio"], capture_output=True).returncode == 0:
        return LLAMAFACTORY_PYTHON
    return None


def webdataset_path(folder) -> str:
    """A folder holding (links to) this environment's webdataset and braceexpand, both pure Python."""
    os.makedirs(folder, exist_ok=True)
    for name in ("webdataset", "braceexpand"):
        spec = importlib.util.find_spec(name)
        source = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        os.symlink(source, os.path.join(folder, os.path.basename(source)))
    return str(folder)


@pytest.fixture(scope="module")
def results(shards, tmp_path_factory) -> dict:
    """Each run (its environment's modes, protected or stock): its rows, or why it did not run.
    Four runs at once: each environment's two modes one after the other in one interpreter."""
    torchaudio_python = with_torchaudio()
    extra_path = [] if torchaudio_python in (None, sys.executable) else \
        [webdataset_path(tmp_path_factory.mktemp("path") / "webdataset")]

    def run(case):
        python, modes, protected = case
        if python is None:
            return case, "no environment here has torchaudio (make test builds .venv-llamafactory, which has)"
        run_name = f"{modes[0]} {protected}"
        env = clean_environment({"PROTECT": "1" if protected else "0", "RUN": run_name}, warm_start=True,
                                pythonpath=[ROOT, *([] if python == sys.executable else extra_path)])
        started = time.monotonic()
        child = subprocess.Popen([python, "-m", "tests.programs.user_shards", shards, *modes], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = child.communicate(timeout=RUN_BOUND_S)
        except subprocess.TimeoutExpired as exc:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return case, exc
        seconds = time.monotonic() - started
        print(f"{run_name}: {seconds:.1f} s")
        if child.returncode != 0 or "Traceback" in stderr:
            return case, AssertionError(f"{run_name} exited {child.returncode}: {(stdout + stderr)[-4000:]}")
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert {row["run"] for row in rows} == {run_name}, stdout  # every line is this run's
        return case, rows

    cases = [(python, tuple(mode for mode in MODES if mode.startswith(prefix)), protected)
             for prefix, python in (("soundfile", sys.executable), ("torch", torchaudio_python))
             for protected in (True, False)]
    found = {}
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        for (_, modes, protected), rows in pool.map(run, cases):
            for mode in modes:
                found[(mode, protected)] = rows if isinstance(rows, (str, BaseException)) else \
                    [row for row in rows if row["mode"] == mode]
    return found


def _rows(results, mode, protected) -> dict:
    found = results[(mode, protected)]
    if isinstance(found, str):
        pytest.skip(found)
    if isinstance(found, BaseException):
        raise found
    return {"samples": {row["key"]: row for row in found if "crc" in row},
            "skipped": [row for row in found if "skipped" in row],
            "summary": [row for row in found if "summary" in row]}


def _counted(results, mode) -> dict:
    """The decodes the run's summary counted for this mode's pipeline (it counts since the start)."""
    [summary] = _rows(results, mode, True)["summary"]
    modes = [other for other in MODES if other[:5] == mode[:5]]
    if modes.index(mode) == 0:
        return summary["summary"]
    [before] = _rows(results, modes[modes.index(mode) - 1], True)["summary"]
    return {name: count - before["summary"][name] for name, count in summary["summary"].items()}


def _without_addresses(text: str) -> str:
    """Stock's message, less what differs between two runs: objects' addresses, and the
    temporary folder webdataset's torch_audio writes the member to."""
    return re.sub(r"/tmp[a-z0-9_]{8}/", "/tmp/", re.sub(r" at 0x[0-9a-f]+", "", text))


@pytest.mark.timeout(2 * RUN_BOUND_S + 60)
@pytest.mark.parametrize("mode", list(MODES))
def test_shard_members_decode_as_stock_bounded_and_the_bad_member_is_named_and_skipped(results, shards, mode):
    ours, stock = _rows(results, mode, True), _rows(results, mode, False)
    entry_point = MODES[mode]
    valid = {f"shard{shard}/clip{index}" for shard in range(2) for index in range(3)} - {BAD[1]}

    # Every valid member, with stock's samples, read in both workers; each through the stand-in.
    assert set(ours["samples"]) == set(stock["samples"]) == valid, (ours, stock)
    assert {key: row["crc"] for key, row in ours["samples"].items()} == \
        {key: row["crc"] for key, row in stock["samples"].items()}
    assert len({row["pid"] for row in ours["samples"].values()}) == 2, ours["samples"]
    assert {row["bounded"] for row in ours["samples"].values()} == {True}, ours["samples"]
    assert {row["bounded"] for row in stock["samples"].values()} == {False}, stock["samples"]

    # The bad member: stock's error, skipped by the user's handler; protected, MediaDecodeError
    # carrying stock's error and naming the member.
    [theirs], [mine] = stock["skipped"], ours["skipped"]
    member = f"{os.path.join(shards, BAD[0])}:{BAD[1]}.{BAD[2]}"
    if mode.endswith("-decode"):  # webdataset's Decoder names the sample; the cause is the decoder's
        for row in (theirs, mine):
            assert row["skipped"] == "DecodingError", row
            assert (row["key"], row["url"], row["field"]) == (BAD[1], os.path.join(shards, BAD[0]), BAD[2]), row
        assert theirs["cause"] != "MediaDecodeError" and mine["cause"] == "MediaDecodeError", (theirs, mine)
        stock_error, error = theirs["cause_message"], mine["cause_message"]
    else:
        assert theirs["skipped"] != "MediaDecodeError" and mine["skipped"] == "MediaDecodeError", (theirs, mine)
        stock_error, error = theirs["message"], mine["message"]
    assert f"decode failed (stock {entry_point}): " in error, error
    assert _without_addresses(stock_error) in _without_addresses(error), (stock_error, error)
    if mode != "torch_audio-decode":  # webdataset's torch_audio hands torchaudio a temporary file
        assert error.startswith(f"{member}: decode failed"), error

    # Each decode was counted by the engine that bounds it: 5 ok, the bad member's error.
    assert _counted(results, mode) == {"decodes": 6, "ok": 5, "error": 1, "timeout": 0, "crash": 0}
    [summary] = ours["summary"]
    if mode != "torch_audio-decode":  # the slowest decodes (ten at most), each named as its member
        assert all(re.fullmatch(rf"{re.escape(shards)}/shard-00000[01].tar:shard[01]/clip[0-2].(wav|flac)|/tmp/.*",
                                path) for path in summary["slowest"]), summary
    assert not stock["summary"]


def test_a_nameless_bytesio_of_a_shard_members_bytes_is_named_as_that_member(shards):
    """The name errors and the run's summary give such a decode: found in the callers' frames,
    as the real webdataset sample that holds those bytes; a BytesIO of bytes no sample holds
    stays ``<BytesIO>``, and one with a name of its own keeps it."""
    import webdataset as wds

    from swift_safe_media.decoders.stock import _label

    def name_it(sample):
        [field] = [name for name in sample if name in ("wav", "flac")]
        return {"name": _label(io.BytesIO(sample[field])), "copy": _label(io.BytesIO(bytes(7))),
                "named": _label(_named(io.BytesIO(sample[field])))}

    shard = os.path.join(shards, "shard-000000.tar")
    found = list(wds.WebDataset(shard, shardshuffle=False).map(name_it))
    assert [row["name"] for row in found] == [f"{shard}:shard0/clip{index}.{field}"
                                              for index, field in enumerate(("wav", "flac", "wav"))]
    assert {row["copy"] for row in found} == {"<BytesIO>"}
    assert {row["named"] for row in found} == {"clip.wav"}


def _named(media):
    media.name = "clip.wav"
    return media
