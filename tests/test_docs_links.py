"""Every relative link and image of README.md and docs/*.md resolves: the file or folder exists,
and a #fragment names a heading of the target as GitHub renders it."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
  """The text outside fenced code blocks and inline code spans."""
  text = FENCE.sub("", text)
  return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", text, flags=re.S)


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: its text as rendered (no markup), lower case, without
  punctuation other than `-` and `_`, spaces as hyphens."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
  text = re.sub(r"<[^>]+>", "", text).replace("`", "")
  text = re.sub(r"(\*\*|\*)(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # emphasis; `_` only between words:
  text = re.sub(r"(?<!\w)(__|_)(?=\S)(.+?)(?<=\S)\1(?!\w)", r"\2", text)  # snake_case stays
  text = text.strip().lower()
  kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
  return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
  """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
  seen: dict[str, int] = {}
  out = set()
  for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
    m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    base = slug(m.group(1))
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


def links(page: Path) -> list[str]:
  return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8")))
          if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto:


def test_the_anchor_rule_on_known_headings():
  assert slug("1. One full RL step vs TRL `GRPOTrainer`: `benchmarks/step_vs_trl.py`") == \
      "1-one-full-rl-step-vs-trl-grpotrainer-benchmarksstep_vs_trlpy"
  assert slug("float32 update with C++ attention and folded adapters: 2.64-2.68x (2026-12-05)") == \
      "float32-update-with-c-attention-and-folded-adapters-264-268x-2026-12-05"
  assert slug("Rival methods (issue 25)") == "rival-methods-issue-25"
  assert slug("A **bold** [linked](x.md) heading") == "a-bold-linked-heading"


def test_links_in_code_are_not_links():
  assert links_of("see `[a](missing.md)` and\n```\n[b](missing.md)\n```\n[c](here.md)\n") == ["here.md"]


def links_of(text: str) -> list[str]:
  return LINK.findall(prose(text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page):
  broken = []
  for target in links(page):
    path, _, fragment = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f"{target}: no such file")
    elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
      broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
  assert not broken, broken


def test_the_readme_links_every_docs_page_through_the_index():
  index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
  missing = [p.name for p in PAGES[1:] if p.name != "README.md" and f"]({p.name})" not in index]
  assert not missing, f"add a line for these pages to docs/README.md: {missing}"
  assert "](docs/README.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
