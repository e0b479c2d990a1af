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
    stuck = {row["case"]: row for row in rows if "stuck" in row}
    # In a confined sandbox of their own that may read only the regular files handed with the
    # call (those that run ffmpeg too): the FIFO is named before a sandbox starts.
    for case in ("keye_vl_utils.fetch_video", "soundfile.read", "remote code ixc_utils.load_video",
                 "minicpmo get_video_frame_audio_segments", "whisper.load_audio", "librosa.load"):
        assert stuck[case]["stuck"].endswith("stuck.mp4: not a regular file (FIFO)"), stuck[case]
        assert stuck[case]["stuck_seconds"] < 10, stuck[case]


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
    # librosa opens the file by name in a sandbox per call: a FIFO is named before one starts.
    assert rows["fifo"]["ok"] is False and "stuck.wav: not a regular file (FIFO)" in rows["fifo"]["error"]
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
        # Each reader runs confined, in a sandbox per call, which reads only regular files
        # (whisper's and MiniCPM-o's may run ffmpeg too): the FIFO is named before it starts.
        assert f"skipped {tmp_path}/stuck_{row['template']}{suffix}: not a regular file (FIFO)" in done.stderr, row


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
    # ...and, registered under a name ms-swift 4.6.0 does not have, it is the one new template, named once.
    [new] = [line for line in done.stderr.splitlines() if NEW_TEMPLATES_WARNING in line]
    assert "1 template(s) registered here (ms-swift 4.6.0)" in new and "users_own_video (" in new, new
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
    # A playlist whose segment is a FIFO: stock follows it, and in its confined sandbox of one
    # call it may open nothing but the named file, so the decode fails at once, named.
    assert f"skipped {fifo}: decode failed" in done.stderr, done.stderr[-3000:]
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


# Issue 44: a template family new since the ms-swift release the suite knows is named the day it lands.

def test_the_installed_ms_swift_registers_no_template_new_since_the_known_release(caplog, monkeypatch):
    """ms-swift 4.6.0, as installed here: every template it registers is in the record
    (nothing new), every recorded one is still registered (nothing gone: a rename would show
    as one of each), and the record is what the generator writes for it, classes included.
    Building a template logs no warning of new templates."""
    import importlib.metadata

    from swift_safe_media.hosts.swift import known_templates

    assert known_templates.KNOWN_RELEASE == importlib.metadata.version("ms-swift") == "4.6.0"
    registered = swift_coverage.registered_templates()
    assert len(registered) > 200, len(registered)
    assert swift_coverage.new_templates(may_import=True) == []
    tool = record_templates_tool()
    assert set(registered) == known_templates.KNOWN_TEMPLATE_NAMES, tool.differences(
        known_templates.KNOWN_TEMPLATE_NAMES, set(registered))
    assert tool.render("4.6.0", tool.registered()) == pathlib.Path(known_templates.__file__).read_text(), (
        "known_templates.py is stale: run .venv/bin/python tools/record_templates.py")
    monkeypatch.setattr(swift_coverage, "_new_templates_warned", [])
    with caplog.at_level(logging.WARNING, logger="swift_safe_media"):
        swift_coverage.template_built(lambda template: None, Template.__new__(Template))
    assert swift_coverage._new_templates_warned == [True]  # looked, once, and found nothing to say
    assert not [record for record in caplog.records if NEW_TEMPLATES_WARNING in record.getMessage()]


NEW_TEMPLATES_WARNING = "the newest release swift-safe-media is tested with"


def record_templates_tool():
    """tools/record_templates.py, the generator of ``known_templates``, as a module."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "record_templates.py"
    spec = importlib.util.spec_from_file_location("record_templates", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_the_generator_names_templates_new_and_gone_since_the_record():
    """``--check`` after a release: a family added is new, one removed is gone, a renamed one
    is both. Gone names are the suite's concern only (the equality above fails on them, so
    the record is refreshed): a run cannot build a template its ms-swift no longer has."""
    differences = record_templates_tool().differences
    assert differences({"qwen2_5_vl", "old_name"}, {"qwen2_5_vl", "new_name", "brand_new"}) == [
        "new: brand_new", "new: new_name", "gone: old_name"]
    assert differences({"chatml"}, {"chatml"}) == []

# A family ms-swift has not released: its own template class, in a module of its own (the scan
# reads a template's source file), opening video with decord, which protection does not bound.
BRAND_NEW_FAMILY = '''
from swift.template import Template


class BrandNewFamilyTemplate(Template):
    def replace_tag(self, media_type, index, inputs):
        import decord
        return [f"{len(decord.VideoReader(inputs.videos[index]))} frames"]
'''
# Registered as ms-swift registers its own (swift/template/templates/*.py), then built under
# protection (``--safe_media true`` through ms-swift's parse_args), as a training run builds it.
REGISTER_AND_BUILD = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from swift.template import TemplateMeta, register_template
from swift.utils import parse_args
from tests.programs.model_templates import Family, StandIn, TrainArgs, template_for
from swift_safe_media.hosts.swift import coverage
import brand_new_family

parse_args(TrainArgs, ["--safe_media", "true"])
register_template(TemplateMeta("brand_new_family", prefix=[], prompt=["{{QUERY}}"], chat_sep=None,
                               template_cls=brand_new_family.BrandNewFamilyTemplate))
register_template(TemplateMeta("brand_new_chat", prefix=["<s>"], prompt=["{{QUERY}}"], chat_sep=None))
for name in ("brand_new_family", "brand_new_chat", "brand_new_family"):
    template_for(Family(name, "llama3_1_omni", StandIn, "video"), "/nonexistent")
print(json.dumps([[new.name, new.cls, new.known_class, [[reach.where, reach.call, reach.kind] for reach in new.unbounded]]
                  for new in coverage.new_templates()]))
'''


def test_a_template_registered_since_the_known_release_is_named_once_at_start_up(tmp_path):
    """Two templates registered with ms-swift's real ``register_template`` in a fresh process:
    a new family with a class of its own, and a new name on ms-swift's base class (as 90 of
    4.6.0's own are registered). Both are listed
    with their class and what the scan found, and, of the three templates built, one warning
    names both, with the installed and the known release."""
    (tmp_path / "brand_new_family.py").write_text(BRAND_NEW_FAMILY)
    done = run_python(code=REGISTER_AND_BUILD, args=[tmp_path], timeout=300)
    new = json.loads(done.stdout.strip().splitlines()[-1])
    assert new == [
        ["brand_new_chat", "swift.template.base.Template", True, []],
        ["brand_new_family", "brand_new_family.BrandNewFamilyTemplate", False,
         [["BrandNewFamilyTemplate.replace_tag", "decord.VideoReader", OPENER]]],
    ], done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if NEW_TEMPLATES_WARNING in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "2 template(s) registered here (ms-swift 4.6.0) that ms-swift 4.6.0," in warnings[0]
    assert ("brand_new_family (brand_new_family.BrandNewFamilyTemplate, a new class): "
            "BrandNewFamilyTemplate.replace_tag reaches decord.VideoReader (unbounded opener)") in warnings[0]
    assert "brand_new_chat (swift.template.base.Template): bounded" in warnings[0]
    # The family's own opener is still named by the per-template warning, once.
    assert sum("BrandNewFamilyTemplate.replace_tag reaches decord.VideoReader, which protection does not bound"
               in line for line in done.stderr.splitlines()) == 1, done.stderr[-3000:]


def test_the_warning_of_new_templates_fails_open(monkeypatch, caplog):
    """A record that cannot be read (or any error of the reading) never stops a template
    from being built: the template is built, the reading is skipped at debug level."""
    import swift_safe_media.hosts.swift.known_templates as known

    monkeypatch.setattr(swift_coverage, "_new_templates_warned", [])
    monkeypatch.delattr(known, "KNOWN_TEMPLATE_NAMES")
    built = []
    with caplog.at_level(logging.DEBUG, logger="swift_safe_media"):
        swift_coverage.template_built(lambda template: built.append(template), "a template")
    assert built == ["a template"]
    assert any("coverage reading skipped" in record.getMessage() for record in caplog.records)
