"""Benchmark outputs: results.json (every raw figure), results.md (tables), PNG plots."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

MODE_ORDER = ["ar", "assisted", "stop-and-wait", "pipelined D=1", "pipelined D=2",
              "pipelined D=4"]  # fmt: skip


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def tables(rows: list[dict[str, Any]], regimes: list[Any]) -> str:
    out = []
    for reg in regimes:
        sel = [r for r in rows if r["regime"] == reg.name]
        if not sel:
            continue
        title = (
            "raw CPU"
            if not reg.emulated
            else (
                f"PicoSpec regime (emulated: draft {reg.draft_ms:g} ms/token, verify "
                f"{reg.verify_ms:g} ms, AR {reg.ar_ms:g} ms/token; time-dilated ×{reg.scale:g})"
            )
        )
        out.append(f"### {title}\n")
        out.append(
            "| RTT ms | mode | tok/s | decode tok/s | × AR | acceptance | accepted/round | "
            "up B/round | down B/rejection | B/token | ceiling tok/s | of ceiling |"
        )
        out.append("|" + "---|" * 12)
        for r in sel:
            out.append(
                f"| {r['rtt_ms']:g} | {r['mode']} | {_fmt(r['tokens_per_s'])} | "
                f"{_fmt(r['decode_tokens_per_s'])} | {_fmt(r.get('speedup_vs_ar'))} | "
                f"{_fmt(r.get('acceptance'))} | {_fmt(r.get('mean_accepted_per_round'))} | "
                f"{_fmt(r.get('uplink_bytes_per_round'), 1)} | "
                f"{_fmt(r.get('downlink_bytes_per_rejection'), 1)} | "
                f"{_fmt(r.get('bytes_per_token'), 1)} | "
                f"{_fmt(r.get('ceiling_tokens_per_s'))} | {_fmt(r.get('fraction_of_ceiling'))} |"
            )
        out.append("")
    if rows:
        out.append(
            f"Sending the full distribution instead would cost "
            f"{rows[0]['full_distribution_bytes_per_token']:,} bytes per token (|V| × 4).\n"
        )
    return "\n".join(out)


def plots(out: Path, rows: list[dict[str, Any]], regimes: list[Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    names = [r.name for r in regimes if any(x["regime"] == r.name for x in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        sel = [r for r in rows if r["regime"] == name]
        for mode in MODE_ORDER:
            pts = sorted((r["rtt_ms"], r["tokens_per_s"]) for r in sel if r["mode"] == mode)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=mode)
        ax.set_title(f"{name}: tokens/s vs RTT" + (" (emulated)" if name != "raw" else ""))
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s_vs_rtt.png", dpi=110)
    plt.close(fig)
    written.append("tokens_per_s_vs_rtt.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    modes = [
        m for m in MODE_ORDER if any(r["mode"] == m and r.get("bytes_per_token") for r in rows)
    ]
    vals = []
    for m in modes:
        sel = [r["bytes_per_token"] for r in rows if r["mode"] == m and r.get("bytes_per_token")]
        vals.append(sum(sel) / len(sel))
    ax.bar(modes, vals, color="tab:blue")
    if rows:
        full = rows[0]["full_distribution_bytes_per_token"]
        ax.axhline(full, color="tab:red", linestyle="--", label=f"full distribution ({full:,} B)")
    ax.set_yscale("log")
    ax.set_ylabel("protocol bytes per committed token (log)")
    ax.set_title("bytes on the wire per token, by mode")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(out / "bytes_per_token.png", dpi=110)
    plt.close(fig)
    written.append("bytes_per_token.png")
    return written


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
    }
    (out / "results.json").write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    md = [
        "# wanspec benchmark results\n",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs; torch {machine['torch']}, "
        f"transformers {machine['transformers']}; commit {machine['git_commit']}; "
        f"{machine['date']}.\n",
        f"Target `{cfg.target}`, draft `{cfg.draft}`, γ = {cfg.gamma}, greedy, "
        f"{cfg.tokens} new tokens per prompt, {cfg.prompts_per_dataset} prompt(s) per dataset "
        f"(GSM8K, HumanEval), link {cfg.bandwidth_mbit:g} Mbit/s each way.\n",
        tables(rows, regimes),
    ]
    (out / "results.md").write_text("\n".join(md))
