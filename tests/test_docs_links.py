"""The links between the project's pages resolve: every relative Markdown link in README.md, ARCHITECTURE.md
and docs/*.md names a file that exists and, with `#anchor`, a heading of that file (GitHub's slug rule); and
every `docs/PAGE.md#anchor` a source file, script or test names in a comment points at a heading that is
there. Guides move text between pages; this keeps the links that lead to it true."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_REF = re.compile(r"(docs/[A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link outside code blocks whose target is a relative path or an anchor."""
    out, in_fence = [], False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ... are not checked
                out.append((no, target))
    return out


def broken(source: Path, target: str) -> str | None:
    """Why a link from source does not resolve, or None."""
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    if not dest.exists():
        return f"no file {file_part}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {dest.name}"
    return None


def test_every_link_between_pages_resolves():
    failures = [f"{p.relative_to(ROOT)}:{no}: ({target}) {why}"
                for p in PAGES for no, target in links(p) if (why := broken(p, target))]
    assert not failures, "broken links:\n" + "\n".join(failures)


def test_every_docs_anchor_named_in_the_code_exists():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.toml", "*.yaml", "eval_record/*.md"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    failures = []
    for rel in tracked:
        path = ROOT / rel
        if not path.is_file() or rel == "tests/test_docs_links.py":
            continue
        for m in CODE_REF.finditer(path.read_text(encoding="utf-8", errors="replace")):
            page, anchor = ROOT / m.group(1), m.group(2)
            if not page.exists() or anchor not in anchors(page):
                failures.append(f"{rel}: {m.group(0)}")
    assert not failures, "docs anchors named in the code that do not exist:\n" + "\n".join(failures)


def test_the_checker_catches_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# A page\n## Under load: `bench/faults.py --scenario x`\n## Tasks\n## Tasks\n"
                    "[ok](#tasks-1) [ok](#under-load-benchfaultspy---scenario-x) [bad](#nowhere) [bad](b.md)\n"
                    "```\n## not a heading\n```\n")
    found = {t: broken(page, t) for _, t in links(page)}
    assert found["#tasks-1"] is None and found["#under-load-benchfaultspy---scenario-x"] is None
    assert "no heading #nowhere" in found["#nowhere"] and "no file b.md" in found["b.md"]
    assert "not-a-heading" not in anchors(page)
