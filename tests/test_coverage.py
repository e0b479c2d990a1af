"""Every decode a host runs is bounded, not only the loaders listed by hand (issue 32).

- The installed ms-swift's templates (and the Hugging Face processors that open media
  themselves) are read from their sources (``integrations/swift_coverage.py``): a test
  fails when any reaches a media opener that protection does not bound, and a template
  whose code cannot be read gets one warning as it is built.
- Each library entry point protection bounds (``integrations/media.py``), called as a
  host calls it: stock's result on valid media, a named error on media that blocks or
  spins stock for ever.
- A plain PyTorch script with ``enable()``: its DataLoader workers start from the warm
  forkserver and bound the same library calls.
"""

import importlib
import inspect
import json
import logging
import os
import pathlib
import re
import shutil
import select
import subprocess
import sys

import pytest

from tests.fresh import clean_environment, run_python
from tests.media_corpus import session_corpus

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

from swift.template.base import Template  # noqa: E402
import swift.template.templates  # noqa: E402,F401  every family's module: all of ms-swift's template classes
from swift_safe_media.hosts.swift import coverage as swift_coverage  # noqa: E402
from swift_safe_media.hosts.swift.coverage import BOUNDED, OPENER, UNREAD  # noqa: E402


def subclasses(cls):
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | subclasses(sub)
    return found


def template_classes():
    return sorted((cls for cls in {Template} | subclasses(Template) if cls.__module__.startswith("swift.")),
                  key=lambda cls: cls.__qualname__)


def reach(cls, kind):
    return {found.call for found in swift_coverage.media_reach(cls, may_import=True) if found.kind == kind}


@pytest.fixture(scope="module")
def readings():
    return {cls: swift_coverage.media_reach(cls, may_import=True) for cls in template_classes()}


def test_no_template_reaches_a_media_opener_protection_does_not_bound(readings):
    assert len(readings) > 100  # every template class ms-swift defines was read
    unbounded = [(cls.__qualname__, found.where, found.call) for cls, found_all in readings.items()
                 for found in found_all if found.kind == OPENER]
    assert not unbounded, f"templates reach media openers that protection does not bound: {unbounded}"


# What the reading finds for the paths of issue 32 (found by reading, asserted here so a
# reading that silently finds nothing fails).
NEW_PATHS = {
    "Llama3_1OmniTemplate": "whisper.load_audio",
    "KeyeVLTemplate": "keye_vl_utils.fetch_video",
    "MiniCPMO4_5Template": "minicpmo.utils.get_video_frame_audio_segments",
    "GLM4VTemplate": "transformers.video_utils.load_video",
    "MiDashengLMTemplate": "transformers.audio_utils.load_audio",
    "Qwen3TTSTemplate": "librosa.load",
    "Phi4MMTemplate": "soundfile.read",
    "StepAudio2MiniTemplate": "torchaudio.load",
    "InternLMXComposer2Template": "transformers.dynamic_module_utils.get_class_from_dynamic_module",
}


def test_the_reading_finds_each_new_decode_path_bounded(readings):
    by_name = {cls.__name__: {found.call for found in found_all if found.kind == BOUNDED}
               for cls, found_all in readings.items()}
    for name, call in NEW_PATHS.items():
        assert call in by_name[name], (name, by_name[name])


class UsersOwnTemplate(Template):
    """A user's template, as registered with ms-swift: one decode the library does not
    bound (decord's reader), one it does (librosa.load, found through a helper)."""

    def replace_tag(self, media_type, index, inputs):
        import decord
        frames = decord.VideoReader(inputs.videos[index])
        return [len(frames)]

    def _encode(self, inputs):
        encoded = super()._encode(inputs)
        encoded["audio"] = [_load_speech(path) for path in inputs.audios]
        return encoded


def _load_speech(path):
    import librosa
    return librosa.load(path, sr=16000)[0]


def test_a_users_own_template_is_read_the_same_way(caplog):
    found = swift_coverage.media_reach(UsersOwnTemplate, may_import=True)
    assert ("UsersOwnTemplate.replace_tag", "decord.VideoReader", OPENER) in [
        (item.where, item.call, item.kind) for item in found]
    assert any(item.call == "librosa.load" and item.kind == BOUNDED and item.where.endswith("_load_speech")
               for item in found)
    with caplog.at_level(logging.WARNING, logger="swift_safe_media"):
        swift_coverage.warn_unbounded(UsersOwnTemplate.__new__(UsersOwnTemplate))
        swift_coverage.warn_unbounded(UsersOwnTemplate.__new__(UsersOwnTemplate))
    warnings = [record.getMessage() for record in caplog.records if "decord.VideoReader" in record.getMessage()]
    assert len(warnings) == 1 and "UsersOwnTemplate.replace_tag" in warnings[0], warnings


def test_code_that_cannot_be_read_is_never_silent(readings, caplog):
    """Step-Audio's template imports ``load_audio`` from the model's own ``utils``: not
    readable before the run, so its template is named in a warning as it is built."""
    unread = {cls: [found for found in found_all if found.kind == UNREAD] for cls, found_all in readings.items()}
    unread = {cls: found for cls, found in unread.items() if found}
    assert any(found.call == "utils.load_audio" for found_all in unread.values() for found in found_all)
    with caplog.at_level(logging.WARNING, logger="swift_safe_media"):
        for cls in unread:
            swift_coverage.warn_unbounded(cls.__new__(cls))
    for cls, found_all in unread.items():
        for found in found_all:
            assert any(cls.__name__ in record.getMessage() and found.call in record.getMessage()
                       for record in caplog.records), (cls, found)


def test_hugging_face_processors_that_open_media_are_bounded():
    """The processors ms-swift hands raw paths to: every class of transformers' processor,
    feature extractor and video processor modules that name a media library."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent
    mentions = re.compile(r"decord|av\.open|VideoCapture|torchaudio|librosa\.load|sf\.read|SoundFile|"
                          r"load_video|load_audio|read_video|subprocess")
    read, unbounded = 0, []
    for source in sorted(root.glob("models/*/*.py")):
        if not re.match(r"(processing|feature_extraction|video_processing)_", source.name):
            continue
        if not mentions.search(source.read_text()):
            continue
        name = "transformers." + ".".join(source.relative_to(root).with_suffix("").parts)
        try:
            module = importlib.import_module(name)
        except Exception:  # a model whose optional dependency is not installed here
            continue
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name:
                read += 1
                unbounded += [(cls.__qualname__, found.where, found.call) for found in swift_coverage.media_reach(
                    cls, entry_points=swift_coverage.PROCESSOR_ENTRY_POINTS) if found.kind == OPENER]
    assert read > 10
    assert not unbounded, unbounded


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return session_corpus(tmp_path_factory)


def test_each_library_entry_point_gives_stocks_result_and_never_hangs(corpus, tmp_path):
    done = run_python(module="tests.programs.library_entry_points", timeout=400,
                      args=[tmp_path, corpus["h264_aac_bframes.mp4"], corpus["pcm_44k_mono.wav"]])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 13, done.stderr[-2000:]
    for row in rows:
        assert row.get("same") is True, row
        if "stuck" in row:
            assert row["stuck"].startswith("MediaDecode"), row  # named: MediaDecodeError or its Timeout
            assert str(tmp_path / "stuck.mp4") in row["stuck"], row
            assert row["stuck_seconds"] < 60, row
    stuck = {row["case"]: row["stuck"] for row in rows if "stuck" in row}
    for case in ("keye_vl_utils.fetch_video", "minicpmo get_video_frame_audio_segments", "whisper.load_audio",
                 "librosa.load", "soundfile.read", "remote code ixc_utils.load_video"):
        assert stuck[case].startswith("MediaDecodeTimeout"), (case, stuck[case])


def test_a_plain_pytorch_script_is_protected(tmp_path, spin_library):
    """``enable()`` and a plain DataLoader: workers from the warm forkserver bound a FIFO read
    by librosa and a native spin, and decode tar-shard bytes as stock; a dataset that cannot
    be pickled forks, with one warning saying why."""
    # The native spin is a library the user's loader loads by name: confinement would refuse it first.
    env = {**clean_environment(warm_start=True), "SWIFT_SAFE_MEDIA_READ_ROOTS": os.path.dirname(spin_library)}
    done = run_python(module="tests.programs.plain_pytorch", args=[tmp_path, spin_library], timeout=300, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["kind"]: row for row in result["rows"]}
    assert all(row["worker_parent"] != result["trainer"] for row in result["rows"])  # not forked from the trainer
    assert rows["fifo"]["ok"] is False and "MediaDecodeTimeout" in rows["fifo"]["error"]
    assert "stuck.wav" in rows["fifo"]["error"]
    assert rows["spin"]["ok"] is False and "MediaDecodeTimeout" in rows["spin"]["error"]
    assert rows["tar"]["ok"] and rows["tar"]["samples"] == result["stock"]["samples"]
    assert rows["tar"]["rate"] == result["stock"]["rate"]
    [forked] = result["unpicklable_rows"]
    assert forked["worker_parent"] == result["trainer"] and forked["samples"] == result["stock"]["samples"]
    assert done.stderr.count("cannot be pickled") == 1, done.stderr[-2000:]


def test_templates_of_the_new_paths_encode_through_lazy_dataset_workers(corpus, tmp_path):
    """Llama-3.1-Omni (whisper), Keye-VL (keye_vl_utils) and MiniCPM-o 4.5 (minicpmo's video
    with audio), protected by ``--safe_media true``: every batch comes, each FIFO is named
    in the log and skipped, the good rows are stock's; of the templates built, only a
    user's own that opens video with OpenCV gets the coverage warning."""
    templates = ["llama3_1_omni", "keye_vl", "minicpmo4_5"]
    done = run_templates(corpus, tmp_path, templates)
    for row in template_rows(done, templates):
        suffix = ".wav" if row["template"] == "llama3_1_omni" else ".mp4"
        assert f"skipped {tmp_path}/stuck_{row['template']}{suffix}: decode overran" in done.stderr, row


def run_templates(corpus, media, templates):
    """``tests/programs/coverage_templates`` on those templates, a good clip of each kind in ``media``;
    of the templates built, only the user's own that opens video with OpenCV gets the warning."""
    shutil.copy(corpus["h264_aac_bframes.mp4"], media / "good.mp4")
    shutil.copy(corpus["pcm_16k_stereo.wav"], media / "good.wav")
    done = run_python(module="tests.programs.coverage_templates", args=[media, media, *templates], timeout=400,
                      env=clean_environment(warm_start=True))
    warnings = [line for line in done.stderr.splitlines() if "protection does not bound" in line]
    assert len(warnings) == 1, warnings  # the user's own template only, once
    assert "UsersOwnVideoTemplate.replace_tag reaches cv2.VideoCapture" in warnings[0]
    return done


def template_rows(done, templates):
    """Every batch came and every good row is stock's."""
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["template"] for row in rows] == templates, done.stderr[-3000:]
    for row in rows:
        assert row["batches"] == 3 and row["all_equal_stock"], row
    return rows


def test_transformers_load_video_and_load_audio_templates_through_lazy_dataset_workers(corpus, tmp_path):
    """GLM-4.5V (ms-swift's ``load_video_hf``: transformers' ``load_video`` on the raw path, then
    the real ``Glm4vProcessor``: the full ``encode``) and MiDashengLM (transformers'
    ``load_audio`` through the template module's ``load_batch``; its processor is remote code),
    protected: over clips that block stock for ever (checked here, unprotected, for a few
    seconds), every batch comes, each bad clip is named and skipped, the good rows are stock's."""
    templates = ["glm4_5v", "midashenglm"]
    done = run_templates(corpus, tmp_path, templates)
    template_rows(done, templates)
    playlist, fifo = tmp_path / "stuck_glm4_5v.m3u8", tmp_path / "stuck_midashenglm.wav"
    assert f"skipped {playlist}: HLS playlist refused" in done.stderr, done.stderr[-3000:]
    assert f"skipped {fifo}: decode overran" in done.stderr, done.stderr[-3000:]
    stock = {path: subprocess.Popen([sys.executable, "-c", f"import transformers.{module} as m\n"
                                     f"print('calling', flush=True)\nm.{call}\nprint('returned')"],
                                    stdout=subprocess.PIPE, text=True)
             for path, module, call in [(playlist, "video_utils", f"load_video({str(playlist)!r})"),
                                        (fifo, "audio_utils", f"load_audio({str(fifo)!r}, sampling_rate=16000)")]}
    for path, process in stock.items():
        # Inside the call first (importing transformers takes longer than 15 s on a loaded machine)...
        ready, _, _ = select.select([process.stdout], [], [], 240)
        assert ready and process.stdout.readline() == "calling\n", path
        with pytest.raises(subprocess.TimeoutExpired):  # ...then stock blocks: the clip is what it claims to be
            process.wait(timeout=15)
        process.kill()
        assert process.communicate()[0] == "", path  # never returned
