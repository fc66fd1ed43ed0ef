"""docs/decisions.md opens with an index of its sections, each linked, in order."""

from __future__ import annotations

import re

from tests.support import REPO_ROOT

DOC = REPO_ROOT / "docs" / "decisions.md"


def anchor(heading: str, seen: dict[str, int]) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives `heading`: lower case, punctuation
    dropped, spaces as hyphens, `-1`, `-2` … for repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


def index_lines(text: str) -> list[str]:
    """The index the document's `## ` headings call for, one `- [title](#anchor)` line each."""
    seen: dict[str, int] = {}
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    return [f"- [{h.replace('[', '').replace(']', '')}](#{anchor(h, seen)})" for h in headings]


def test_the_index_lists_every_section_in_order() -> None:
    text = DOC.read_text()
    listed = [line for line in text[: text.index("\n## ")].splitlines() if line.startswith("- [")]
    assert listed == index_lines(text), "regenerate: python -m tests.test_decisions"


if __name__ == "__main__":
    print("\n".join(index_lines(DOC.read_text())))
