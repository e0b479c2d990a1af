"""The red-team corpus (tests/test_hostile_media.py) through LLaMA-Factory's own media
readers, protected, in LLaMA-Factory 0.9.5's environment (tests/programs/llamafactory_hostile.py):
each playlist hidden behind accepted bytes fails naming itself, no decoy is opened, the
trap port hears nothing, and a good video and a good audio still decode (issue 42, item 4)."""

from __future__ import annotations

import json

import pytest

from .fresh import clean_environment, run_python
from .test_hostile_media import FolderWatch, corpus, hostile_files, trap  # noqa: F401  (fixtures)
from .test_llamafactory_train import VENV

pytestmark = pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                reason=f"{VENV} is missing: `make test` builds it")


def _rows(corpus) -> list[dict]:
    """The program's rows; no file in decoys/ may be opened while it runs (the sandboxes included)."""
    watch = FolderWatch(corpus["decoys"])
    try:
        done = run_python(module="tests.programs.llamafactory_hostile",
                          args=[corpus["hostile"], corpus["good"] / "clip.mp4", corpus["good"] / "tone.wav"],
                          python=str(VENV / "bin" / "python"), env=clean_environment({"HF_HUB_OFFLINE": "1"}),
                          timeout=540)
        opened = watch.names()
    finally:
        watch.close()
    assert opened == set(), f"decoys opened through LLaMA-Factory's readers: {opened}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _refused(row) -> bool:
    """A hostile file's row: the read failed with MediaDecodeError naming that file. Stock's
    video metadata reader catches PyAV's errors itself and answers None: for it, None too
    (without confinement nothing else comes back either: what the decoy folder saw decides)."""
    if row["error"] is None:
        return row["kind"] == "metadata" and row["decoded"] is None
    return row["media_decode_error"] and row["path"] == row["file"]


def _decoded(row) -> bool:
    """A good file's row: frames, samples or the clip's metadata came back."""
    decoded = row["error"] is None and row["decoded"]
    if not decoded:
        return False
    return {"video": lambda: decoded["frames"] > 0 and decoded["size"] == [64, 48],
            "audio": lambda: decoded["samples"] >= 15000 and decoded["rate"] == 16000,
            "metadata": lambda: (decoded["width"], decoded["height"]) == ("64", "48")}[row["kind"]]()


@pytest.mark.timeout(600)
def test_hostile_corpus_fails_through_llamafactorys_readers(corpus, trap):
    """Each hostile file through five readers (three video, the video metadata, the audio)
    in the confined sandbox of one call: it fails naming itself; no decoy is opened (the
    watch covers the whole program), the trap port hears nothing; the good clip and tone
    still decode through each."""
    names = hostile_files(corpus, trap.port)
    for name, content in names.items():
        (corpus["hostile"] / name).write_bytes(content)
    rows = _rows(corpus)
    readers = {row["reader"] for row in rows}
    assert len(readers) == 5, readers
    for reader in readers:
        files = {row["file"] for row in rows if row["reader"] == reader and row["hostile"]}
        assert files == {str(corpus["hostile"] / name) for name in names}, (reader, files)
        good = [row for row in rows if row["reader"] == reader and not row["hostile"]]
        assert len(good) == 1 and _decoded(good[0]), good
    not_refused = [row for row in rows if row["hostile"] and not _refused(row)]
    assert not_refused == [], not_refused
    # FFmpeg's own refusal of a concat entry ("unsafe file name": permission denied on the
    # list itself) is FFmpeg's, never called a write the sandbox refused.
    misnamed = [row for row in rows if row["hostile"] and "sandbox refused a file write" in str(row.get("message"))]
    assert misnamed == [], misnamed
    assert not trap.was_contacted(), "a request reached the trap port"
