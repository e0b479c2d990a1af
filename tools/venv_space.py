"""Disk space for `make test`'s four venvs: a check before they are built, and sharing after.

    python3 tools/venv_space.py check VENV=GIB ...   before building: stop, saying what is needed,
                                                     when the disk cannot hold the venvs still missing
    python3 tools/venv_space.py share VENV ...       after building: identical binaries hard-linked

Each venv holds its own CUDA build of torch (three different releases, 5 to 8 GiB each), and pip
copies every wheel in full, so the four take about 27 GiB; the CUDA libraries, triton's tool
chain and other binaries are byte-identical between several of them (about 6 GiB). Without the
check, a full disk shows up as pip's `OSError: [Errno 28]` halfway through one of four parallel
installs, naming neither the space needed nor the venvs; with it, the make stops before
installing anything.

Only files of 1 MiB or more that are not Python source are shared: shared libraries and
executables, which nothing edits in place (pip unlinks a file before it writes a new one, so a
reinstall in one venv leaves the others' copy alone).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import stat
import sys
from collections import defaultdict
from pathlib import Path

SMALLEST_SHARED = 1 << 20
NEVER_SHARED_SUFFIXES = (".py", ".pyi", ".pth", ".txt", ".json", ".cfg", ".toml")
GIB = 1 << 30


def _built(venv: Path) -> bool:
    return (venv / ".installed").exists()


def check(needs: dict[Path, float]) -> int:
    """0 when the venvs still missing fit on the disk; otherwise 1, with what each needs."""
    missing = {venv: gib for venv, gib in needs.items() if not _built(venv)}
    if not missing:
        return 0
    where = Path(".").resolve()
    free = shutil.disk_usage(where).free / GIB
    needed = sum(missing.values())
    if free >= needed:
        return 0
    listed = ", ".join(f"{venv} ({gib:g} GiB)" for venv, gib in missing.items())
    print(f"make test: {free:.1f} GiB free on the disk of {where}; the venvs still to build need "
          f"about {needed:g} GiB while pip installs them side by side: {listed}. Free some space "
          "and run make test again (the venvs already built are kept).", file=sys.stderr)
    return 1


def _digest(path: Path) -> bytes:
    hasher = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.digest()


def _candidates(venvs: list[Path]) -> dict[tuple[int, int], list[tuple[Path, int]]]:
    """Regular files worth sharing, with their mode, by (device, size); links already shared
    count once."""
    by_size: dict[tuple[int, int], list[tuple[Path, int]]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    for venv in venvs:
        for folder, _, names in os.walk(venv):
            for name in names:
                if name.endswith(NEVER_SHARED_SUFFIXES):
                    continue
                path = Path(folder, name)
                found = path.lstat()  # a symbolic link's own: not a regular file
                if not stat.S_ISREG(found.st_mode) or found.st_size < SMALLEST_SHARED:
                    continue
                if (found.st_dev, found.st_ino) in seen:
                    continue
                seen.add((found.st_dev, found.st_ino))
                by_size[(found.st_dev, found.st_size)].append((path, found.st_mode))
    return by_size


def share(venvs: list[Path]) -> int:
    """Hard-links byte-identical binaries across `venvs`; returns the bytes freed."""
    freed = 0
    for (_, size), paths in _candidates([venv for venv in venvs if venv.is_dir()]).items():
        if len(paths) < 2:
            continue
        # Same bytes and same mode (an executable keeps its x bit in every venv).
        by_content: dict[tuple[bytes, int], list[Path]] = defaultdict(list)
        for path, mode in paths:
            by_content[(_digest(path), mode)].append(path)
        for kept, *copies in by_content.values():
            for copy in copies:
                # Linked beside the copy, then renamed over it: the path is never missing.
                temporary = copy.with_name(f".{copy.name}.shared")
                os.link(kept, temporary)
                os.replace(temporary, copy)
                freed += size
    return freed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check_command = commands.add_parser("check", help="stop when the venvs still missing do not fit")
    check_command.add_argument("needs", nargs="+", metavar="VENV=GIB")
    share_command = commands.add_parser("share", help="hard-link identical binaries across venvs")
    share_command.add_argument("venvs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "check":
        needs = {}
        for item in args.needs:
            venv, _, gib = item.partition("=")
            needs[Path(venv)] = float(gib)
        return check(needs)
    freed = share(args.venvs)
    print(f"venvs: {freed / GIB:.1f} GiB of identical binaries shared between "
          f"{', '.join(map(str, args.venvs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
