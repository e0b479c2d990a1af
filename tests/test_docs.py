"""The README stays short and every document links where it says: each relative link in
README.md, docs/ and the other Markdown files of the repository names a file that exists,
and each ``#anchor`` a heading of that file (as GitHub makes anchors). Every docs page
opens with what it is for and is reachable from the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 199

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    files = [README, *sorted(DOCS.glob("*.md"))]
    for pattern in ("patches/**/*.md", "upstream_pr/*.md", "tests/**/README.md", "bench/*.md"):
        files += sorted(path for path in ROOT.glob(pattern) if ".venv" not in path.parts)
    return files


def prose_lines(text: str):
    """(number, line) of the lines outside fenced code blocks, with code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", "``", line)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lower-cased, without punctuation but
    hyphens and underscores, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    found, seen = set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not fenced:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def links_of(path: Path):
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(line):
            yield number, match.group(1)


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert max(len(line) for line in lines) <= 400, "a README line (a table cell?) over 400 characters"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for number, target in links_of(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda page: page.name)
def test_every_docs_page_opens_with_what_it_is_for_and_is_reachable(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), f"{page.name} does not open with a title"
    opening = next(line for line in lines[1:] if line.strip())
    assert re.match(r"^[A-Za-z`*\[]", opening) and not opening.startswith(("|", "- ", "```")), (
        f"{page.name}: the first thing after the title should say what the page is for, not {opening!r}")
    reachable = {(README.parent / target.partition("#")[0]).resolve() for _, target in links_of(README)}
    index = DOCS / "README.md"
    if index.exists():
        reachable |= {(DOCS / target.partition("#")[0]).resolve() for _, target in links_of(index)}
    assert page.resolve() in reachable, f"neither README.md nor docs/README.md links to {page.name}"


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("Safe decoders (`swift_safe_media.decoders`)") == "safe-decoders-swift_safe_mediadecoders"
    assert github_anchor("ms-swift: two steps") == "ms-swift-two-steps"
    assert github_anchor("What `--safe_media true` changes") == "what---safe_media-true-changes"


def test_the_layout_names_every_module():
    layout = (DOCS / "how-it-works.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "swift_safe_media"
    modules = sorted(str(path.relative_to(package)) for path in package.rglob("*.py"))
    missing = [module for module in modules if f"`{module}`" not in layout]
    assert not missing, f"docs/how-it-works.md#layout does not name: {missing}"


def test_the_map_and_the_layout_name_every_subpackage():
    package = ROOT / "swift_safe_media"
    subpackages = sorted(init.parent.name for init in package.glob("*/__init__.py"))
    page = (DOCS / "how-it-works.md").read_text()
    readme_map = page.split("\n## Map\n", 1)[1].split("\n## ", 1)[0]
    layout = page.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in layout.splitlines() if line.startswith("| `")]
    assert subpackages and "engine" in subpackages
    assert [name for name in subpackages if f"`swift_safe_media/{name}/`" not in readme_map] == []
    assert sorted(row.strip("`/") for row in rows) == subpackages, rows
