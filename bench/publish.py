"""Publish a benchmark's results: rewrite the README's results table and the benchmark page's
tables from ``results.json``, between their markers, so that every published figure is read off
the committed file and none is typed by hand.

    python -m bench.publish docs/results/bench/results.json          # rewrite both
    python -m bench.publish docs/results/bench/results.json --check  # exit 1 if either differs

README.md, between ``<!-- results:begin -->`` and ``<!-- results:end -->``: the real draft's
tokens/s per RTT and mode, each with its speed-up over ``ar`` and over ``cloud-sd``, and outcome
pre-drafting's hit rate, gap per rejection and unused branch tokens per RTT.
docs/benchmarks/index.md, between ``<!-- bench-tables:begin -->`` and ``<!-- bench-tables:end -->``:
the same tables, the verifier's busy seconds per 100 committed tokens, the token sources at RTT
100 ms, the datasets at RTT 100 ms, and the oracle drafts' rows.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from bench.report import _fmt, _modes, _sources

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCH_PAGE = ROOT / "docs" / "benchmarks" / "index.md"

#: The RTT of the sources and datasets paragraphs (the issue's reference RTT).
REFERENCE_RTT_MS = 100.0


def _x(v: float | None) -> str:
    return "–" if v is None else f"{_fmt(v)}×"


class Results:
    """One ``results.json``: its summary rows, runs and settings, read once."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path
        self.rows: list[dict[str, Any]] = data["summary"]
        self.runs: list[dict[str, Any]] = data["runs"]
        self.settings: dict[str, Any] = data["settings"]
        self.regime: str = data["regimes"][0]["name"]

    @classmethod
    def load(cls, path: Path) -> Results:
        folder = path.resolve().parent
        shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
        return cls(orjson.loads(path.read_bytes()), str(shown))

    def model_draft(self) -> str:
        """The first draft that is a model (not an oracle)."""
        for d in self.settings["drafts"]:
            if not d.startswith("oracle:"):
                return str(d)
        raise SystemExit("publish: the run has no model draft")

    def sel(self, draft: str | None) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["regime"] == self.regime and r.get("draft") == draft]

    def modes(self, draft: str) -> list[str]:
        return _modes(self.sel(draft))

    def rtts(self, draft: str) -> list[float]:
        return sorted({r["rtt_ms"] for r in self.sel(draft)})

    def row(self, draft: str | None, rtt: float, mode: str) -> dict[str, Any] | None:
        for r in self.sel(draft):
            if r["rtt_ms"] == rtt and r["mode"] == mode:
                return r
        return None

    # ------------------------------------------------------------------ tables

    def speed_table(self, draft: str) -> list[str]:
        modes = self.modes(draft)
        out = [
            "| RTT ms | ar | " + " | ".join(modes) + " |",
            "|" + "---|" * (len(modes) + 2),
        ]
        for rtt in self.rtts(draft):
            ar = self.row(None, rtt, "ar")
            cells = []
            for m in modes:
                r = self.row(draft, rtt, m)
                cells.append(
                    "–"
                    if r is None
                    else f"{_fmt(r['tokens_per_s'])} ({_x(r.get('speedup_vs_ar'))}, "
                    f"{_x(r.get('speedup_vs_cloud_sd'))})"
                )
            out.append(
                f"| {rtt:g} | {_fmt(ar['tokens_per_s'] if ar else None)} | "
                + " | ".join(cells)
                + " |"
            )
        return out

    def busy_table(self, draft: str) -> list[str]:
        modes = self.modes(draft)
        out = ["| RTT ms | ar | " + " | ".join(modes) + " |", "|" + "---|" * (len(modes) + 2)]
        for rtt in self.rtts(draft):
            ar = self.row(None, rtt, "ar")
            cells = [_fmt((self.row(draft, rtt, m) or {}).get("verifier_busy_s_per_100_tokens"))
                     for m in modes]  # fmt: skip
            ar_busy = _fmt(ar.get("verifier_busy_s_per_100_tokens") if ar else None)
            out.append(f"| {rtt:g} | {ar_busy} | " + " | ".join(cells) + " |")
        return out

    def predraft_table(self, draft: str) -> list[str]:
        """Per RTT and mode with outcome pre-drafting: the hit rate (rejections answered from a
        prepared branch), the gap per rejection against the same mode without pre-drafting
        (``auto predraft`` against ``auto``), and the branch tokens drafted but never used."""
        modes = [
            m for m in self.modes(draft)
            if any(r["mode"] == m and r.get("predraft") for r in self.sel(draft))
        ]  # fmt: skip
        if not modes:
            return []
        out = [
            "| RTT ms | mode | hit rate | gap per rejection, ms (without → with) "
            "| branch tokens never used / generation |",
            "|---|---|---|---|---|",
        ]
        for rtt in self.rtts(draft):
            for m in modes:
                r = self.row(draft, rtt, m)
                if r is None:
                    continue
                base = self.row(draft, rtt, m.removesuffix(" predraft"))
                without = _fmt(base.get("gap_per_rejection_ms"), 0) if base else "–"
                out.append(
                    f"| {rtt:g} | {m} | {_fmt(r.get('predraft_hit_rate'))} "
                    f"| {without} → {_fmt(r.get('gap_per_rejection_ms'), 0)} "
                    f"| {_fmt(r.get('predraft_unused_tokens_per_generation'), 0)} |"
                )
        return out

    def sources(self, draft: str, rtt: float) -> list[str]:
        out = []
        for m in self.modes(draft):
            out.append(f"- {m}: {_sources(self.row(draft, rtt, m) or {}) or '–'}")
        return out

    def datasets(self, draft: str, rtt: float) -> list[str]:
        """Per dataset: mean tokens/s of each mode's runs, and the edge draft's acceptance in
        ``auto`` (accepted / drafted tokens over that dataset's runs)."""
        modes = self.modes(draft)
        tps: dict[tuple[str, str], list[float]] = defaultdict(list)
        acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        order: list[str] = []
        for run in self.runs:
            if run["regime"] != self.regime or run["rtt_ms"] != rtt:
                continue
            if run.get("draft") not in (None, draft):
                continue
            ds = run["dataset"]
            if ds not in order:
                order.append(ds)
            tps[(ds, run["mode"])].append(run["tokens_per_s"])
            if run.get("draft") == draft and run["mode"] == "auto":
                acc[ds][0] += run["extra"]["accepted_tokens"]
                acc[ds][1] += run["extra"]["draft_tokens"]
        out = [
            "| dataset | acceptance (auto) | ar | " + " | ".join(modes) + " |",
            "|" + "---|" * (len(modes) + 3),
        ]
        for ds in order:
            a, d = acc[ds]
            cells = [_fmt(_mean(tps.get((ds, m), []))) for m in ["ar", *modes]]
            out.append(f"| {ds} | {_fmt(a / d if d else None)} | " + " | ".join(cells) + " |")
        return out

    def oracle_lines(self) -> list[str]:
        out = []
        for d in self.settings["drafts"]:
            if not d.startswith("oracle:"):
                continue
            for m in self.modes(d):
                cells = []
                for rtt in self.rtts(d):
                    r = self.row(d, rtt, m)
                    if r is not None:
                        cells.append(
                            f"RTT {rtt:g}: {_fmt(r['tokens_per_s'])} "
                            f"({_x(r.get('speedup_vs_ar'))} AR, "
                            f"{_x(r.get('speedup_vs_cloud_sd'))} cloud-sd)"
                        )
                out.append(f"`{d}`, `{m}`: " + ", ".join(cells))
        return out

    # ------------------------------------------------------------------ sections

    def caption(self, draft: str) -> str:
        s = self.settings
        commit = self.data["machine"].get("git_commit", "?")
        return (
            f"Real draft `{draft}`: tok/s (× AR, × cloud-sd); run of commit {commit},\n"
            f"{s['prompts_per_dataset']} prompts each of GSM8K, chat and HumanEval, "
            f"{s['tokens']} tokens per prompt (`{self.path}/`):"
        )

    def readme_section(self) -> str:
        """The speed table (pre-drafting's own table is on the benchmark page)."""
        draft = self.model_draft()
        parts = [self.caption(draft), "", *self.speed_table(draft)]
        return "\n".join(parts)

    def _predraft_part(self, draft: str) -> list[str]:
        table = self.predraft_table(draft)
        return ["Outcome pre-drafting (emulated gaps):", "", *table, ""] if table else []

    def page_section(self) -> str:
        draft = self.model_draft()
        rtt = REFERENCE_RTT_MS
        parts = [
            f"### Real draft `{draft}`: tok/s (× AR, × cloud-sd)",
            "",
            *self.speed_table(draft),
            "",
            "Verifier busy seconds per 100 committed tokens (emulated):",
            "",
            *self.busy_table(draft),
            "",
            *self._predraft_part(draft),
            f"Token sources at RTT {rtt:g} ms:",
            "",
            *self.sources(draft, rtt),
            "",
            f"By dataset at RTT {rtt:g} ms (tok/s; edge draft acceptance in auto):",
            "",
            *self.datasets(draft, rtt),
        ]
        oracles = self.oracle_lines()
        if oracles:
            parts += ["", "Oracles: " + oracles[0], *("\n" + o for o in oracles[1:])]
        return "\n".join(parts)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.publish", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("results", type=Path, help="a bench run's results.json")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    args = p.parse_args(argv)
    res = Results.load(args.results)
    stale = []
    for path, marker, body in (
        (README, "results", res.readme_section()),
        (BENCH_PAGE, "bench-tables", res.page_section()),
    ):
        old = path.read_text()
        new = replace_between(old, marker, body)
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{'out of date' if args.check else 'rewrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
