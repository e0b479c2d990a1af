"""A host release that moves what we patch is named at start-up, never silent (issue 44).

Each case makes, at test time, a copy of an installed host (every file a link to the
installed one, the files a refactor would touch rewritten) with one patch target renamed
as a refactor would (the definition and every use), puts it first on the import path of
a fresh interpreter of that host's own venv, turns protection on and imports the host as
a run would: one WARNING names the host, its version, the target and what is no longer
protected. The unchanged host, the same program without the copy, gets none.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from . import fresh

ROOT = pathlib.Path(fresh.ROOT)
VENVS = {name: ROOT / name for name in (".venv", ".venv-lerobot", ".venv-lerobot-0.6", ".venv-llamafactory")}
# What the checks say, and only they (moved_targets.Finding.message, host_adapters.is_supported).
DRIFT = re.compile(r"is missing|is a decode function no patch target covers|now takes \(|"
                   r"no known layout of LeRobot's decode path")


def python_of(venv: str) -> str:
    path = VENVS[venv] / "bin" / "python"
    if not path.exists():
        pytest.skip(f"{venv} is built by `make test`")
    return str(path)


def site_packages(python: str, package: str) -> pathlib.Path:
    done = fresh.run_python(code=f"import importlib.util, os; print(os.path.dirname("
                                 f"importlib.util.find_spec({package!r}).origin))", python=python)
    return pathlib.Path(done.stdout.strip())


def moved_copy(where: pathlib.Path, package: pathlib.Path, old: str, new: str, files=("*.py",)) -> pathlib.Path:
    """A copy of ``package`` under ``where`` whose files link to the installed ones, except
    each file (matching ``files``) that names ``old``: rewritten with ``new`` for every use of
    the name, as a refactor would. Returns the folder to put first on the import path."""
    copy = where / package.name
    rewritten = 0
    # The name as a whole word (not load_video_llava in load_video_llava_v2).
    word = re.compile((r"\b" if old[0].isidentifier() else "") + re.escape(old)
                      + (r"\b" if (old[-1].isalnum() or old[-1] == "_") else ""))
    for folder, subfolders, names in os.walk(package):
        relative = pathlib.Path(folder).relative_to(package)
        (copy / relative).mkdir(parents=True, exist_ok=True)
        for name in names:
            source = pathlib.Path(folder) / name
            text = None
            if any(source.match(pattern) for pattern in files) and source.suffix == ".py":
                text = source.read_text(encoding="utf-8", errors="surrogateescape")
            # A module named ``old`` moves to ``new`` (its file renamed, as its imports are).
            target = copy / relative / (new + source.suffix if source.stem == old and source.suffix == ".py" else name)
            if text is not None and word.search(text):
                target.write_text(word.sub(new, text), encoding="utf-8", errors="surrogateescape")
                rewritten += 1
            else:
                target.symlink_to(source)
            rewritten += target.name != name
    assert rewritten, f"{old} is used nowhere in {package}"
    return where


def host_copy(tmp_path, venv: str, package: str, old: str, new: str, **kwargs) -> tuple[str, pathlib.Path]:
    """The python of ``venv``, and a :func:`moved_copy` of its installed ``package``."""
    python = python_of(venv)
    return python, moved_copy(tmp_path, site_packages(python, package), old, new, **kwargs)


def run_protected(python: str, imports: str, hosts: str, copy: pathlib.Path | None, timeout: float = 240):
    code = (f"import swift_safe_media\nswift_safe_media.enable(hosts={hosts})\n{imports}\n"
            "import swift_safe_media.patching.host_adapters as hosts\nprint('ENABLED', sorted(hosts.enabled_hosts()))\n")
    pythonpath = ([str(copy)] if copy else []) + [str(ROOT)]
    done = fresh.run_python(code=code, python=python, env=fresh.clean_environment(pythonpath=pythonpath),
                            timeout=timeout)
    return [line for line in done.stderr.splitlines() if DRIFT.search(line)], done


def test_llamafactory_with_a_media_read_renamed_is_named(tmp_path):
    python, copy = host_copy(tmp_path, ".venv-llamafactory", "llamafactory", "_regularize_videos",
                             "_regularize_video_inputs")
    imports = "import llamafactory.data.mm_plugin, llamafactory.data.loader"
    warnings, _ = run_protected(python, imports, "['llamafactory']", copy)
    wanted = [line for line in warnings
              if "llamafactory 0.9.5: llamafactory.data.mm_plugin.MMPluginMixin._regularize_videos is missing" in line]
    assert len(wanted) == 1 and "not protected" in wanted[0] and "LLaMA-Factory" in wanted[0], warnings
    assert any("Qwen2VLPlugin._regularize_videos is missing" in line for line in warnings), warnings
    assert all(line.count("swift_safe_media:") == 1 for line in warnings)

    # Before a run: `swift-safe-media targets` lists the row as MOVED, `doctor` names it too.
    before = fresh.clean_environment(pythonpath=[str(copy), str(ROOT)])
    listed = fresh.run_python(module="swift_safe_media.cli", args=["targets"], python=python, env=before,
                              timeout=240).stdout
    assert re.search(r"^  moved +llamafactory\.data\.mm_plugin\.MMPluginMixin\._regularize_videos$", listed, re.M), listed
    assert "MOVED" in listed and "3 problem(s)" in listed, listed
    doctor = fresh.run_python(module="swift_safe_media.cli", args=["doctor"], python=python, env=before,
                              timeout=240, check=False).stdout
    assert re.search(r"patch target .*MMPluginMixin\._regularize_videos is missing.*\[MOVED\]", doctor), doctor

    unchanged, done = run_protected(python, imports, "['llamafactory']", None)
    assert unchanged == [] and "ENABLED ['llamafactory']" in done.stdout, done.stderr[-3000:]
    listed = fresh.run_python(module="swift_safe_media.cli", args=["targets"], python=python, timeout=240,
                              env=fresh.clean_environment(pythonpath=[str(ROOT)])).stdout
    assert "0 problem(s)" in listed and "present                llamafactory.data.mm_plugin" in listed, listed


def test_llamafactory_with_a_module_moved_is_named(tmp_path):
    # llamafactory/train/tuner.py -> tuning.py
    python, copy = host_copy(tmp_path, ".venv-llamafactory", "llamafactory", "tuner", "tuning")
    imports = "import llamafactory.train.tuning, llamafactory.data.loader"
    warnings, _ = run_protected(python, imports, "['llamafactory']", copy)
    assert any("llamafactory 0.9.5: llamafactory.train.tuner._training_function is missing: its module "
               "llamafactory.train.tuner is gone" in line for line in warnings), warnings


def test_ms_swift_with_a_loader_renamed_is_named_and_the_new_name_too(tmp_path):
    python, copy = host_copy(tmp_path, ".venv", "swift", "load_video_llava", "load_video_llava_frames")
    imports = "import swift.template, swift.template.vision_utils"
    warnings, _ = run_protected(python, imports, "['swift']", copy)
    assert any("ms-swift 4.6.0: swift.template.vision_utils.load_video_llava is missing" in line
               and "(ms-swift)" in line for line in warnings), warnings
    # The renamed loader is a decode function of vision_utils no row covers: named too.
    assert any("swift.template.vision_utils.load_video_llava_frames is a decode function no patch target covers"
               in line for line in warnings), warnings

    unchanged, done = run_protected(python, imports, "['swift']", None)
    assert unchanged == [], done.stderr[-3000:]


def test_ms_swift_loader_whose_parameters_changed_is_named_and_left_as_stock(tmp_path):
    # A new parameter, as a release would add one: the twin knows only (video).
    python, copy = host_copy(tmp_path, ".venv", "swift", "def load_video_cogvlm2(video: Union[str, bytes])",
                             "def load_video_cogvlm2(video: Union[str, bytes], num_frames: int = 24)")
    imports = ("import swift.template.vision_utils as vu\n"
               "print('OURS' if hasattr(vu.load_video_cogvlm2, '__swift_safe_media_original__') else 'STOCK')\n"
               "print('LLAVA', 'OURS' if hasattr(vu.load_video_llava, '__swift_safe_media_original__') else 'STOCK')")
    warnings, done = run_protected(python, imports, "['swift']", copy)
    assert any("swift.template.vision_utils.load_video_cogvlm2 now takes (video, num_frames)" in line
               and "not (video) as in 4.6.0" in line for line in warnings), warnings
    assert "STOCK" in done.stdout.split("LLAVA")[0] and "LLAVA OURS" in done.stdout, done.stdout


@pytest.mark.parametrize("venv", [".venv-lerobot", ".venv-lerobot-0.6"])
def test_lerobot_with_its_decode_renamed_is_named(tmp_path, venv):
    python, copy = host_copy(tmp_path, venv, "lerobot", "decode_video_frames", "decode_frames")
    imports = "import lerobot.datasets.lerobot_dataset, lerobot.datasets.video_utils"
    warnings, _ = run_protected(python, imports, "['lerobot']", copy)
    assert len(warnings) == 1, warnings
    assert re.search(r"lerobot 0\.[46]\.\d+: no known layout .* lacks [^)]*lerobot\.datasets\.video_utils\."
                     r"decode_video_frames.*none of its decoding is protected", warnings[0]), warnings

    unchanged, done = run_protected(python, imports, "['lerobot']", None)
    assert unchanged == [] and "ENABLED ['lerobot']" in done.stdout, done.stderr[-3000:]


def test_torch_dataloader_with_a_patched_method_renamed_is_named(tmp_path):
    python, copy = host_copy(tmp_path, ".venv", "torch", "_try_get_data", "_try_get_batch",
                             files=("*/utils/data/*.py",))
    imports = "import torch.utils.data"
    warnings, _ = run_protected(python, imports, "[]", copy)
    wanted = "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._try_get_data is missing"
    assert any(wanted in line and "torch's DataLoader, worker restart" in line for line in warnings), warnings
    assert all(line.startswith(tuple("0123456789")) for line in warnings)  # the package's log format

    unchanged, _ = run_protected(python, imports, "[]", None)
    assert unchanged == []


def test_a_target_absent_by_design_is_quiet_and_one_that_should_be_there_is_not(tmp_path):
    """The rule itself, on real installed distributions: a row whose ``expected_in`` does
    not hold here is absent by design; without one, it must exist wherever its
    distribution is installed."""
    code = """
from swift_safe_media.patching import moved_targets
from swift_safe_media.patching.targets import Target
import soundfile
version = moved_targets.version_of("soundfile")
by_design = Target("soundfile", "read_v2", "x:y", expected_in="soundfile>=99")
required = Target("soundfile", "read_v2", "x:y")
not_installed = Target("not_a_distribution_here.mod", "f", "x:y")
print(moved_targets.expected_here(by_design), moved_targets.expected_here(required),
      moved_targets.expected_here(not_installed))
found = moved_targets.check("a table", [by_design, required, not_installed], lambda target: print)
print([finding.message() for finding in found])
print(moved_targets.holds(f"soundfile=={version}"), moved_targets.holds("soundfile<0.1"))
"""
    done = fresh.run_python(code=code)
    lines = done.stdout.splitlines()
    assert lines[0] == "False True None", done.stdout
    assert "soundfile.read_v2 is missing (renamed or moved?)" in lines[1] and lines[1].count("swift_safe_media:") == 1
    assert lines[2] == "True False"
