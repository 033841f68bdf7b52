"""The README and the documentation site (``docs/``, ``mkdocs.yml``), without building the site
(``make docs`` builds it in strict mode; ``make test`` runs that): the README stays a short
entry point whose links resolve, every page is in the nav, the results tables sit between the
markers a regeneration script replaces, and no command needs an activated venv."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"

# A README a newcomer reads in five minutes; the rest belongs in docs/.
README_MAX_BYTES = 10_000


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _nav() -> list[str]:
    """The .md paths of mkdocs.yml's nav, in order (entries `- Title: path.md` or `- path.md`)."""
    text = (REPO / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return re.findall(r"^\s*-\s+(?:.*?:\s+)?([\w./-]+\.md)\s*$", nav, flags=re.M)


def _between(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, name
    inside = text[text.index(begin) + len(begin) : text.index(end)]
    return inside


def test_readme_is_short_and_has_the_two_commands() -> None:
    raw = README.read_bytes()
    assert len(raw) <= README_MAX_BYTES, f"README.md is {len(raw)} bytes: move detail to docs/"
    text = raw.decode()
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\s+#", text, flags=re.M), command


def test_readme_links_resolve() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to the documentation"
    missing = [link for link in local if not (REPO / link.split("#")[0]).exists()]
    assert not missing, missing
    assert any(link.startswith("docs/") for link in local)


def test_every_docs_page_is_in_the_nav() -> None:
    nav = _nav()
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    on_disk = {page.relative_to(DOCS).as_posix() for page in _pages()}
    assert set(nav) - on_disk == set(), "the nav names a page that does not exist"
    assert on_disk - set(nav) == set(), "a page under docs/ is not in mkdocs.yml's nav"


def test_results_tables_sit_between_their_markers() -> None:
    readme = _between(README.read_text(), "results")
    assert re.search(r"^\| RTT ms \|.*\n\|---", readme, flags=re.M)
    bench = _between((DOCS / "benchmarks" / "index.md").read_text(), "bench-tables")
    assert len(re.findall(r"^\| RTT ms \|", bench, flags=re.M)) >= 2


def test_ttft_figures_are_read_off_the_committed_run() -> None:
    """The README's time-to-first-token block is what ``bench.ttft --publish`` writes from
    ``docs/results/ttft.json``, and the raw tables (``ttft.md``) are that run's."""
    import json

    from bench import ttft

    doc = json.loads((DOCS / "results" / "ttft.json").read_text())
    assert _between(README.read_text(), "ttft").strip() == ttft.readme_block(doc)
    assert (DOCS / "results" / "ttft.md").read_text() == ttft.report(doc)


def test_results_tables_are_read_off_the_committed_results() -> None:
    """Every figure in the README's and the benchmark page's tables is what ``bench.publish``
    writes from ``docs/results/bench/results.json``: none typed by hand, none left stale."""
    from bench import publish

    res = publish.Results.load(DOCS / "results" / "bench" / "results.json")
    assert _between(README.read_text(), "results").strip() == res.readme_section()
    page = (DOCS / "benchmarks" / "index.md").read_text()
    assert _between(page, "bench-tables").strip() == res.page_section()


def test_commands_do_not_need_an_activated_venv() -> None:
    """A command in the README or a page starts with .venv/bin/..., not a bare program that only
    an activated venv puts on the PATH. Commands: the lines of ```bash blocks and of indented
    code blocks, and the `$ ` lines of other blocks (transcripts). docs/results/ is the bench's."""
    program = r"(cloud-verifier|edge-agent|python3? -m|torchrun|mkdocs) "
    pages = [README, *(p for p in _pages() if "results" not in p.relative_to(DOCS).parts)]
    found = []
    for page in pages:
        fence: str | None = None  # the open fence's language, "" when it has none
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else line.strip().strip("`")
                continue
            if fence in ("bash", "sh") or (fence is None and line.startswith("    ")):
                command = re.match(rf"\s*(\$ )?{program}", line)
            elif fence is not None:
                command = re.match(rf"\s*\$ {program}", line)
            else:
                command = None
            if command:
                found.append(f"{page.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, found
