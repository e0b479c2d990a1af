"""A user's own decode in a DataLoader worker ends within the timeout (issue #43, item 2).

``tests/programs/own_decoders.py`` is a user's script whose ``Dataset`` opens media with the
libraries themselves: decord, PyAV, OpenCV, torchcodec, imageio, moviepy. Each library gets a
file that really hangs it (an HLS playlist whose segment is a FIFO, a FIFO posing as a
file) among other projects' public test assets, and a DataLoader with 2 workers under
``enable(timeout=5)``: the hang is ended (its worker killed and replaced), named in the log,
and raised in the user's ``__getitem__`` as ``MediaDecodeTimeout`` naming the file, where the
dataset skips it; every other sample is stock's. The same script without ``enable()`` hangs
until torch's own DataLoader timeout. Also: a native call that holds the GIL, fork-started
workers, ``skip_bad_samples``, an ``IterableDataset`` (the error reaches the training loop,
the other worker's stream goes on), a quarantine registry (the second epoch refuses the
file at once), and a decode in the training process (``num_workers=0``: named once).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests.fresh import ROOT, clean_environment

LIBRARIES = ("decord", "av", "cv2", "torchcodec", "imageio", "moviepy", "gil")
BAD = {"decord": "playlist.mp4", "av": "fifo.wav", "cv2": "fifo.mp4", "torchcodec": "playlist.mp4",
       "imageio": "fifo.mp4", "moviepy": "fifo.mp4", "gil": "gil.mp4"}
# Cases per protected run; the runs go side by side (most of each is a hang's wait).
PROTECTED = (("decord", "av", "cv2", "fork"), ("torchcodec", "imageio", "gil", "in_trainer", "raised"),
             ("moviepy", "skip_wrapper", "stream", "two_epochs", "valid"))
RUN_BOUND_S = 400
SLOW_TIMEOUT = {"moviepy": 15}  # as tests/programs/own_decoders.py gives it


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own_media")
    for fifo in ("segment.ts", "fifo.wav", "fifo.mp4"):
        os.mkfifo(folder / fifo)  # no writer: opening it blocks for ever
    (folder / "playlist.mp4").write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n"
                                         "#EXTINF:10.0,\nsegment.ts\n#EXT-X-ENDLIST\n")
    shutil.copy(os.path.join(ROOT, "tests", "data", "nasa_13013_rotated.mp4"), folder / "gil.mp4")  # valid
    return str(folder)


def _run(media: str, mode: str, cases) -> tuple[dict, str]:
    env = clean_environment(None, pythonpath=[ROOT], warm_start=mode == "protect")
    done = subprocess.run([sys.executable, "-m", "tests.programs.own_decoders", media, mode, *cases], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    results, skipped = {}, []
    for line in done.stdout.splitlines():
        record = json.loads(line)
        if "case" in record:
            record["skipped"], skipped = skipped, []
            results[record["case"]] = record
        else:
            skipped.append(record)
    return results, done.stderr


@pytest.fixture(scope="module")
def runs(media):
    """(protected results, stock results, protected stderr) of every case."""
    with concurrent.futures.ThreadPoolExecutor(len(PROTECTED) + 1) as pool:
        protected = [pool.submit(_run, media, "protect", cases) for cases in PROTECTED]
        stock = pool.submit(_run, media, "stock", ("valid", "decord"))
        results, stderr = {}, ""
        for future in protected:
            found, err = future.result()
            results.update(found)
            stderr += err
        return results, stock.result()[0], stderr


def _valid_checksums(stock) -> dict[str, list[int]]:
    """Stock's checksums of the valid files, per library (the order of the 'valid' case)."""
    items = stock["valid"]["items"]
    return {library: items[4 * n:4 * n + 2] for n, library in enumerate(l for l in LIBRARIES if l != "gil")}


@pytest.mark.timeout(RUN_BOUND_S + 60)
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_hang_in_a_workers_own_decode_is_ended_named_and_skipped(runs, media, library):
    results, stock, stderr = runs
    result = results[library]
    valid = _valid_checksums(stock)["decord" if library == "gil" else library]
    bad = os.path.join(media, BAD[library])
    # files: valid0, valid1, bad, valid0, valid1, valid0 -- every valid sample is stock's
    assert result["items"] == [valid[0], valid[1], -1, valid[0], valid[1], valid[0]], result
    [skip] = result["skipped"]
    timeout = f"{SLOW_TIMEOUT.get(library, 5):g} s timeout"
    assert skip["skipped"] == 2 and skip["type"] == "MediaDecodeTimeout", skip
    assert skip["error"].startswith(f"{bad}: ") and f"overran its {timeout}" in skip["error"], skip
    assert re.search(rf"{re.escape(bad)}: \S+ overran its {timeout}.* killed; replaced by pid \d+", stderr), \
        stderr[-3000:]


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_stock_hangs_on_the_same_file_and_valid_files_decode_the_same(runs):
    results, stock, _ = runs
    assert stock["decord"]["errors"] == ["RuntimeError: DataLoader timed out after 6 seconds"], stock["decord"]
    assert results["valid"]["items"] == stock["valid"]["items"] and len(set(stock["valid"]["items"])) >= 8


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_fork_started_workers_are_bounded_too(runs, media):
    result = runs[0]["fork"]
    assert result["items"][2] == -1 and -1 not in result["items"][:2] + result["items"][3:], result
    assert result["skipped"][0]["error"].startswith(os.path.join(media, "playlist.mp4")), result


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_skip_bad_samples_replaces_the_sample_the_same_way_everywhere(runs, media):
    results, stock, stderr = runs
    valid = _valid_checksums(stock)["decord"]
    files = [valid[0], valid[1], None, valid[0], valid[1], valid[0]]
    replacement = random.Random("2/0").randrange(6)  # chosen from the index alone
    assert results["skip_wrapper"]["items"] == [valid[0], valid[1], files[replacement], valid[0], valid[1], valid[0]]
    assert re.search(rf"sample 2 failed: {re.escape(os.path.join(media, 'playlist.mp4'))}: .*overran.*; "
                     rf"sample {replacement} substituted", stderr), stderr[-3000:]


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_a_streams_hang_reaches_the_training_loop_named_and_the_other_worker_goes_on(runs, media):
    result = runs[0]["stream"]
    [error] = result["errors"]
    assert error.startswith(f"MediaDecodeTimeout: {os.path.join(media, 'playlist.mp4')}: decord.VideoReader "
                            f"overran its 5 s timeout"), error
    assert len(result["items"]) == 3, result  # worker 0's three files; worker 1's stream ended at the hang


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_with_a_registry_the_next_epoch_refuses_the_file_at_once(runs, media):
    result = runs[0]["two_epochs"]
    first, second = result["items"]
    assert first == second and first[2] == -1, result
    kinds = [skip["type"] for skip in result["skipped"]]
    assert kinds == ["MediaDecodeTimeout", "MediaQuarantined"], result  # no second wait, no second kill
    assert os.listdir(os.path.join(media, "registry", "quarantine.jsonl.d"))


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_an_error_the_dataset_lets_through_reaches_the_training_loop_as_itself(runs, media):
    """torch rebuilds a worker's exception from its text alone (a MediaDecodeError became a plain
    RuntimeError); protected, the loop gets the MediaDecodeTimeout, its path, the worker's traceback."""
    result = runs[0]["raised"]
    [error] = result["errors"]
    assert error["type"] == "MediaDecodeTimeout" and error["runtime_error"], result
    assert error["path"] == os.path.join(media, "playlist.mp4"), result
    assert "in DataLoader worker process" in error["notes"] and "Traceback" in error["notes"], error
    assert result["items"] == [result["items"][0], result["items"][1]], result  # the first batch came through


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_a_decode_in_the_training_process_is_named_once(runs):
    results, _, stderr = runs
    assert len(results["in_trainer"]["items"]) == 2
    named = [line for line in stderr.splitlines() if "in a DataLoader with num_workers=0" in line]
    assert len(named) == 1 and "decord.VideoReader decodes " in named[0], named


# -- in this process: the protocol's pieces --------------------------------------------------
def test_a_hung_mark_matches_by_name_or_by_its_number():
    from swift_safe_media.workers.decode_deadline import Hung, media_of

    import io

    named = Hung(3, "/data/a.mp4", True, "decord.VideoReader", "overran")
    assert named.matches(1, "/data/a.mp4") and not named.matches(3, "/data/b.mp4")
    unnamed = Hung(2, "<BytesIO>", False, "av.open", "overran")
    assert unnamed.matches(2, "<BytesIO>") and not unnamed.matches(1, "<BytesIO>")
    assert media_of(io.BytesIO(b"x")) == ("<BytesIO>", False)
    assert media_of(b"/data/a.mp4") == ("/data/a.mp4", True) and media_of(0) == ("<camera 0>", False)
    error = named.error()
    assert error.path == "/data/a.mp4" and "refused now" in error.reason


def test_a_slot_is_written_on_a_mark_and_cleared_as_the_task_ends(tmp_path):
    from swift_safe_media.workers.decode_deadline import Mark, Slot

    slot = Slot(str(tmp_path), 7.0)
    slot.begin(())
    slot.mark("decord.VideoReader", "/data/a.mp4")
    mark = Mark.read(slot.file)
    assert (mark.number, mark.timeout, mark.opener, mark.media) == (1, 7.0, "decord.VideoReader", "/data/a.mp4")
    # the marking thread's times as the mark was written: the trainer's clock counts its wait from them
    tid, ran, waited, cpu = mark.start_times
    assert tid == threading.get_native_id() and 0 < ran <= cpu <= time.process_time_ns() and waited >= 0
    slot.mark("decord.VideoReader.get_batch", "/data/a.mp4")  # another opener: written again
    assert Mark.read(slot.file).number == 2
    slot.end()
    assert not os.path.exists(slot.file) and slot.marks == 0


SCRIPT = '''
import decord
from torch.utils.data import Dataset


class Clips(Dataset):
    def __init__(self, path):
        self.frames = len(decord.VideoReader(path))  # OPENED_IN_TRAINER

    def __len__(self):
        return self.frames

    def __getitem__(self, index):
        return decord.VideoReader("clip.mp4")[index]  # OPENED_IN_WORKER
'''


@pytest.mark.parametrize("bound", ["1", "0"])
def test_the_scan_names_what_runs_in_the_trainer_or_is_not_bounded(tmp_path, monkeypatch, bound):
    from swift_safe_media.checks import user_code

    monkeypatch.setenv("SWIFT_SAFE_MEDIA_BOUND_OPENERS", bound)
    (tmp_path / "train.py").write_text(SCRIPT)
    lines = {n: line for n, line in enumerate(SCRIPT.splitlines(), 1)}
    found = sorted(finding.line for finding in user_code.Scan(str(tmp_path / "train.py")).run())
    in_trainer = next(n for n, line in lines.items() if "OPENED_IN_TRAINER" in line)
    in_worker = next(n for n, line in lines.items() if "OPENED_IN_WORKER" in line)
    assert found == ([in_trainer] if bound == "1" else [in_trainer, in_worker])


def test_with_the_switch_off_the_openers_are_stock():
    program = ("import os; os.environ['SWIFT_SAFE_MEDIA_BOUND_OPENERS'] = '0'\n"
               "import swift_safe_media, decord, av, cv2\nswift_safe_media.enable(hosts=[])\n"
               "from swift_safe_media.patching import media_openers, targets\n"
               "print(media_openers.is_patched(), targets.original_of(av.open), targets.original_of(cv2.VideoCapture))\n"
               "os.environ['SWIFT_SAFE_MEDIA_BOUND_OPENERS'] = '1'\nmedia_openers.enable()\n"
               "print(media_openers.is_patched(), targets.original_of(av.open) is not None,"
               " targets.original_of(decord.VideoReader.__init__) is not None,"
               " targets.original_of(cv2.VideoCapture) is not None)\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=clean_environment(None, pythonpath=[ROOT]))
    assert done.stdout.splitlines() == ["False None None", "True True True True"], done.stderr[-3000:]

