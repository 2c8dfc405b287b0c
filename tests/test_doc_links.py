"""Specification: every relative link of the documentation leads somewhere.

Markdown links and images in README.md, data/README.md, docs/*.md and studies/*/README.md: the
file or folder a relative target names exists, and an anchor (``page.md#heading``, ``#heading``)
names a heading of its page, spelt as GitHub spells it (lower case, punctuation dropped, spaces to
hyphens). Web addresses are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    return [
        REPO / "README.md",
        REPO / "data" / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "studies").glob("*/README.md")),
    ]


def anchor_of(heading: str) -> str:
    """A Markdown heading's text -> its GitHub anchor."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor_of(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(REPO)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    return broken


def test_the_anchor_of_a_heading_is_spelt_as_github_spells_it():
    assert anchor_of("Benchmark scripts (`bench/`)") == "benchmark-scripts-bench"
    assert anchor_of("The demo's budget") == "the-demos-budget"
    assert anchor_of("1x on version 4, seed 0 (2026-11-29)") == "1x-on-version-4-seed-0-2026-11-29"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_a_page_leads_somewhere(page):
    assert not broken_links(page), f"{page.relative_to(REPO)}:\n" + "\n".join(broken_links(page))
