"""The published pages a study or a publishing tool rewrites, and how: the text between two
markers (``<!-- name:begin -->`` … ``<!-- name:end -->``) replaced, nothing else.
"""

from __future__ import annotations

from testkit.provenance import REPO

README = REPO / "README.md"
BENCH_PAGE = REPO / "docs" / "benchmarks" / "index.md"


def replace_between(text: str, marker: str, body: str) -> str:
    """``text`` with what lies between ``<!-- marker:begin -->`` and ``<!-- marker:end -->``
    replaced by ``body`` (one blank line either side where the page had them)."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"publish: markers {begin} … {end} not found in order")
    inner = text[i + len(begin) : j]
    pad = "\n\n" if inner.startswith("\n\n") else "\n"
    return text[: i + len(begin)] + pad + body + pad + text[j:]
