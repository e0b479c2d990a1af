"""Never silent about the user's own code (issue #43, item 1): ``enable()`` names, once, each
media opener a script's DataLoader reaches that it cannot bound, with its call site and the
fix; ``swift-safe-media doctor --script`` names the same ones before the run.

The runs are real: a training script with a decord dataset and a PyAV collate_fn decodes a
clip made by ffmpeg here, in two DataLoader workers, under ``enable()``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from swift_safe_media import cli
from swift_safe_media.checks import user_code
from tests.fresh import ROOT, clean_environment

TRAIN = '''
import os
import sys

import av
import decord
import torch
from torch.utils.data import DataLoader, Dataset

import swift_safe_media

swift_safe_media.enable()  # at the top level: spawned workers import this file again


def frames_of(path):
    reader = decord.VideoReader(path)  # OPENER decord.VideoReader
    return len(reader)


class ClipDataset(Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 4

    def __getitem__(self, index):
        print("read in", __name__, flush=True)  # __mp_main__: the worker imported this file, enable() and all
        return self._load(index)

    def _load(self, index):
        return frames_of(self.path) + index


def collate(batch):
    with av.open(os.environ["CLIP"]) as container:  # OPENER av.open
        streams = len(container.streams)
    return torch.tensor(batch), streams


if __name__ == "__main__":
    loader = DataLoader(ClipDataset(os.environ["CLIP"]), batch_size=2, num_workers=2, collate_fn=collate)
    print("batches", [(batch.tolist(), streams) for batch, streams in loader], flush=True)
'''

SOUND_ONLY = '''
import soundfile
from torch.utils.data import DataLoader, Dataset

import swift_safe_media

swift_safe_media.enable()


class SoundDataset(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        samples, rate = soundfile.read("speech.wav")  # bounded by enable()
        return len(samples)


if __name__ == "__main__":
    loader = DataLoader(SoundDataset(), batch_size=1, num_workers=2)
    print("built", flush=True)
'''

# A Dataset with no source to read (python -c, exec): enable() must neither raise nor guess.
NO_SOURCE = '''
import swift_safe_media
namespace = {}
exec("import decord\\nfrom torch.utils.data import Dataset\\n"
     "class Hidden(Dataset):\\n    def __getitem__(self, index):\\n        return decord.VideoReader('x')\\n",
     namespace)
swift_safe_media.enable()
from swift_safe_media.checks import user_code
print("scanned", user_code.Scan("/nonexistent/train.py").run(), flush=True)
'''


def openers_marked(source: str) -> dict[int, str]:
    """line -> opener, from the ``# OPENER name`` marks of a script."""
    return {number: line.split("# OPENER ")[1].strip()
            for number, line in enumerate(source.splitlines(), 1) if "# OPENER " in line}


def warnings_in(stderr: str) -> list[str]:
    """The scan's warnings, without the log's time and level."""
    return [line.split(" WARNING ", 1)[1] for line in stderr.splitlines()
            if " WARNING " in line and "opens media with" in line]


def run_script(folder, name: str, env_extra=None, timeout: float = 240, warm_start: bool = False):
    # The source tree before any installed wheel; with the warm start, the forkserver imports the script too.
    env = clean_environment(env_extra, pythonpath=[ROOT], warm_start=warm_start)
    return subprocess.run([sys.executable, name], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=8", "-t", "1",
                    "-pix_fmt", "yuv420p", "-c:v", "mpeg4", str(path)], check=True, timeout=60)
    return str(path)


@pytest.mark.timeout(300)
def test_enable_names_each_unbounded_opener_once_and_doctor_the_same(tmp_path, clip, monkeypatch, capsys):
    """With the openers' bound in DataLoader workers switched off, decord and PyAV in a worker are
    named (with it on, only calls in the training process are: tests/test_own_decoders_bounded.py)."""
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_BOUND_OPENERS", "0")  # for doctor, below
    done = run_script(tmp_path, "train.py", {"CLIP": clip, "SWIFT_SAFE_MEDIA_BOUND_OPENERS": "0"},
                      warm_start=True)  # the start users get
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batches [([8, 9], 1), ([10, 11], 1)]" in done.stdout, done.stdout  # 8 frames + index: decoded for real
    assert "read in __mp_main__" in done.stdout and "read in __main__" not in done.stdout, done.stdout
    found = warnings_in(done.stderr)
    expected = openers_marked(TRAIN)
    assert len(found) == len(expected) == 2, done.stderr[-3000:]  # once each: never again from a worker
    for line, opener in expected.items():
        [warning] = [text for text in found if f"train.py:{line} " in text]
        assert f"opens media with {opener}, which enable() does not bound" in warning, warning
        assert "@swift_safe_media.isolated(timeout=30, confine=swift_safe_media.BY_NAME)" in warning, warning
    assert "frames_of (reached from ClipDataset.__getitem__)" in found[0]
    assert "collate opens media with av.open" in found[1]

    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor", "--script", "train.py"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:-1] == found  # the same lines, in the same order, before the run
    assert printed[-1].startswith("2 unbounded media opener(s) found in train.py")


@pytest.mark.timeout(300)
def test_a_dataset_reading_only_through_bounded_entry_points_gets_no_warning(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(SOUND_ONLY)
    done = run_script(tmp_path, "train.py")
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-3000:]
    assert "opens media with" not in done.stderr, done.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor", "--script", "train.py"]) == 0
    assert capsys.readouterr().out == "no unbounded media openers found in train.py and the modules of its own it imports\n"


@pytest.mark.timeout(300)
def test_a_dataset_without_readable_source_is_passed_over(tmp_path):
    env = clean_environment(pythonpath=[ROOT])
    done = subprocess.run([sys.executable, "-c", NO_SOURCE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "scanned []" in done.stdout and "opens media with" not in done.stderr, done.stderr[-3000:]


def write(folder, files: dict[str, str]):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def sites(findings) -> list[tuple[str, int, str, str]]:
    return [(finding.path.rsplit("/", 1)[-1], finding.line, finding.function, finding.opener) for finding in findings]


def test_calls_are_followed_into_the_users_modules_and_not_into_isolated_functions(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_BOUND_OPENERS", "0")  # every opener named: the following is what is tested
    write(tmp_path, {
        "train.py": """
            import functools
            import subprocess
            from torch.utils import data
            import swift_safe_media as ssm
            from video.readers import Reader, grab
            from video import helpers

            @ssm.isolated(timeout=30)
            def bounded(path):
                import decord
                return decord.VideoReader(path)

            class Clips(data.IterableDataset):
                def __iter__(self):
                    yield bounded("a.mp4")
                    yield ssm.call(grab, "a.mp4")      # a reference, run in a sandbox: not a call here
                    yield Reader("a.mp4")
                    yield helpers.probe("a.mp4")

            class Collate:
                def __call__(self, batch):
                    subprocess.run(["ffmpeg", "-i", "x.mp4", "out.wav"])
                    subprocess.run(["ls", "-l"])
                    return batch

            def seed(worker_id, root):
                return recurse(worker_id)

            def recurse(n):
                return recurse(n - 1) if n else 0

            def main():
                data.DataLoader(Clips(), collate_fn=Collate(), worker_init_fn=functools.partial(seed, root="x"))
        """,
        "video/__init__.py": "",
        "video/readers.py": """
            import cv2
            def grab(path):
                return cv2.VideoCapture(path)
            class Reader:
                def __init__(self, path):
                    from moviepy.editor import VideoFileClip as Clip
                    self.clip = Clip(path)
        """,
        "video/helpers.py": """
            from . import readers
            import imageio.v3 as iio
            def probe(path):
                readers.grab(path)
                return iio.imread(path, plugin="pyav"), iio.imread("still.png")
        """,
    })
    found = user_code.scan_script(str(tmp_path / "train.py"))
    assert sites(found) == [
        ("train.py", 23, "Collate.__call__", "subprocess.run running ffmpeg"),
        ("helpers.py", 6, "probe", "imageio.v3.imread (of video)"),
        ("readers.py", 4, "grab", "cv2.VideoCapture"),
        ("readers.py", 8, "Reader.__init__", "moviepy.editor.VideoFileClip"),
    ], found


def test_a_dataset_handed_to_a_dataloader_and_a_module_on_the_path_are_read(tmp_path, monkeypatch):
    """A class deriving from another library's dataset counts once a DataLoader gets it; the
    user's modules are found in a folder on the path too (an editable src/), never in this package."""
    write(tmp_path, {
        "scripts/train.py": """
            import swift_safe_media
            from torch.utils.data import DataLoader
            from monai.data import Dataset as MonaiDataset
            from clips.io import open_clip

            class Scans(MonaiDataset):
                def __getitem__(self, index):
                    return open_clip(index)

            loader = DataLoader(dataset=Scans([]), batch_size=2)
            swift_safe_media.enable()
        """,
        "src/clips/__init__.py": "",
        "src/clips/io.py": """
            import torchvision
            def open_clip(path):
                return torchvision.io.VideoReader(path)
        """,
    })
    script = str(tmp_path / "scripts" / "train.py")
    assert user_code.scan_script(script) == []  # src/ is not beside the script nor the current folder
    found = user_code.Scan(script, extra_roots=user_code.own_folders([str(tmp_path / "src"), ROOT])).run()
    assert sites(found) == [("io.py", 4, "open_clip", "torchvision.io.VideoReader")]
    assert found[0].entry == "Scans.__getitem__"
    monkeypatch.chdir(tmp_path / "src")
    assert sites(user_code.scan_script(script)) == sites(found)  # doctor --script, run from src/


def test_a_script_inside_a_package_reads_its_relative_imports(tmp_path):
    """``python -m proj.train`` (and ``doctor --script proj/train.py``): ``from .data import Clips``."""
    write(tmp_path, {
        "proj/__init__.py": "",
        "proj/train.py": "from .data import Clips\nfrom torch.utils.data import DataLoader\n"
                         "DataLoader(Clips(['a.mp4']))\n",
        "proj/data.py": """
            import cv2
            from torch.utils.data import Dataset
            class Clips(Dataset):
                def __init__(self, paths):
                    self.frames = [cv2.VideoCapture(path).get(7) for path in paths]
        """,
    })
    assert sites(user_code.scan_script(str(tmp_path / "proj" / "train.py"))) == [
        ("data.py", 6, "Clips.__init__", "cv2.VideoCapture")]


def test_unreadable_or_odd_sources_never_raise(tmp_path):
    write(tmp_path, {
        "train.py": """
            from torch.utils.data import Dataset
            from broken import load
            from latin import other
            class Loop(Loop2 if False else Dataset):
                def __getitem__(self, index):
                    return self[index] + load(index) + other(index) + undefined(index)
        """,
        "broken.py": "def load(:\n",
        "first.py": "from second import Base\n",  # modules that import each other's names
        "second.py": "from first import Base\n",
        "cyclic.py": """
            from torch.utils.data import Dataset
            from first import Base
            class Ring(Base, Dataset):
                def __getitem__(self, index):
                    return self.missing(index)
            class Ring(Ring):
                pass
        """,
    })
    (tmp_path / "latin.py").write_bytes(b"# \xff\xfe not utf-8\ndef other(x):\n    return x\n")
    assert user_code.scan_script(str(tmp_path / "train.py")) == []
    assert user_code.scan_script(str(tmp_path / "cyclic.py")) == []
    assert user_code.Scan(str(tmp_path / "missing.py")).run() == []
    (tmp_path / "bad.py").write_text("class (:\n")
    assert cli.main(["doctor", "--script", str(tmp_path / "bad.py")]) == 2


def long_script(datasets: int) -> str:
    """A training script of about 27 lines a dataset: each dataset reaches decord through 5
    helpers (20 datasets: about 550 lines). ``bench/user_code_scan.py`` times its scan."""
    helpers = "".join(f"def helper_{n}(path):\n    return helper_{n + 1}(path) + len(str(path))\n\n\n"
                      if n % 5 != 4 else f"def helper_{n}(path):\n    return decord.VideoReader(path)\n\n\n"
                      for n in range(datasets * 5))
    classes = "".join(f"class Clips{n}(Dataset):\n    def __getitem__(self, index):\n"
                      f"        return self.load(index)\n\n    def load(self, index):\n"
                      f"        return helper_{n * 5}(index)\n\n\n" for n in range(datasets))
    return "import decord\nfrom torch.utils.data import Dataset\n\n\n" + helpers + classes


def test_a_long_script_is_followed_through_every_helper(tmp_path, monkeypatch):
    """About 550 lines: 20 datasets, each reaching decord through 5 helpers. (How long the
    scan takes is a bench, not a test: bench/user_code_scan.py.)"""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_BOUND_OPENERS", "0")  # every opener named, as before they were bounded
    (tmp_path / "train.py").write_text(long_script(20))
    found = user_code.scan_script(str(tmp_path / "train.py"))
    assert [(finding.function, finding.entry) for finding in found] == [
        (f"helper_{n * 5 + 4}", f"Clips{n}.__getitem__") for n in range(20)]
