"""Publish the benchmark: rewrite the README's results table and the benchmark page's tables from
the committed results, between their markers, so that every published figure is read off the
committed files and none is typed by hand.

    python -m bench publish docs/results/bench/results.json          # rewrite both
    python -m bench publish docs/results/bench/results.json --check  # exit 1 if either differs

The inputs: the users' grid, ``docs/results/bench/results.json`` (``python -m bench grid``: the
simulation, per RTT, reply length, cloud draft cost c and edge batch cost b, every ratio with its
95 % interval paired by prompt), and the operators' capacity, ``docs/results/capacity.json``
(``python -m bench capacity``; ``--capacity`` names another file).

README.md, between ``<!-- results:begin -->`` and ``<!-- results:end -->``: 256-token replies at
the measured c and the GPU-class b, per RTT: ``ar``, the best cloud-sd (its choice) and the best
edge mode (its mode), tok/s with the speed-ups and their intervals, the time to first token, a
line comparing the best edge mode with the best cloud-sd, and the users one verifier serves at
the reading service level. docs/benchmarks/index.md, between ``<!-- bench-tables:begin -->`` and
``<!-- bench-tables:end -->``: that table for every reply length, at the other cloud draft costs
and at this CPU's batch cost, the verifier's busy time, pre-drafting, the categories, the
targets, the capacity, users at each service level and the simulation's validation.

A claim is worded by its interval (:func:`claim`): "≥" only where the low end is ≥ 1.

Figures in prose. A number in the README's or the docs' prose that a study measured is
followed by a marker naming its source, ``81<!-- fig capacity.json users_at_slo.auto.reading
-->`` (the file under docs/results/, the field: :func:`resolve`); ``--check`` (and
:func:`check_figures`, which the tests run) fails when the number is not the field's value
rounded as written, so a regenerated result leaves no stale sentence behind.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.lib.cli import study_parser
from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST
from bench.lib.modes import DEFAULT_EDGE
from bench.lib.pages import BENCH_PAGE, README, replace_between
from bench.lib.report import num
from testkit.provenance import REPO as ROOT

#: Where the capacity study lies, relative to the grid's results.json (docs/results/bench/);
#: beside it, the same study under the roofline cost model and its real-time check under load.
CAPACITY = Path("..") / "capacity.json"
ROOFLINE = "capacity_roofline.json"
LOAD_CHECK = "capacity_validation.json"

#: The README's reply length.
README_TOKENS = 256
#: The service level the README's users line reads.
README_SLO = "reading"
#: The rows listed mode by mode: the edge modes, and cloud decoding (bench.grid's
#: ``CLOUD_DECODING``: the default verifier behind an edge with ``draft = "none"``).
LISTED_ROLES = ("edge", "cloud decoding")
#: Roles of the grid's rows (``role``), and the modes of the two chosen rows.
BEST_CLOUD_SD = "best cloud-sd"
BEST_EDGE = "best edge"
AR = "ar"


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and math.isclose(float(a), b, rel_tol=1e-6, abs_tol=1e-9)


def ci(v: Any) -> str:
    """An interval ``[low, high]`` as "[lo–hi]"; "" for none."""
    if not isinstance(v, (list, tuple)) or len(v) != 2 or None in v:
        return ""
    return f" [{v[0]:.2f}–{v[1]:.2f}]"


def times(value: Any, interval: Any = None) -> str:
    """A speed-up with its interval: "1.92× [1.84–2.01]"."""
    return "–" if value is None else f"{value:.2f}×{ci(interval)}"


def claim(interval: Any) -> str:
    """The word a ratio's 95 % interval allows against 1: "≥" only where its low end is ≥ 1,
    "<" where its high end is below 1, "≈" (not told apart) otherwise; "?" without one."""
    if not isinstance(interval, (list, tuple)) or len(interval) != 2 or None in interval:
        return "?"
    low, high = interval
    if low >= 1:
        return "≥"
    if high < 1:
        return "<"
    return "≈"


def _uplink(r: dict[str, Any]) -> str:
    """A row's uplink bytes a round, the branch frames' share of them in brackets."""
    return f"{num(r.get('uplink_bytes_per_round'), 0)} ({num(r.get('branch_bytes_per_round'), 0)})"


def share(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.0f} %"


def _rtt(v: Any) -> str:
    return f"{float(v):g}"


class Results:
    """The grid's ``results.json`` and the capacity study, read once."""

    def __init__(
        self,
        data: dict[str, Any],
        capacity: dict[str, Any] | None,
        path: str,
        roofline: dict[str, Any] | None = None,
        load_check: dict[str, Any] | None = None,
    ) -> None:
        self.data = data
        self.capacity = capacity
        self.roofline = roofline
        self.load_check = load_check
        self.path = path
        self.rows: list[dict[str, Any]] = list(data["summary"])

    @classmethod
    def load(cls, path: Path, capacity: Path | None = None) -> Results:
        """``path``: the grid's results.json; ``capacity``: the capacity study (default
        :data:`CAPACITY` beside it; absent: no capacity sections)."""
        cap_path = capacity if capacity is not None else (path.parent / CAPACITY).resolve()

        def read(p: Path) -> dict[str, Any] | None:
            out: dict[str, Any] | None = orjson.loads(p.read_bytes()) if p.exists() else None
            return out

        folder = path.resolve().parent
        shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
        return cls(
            orjson.loads(path.read_bytes()),
            read(cap_path),
            str(shown),
            read(cap_path.parent / ROOFLINE),
            read(cap_path.parent / LOAD_CHECK),
        )

    # ------------------------------------------------------------------ rows

    def at(
        self,
        tokens: int,
        cost: float = CLOUD_DRAFT_PER_VERIFY,
        batch: float = DRAFT_BATCH_COST,
    ) -> list[dict[str, Any]]:
        """The rows of one reply length, cloud draft cost and edge batch cost."""
        return [
            r
            for r in self.rows
            if r.get("reply_tokens") == tokens
            and _close(r.get("cloud_draft_cost"), cost)
            and _close(r.get("edge_batch_cost"), batch)
        ]

    @staticmethod
    def role(row: dict[str, Any]) -> str:
        """ar, best cloud-sd, best edge, or edge (every other mode)."""
        if row.get("role"):
            return str(row["role"])
        if row.get("best_cloud_sd") or row.get("mode") == BEST_CLOUD_SD:
            return BEST_CLOUD_SD
        if row.get("best_of") or row.get("mode") == BEST_EDGE:
            return BEST_EDGE
        return AR if row.get("mode") == AR else "edge"

    def by_role(self, rows: Iterable[dict[str, Any]], role: str) -> dict[float, dict[str, Any]]:
        return {float(r["rtt_ms"]): r for r in rows if self.role(r) == role}

    @staticmethod
    def rtts(rows: Iterable[dict[str, Any]]) -> list[float]:
        return sorted({float(r["rtt_ms"]) for r in rows})

    def edge_modes(self, rows: Sequence[dict[str, Any]]) -> list[str]:
        """The edge modes' labels (and cloud decoding's, the default verifier behind an edge
        that does not draft), in the rows' order."""
        out: list[str] = []
        for r in rows:
            if self.role(r) in LISTED_ROLES and r["mode"] not in out:
                out.append(str(r["mode"]))
        return out

    def lengths(self) -> list[int]:
        return sorted({int(r["reply_tokens"]) for r in self.rows})

    def other_costs(self) -> list[float]:
        return sorted(
            {
                float(r["cloud_draft_cost"])
                for r in self.rows
                if r.get("cloud_draft_cost") is not None
                and not _close(r["cloud_draft_cost"], CLOUD_DRAFT_PER_VERIFY)
            }
        )

    def other_batches(self) -> list[float]:
        return sorted(
            {
                float(r["edge_batch_cost"])
                for r in self.rows
                if r.get("edge_batch_cost") is not None
                and not _close(r["edge_batch_cost"], DRAFT_BATCH_COST)
            }
        )

    # ------------------------------------------------------------------ tables

    def choice(self, row: dict[str, Any]) -> str:
        """What a chosen row chose: the best cloud-sd its cloud draft and γ, the best edge its
        mode."""
        if self.role(row) == BEST_CLOUD_SD:
            return f"{row.get('cloud_draft')} γ={row.get('gamma')}"
        return str(row.get("mode_spec") or row.get("mode"))

    def cell(
        self, row: dict[str, Any] | None, *, vs_cloud: bool = True, chosen: bool = True
    ) -> str:
        """The figures of one row: "tok/s (× ar [lo–hi], × cloud-sd [lo–hi]) choice"."""
        if row is None:
            return "–"
        parts = [times(row.get("speedup_vs_ar"), row.get("speedup_vs_ar_ci"))]
        if vs_cloud:
            parts.append(times(row.get("speedup_vs_cloud_sd"), row.get("speedup_vs_cloud_sd_ci")))
        choice = f" {self.choice(row)}" if chosen else ""
        return f"{num(row['tokens_per_s'], 1)} ({', '.join(parts)}){choice}"

    def headline_table(self, rows: Sequence[dict[str, Any]], *, ar_ttft: bool = True) -> list[str]:
        """Per RTT: ar, the best cloud-sd, the default edge mode (what the edge daemon runs
        unless told otherwise) and the best edge mode (chosen on the tuning prompts, so on the
        measured ones it may be slower than the default); TTFT of the best cloud-sd and the
        default edge (and ar's with ``ar_ttft``)."""
        ar, sd = self.by_role(rows, AR), self.by_role(rows, BEST_CLOUD_SD)
        edge = self.by_role(rows, BEST_EDGE)
        default = {
            float(r["rtt_ms"]): r
            for r in rows
            if self.role(r) == "edge" and r.get("mode_spec") == DEFAULT_EDGE
        }
        out = [
            "| RTT ms | ar | best cloud-sd | default edge | best edge (tuning prompts) | TTFT s |",
            "|---|---|---|---|---|---|",
        ]
        for rtt in self.rtts(rows):
            a, s, d, e = ar.get(rtt), sd.get(rtt), default.get(rtt), edge.get(rtt)
            ttft = "/".join(
                num((x or {}).get("ttft_s")) for x in ((a, s, d) if ar_ttft else (s, d))
            )
            out.append(
                f"| {_rtt(rtt)} | {num((a or {}).get('tokens_per_s'), 1)} "
                f"| {self.cell(s, vs_cloud=False)} | {self.cell(d, chosen=False)} "
                f"| {self.cell(e)} | {ttft} |"
            )
        return out

    def claim_line(self, rows: Sequence[dict[str, Any]]) -> str:
        """The best edge mode against the best cloud-sd in :func:`claim`'s words, the RTTs
        grouped by word in RTT order."""
        groups: dict[str, list[str]] = {}
        for rtt, r in sorted(self.by_role(rows, BEST_EDGE).items()):
            groups.setdefault(claim(r.get("speedup_vs_cloud_sd_ci")), []).append(_rtt(rtt))
        said = "; ".join(f"{word} at {', '.join(rtts)} ms" for word, rtts in groups.items())
        return f"Best edge vs best cloud-sd: {said}."

    def modes_table(self, rows: Sequence[dict[str, Any]]) -> list[str]:
        """RTT × every edge mode: tok/s (× ar, × cloud-sd, with intervals)."""
        modes = self.edge_modes(rows)
        out = ["| RTT ms | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
        for rtt in self.rtts(rows):
            by = {
                r["mode"]: r
                for r in rows
                if float(r["rtt_ms"]) == rtt and self.role(r) in LISTED_ROLES
            }
            cells = []
            for m in modes:
                r = by.get(m)
                cells.append(
                    "–"
                    if r is None
                    else f"{num(r['tokens_per_s'])} ("
                    f"{times(r.get('speedup_vs_ar'), r.get('speedup_vs_ar_ci'))}, "
                    f"{times(r.get('speedup_vs_cloud_sd'), r.get('speedup_vs_cloud_sd_ci'))})"
                )
            out.append(f"| {_rtt(rtt)} | " + " | ".join(cells) + " |")
        return out

    def busy_table(self, rows: Sequence[dict[str, Any]]) -> list[str]:
        """RTT × mode: the verifier's busy seconds per 100 committed tokens."""
        named = [AR, BEST_CLOUD_SD, *self.edge_modes(rows)]
        out = ["| RTT ms | " + " | ".join(named) + " |", "|---" * (len(named) + 1) + "|"]
        for rtt in self.rtts(rows):
            here = [r for r in rows if float(r["rtt_ms"]) == rtt]
            cells = []
            for m in named:
                r = next((x for x in here if m in (self.role(x), x["mode"])), None)
                cells.append(num((r or {}).get("verifier_busy_s_per_100_tokens")))
            out.append(f"| {_rtt(rtt)} | " + " | ".join(cells) + " |")
        return out

    def predraft_table(self, rows: Sequence[dict[str, Any]]) -> list[str]:
        """Per reply length, RTT and branching mode: the share of rejections whose branch was
        ready (a hit), why the others missed, the uplink a round (branch frames included, their
        share beside it), and what the same branches would cost a cloud that drafted them
        itself beside what the edge's session costs the verifier (the fair comparison where
        branches carry the edge's gain)."""
        pre = [r for r in rows if self.role(r) == "edge" and r.get("predraft_hit_rate") is not None]
        if not pre:
            return []
        out = [
            "| tokens | RTT ms | mode | hit rate | miss: not an alternative "
            "| miss: no branch ready | uplink B / round (branches) | verifier busy s / 100 tokens "
            "| a cloud drafter's branches s / 100 tokens |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(pre, key=lambda x: (x["reply_tokens"], float(x["rtt_ms"]), x["mode"])):
            out.append(
                f"| {r['reply_tokens']} | {_rtt(r['rtt_ms'])} | {r['mode']} "
                f"| {num(r['predraft_hit_rate'])} "
                f"| {share(r.get('predraft_miss_alternative'))} "
                f"| {share(r.get('predraft_miss_none'))} "
                f"| {_uplink(r)} "
                f"| {num(r.get('verifier_busy_s_per_100_tokens'))} "
                f"| {num(r.get('branch_cloud_s_per_100_tokens'))} |"
            )
        return out

    def batch_table(self, tokens: int, batch: float) -> list[str]:
        """The rows run at edge batch cost ``batch`` beside the same modes at the GPU class."""
        cheap = self.at(tokens)
        rows = [r for r in self.at(tokens, batch=batch) if self.role(r) == "edge"]
        if not rows:
            return []
        out = [
            f"| RTT ms | mode | b = {DRAFT_BATCH_COST:.4f} | b = {batch:.2f} | hit rate "
            f"(b = {batch:.2f}) |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda x: (float(x["rtt_ms"]), x["mode"])):
            base = next(
                (x for x in cheap if x["mode"] == r["mode"] and x["rtt_ms"] == r["rtt_ms"]), None
            )
            out.append(
                f"| {_rtt(r['rtt_ms'])} | {r['mode']} | {self.cell(base, chosen=False)} "
                f"| {self.cell(r, chosen=False)} "
                f"| {num(r.get('predraft_hit_rate'))} |"
            )
        return out

    def categories_table(self) -> list[str]:
        rows = self.data.get("categories") or []
        if not rows:
            return []
        first = rows[0]
        out = [
            f"Per category at RTT {_rtt(first['rtt_ms'])} ms, {first['reply_tokens']}-token "
            "replies:",
            "",
            "| category | mode | prompts | α per token | accepted / round | tok/s | × ar "
            "| × best cloud-sd |",
            "|---|---|---|---|---|---|---|---|",
        ]
        shown: set[tuple[str, str]] = set()
        for r in rows:
            # the best edge mode is often one of the modes listed beside it: once per category
            key = (str(r["dataset"]), str(r.get("mode_spec") or r["mode"]))
            if key in shown:
                continue
            shown.add(key)
            out.append(
                f"| {r['dataset']} | {self.choice(r) if r['mode'] == BEST_EDGE else r['mode']} "
                f"| {r.get('prompts', '–')} | {num(r.get('alpha_per_token'))} "
                f"| {num(r.get('mean_accepted_per_round'))} | {num(r.get('tokens_per_s'))} "
                f"| {times(r.get('speedup_vs_ar'), r.get('speedup_vs_ar_ci'))} "
                f"| {times(r.get('speedup_vs_cloud_sd'), r.get('speedup_vs_cloud_sd_ci'))} |"
            )
        return out

    def targets_table(self) -> list[str]:
        rows = self.data.get("targets") or []
        if not rows:
            return []
        out = ["| target | measured | 95 % interval | threshold | met |", "|---|---|---|---|---|"]
        for t in rows:
            interval = ci(t.get("ci")).strip() or "–"
            met = t.get("met")
            out.append(
                f"| {t['name']} | {num(t.get('measured'))} | {interval} "
                f"| ≥ {num(t.get('threshold'))} | {'–' if met is None else num(bool(met))} |"
            )
        return out

    def capacity_tables(self) -> list[str]:
        cap = self.capacity
        if cap is None:
            return ["No capacity study (`docs/results/capacity.json`) yet."]
        out = [
            "| mode | edges | per-user tok/s p50 | p10 | p10 / p50 | TTFT p99 s | goodput tok/s "
            "| verifier busy s / 100 tokens | rejections with no branch ready "
            "| uplink B / round (branches) | a cloud drafter's branches s / 100 tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in cap.get("rows", []):
            branched = r.get("branch_cloud_s_per_100_tokens")
            out.append(
                f"| {r['mode']} | {r['edges']} | {num(r.get('per_user_tokens_per_s_p50'))} "
                f"| {num(r.get('per_user_tokens_per_s_p10'))} | {num(r.get('p10_over_p50'))} "
                f"| {num(r.get('ttft_p99_s'))} | {num(r.get('goodput_tokens_per_s'), 1)} "
                f"| {num(r.get('verifier_busy_s_per_100_tokens'))} "
                f"| {share(r.get('no_branch_ready'))} "
                f"| {_uplink(r)} "
                f"| {num(branched) if branched else '–'} |"
            )
        slos = [s["name"] for s in cap.get("slos", [])]
        if slos:
            roof = (self.roofline or {}).get("users_at_slo", {})
            out += ["", "Users one verifier serves at each service level (linear cost model"]
            out[-1] += "; roofline beside it, `capacity_roofline.json`):" if roof else "):"
            out += [""]
            heads = [self.slo_name(s) for s in slos]
            heads += [f"{s}, roofline" for s in slos] if roof else []
            out.append("| mode | " + " | ".join(heads) + " |")
            out.append("|---" * (len(heads) + 1) + "|")
            for mode, found in cap.get("users_at_slo", {}).items():
                cells = [num(found.get(s)) for s in slos]
                cells += [num(roof.get(mode, {}).get(s)) for s in slos] if roof else []
                out.append(f"| {mode} | " + " | ".join(cells) + " |")
            per_level = (cap.get("best_cloud_sd") or {}).get("per_level") or {}
            if per_level:
                chosen = ", ".join(f"{s}: `{spec}`" for s, spec in per_level.items())
                out += [
                    "",
                    "At each level, best cloud-sd is the candidate serving the most users there "
                    f"({chosen}; the rows above are the "
                    f"{(cap.get('headline') or {}).get('slo', README_SLO)} level's).",
                ]
        return out

    def load_check_table(self) -> list[str]:
        """The capacity study's real-time check under load (``capacity_validation.json``)."""
        doc = self.load_check
        if not doc:
            return ["No real-time check under load (`docs/results/capacity_validation.json`) yet."]
        keys = (
            ("per_user_tokens_per_s_p50", "tok/s p50"),
            ("per_user_tokens_per_s_p10", "tok/s p10"),
            ("ttft_p99_s", "TTFT p99 s"),
            ("goodput_tokens_per_s", "goodput tok/s"),
        )
        out = [
            "| mode | N | S | "
            + " | ".join(f"{t} measured → simulated (sim/measured)" for _, t in keys)
            + " | overruns |",
            "|---|---|---|" + "---|" * len(keys) + "---|",
        ]
        for r in doc.get("rows", []):
            cells = []
            for k, _ in keys:
                ratio = (r.get("ratio") or {}).get(k) or {}
                mark = "" if (r.get("within_15pct") or {}).get(k) else " ✗"
                cells.append(
                    f"{num((r.get('measured') or {}).get(k))} → "
                    f"{num((r.get('simulated') or {}).get(k))} "
                    f"({times(ratio.get('value'), ratio.get('ci'))}){mark}"
                )
            o = r.get("overruns") or {}
            over = (
                f"draft {o.get('edge_draft_overruns', 0)}/{o.get('edge_draft_steps', 0)}, "
                f"verifier {o.get('verifier_target_overruns', 0)}"
                f"/{o.get('verifier_target_forwards', 0)}"
            )
            out.append(
                f"| {r['mode']} | {r['edges']} | {num(r.get('time_scale'), 0)} | "
                + " | ".join(cells)
                + f" | {over} |"
            )
        return out

    def slo_terms(self, name: str) -> str:
        """A service level's terms: "p10 ≥ 5 tok/s, p99 TTFT ≤ 1.5 s"."""
        for s in (self.capacity or {}).get("slos", []):
            if s["name"] == name:
                return (
                    f"p10 ≥ {s['min_tokens_per_s_p10']:g} tok/s, p99 TTFT ≤ "
                    f"{s['max_ttft_p99_s']:g} s"
                )
        return name

    def slo_name(self, name: str) -> str:
        """A service level by its name and terms: "reading (p10 ≥ 5 tok/s, p99 TTFT ≤ 1.5 s)"."""
        terms = self.slo_terms(name)
        return name if terms == name else f"{name} ({terms})"

    def users_line(self) -> str:
        cap = self.capacity
        if cap is None:
            return "Users per verifier: no capacity study yet."
        users = {m: v.get(README_SLO) for m, v in cap.get("users_at_slo", {}).items()}
        listed = ", ".join(f"{m} {num(n)}" for m, n in users.items())
        line = f"Users per verifier at {self.slo_terms(README_SLO)}: {listed}"
        roof = (self.roofline or {}).get("users_at_slo", {})
        if roof:
            shown = ", ".join(f"{m} {num(v.get(README_SLO))}" for m, v in roof.items())
            line += f" (roofline costs: {shown})"
        return line + "."

    def validation_table(self) -> list[str]:
        rows = self.data.get("validation") or []
        if not rows:
            return ["No real-time validation run in this results file."]
        out = [
            "| mode | RTT ms | runs | tok/s measured → simulated (sim/measured) "
            "| decode tok/s | TTFT s |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            cells = []
            for key, suffix in (("tokens_per_s", ""), ("decode_tokens_per_s", "_decode"),
                                ("ttft_s", "_ttft")):  # fmt: skip
                ratio = r.get(f"sim_over_measured{suffix}")
                cells.append(
                    f"{num(r.get(f'measured_{key}'))} → {num(r.get(f'sim_{key}'))} "
                    f"({times(ratio, r.get(f'sim_over_measured{suffix}_ci'))})"
                )
            out.append(
                f"| {r['mode']} | {_rtt(r['rtt_ms'])} | {r.get('runs', '–')} | "
                + " | ".join(cells)
                + " |"
            )
        return out

    # ------------------------------------------------------------------ sections

    def caption(
        self, tokens: int, cost: float = CLOUD_DRAFT_PER_VERIFY, *, ar_ttft: bool = True
    ) -> str:
        return (
            f"{tokens}-token replies, c = {cost:.2f}: tok/s (× ar, × best cloud-sd; 95 % CI); "
            f"TTFT {'ar/' if ar_ttft else ''}sd/default edge:"
        )

    def readme_section(self) -> str:
        rows = self.at(README_TOKENS)
        return "\n".join(
            [
                "Simulated, " + self.caption(README_TOKENS, ar_ttft=False),
                "",
                *self.headline_table(rows, ar_ttft=False),
                "",
                self.users_line(),
            ]
        )

    def page_section(self) -> str:
        parts: list[str] = []
        for tokens in self.lengths():
            rows = self.at(tokens)
            parts += [
                f"### {tokens}-token replies",
                "",
                self.caption(tokens),
                "",
                *self.headline_table(rows),
                "",
                self.claim_line(rows),
                "",
                "Every edge mode:",
                "",
                *self.modes_table(rows),
                "",
            ]
        top = max(self.lengths(), default=README_TOKENS)
        for cost in self.other_costs():
            rows = self.at(top, cost=cost)
            parts += [
                f"### Cloud draft step c = {cost:.2f}",
                "",
                self.caption(top, cost),
                "",
                *self.headline_table(rows),
                "",
                self.claim_line(rows),
                "",
            ]
        for batch in self.other_batches():
            parts += [
                f"### Edge batch cost b = {batch:.2f}",
                "",
                f"{top}-token replies, each extra branch of a batched draft step at {batch:.2f} "
                f"of a step (this CPU) against {DRAFT_BATCH_COST:.4f} (GPU class):",
                "",
                *self.batch_table(top, batch),
                "",
            ]
        rows = self.at(top)
        parts += [
            "### Verifier busy seconds per 100 committed tokens",
            "",
            *self.busy_table(rows),
            "",
        ]
        pre = self.predraft_table([r for n in self.lengths() for r in self.at(n)])
        if pre:
            parts += ["### Branches ready at a rejection", "", *pre, ""]
        cats = self.categories_table()
        if cats:
            parts += ["### Categories", "", *cats, ""]
        targets = self.targets_table()
        if targets:
            parts += ["### Targets", "", *targets, ""]
        parts += ["### Edges per verifier", "", *self.capacity_tables(), ""]
        parts += ["### The capacity study's check under load", "", *self.load_check_table(), ""]
        parts += ["### Validation against the real-time run", "", *self.validation_table()]
        return "\n".join(parts)


# ------------------------------------------------------------------------------ figures in prose

#: A figure in prose and its source: the number, then ``<!-- fig FILE PATH [×100] -->``
#: (FILE relative to docs/results/; PATH as :func:`resolve` reads it; ``×100`` for a percent).
FIGURE = re.compile(
    r"(?P<num>-?[0-9][0-9,]*(?:\.[0-9]+)?)(?P<unit> ?[×%]?)"
    r"<!--\s*fig\s+(?P<file>\S+)\s+(?P<path>.+?)(?:\s+(?P<scale>×100))?\s*-->"
)
#: The pages whose prose figures are checked.
PROSE = ("README.md", "docs")
RESULTS_DIR = Path("docs") / "results"
_SELECT = re.compile(r"^(?P<key>[^\[]*)\[(?P<cond>[^\]]+)\]$")


def _segments(path: str) -> list[str]:
    """``a."b c".d[k=v,j=w]`` → ``['a', 'b c', 'd[k=v,j=w]']`` (dots inside quotes or brackets
    do not split)."""
    out, cur, quoted, depth = [], "", False, 0
    for ch in path:
        if ch == '"':
            quoted = not quoted
        elif ch == "[" and not quoted:
            depth += 1
            cur += ch
        elif ch == "]" and not quoted:
            depth -= 1
            cur += ch
        elif ch == "." and not quoted and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def resolve(doc: Any, path: str) -> Any:
    """The value at ``path`` in a results document: keys joined by dots (quoted where they
    hold spaces or dots), a list's element by its index (``rows.3``) or by its first element
    whose fields equal the given ones (``rows[mode=auto predraft,edges=64]``). KeyError where
    nothing is there."""
    value = doc
    for seg in _segments(path):
        m = _SELECT.match(seg)
        key, cond = (m["key"], m["cond"]) if m else (seg, None)
        if key:
            if isinstance(value, list):
                value = value[int(key)]
            elif isinstance(value, dict) and key in value:
                value = value[key]
            else:
                raise KeyError(f"{key!r} not in {path!r}")
        if cond is not None:
            want = dict(c.split("=", 1) for c in cond.split(","))
            found = [
                x
                for x in value
                if all(str(x.get(k)).removesuffix(".0") == v for k, v in want.items())
            ]
            if not found:
                raise KeyError(f"no element with {cond} in {path!r}")
            value = found[0]
    return value


def as_read(text: str) -> str:
    """``text`` as a reader sees it: each figure without its source marker."""
    return FIGURE.sub(lambda m: m["num"] + m["unit"], text)


def check_figures(root: Path | None = None, *, fix: bool = False) -> list[str]:
    """Every prose figure of :data:`PROSE` under ``root`` (default :data:`ROOT`) against its
    source: one line per figure whose number is not its source's value rounded as written, or
    whose source is missing. ``fix``: rewrite each wrong number as its source's value, to the
    places written (the words around it are the author's to re-read: the lines are still
    returned)."""
    root = ROOT if root is None else root
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    cache: dict[Path, Any] = {}
    bad: list[str] = []
    for page in pages:
        if not page.exists():
            continue
        text = page.read_text()

        def check(m: re.Match[str], text: str = text, page: Path = page) -> str:
            lineno = text.count("\n", 0, m.start()) + 1
            where = f"{page.relative_to(root)}:{lineno}: {m['num']}{m['unit']}"
            src = root / RESULTS_DIR / m["file"]
            try:
                if src not in cache:
                    cache[src] = orjson.loads(src.read_bytes())
                value = float(resolve(cache[src], m["path"].strip()))
            except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
                bad.append(f"{where}: {m['file']} {m['path']}: {e}")
                return m[0]
            shown = m["num"].replace(",", "")
            if m["scale"]:
                value *= 100.0
            places = len(shown.partition(".")[2])
            if round(value, places) == float(shown) or f"{value:.{places}f}" == shown:
                return m[0]
            bad.append(f"{where}: {m['file']} {m['path']} is {value:.{places + 2}f}")
            num = f"{value:,.{places}f}" if "," in m["num"] else f"{value:.{places}f}"
            return num + m[0][len(m["num"]) :]

        new = FIGURE.sub(check, text)
        if fix and new != text:
            page.write_text(new)
    return bad


def main(argv: list[str] | None = None) -> int:
    p = study_parser("publish", __doc__, paragraph=True)
    p.add_argument("results", type=Path, help="the grid's results.json (python -m bench grid)")
    p.add_argument(
        "--capacity",
        type=Path,
        default=None,
        help="the capacity study (default: ../capacity.json beside results.json)",
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    p.add_argument(
        "--fix-figures",
        action="store_true",
        help="rewrite each stale prose figure as its source's value (then re-read its sentence)",
    )
    args = p.parse_args(argv)
    res = Results.load(args.results, args.capacity)
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
    wrong = check_figures(fix=args.fix_figures and not args.check)
    for line in wrong:
        print(f"{'rewrote' if args.fix_figures else 'stale'} figure: {line}")
    return 1 if (args.check and stale) or (wrong and not args.fix_figures) else 0


if __name__ == "__main__":
    sys.exit(main())
