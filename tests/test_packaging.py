"""The distribution builds as a user's ``pip install`` and PyPI's upload would see it:
``python -m build`` makes the sdist and, from it, the wheel, with no deprecation warning
from the build backend; ``twine check --strict`` passes on both; the wheel carries the
start-up hook (``swift_safe_media.pth`` at the root of site-packages, and the module it
imports) and the licence, declared as an SPDX expression (PEP 639)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # The default build: an isolated environment with the build-system requirements,
    # the sdist first and the wheel built from the unpacked sdist (what pip does for a user).
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out, built.stdout + built.stderr


def test_the_build_prints_no_deprecation_warning(dist):
    _, output = dist
    warnings = [line for line in output.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)]
    assert not warnings, "\n".join(warnings)


def test_twine_check_passes_on_the_sdist_and_the_wheel(dist):
    out, _ = dist
    files = sorted(str(path) for path in out.iterdir())
    assert any(name.endswith(".whl") for name in files) and any(name.endswith(".tar.gz") for name in files)
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == len(files), checked.stdout


def test_the_wheel_carries_the_startup_hook_and_the_licence(dist):
    out, _ = dist
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(name).decode() for name in names if name.endswith(".dist-info/METADATA"))
        hook = archive.read("swift_safe_media.pth").decode()
    assert {"swift_safe_media.pth", "_swift_safe_media_startup.py", "swift_safe_media/__init__.py"} <= names
    # Every module of every subpackage (engine/, hosts/swift/, ...), not only the top level.
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "swift_safe_media").rglob("*.py")}
    assert modules - names == set(), sorted(modules - names)
    assert "swift_safe_media/hosts/swift/adapter.py" in names and "swift_safe_media/engine/pool.py" in names
    assert hook.strip() == "import _swift_safe_media_startup"
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert not any(line.startswith("Classifier: License ::") for line in metadata.splitlines())


def test_the_sdist_carries_what_the_wheel_is_built_from(dist):
    out, _ = dist
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "swift_safe_media.pth", "setup.py", "pyproject.toml", "README.md"} <= names
