"""Benchmark outputs: results.json (every raw figure), results.md (tables), PNG plots.

results.md: per regime, reply length and draft, a table of tokens/s and speed-up vs ``ar`` (RTT ×
mode), then the details of every row (TTFT, acceptance, bytes, ceiling). Plots, of the longest
replies: ``tokens_per_s_vs_rtt.png`` (one panel per regime and draft, a line per mode and the
``ar`` line), ``verifier_busy_per_token.png`` and ``bytes_per_token.png``.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from testkit.provenance import provenance


def num(v: Any, digits: int = 2) -> str:
    """A figure as the tables print it; "–" for none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _modes(rows: list[dict[str, Any]]) -> list[str]:
    """Modes in the order of the summary (it is sorted: ar, assisted, then the grid's order)."""
    out: list[str] = []
    for r in rows:
        if r["mode"] not in out:
            out.append(r["mode"])
    return out


def _drafts(rows: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for r in rows:
        if r.get("draft") and r["draft"] not in out:
            out.append(r["draft"])
    return out


def _regime_title(reg: Any, scales: list[float]) -> str:
    if not reg.emulated:
        return "raw CPU"
    s = ", ".join(f"×{x:g}" for x in scales) if scales else f"×{reg.scale:g}"
    return (
        f"PicoSpec regime (emulated: draft {reg.draft_ms:g} ms/token, verify {reg.verify_ms:g} ms, "
        f"AR {reg.ar_ms:g} ms/token; time-dilated {s})"
    )


def speed_table(rows: list[dict[str, Any]], draft: str) -> list[str]:
    """RTT × mode: tokens/s (× AR) for one draft of one regime (``rows``: that regime's)."""
    ar = {r["rtt_ms"]: r for r in rows if r["mode"] == "ar"}
    sel = [r for r in rows if r.get("draft") == draft]
    modes = [m for m in _modes(sel) if m != "ar"]
    rtts = sorted({r["rtt_ms"] for r in sel})
    by = {(r["rtt_ms"], r["mode"]): r for r in sel}
    out = [
        "| RTT ms | ar tok/s | "
        + " | ".join(f"{m} tok/s (× AR, × cloud-sd)" for m in modes)
        + " |",
        "|" + "---|" * (len(modes) + 2),
    ]
    for rtt in rtts:
        cells = []
        for m in modes:
            r = by.get((rtt, m))
            cells.append(
                "–"
                if r is None
                else f"{num(r['tokens_per_s'])} ({num(r.get('speedup_vs_ar'))}, "
                f"{num(r.get('speedup_vs_cloud_sd'))})"
            )
        base = ar.get(rtt)
        out.append(
            f"| {rtt:g} | {num(base['tokens_per_s'] if base else None)} | "
            + " | ".join(cells)
            + " |"
        )
    return out


#: Short names of the token sources in the tables.
_SOURCE_ABBREV = {
    "edge_draft": "edge",
    "correction": "corr",
    "bonus": "bonus",
    "cogenerated": "cogen",
    "cloud_draft": "cloud",
    "local_draft": "local",
}


def _sources(row: dict[str, Any]) -> str:
    """The shares of the committed tokens by source, largest first ("edge 71 %, cogen 20 %")."""
    shares = row.get("token_sources")
    if not shares:
        return "–"
    parts = sorted(((v, k) for k, v in shares.items() if v > 0), reverse=True)
    return ", ".join(f"{_SOURCE_ABBREV.get(k, k)} {v:.0%}" for v, k in parts)


def detail_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| RTT ms | mode | tok/s | decode tok/s | TTFT s | × AR | × cloud-sd | "
        "verifier busy s / 100 tokens | token sources | "
        "draft acceptance | α per token | accepted/round | co-gen tok/gen | up B/round | "
        "down B/rejection | B/token | ceiling tok/s | of ceiling |",
        "|" + "---|" * 18,
    ]
    for r in rows:
        cap = num(r.get("ceiling_tokens_per_s"))
        if r.get("ceiling_approx"):
            cap += " ≈"
        out.append(
            f"| {r['rtt_ms']:g} | {r['mode']} | {num(r['tokens_per_s'])} | "
            f"{num(r['decode_tokens_per_s'])} | {num(r.get('ttft_s'))} | "
            f"{num(r.get('speedup_vs_ar'))} | {num(r.get('speedup_vs_cloud_sd'))} | "
            f"{num(r.get('verifier_busy_s_per_100_tokens'))} | {_sources(r)} | "
            f"{num(r.get('draft_acceptance'))} | {num(r.get('alpha_per_token'))} | "
            f"{num(r.get('mean_accepted_per_round'))} | "
            f"{num(r.get('cogen_tokens_per_generation'), 1)} | "
            f"{num(r.get('uplink_bytes_per_round'), 1)} | "
            f"{num(r.get('downlink_bytes_per_rejection'), 1)} | "
            f"{num(r.get('bytes_per_token'), 1)} | {cap} | "
            f"{num(r.get('fraction_of_ceiling'))} |"
        )
    return out


def _length_tables(reg: Any, sel: list[dict[str, Any]]) -> list[str]:
    """Per draft: the speed table and the details, for one regime's rows of one reply length."""
    out: list[str] = []
    for draft in _drafts(sel):
        mine = [r for r in sel if r.get("draft") == draft]
        scale = mine[0].get("time_scale") if mine else None
        s = f", time-dilated ×{scale:g}" if reg.emulated and scale else ""
        alpha = [r["oracle_alpha_measured"] for r in mine if r.get("oracle_alpha_measured")]
        a = f", measured α {sum(alpha) / len(alpha):.2f}" if alpha else ""
        out.append(f"##### draft `{draft}`{s}{a}\n")
        out += speed_table(sel, draft)
        out.append("")
        ar = [r for r in sel if r["mode"] == "ar" and r["rtt_ms"] in {x["rtt_ms"] for x in mine}]
        out += detail_table(sorted(ar + mine, key=lambda r: r["rtt_ms"]))
        out.append("")
    return out


def tables(rows: list[dict[str, Any]], regimes: list[Any]) -> str:
    out = []
    for reg in regimes:
        here = [r for r in rows if r["regime"] == reg.name]
        if not here:
            continue
        scales = sorted({r["time_scale"] for r in here if r.get("time_scale") is not None})
        out.append(f"### {_regime_title(reg, scales)}\n")
        for length in sorted({r.get("reply_tokens", 0) for r in here}):
            out.append(f"#### replies of {length} tokens\n")
            out += _length_tables(reg, [r for r in here if r.get("reply_tokens", 0) == length])
    if rows:
        out.append(
            "× AR: speed-up over the cloud-only autoregressive baseline at the same RTT; "
            "× cloud-sd: over cloud-only speculative decoding (the verifier drafting for itself "
            "with the draft model, no edge draft) at the same RTT. Token sources: accepted edge "
            "drafts, corrections, bonus tokens, tokens the verifier decoded (cogen) and its own "
            "accepted draft tokens (cloud). "
            "Draft acceptance: accepted / drafted tokens; α per token: accepted / (accepted + "
            "rejections), the drafts the verifier judged. ≈: an approximate ceiling (auto: at "
            "the means of γ and D); –: a mode outside the ceiling's model.\n"
        )
        out.append(
            f"Sending the full distribution instead would cost "
            f"{rows[0]['full_distribution_bytes_per_token']:,} bytes per token (|V| × 4).\n"
        )
    return "\n".join(out)


def plots(out: Path, rows: list[dict[str, Any]], regimes: list[Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max((r.get("reply_tokens", 0) for r in rows), default=0)
    rows = [r for r in rows if r.get("reply_tokens", 0) == longest]
    written = []
    panels = [
        (reg.name, draft)
        for reg in regimes
        for draft in _drafts([r for r in rows if r["regime"] == reg.name])
    ]
    if not panels:
        panels = [(reg.name, "") for reg in regimes if any(x["regime"] == reg.name for x in rows)]
    cols = min(4, max(1, len(panels)))
    nrows = -(-len(panels) // cols) if panels else 1
    # One y axis, from zero, shared by the panels that are compared.
    fig, axes = plt.subplots(
        nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False, sharey=True
    )
    colors: dict[str, Any] = {}
    cmap = plt.get_cmap("tab10")
    for ax, (name, draft) in zip(axes.flat, panels, strict=False):
        sel = [
            r
            for r in rows
            if r["regime"] == name and (r["mode"] == "ar" or r.get("draft") == draft)
        ]
        for mode in _modes(sel):
            if mode == "assisted":
                continue
            pts = sorted((r["rtt_ms"], r["tokens_per_s"]) for r in sel if r["mode"] == mode)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            if mode == "ar":
                ax.plot(xs, ys, color="black", linestyle="--", marker="s", label="ar")
                continue
            color = colors.setdefault(mode, cmap(len(colors) % 10))
            ax.plot(xs, ys, marker="o", color=color, label=mode)
        emulated = name != "raw"
        ax.set_title(
            f"{name}: {draft or 'tokens/s'}" + (" (emulated)" if emulated else ""), fontsize=10
        )
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    top = max((r["tokens_per_s"] for r in rows if r["mode"] != "assisted"), default=1.0)
    for ax in axes.flat:
        ax.set_ylim(0, 1.05 * top)  # from zero, one scale for every panel
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if any(r["regime"] != "raw" for r in rows):
        status = (
            "EMULATED: real models and real acceptance, each step padded to measured "
            "GPU-class timings (the regime in each panel's title)"
        )
    else:
        status = "MEASURED on this CPU, as it is (no padding)"
    fig.suptitle(f"tokens/s vs RTT — {status}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out / "tokens_per_s_vs_rtt.png", dpi=110)
    plt.close(fig)
    written.append("tokens_per_s_vs_rtt.png")

    written += _busy_plot(out, rows, plt)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    modes = [
        m for m in _modes(rows) if any(r["mode"] == m and r.get("bytes_per_token") for r in rows)
    ]
    vals = []
    for m in modes:
        per_row = [
            r["bytes_per_token"] for r in rows if r["mode"] == m and r.get("bytes_per_token")
        ]
        vals.append(sum(per_row) / len(per_row))
    ax.bar(modes, vals, color="tab:blue")
    if rows:
        full = rows[0]["full_distribution_bytes_per_token"]
        ax.axhline(full, color="tab:red", linestyle="--", label=f"full distribution ({full:,} B)")
    ax.set_yscale("log")
    ax.set_ylabel("protocol bytes per committed token (log)")
    ax.set_title("bytes on the wire per token, by mode (mean over drafts and RTTs)")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    fig.savefig(out / "bytes_per_token.png", dpi=110)
    plt.close(fig)
    written.append("bytes_per_token.png")
    return written


def _busy_plot(out: Path, rows: list[dict[str, Any]], plt: Any) -> list[str]:
    """The cloud's cost: verifier busy seconds per 100 committed tokens against RTT, a line
    per mode of the emulated regime's real draft (y from zero)."""
    sel = [
        r
        for r in rows
        if r["regime"] != "raw" and r.get("verifier_busy_s_per_100_tokens") is not None
    ]
    drafts = [d for d in _drafts(sel) if not d.startswith("oracle:")]
    if not sel or not drafts:
        return []
    sel = [r for r in sel if r["mode"] == "ar" or r.get("draft") == drafts[0]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in _modes(sel):
        pts = sorted(
            (r["rtt_ms"], r["verifier_busy_s_per_100_tokens"]) for r in sel if r["mode"] == mode
        )
        xs, ys = zip(*pts, strict=True)
        style = {"color": "black", "linestyle": "--"} if mode == "ar" else {}
        ax.plot(xs, ys, marker="o", label=mode, **style)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("RTT (ms)")
    ax.set_ylabel("verifier busy s per 100 tokens")
    ax.set_title(f"the cloud's GPU time per token ({drafts[0]}, emulated)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "verifier_busy_per_token.png", dpi=110)
    plt.close(fig)
    return ["verifier_busy_per_token.png"]


def write_outputs(
    out: Path,
    cfg: Any,
    regimes: list[Any],
    runs: list[Any],
    rows: list[dict[str, Any]],
    machine: dict[str, Any],
) -> None:
    pngs = plots(out, rows, regimes)
    doc = {
        "machine": machine,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(cfg).items()
            if k != "regimes"
        },
        "regimes": [asdict(r) for r in regimes],
        "summary": rows,
        "runs": [asdict(r) for r in runs],
        "plots": pngs,
        "provenance": provenance(),
    }
    (out / "results.json").write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    drafts = ", ".join(f"`{d}`" for d in cfg.drafts)
    md = [
        "# wanspec benchmark results\n",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs; torch {machine['torch']}, "
        f"transformers {machine['transformers']}; commit {machine['git_commit']}; "
        f"{machine['date']}.\n",
        f"Target `{cfg.target}`, drafts {drafts}; greedy, replies of "
        f"{' and '.join(map(str, cfg.tokens))} tokens per prompt, {cfg.prompts_per_dataset} "
        f"prompt(s) per dataset ({', '.join(cfg.datasets)}; measured split), on warm links, link "
        f"{cfg.bandwidth_mbit:g} Mbit/s each way. Modes of model drafts: "
        f"`{','.join(cfg.modes)}` at RTTs {', '.join(f'{x:g}' for x in cfg.rtts_ms)} ms; "
        f"of oracle drafts: `{','.join(cfg.oracle_modes)}` at RTTs "
        f"{', '.join(f'{x:g}' for x in cfg.oracle_rtts_ms)} ms.\n",
        tables(rows, regimes),
    ]
    (out / "results.md").write_text("\n".join(md))
