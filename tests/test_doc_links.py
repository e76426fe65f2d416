"""Every relative link of README.md and docs/*.md resolves: to a file or folder of the checkout, and a ``#anchor``
to a heading of the Markdown file it names, spelt as GitHub spells its heading anchors."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCED = re.compile(r"^ *```.*?^ *```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)         # http:, https:, mailto: ...


def prose(text: str) -> str:
    """Markdown without its fenced blocks (their lines kept empty, so line numbers hold)."""
    return FENCED.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def slug(title: str) -> str:
    """GitHub's anchor of a heading: links reduced to their text, lower case, everything but letters, digits,
    spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one also as ``-1``, ``-2``, ... as GitHub numbers
    them."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(prose(path.read_text())):
        base = slug(match["title"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link and image of a Markdown file, outside code."""
    text = prose(path.read_text())
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match["target"]
            if not EXTERNAL.match(target):
                found.append((number, target))
    return found


def problem(page: Path, target: str, root: Path = REPO) -> str | None:
    """Why ``target``, linked from ``page``, does not resolve in the checkout ``root`` (None: it does)."""
    where, _, anchor = target.partition("#")
    linked = (page.parent / unquote(where)).resolve() if where else page
    if not linked.exists():
        return "no such file or folder"
    if root not in linked.parents and linked != root:
        return "outside the checkout"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"{linked.relative_to(root)} has no heading with the anchor #{anchor}"
    return None


def test_slug_follows_github() -> None:
    assert slug("Volumes: `infer --volume`, `dl.infer_volume`") == "volumes-infer---volume-dlinfer_volume"
    assert slug("Volumes: 3-D tile grids (`TileGrid(depth=D, rows=R, cols=C)`)") == \
        "volumes-3-d-tile-grids-tilegriddepthd-rowsr-colsc"
    assert slug("The manifest's `split` column") == "the-manifests-split-column"
    assert slug("µm per [pixel](x.md)") == "µm-per-pixel"


def test_links_skip_code_and_external_targets(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n[a](b.md#x) `[c](d.md)` [e](https://f)\n```\n[g](h.md)\n```\n![i](j.png)\n## Top\n")
    assert links(page) == [(2, "b.md#x"), (6, "j.png")]
    assert anchors(page) == {"top", "top-1"}
    (tmp_path / "b.md").write_text("## X\n")
    assert problem(page, "#top-1", tmp_path) is None
    assert problem(page, "b.md#x", tmp_path) is None
    assert problem(page, "#nowhere", tmp_path) == "p.md has no heading with the anchor #nowhere"
    assert problem(page, "b.md#y", tmp_path) == "b.md has no heading with the anchor #y"
    assert problem(page, "c.md", tmp_path) == "no such file or folder"
    assert problem(page, "../" + tmp_path.name + "/b.md", tmp_path) is None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [f"line {line}: {target}: {why}" for line, target in links(page)
              if (why := problem(page, target)) is not None]
    assert not broken, f"{page.relative_to(REPO)} has links that do not resolve:\n" + "\n".join(broken)
