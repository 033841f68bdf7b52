"""Every study and publishing tool of the benchmark, declared once: what ``python -m bench`` lists
and runs, and the table of docs/benchmarks/index.md (``python -m bench --write-docs`` rewrites
it from here).

A study is one module of :mod:`bench.studies` with ``main(argv) -> int``; it writes one results
file (or folder). Times are this 2-core machine's, as the page or the results file gives them
(``est.``: no run records one; reckoned from the study's defaults).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from bench.lib.pages import BENCH_PAGE, replace_between

#: The marker of the studies' table in :data:`bench.lib.pages.BENCH_PAGE`.
DOCS_MARKER = "studies"


@dataclass(frozen=True)
class Study:
    """One entry of ``python -m bench``: ``name`` runs ``module``'s ``main``."""

    name: str
    module: str
    measures: str
    time: str  # on this 2-core machine, "~N min"
    writes: str  # the results file (or folder) at its default or published path
    page: str  # the docs page that gives its command, from the repository root
    kind: str = "study"  # or "publishing": rewrites pages from committed results

    def main(self) -> Callable[[list[str]], int]:
        """The module's ``main`` (the module imported now: a study's imports are heavy)."""
        return cast(Callable[[list[str]], int], importlib.import_module(self.module).main)


BENCH = "docs/benchmarks/index.md"
EARLIER = "docs/benchmarks/earlier.md"  # the real-time runs that set the defaults
VERIFIER = "docs/benchmarks/verifier.md"
RELIABILITY = "docs/reliability.md"

STUDIES: tuple[Study, ...] = (
    Study("traces", "bench.studies.traces", "acceptance traces of the real target and draft: "
          "the simulation's input", "~17 min", "docs/results/bench/traces.json.gz", BENCH),
    Study("grid", "bench.studies.grid", "the users' grid: whole replies per mode, RTT and "
          "length, simulated, with paired 95 % intervals", "~8 min",
          "docs/results/bench/results.json", BENCH),
    Study("capacity", "bench.studies.capacity", "edges per verifier: N users sharing one "
          "verifier GPU, simulated, users served at each service level", "~21 min",
          "docs/results/capacity.json", BENCH),
    Study("capacity_validation", "bench.studies.capacity_validation", "N users in real time "
          "on one padded verifier against the simulation of the same users", "~35 min (est.)",
          "docs/results/capacity_validation.json", "bench/studies/capacity_validation.py"),
    Study("realtime", "bench.studies.realtime", "the product in real time over an emulated WAN "
          "against its baselines: the simulation's check", "~30 min",
          "docs/results/bench/real/", BENCH),
    Study("ttft", "bench.studies.ttft", "time to first token and to a whole reply through the "
          "daemon, warm link against cold, and requests at once", "~60 min",
          "docs/results/ttft.json", BENCH),
    Study("draft_batch", "bench.studies.draft_batch", "what a batched draft step of B branches "
          "costs on this CPU", "~1 min (est.)", "docs/results/draft_batch.json", EARLIER),
    Study("tree_cost", "bench.studies.tree_cost", "what N tree tokens add to a verify forward "
          "on this CPU", "~1 min (est.)", "docs/results/tree_cost.json", EARLIER),
    Study("gpu", "bench.studies.gpu", "the GPU-class costs the benchmark emulates, on a CUDA "
          "device", "CUDA only", "docs/results/gpu_costs.json", "docs/benchmarks/costs.md"),
    Study("verifier_load", "bench.studies.verifier_load", "N concurrent sessions on one "
          "verifier: the batched engine against the serial one", "~3 min (est.)",
          "docs/results/verifier_load.json", VERIFIER),
    Study("overload", "bench.studies.overload", "offered load against one verifier: goodput, "
          "failures and recovery as sessions grow", "~5 min", "docs/results/overload.json",
          VERIFIER),
    Study("tenants", "bench.studies.tenants", "one bearer token's long prompts beside honest "
          "sessions: the honest rounds' goodput and p99", "~8 min",
          "docs/results/overload_tenants.json", VERIFIER),
    Study("overhead", "bench.studies.overhead", "the verifier's per-round overhead beside "
          "its model forward", "~1 min (est.)", "stdout", VERIFIER),
    Study("prefix", "bench.studies.prefix", "prefix cache on and off: a conversation's turns "
          "and a shared system prompt", "~2 min (est.)", "docs/results/prefix_cache.json",
          "docs/how-it-works/engine.md"),
    Study("federate", "bench.studies.federate", "SpecFed with real models: compression error, "
          "aggregation bias, acceptance", "~5 min", "docs/results/federated.json",
          "docs/benchmarks/federated.md"),
    Study("reliability", "bench.studies.reliability", "chaos: generations through lost "
          "connections, verifier restarts and stalls, texts checked", "~15 min",
          "bench/out/reliability.json", RELIABILITY),
    Study("load", "bench.studies.load", "load held: 64 sessions with churn through the WAN "
          "emulator, texts, reconnects and memory checked", "~1 min",
          "bench/out/load.json", RELIABILITY),
    Study("publish", "bench.publish.tables", "the README's and the benchmark page's tables "
          "from the committed results; prose figures checked", "< 1 min",
          "README.md, docs/benchmarks/index.md", BENCH, "publishing"),
    Study("figures", "bench.publish.figures", "the pictures of the committed results "
          "(tok/s against RTT, users against N, a reply's timeline)", "< 1 min",
          "docs/img/*.png", "bench/publish/figures.py", "publishing"),
)  # fmt: skip


def find(name: str) -> Study | None:
    return next((s for s in STUDIES if s.name == name), None)


def table() -> str:
    """The listing ``python -m bench`` prints: one line per entry, studies first."""
    width = max(len(s.name) for s in STUDIES)
    lines = ["usage: python -m bench STUDY [its args]   (STUDY --help: its options)", ""]
    for kind, title in (("study", "studies"), ("publishing", "publishing tools")):
        lines.append(f"{title}:")
        for s in (s for s in STUDIES if s.kind == kind):
            lines.append(f"  {s.name:<{width}}  {s.measures}")
            lines.append(f"  {'':<{width}}  {s.time} here; writes {s.writes}")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def markdown() -> str:
    """The studies' table of the benchmark page (between its ``studies`` markers)."""
    rows = [
        "| `python -m bench …` | what it measures | time here | writes |",
        "|---|---|---|---|",
    ]
    for s in STUDIES:
        rows.append(f"| `{s.name}` | {s.measures} | {s.time} | {_files(s.writes)} |")
    return "\n".join(rows)


def _files(writes: str) -> str:
    """``writes`` with each path in code font (``stdout`` is no path)."""
    return ", ".join(f"`{w}`" if "/" in w or "." in w else w for w in writes.split(", "))


def write_docs(page: Path = BENCH_PAGE) -> bool:
    """Rewrite the page's table from :data:`STUDIES`; True when it changed."""
    text = page.read_text()
    new = replace_between(text, DOCS_MARKER, markdown())
    if new != text:
        page.write_text(new)
    return new != text


def run(argv: Sequence[str]) -> int:
    """``python -m bench [STUDY [args]]``: no study, the listing; an unknown one, an error and
    the listing (exit 2); else the study's ``main(args)``."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print(table())
        return 0
    if args[0] == "--write-docs":
        changed = write_docs()
        print(f"{'rewrote' if changed else 'unchanged'}: {BENCH}")
        return 0
    study = find(args[0])
    if study is None:
        print(f"python -m bench: no study {args[0]!r}\n\n{table()}", file=sys.stderr)
        return 2
    return study.main()(args[1:])
