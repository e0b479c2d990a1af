"""tools/venv_space.py, as the Makefile runs it: `check` stops a build the disk cannot hold before
pip starts, saying what each venv needs; `share` hard-links identical binaries between venvs
and leaves everything else (Python source, files that differ in bytes or mode) alone."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "venv_space.py"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_check_stops_a_build_the_disk_cannot_hold_and_passes_one_already_built(tmp_path):
    free_gib = shutil.disk_usage(tmp_path).free / (1 << 30)
    too_much = f"{free_gib * 2 + 1:.0f}"
    out = _run("check", f".venv-big={too_much}", ".venv-small=0.001", cwd=tmp_path)
    assert out.returncode == 1
    assert ".venv-big" in out.stderr and f"{too_much} GiB" in out.stderr
    assert "free on the disk of" in out.stderr and str(tmp_path) in out.stderr

    assert _run("check", ".venv-small=0.001", cwd=tmp_path).returncode == 0
    (tmp_path / ".venv-big").mkdir()
    (tmp_path / ".venv-big" / ".installed").touch()  # built already: it needs nothing more
    out = _run("check", f".venv-big={too_much}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_share_links_identical_binaries_only(tmp_path):
    library = os.urandom(3 << 20)
    other = os.urandom(3 << 20)
    for venv in ("a", "b", "c"):
        site = tmp_path / venv / "lib" / "site-packages"
        site.mkdir(parents=True)
        (site / "libcuda_like.so").write_bytes(library)
        (site / "module.py").write_bytes(library)  # Python source: never shared
        (site / "small.so").write_bytes(library[:4096])  # under 1 MiB: not worth it
        tool = site / "ptxas"
        tool.write_bytes(other)
        tool.chmod(0o755 if venv != "c" else 0o644)  # c's differs in mode: kept apart
    (tmp_path / "c" / "lib" / "site-packages" / "libcuda_like.so").write_bytes(other[:len(library)])

    out = _run("share", "a", "b", "c", "missing", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "GiB of identical binaries shared" in out.stdout

    def inode(venv, name):
        return (tmp_path / venv / "lib" / "site-packages" / name).stat().st_ino

    assert inode("a", "libcuda_like.so") == inode("b", "libcuda_like.so") != inode("c", "libcuda_like.so")
    assert inode("a", "ptxas") == inode("b", "ptxas") != inode("c", "ptxas")
    assert len({inode(venv, "module.py") for venv in "abc"}) == 3
    assert len({inode(venv, "small.so") for venv in "abc"}) == 3
    for venv in "ab":
        site = tmp_path / venv / "lib" / "site-packages"
        assert (site / "libcuda_like.so").read_bytes() == library
        assert os.access(site / "ptxas", os.X_OK)
    assert not os.access(tmp_path / "c" / "lib" / "site-packages" / "ptxas", os.X_OK)
    assert not list(tmp_path.rglob(".*.shared"))

    again = _run("share", "a", "b", "c", cwd=tmp_path)  # idempotent: nothing left to share
    assert again.returncode == 0 and "0.0 GiB" in again.stdout
