"""The docs hold together: every relative link resolves (to a file, and for ``#anchors`` to
a heading, by GitHub's rules), README.md stays a front page, every example a page
shows is the file under docs/examples/ that ``tests/real_engine/test_docs_examples.py`` runs,
and every test a page names exists."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "PROTOCOL.md",
        ROOT / "CHANGELOG.md",
        ROOT / "bench" / "README.md",
        ROOT / "tests" / "README.md",
    ]
    + list((ROOT / "docs").rglob("*.md"))
)
README_MAX_BYTES = 12 * 1024

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_EXAMPLE = re.compile(r"^<!-- example: (\S+) -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks and HTML comments."""
    lines, fenced = [], False
    for line in _COMMENT.sub("", text).splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links and emphasis reduced to their words)
    lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor the page's headings make; a repeated one gets ``-1``, ``-2``, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            base = slug(match[2])
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def relative_links(page: Path) -> list[str]:
    return [
        target
        for line in prose_lines(page.read_text(encoding="utf-8"))
        for target in _LINK.findall(_CODE_SPAN.sub("", line))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    ]


def test_the_slugs_follow_githubs_rules() -> None:
    assert slug("Workers' registration") == "workers-registration"
    assert slug("The `streamq` command") == "the-streamq-command"
    assert slug("What is exposed, and why") == "what-is-exposed-and-why"
    assert slug("Timeouts and retries") == "timeouts-and-retries"
    assert slug("Exact resume after a worker failure") == "exact-resume-after-a-worker-failure"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = unquote(target).partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {_name(resolved)}")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move the detail into docs/"


def shown_examples() -> list[tuple[Path, str, str]]:
    """(page, example path, the fenced code under its marker) for every example a page shows."""
    return [(page, path, code) for page in PAGES for path, code in _EXAMPLE.findall(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize(
    ("page", "path", "code"), shown_examples(), ids=lambda v: _name(v) if isinstance(v, Path) else None
)
def test_a_page_shows_its_example_as_the_file_holds_it(page: Path, path: str, code: str) -> None:
    example = ROOT / path
    assert example.parent == EXAMPLES, f"{_name(page)} shows {path}, which is not under docs/examples/"
    assert example.exists(), f"{_name(page)} shows {path}, which does not exist"
    assert code == example.read_text(encoding="utf-8"), f"{_name(page)}: the block under {path} differs from the file"


def test_every_example_marker_is_followed_by_its_code() -> None:
    markers = sum(len(re.findall(r"^<!-- example: ", page.read_text(encoding="utf-8"), re.MULTILINE)) for page in PAGES)
    assert markers == len(shown_examples()), "an <!-- example: ... --> marker without a ```python block under it"


def test_every_example_is_shown_in_the_docs() -> None:
    shown = {path for _, path, _ in shown_examples()}
    unshown = [_name(path) for path in sorted(EXAMPLES.glob("*.py")) if _name(path) not in shown]
    assert EXAMPLES.glob("*.py"), "no examples"
    assert not unshown, f"examples no page shows: {unshown}"


_TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")
_TEST_NAME = re.compile(r"`(test_\w+)(\*?)`")


def test_every_test_a_page_names_exists() -> None:
    """A test file or test function a page names as proof exists (a name ending in ``*``
    stands for the tests it begins): a renamed test must not leave a page pointing at
    nothing. CHANGELOG.md is history and may name tests that are gone."""
    defined = {
        name for path in (ROOT / "tests").rglob("*.py") for name in re.findall(r"def (test_\w+)", path.read_text())
    }
    missing = []
    for page in (page for page in PAGES if page.name != "CHANGELOG.md"):
        text = page.read_text()
        missing += [f"{_name(page)}: {path}" for path in _TEST_PATH.findall(text) if not (ROOT / path).exists()]
        for name, star in _TEST_NAME.findall(text):
            if not (any(test.startswith(name) for test in defined) if star else name in defined):
                missing.append(f"{_name(page)}: {name}{star}")
    assert not missing, missing
