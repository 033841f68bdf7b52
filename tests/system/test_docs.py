"""The README and the documentation site (``docs/``, ``mkdocs.yml``), without building the site
(``make docs`` builds it in strict mode; ``make test`` runs that): the README stays a short
entry point whose links resolve, every page is in the nav, the results tables sit between the
markers a regeneration script replaces, and no command needs an activated venv."""

from __future__ import annotations

import argparse
import re
import shlex
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
    """Short as read: a figure's source marker (``<!-- fig … -->``, checked by
    tests/system/test_bench_publish.py) is not text anyone reads, so it is not counted."""
    from bench.publish.tables import as_read

    text = README.read_text()
    read = as_read(text).encode()
    assert len(read) <= README_MAX_BYTES, f"README.md is {len(read)} bytes: move detail to docs/"
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\s+#", text, flags=re.M), command


def test_the_readme_links_every_page_of_the_site() -> None:
    """The README's documentation list is the site's map: every page of the nav (the raw
    results pages aside) is linked from it."""
    links = {
        link.removeprefix("docs/").partition("#")[0]
        for link in re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    }
    missing = [p for p in _nav() if p not in links and not p.startswith("results/")]
    assert not missing, f"pages in the nav that the README does not link: {missing}"


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
    """The benchmark page's time-to-first-token block is what ``python -m bench ttft --publish``
    writes from ``docs/results/ttft.json``, and the raw tables (``ttft.md``) are that run's."""
    import json

    from bench.studies import ttft

    doc = json.loads((DOCS / "results" / "ttft.json").read_text())
    page = (DOCS / "benchmarks" / "index.md").read_text()
    assert _between(page, "ttft").strip() == ttft.readme_block(doc)
    assert (DOCS / "results" / "ttft.md").read_text() == ttft.report(doc)


def test_results_tables_are_read_off_the_committed_results() -> None:
    """Every figure in the README's and the benchmark page's tables is what ``bench.publish``
    writes from ``docs/results/bench/results.json``: none typed by hand, none left stale."""
    from bench.publish import tables as publish

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


def _links(page: Path) -> set[Path]:
    """The local pages ``page`` links to, resolved."""
    out = set()
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", link) or link.startswith("#"):
            continue
        out.add((page.parent / link.split("#")[0]).resolve())
    return out


def test_every_page_in_the_nav_is_linked_from_another_page() -> None:
    """A page only the sidebar reaches is one a reader of the README never finds."""
    linked: set[Path] = set()
    for page in [README, *_pages()]:
        linked |= {p for p in _links(page) if p != page.resolve()}
    orphans = [p for p in _nav() if p != "index.md" and (DOCS / p).resolve() not in linked]
    assert not orphans, f"linked from no other page: {orphans}"


#: The product's command lines: a CLI (by any path to it) and its words up to a comment.
_CLI = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?(edge-agent|cloud-verifier)((?:\s+[^#\n]*)?)")


def _code_lines(text: str) -> list[str]:
    """The shell lines of ``text``'s fenced code blocks, continuations joined."""
    lines: list[str] = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def _options(prog: str) -> dict[str, set[str]]:
    """Each subcommand of ``prog`` and the options its parser accepts."""
    from cloud_verifier.daemon import cli as vcli
    from edge_agent.daemon import cli as ecli

    parser = (ecli if prog == "edge-agent" else vcli).build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in subs.choices.items()}


def test_every_product_command_in_the_docs_parses() -> None:
    """Every ``edge-agent`` / ``cloud-verifier`` command in a code block of the README or the
    docs names a subcommand that exists and only flags its parser accepts."""
    options = {prog: _options(prog) for prog in ("edge-agent", "cloud-verifier")}
    bad, seen = [], 0
    for page in [README, *_pages()]:
        for line in _code_lines(page.read_text()):
            for m in _CLI.finditer(line):
                try:
                    words = shlex.split(m[2])
                except ValueError:  # a quote the block closes on a later line (a JSON body)
                    words = m[2].split()
                words = [w for w in words if w not in (">", ">>", "2>&1")]
                # (a first word that is a flag or no word: the unit's name in journalctl -u,
                # a diagram's label)
                if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
                    continue
                prog, sub = m[1], words[0]
                seen += 1
                if sub not in options[prog]:
                    bad.append(f"{page.relative_to(REPO)}: {prog} {sub}: no such subcommand")
                    continue
                for w in words[1:]:
                    flag = w.split("=", 1)[0]
                    if flag.startswith("--") and flag not in options[prog][sub]:
                        bad.append(f"{page.relative_to(REPO)}: {prog} {sub} {flag}")
    assert seen > 10, "the docs' commands were not found"
    assert not bad, bad
