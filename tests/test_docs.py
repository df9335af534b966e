import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "experiments" / "README.md",
]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
DATE = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown file outside its fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading's get -1, -2, ..."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append((number, target))
    return links


def test_slug_follows_github():
    assert slug("The demo: `make demo`") == "the-demo-make-demo"
    assert slug("Latest results: AMD EPYC (Zen 4), 2026-12-06") == (
        "latest-results-amd-epyc-zen-4-2026-12-06"
    )
    assert slug("Precision and compilation") == "precision-and-compilation"


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in PAGES:
        for number, target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            shown = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not resolved.is_relative_to(ROOT):
                broken.append(f"{shown} (outside the repository)")
                continue
            if not resolved.exists():
                broken.append(f"{shown} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{shown} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md#a-title) [missing](nowhere.md) ![image](x.png) [web](https://example.com)"
        "\n# A title\n```\n[in code](ignored.md)\n```\n## A title\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(1, "page.md#a-title"), (1, "nowhere.md"), (1, "x.png")]
    assert anchors(page) == {"a-title", "a-title-1"}


def is_latest_results_header(line: str) -> bool:
    """A Markdown heading that names the latest results (``## Latest results: CPU, date``):
    the one place where the docs carry a date."""
    return bool(re.match(r"#{1,6}\s", line)) and "latest" in line.lower()


def test_no_dates_in_docs_and_sources_but_the_latest_results_headers():
    files = [
        *PAGES,
        *(
            path
            for path in sorted((ROOT / "src").rglob("*"))
            if path.is_file()
            and "__pycache__" not in path.parts
            and path.suffix in {".py", ".toml", ".cpp", ".html", ".md", ".txt", ".json", ".cfg"}
        ),
    ]
    dated = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DATE.search(line) and not (path.suffix == ".md" and is_latest_results_header(line)):
                dated.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not dated, "dated lines (git holds the history):\n" + "\n".join(dated)


def test_latest_results_header_is_recognised():
    assert is_latest_results_header("## Latest results: AMD EPYC (Zen 4), 2026-12-06")
    assert not is_latest_results_header("Run of 2026-12-06 on the latest code")
    assert not is_latest_results_header("## Results of 2026-12-06")


# The generated tables of the docs: docs/faithfulness.md's Table 3 parameter counts, and
# docs/performance.md's list of the levers that aiayn.accel.levers holds.
@pytest.mark.parametrize("script", ["param_table.py", "lever_list.py"])
def test_generated_doc_tables_are_up_to_date(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
