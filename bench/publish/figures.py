"""The pictures of the published pages, drawn from the committed results (none from a new run
but the timeline, which simulates one reply):

    python -m bench figures            # docs/img/*.png from docs/results/

* ``tokens_vs_rtt.png``: per mode, whole-reply tok/s against RTT (256-token replies, the
  measured cloud draft cost, the GPU-class edge batch cost), and each edge mode's speed over
  best cloud-sd with its 95 % interval (``docs/results/bench/results.json``);
* ``users_vs_n.png``: per mode, per-user tok/s p10 and TTFT p99 against the users sharing one
  verifier, the reading level's bounds drawn in, and the users each mode serves at each level
  under the linear and the roofline cost model (``docs/results/capacity.json``,
  ``capacity_roofline.json``);
* ``round_timeline.png``: the first seconds of one reply in the simulation (auto predraft,
  RTT 100 ms, one user, a GSM8K prompt): the edge's draft steps and pre-drafted branches, the
  batches it sends, the verifier's rows (verifications, co-generation), the verdicts that
  reject and the branches taken.

Matplotlib (the ``dev`` extra), headless.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.cells import BANDWIDTH_BPS
from bench.lib.cli import study_parser
from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST, TREE_TOKEN_COST
from bench.lib.sim import Costs, Link, Request, SimEvent, SimMode, simulate
from bench.lib.traces import load_traces

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
OUT = REPO / "docs" / "img"
#: The reply length and RTT of the timeline.
TIMELINE_RTT_S = 0.1
TIMELINE_SECONDS = 2.5
MODES_SHOWN = ("ar", "best cloud-sd", "auto", "auto predraft", "hybrid", "hybrid predraft")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    """Title the figure with what its figures are and where they come from; write it."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tokens_vs_rtt(results: dict[str, Any], path: Path, tokens: int = 256) -> None:
    """tok/s against RTT per mode, and the edge modes over best cloud-sd with intervals."""
    plt = _plt()
    rows = [
        r
        for r in results["summary"]
        if r["reply_tokens"] == tokens
        and r["cloud_draft_cost"] == CLOUD_DRAFT_PER_VERIFY
        and r.get("edge_batch_cost") in (None, DRAFT_BATCH_COST)
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("tab10")
    labels = [m for m in MODES_SHOWN if any(r["mode"] == m for r in rows)]
    for i, mode in enumerate(labels):
        pts = sorted((r["rtt_ms"], r) for r in rows if r["mode"] == mode)
        xs = [x for x, _ in pts]
        style: dict[str, Any] = {"marker": "o", "color": cmap(i), "label": mode}
        if mode in ("ar", "best cloud-sd"):
            style.update(color="black", linestyle="--" if mode == "ar" else ":", marker="s")
        left.plot(xs, [r["tokens_per_s"] for _, r in pts], **style)
        if mode in ("ar", "best cloud-sd"):
            continue
        mid = [r["speedup_vs_cloud_sd"] for _, r in pts]
        ci = [r["speedup_vs_cloud_sd_ci"] for _, r in pts]
        err = [[m - c[0] for m, c in zip(mid, ci, strict=True)],
               [c[1] - m for m, c in zip(mid, ci, strict=True)]]  # fmt: skip
        right.errorbar(xs, mid, yerr=err, capsize=3, **style)
    left.set_ylim(bottom=0)
    left.set_title(f"whole {tokens}-token reply, tok/s (simulated)", fontsize=10)
    right.axhline(1.0, color="black", linestyle=":", linewidth=1)
    right.set_title("× best cloud-sd (95 % interval, paired by prompt)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("RTT (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(
        plt,
        fig,
        path,
        "Emulated: PicoSpec's Llama 1B/70B step costs, an H200's batching; real models' "
        "acceptance (docs/results/bench/results.json)",
    )


def users_vs_n(capacity: dict[str, Any], roofline: dict[str, Any] | None, path: Path) -> None:
    """p10 tok/s and p99 TTFT against N per mode (the reading level drawn in), and users per
    verifier at each level under each cost model."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cmap = plt.get_cmap("tab10")
    reading = next(s for s in capacity["slos"] if s["name"] == "reading")
    modes = [m for m in MODES_SHOWN if any(r["mode"] == m for r in capacity["rows"])]
    for i, mode in enumerate(modes):
        pts = sorted((r["edges"], r) for r in capacity["rows"] if r["mode"] == mode)
        xs = [x for x, _ in pts]
        style: dict[str, Any] = {"marker": "o", "color": cmap(i), "label": mode}
        if mode in ("ar", "best cloud-sd"):
            style.update(color="black", linestyle="--" if mode == "ar" else ":", marker="s")
        axes[0].plot(xs, [r["per_user_tokens_per_s_p10"] for _, r in pts], **style)
        axes[1].plot(xs, [r["ttft_p99_s"] for _, r in pts], **style)
    axes[0].axhline(reading["min_tokens_per_s_p10"], color="red", linewidth=1)
    axes[1].axhline(reading["max_ttft_p99_s"], color="red", linewidth=1)
    axes[0].set_title("per-user tok/s, 10th percentile (red: the reading level)", fontsize=9)
    axes[1].set_title("TTFT p99, s (red: the reading level)", fontsize=9)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("users sharing one verifier (N)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylim(bottom=0)
    studies = [("linear", capacity), *([("roofline", roofline)] if roofline else [])]
    levels = [s["name"] for s in capacity["slos"]]
    bars = [(model, level) for model, _ in studies for level in levels]
    width = 0.8 / len(bars)
    for j, (model, level) in enumerate(bars):
        doc = dict(studies)[model]
        found = doc["users_at_slo"]
        axes[2].bar(
            [k + j * width for k in range(len(modes))],
            [found.get(m, {}).get(level, 0) for m in modes],
            width,
            label=f"{level}, {model} costs",
        )
    axes[2].set_xticks([k + 0.4 - width / 2 for k in range(len(modes))])
    axes[2].set_xticklabels(modes, rotation=25, ha="right", fontsize=7)
    axes[2].set_title("users one verifier serves at a service level", fontsize=9)
    axes[2].legend(fontsize=7)
    axes[2].grid(alpha=0.3, axis="y")
    _save(
        plt,
        fig,
        path,
        "Simulated, RTT 100 ms, 256-token replies (docs/results/capacity.json, "
        "capacity_roofline.json)",
    )


def timeline_events(traces_path: Path, prompt: str = "gsm8k") -> list[SimEvent]:
    """One reply of ``auto predraft`` at RTT 100 ms, alone on the verifier, simulated with an
    observer: its events in virtual time."""
    traces = load_traces(traces_path).measured()
    trace = next(t for t in traces if t.dataset == prompt)
    events: list[SimEvent] = []
    costs = Costs(token_cost=TREE_TOKEN_COST, draft_batch_cost=DRAFT_BATCH_COST)
    simulate(
        SimMode.parse("auto:predraft"),
        [[Request(trace, 256)]],
        costs,
        Link(TIMELINE_RTT_S, BANDWIDTH_BPS),
        observe=events.append,
    )
    return events


def round_timeline(
    events: Sequence[SimEvent], path: Path, seconds: float = TIMELINE_SECONDS
) -> None:
    """Swimlanes of one reply: the edge's drafting, its batches up, the verifier's rows, the
    verdicts down (rejections marked) and the branches taken."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 3.6))
    lanes = {"edge drafts": 3, "batches sent": 2, "verifier": 1, "verdicts": 0}
    colors = {
        "draft": "tab:blue",
        "branch": "tab:purple",
        "verify": "tab:green",
        "cogenerate": "tab:orange",
        "prefill": "tab:gray",
    }
    shown = [e for e in events if e.t <= seconds]
    for e in shown:
        if e.what in ("draft", "branch"):
            ax.broken_barh([(e.t, e.end - e.t)], (lanes["edge drafts"] - 0.3, 0.6),
                           color=colors[e.what])  # fmt: skip
        elif e.what == "verify":
            ax.broken_barh([(e.t, e.end - e.t)], (lanes["verifier"] - 0.3, 0.6),
                           color=colors.get(e.kind, "tab:gray"), edgecolor="white")  # fmt: skip
        elif e.what == "propose":
            ax.plot([e.t], [lanes["batches sent"]], marker="^", color="black", markersize=5)
            if e.n:
                ax.annotate(str(e.n), (e.t, lanes["batches sent"] + 0.15), fontsize=6)
        elif e.what == "round":
            rejected = e.k < e.n
            ax.plot([e.t], [lanes["verdicts"]], marker="x" if rejected else "v",
                    color="red" if rejected else "black", markersize=6)  # fmt: skip
        elif e.what == "hit":
            ax.plot([e.t], [lanes["edge drafts"] + 0.45], marker="*", color="tab:purple")
    ax.set_yticks(list(lanes.values()))
    ax.set_yticklabels(list(lanes))
    ax.set_xlim(0, seconds)
    ax.set_xlabel("seconds since the request (virtual time)")
    handles = [plt.Line2D([], [], color=c, linewidth=6, label=k) for k, c in colors.items()] + [
        plt.Line2D([], [], color="black", marker="^", linestyle="", label="batch sent (γ)"),
        plt.Line2D([], [], color="red", marker="x", linestyle="", label="verdict: rejection"),
        plt.Line2D([], [], color="black", marker="v", linestyle="", label="verdict: accepted"),
        plt.Line2D(
            [], [], color="tab:purple", marker="*", linestyle="", label="pre-drafted branch taken"
        ),
    ]
    ax.legend(handles=handles, fontsize=6, ncol=5, loc="upper center",
              bbox_to_anchor=(0.5, -0.22))  # fmt: skip
    ax.set_title(
        "One reply, auto predraft, RTT 100 ms, alone on the verifier (simulated: bench.lib.sim)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build(results: Path = RESULTS, out: Path = OUT) -> list[Path]:
    """Every picture from the results under ``results``, into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    grid = json.loads((results / "bench" / "results.json").read_text())
    tokens_vs_rtt(grid, out / "tokens_vs_rtt.png")
    written.append(out / "tokens_vs_rtt.png")
    cap = json.loads((results / "capacity.json").read_text())
    roof_path = results / "capacity_roofline.json"
    roof = json.loads(roof_path.read_text()) if roof_path.exists() else None
    users_vs_n(cap, roof, out / "users_vs_n.png")
    written.append(out / "users_vs_n.png")
    round_timeline(
        timeline_events(results / "bench" / "traces.json.gz"), out / "round_timeline.png"
    )
    written.append(out / "round_timeline.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = study_parser("figures", __doc__)
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    p.add_argument("--out", type=Path, default=OUT, help="where the pictures go")
    args = p.parse_args(argv)
    for path in build(args.results, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
