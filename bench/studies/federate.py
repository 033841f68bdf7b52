"""SpecFed's experiment with real models: compression error, aggregation bias, acceptance.

    python -m bench federate --out bench/out            # SmolLM2 workers, ~5 minutes
    python -m bench federate --smoke --out /tmp/fed     # tiny models (CI)

Two heterogeneous workers of one tokenizer, w = ½ each: SmolLM2-135M-Instruct in fp32 and the
same model with int8 dynamic quantization of every Linear layer (torch ``quantize_dynamic``;
greedy agreement with fp32 ≈ 0.5, so the two targets really differ). The drafter is the
layer-skipped self-draft ``self:skip=12``. Prompts: GSM8K test questions (chat template).

Generation follows exact federated speculative sampling (full distributions, γ = 4) so that every
configuration is measured on the same positions: at each position the verifier scored (each draft
position and the bonus position) and for each K/|V| ∈ {0.1, 1, 10, 100}% and reconstruction
A (renormalised) and B (residual redistribution) we compute, from the full p_i:

* ε_i (mass outside worker i's top-K) and ε̄ = Σ w_i ε_i;
* the aggregation bias Δ = ‖p̂̄ − p̄‖₁ against its bound 2ε̄;
* the acceptance rate α = Σ min(p, q) of the aggregate against the draft, with p̂̄ (the paper's
  setting) and with p̄, and |Δα| against ε̄ (wanspec's acceptance uses the exact scalars p̄(x), so
  its own Δα is 0; the residual still uses p̂̄);
* bytes per committed token of the workers' FederatedReply frames at that K.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from bench.lib.cli import study_parser
from bench.lib.prompts import DATA
from edge_agent.model.lm import CausalLM
from shared.maths import compression as C
from shared.maths.sampling import SamplingParams, accept, residual, sample, transform
from shared.runtime.models import LoadedModel, load_model
from shared.wire.codec import encode
from shared.wire.messages import FederatedReply
from shared.wire.packing import WireContext
from testkit.provenance import provenance
from testkit.tiny_models import build_tiny_model

FRACTIONS = (0.001, 0.01, 0.1, 1.0)
TEMPERATURES = (0.8, 1.0, 1.2)


@dataclass
class Worker:
    name: str
    loaded: Any
    weight: float


def int8_variant(loaded: LoadedModel) -> Any:
    """A copy of ``loaded`` with int8 dynamic quantization of its Linear layers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize: Any = torch.ao.quantization.quantize_dynamic  # untyped in torch
        model = quantize(copy.deepcopy(loaded.model), {torch.nn.Linear}, dtype=torch.qint8)

    class Int8:
        pass

    out = Int8()
    out.model = model  # type: ignore[attr-defined]
    out.vocab_size = loaded.vocab_size  # type: ignore[attr-defined]
    return out


def reply_bytes(ps: list[np.ndarray], draft: list[int], k: int, vocab: int) -> int:
    """Encoded size of one worker's FederatedReply for a batch at top-k (with exact l1)."""
    dists = tuple(C.top_k(p, k) for p in ps)
    p_draft = np.array([ps[j][x] for j, x in enumerate(draft)], np.float32)
    l1 = np.zeros((len(ps), 2), np.float32)
    ctx = WireContext(vocab_size=vocab, max_k=vocab)
    return len(encode(FederatedReply(0, 0, dists, p_draft, l1), ctx))


def evaluate(
    workers: list[Worker],
    drafter: Any,
    prompts: list[list[int]],
    tokens: int,
    gamma: int,
    vocab: int,
    seed: int,
) -> dict[str, Any]:
    w = C.normalise_weights([x.weight for x in workers])
    ks = sorted({max(1, round(f * vocab)) for f in FRACTIONS})
    out: dict[str, Any] = {}
    for t in TEMPERATURES:
        params = SamplingParams(t)
        rng = np.random.default_rng(seed)
        acc: dict[tuple[int, str], dict[str, list[float]]] = {
            (k, how): {"eps": [], "bias": [], "d_alpha": [], "alpha_hat": []}
            for k in ks for how in C.RECONSTRUCTIONS
        }  # fmt: skip
        alpha_exact: list[float] = []
        bytes_by_k = dict.fromkeys(ks, 0)
        committed = 0
        accepted = drafted = 0
        for prompt in prompts:
            lms = [CausalLM(x.loaded) for x in workers]
            dlm = CausalLM(drafter)
            seq = list(prompt)
            for lm in lms:
                lm.extend(seq[:-1])
            dlm.extend(seq[:-1])
            n_new = 0
            while n_new < tokens:
                # draft γ tokens
                dlm.crop(len(seq) - 1)
                logits = dlm.extend([seq[-1]])[0]
                draft, qs = [], []
                for _ in range(gamma):
                    q = transform(logits.numpy(), params)
                    x = sample(q, rng)
                    draft.append(x)
                    qs.append(q)
                    logits = dlm.extend([x])[0]
                # the workers score seq[-1] + draft: rows for the γ draft positions + bonus
                rows = []
                for lm in lms:
                    lm.crop(len(seq) - 1)
                    rows.append(transform(lm.extend([seq[-1], *draft]).numpy(), params))
                p_bar = np.einsum("m,mjv->jv", w, np.stack(rows))
                # exact federated verification
                n_acc = 0
                for j in range(gamma):
                    if accept(
                        float(p_bar[j, draft[j]]), float(qs[j][draft[j]]), float(rng.random())
                    ):
                        n_acc += 1
                    else:
                        break
                scored = n_acc + 1  # positions the edge evaluated this round
                for j in range(scored):
                    qj = qs[j] if j < gamma else None
                    alpha_ex = float(np.minimum(p_bar[j], qj).sum()) if qj is not None else None
                    if alpha_ex is not None:
                        alpha_exact.append(alpha_ex)
                    for k in ks:
                        sparse = [C.top_k(r[j], k) for r in rows]
                        eps = float(sum(wi * d.eps for wi, d in zip(w, sparse, strict=True)))
                        for how in C.RECONSTRUCTIONS:
                            p_hat = C.aggregate([C.reconstruct(d, vocab, how) for d in sparse], w)
                            m = acc[(k, how)]
                            m["eps"].append(eps)
                            m["bias"].append(C.l1(p_hat, p_bar[j]))
                            if qj is not None and alpha_ex is not None:
                                a_hat = float(np.minimum(p_hat, qj).sum())
                                m["alpha_hat"].append(a_hat)
                                m["d_alpha"].append(abs(a_hat - alpha_ex))
                if n_acc < gamma:
                    tok = sample(residual(p_bar[n_acc], qs[n_acc]), rng)
                else:
                    tok = sample(p_bar[gamma], rng)
                new = [*draft[:n_acc], tok]
                for k in ks:
                    bytes_by_k[k] += sum(reply_bytes(list(r), draft, k, vocab) for r in rows)
                seq += new
                n_new += len(new)
                committed += len(new)
                accepted += n_acc
                drafted += gamma
        rows_out = []
        for (k, kind), m in acc.items():
            eps_bar = float(np.mean(m["eps"]))
            rows_out.append({
                "K": k, "K_over_V": k / vocab, "reconstruction": kind,
                "eps_bar": eps_bar, "bias_bar": float(np.mean(m["bias"])),
                "bias_max_over_bound": float(np.max(np.array(m["bias"])
                                                     - 2 * np.array(m["eps"]))),
                "two_eps_bar": 2 * eps_bar,
                "alpha_exact": float(np.mean(alpha_exact)),
                "alpha_hat": float(np.mean(m["alpha_hat"])),
                "d_alpha_bar": float(np.mean(m["d_alpha"])),
                "bytes_per_token": bytes_by_k[k] / committed,
                "positions": len(m["eps"]),
            })  # fmt: skip
        out[str(t)] = {
            "rows": rows_out,
            "acceptance_rate_measured": accepted / drafted,
            "tokens": committed,
        }
        print(f"T={t}: {committed} tokens, acceptance {accepted / drafted:.3f}", flush=True)
    return out


def markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# SpecFed reproduction (wanspec `bench/studies/federate.py`)\n",
        f"Workers: {meta['workers']}, w = ½ each; drafter `{meta['drafter']}`; γ = {meta['gamma']};"
        f" {meta['prompts']} GSM8K prompts × {meta['tokens']} tokens per temperature;"
        f" |V| = {meta['vocab']:,}. Means over every position the edge evaluated.\n",
        "| T | K/|V| | K | recon | ε̄ | Δ̄ (bias) | 2ε̄ | max(Δ − 2ε) | α exact | α with p̂̄ |"
        " Δα̅ | bytes/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, block in res.items():
        for r in sorted(block["rows"], key=lambda r: (r["K"], r["reconstruction"])):
            lines.append(
                f"| {t} | {r['K_over_V']:.1%} | {r['K']:,} | {r['reconstruction']} | "
                f"{r['eps_bar']:.4f} | {r['bias_bar']:.4f} | {r['two_eps_bar']:.4f} | "
                f"{r['bias_max_over_bound']:+.1e} | {r['alpha_exact']:.3f} | "
                f"{r['alpha_hat']:.3f} | {r['d_alpha_bar']:.4f} | {r['bytes_per_token']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t, block in res.items():
        for how, style in (("A", "-o"), ("B", "--s")):
            rs = sorted(
                (r for r in block["rows"] if r["reconstruction"] == how), key=lambda r: r["K"]
            )
            xs = [r["K_over_V"] * 100 for r in rs]
            axes[0].plot(xs, [r["bias_bar"] for r in rs], style, label=f"Δ̄ {how}, T={t}")
            axes[1].plot(
                [r["eps_bar"] for r in rs],
                [r["d_alpha_bar"] for r in rs],
                style,
                label=f"{how}, T={t}",
            )
        rs = sorted((r for r in block["rows"] if r["reconstruction"] == "A"), key=lambda r: r["K"])
        axes[0].plot(
            [r["K_over_V"] * 100 for r in rs],
            [r["two_eps_bar"] for r in rs],
            ":",
            color="gray",
            label=f"2ε̄, T={t}",
        )
    axes[0].set_xscale("log")
    axes[0].set_xlabel("K / |V| (%)")
    axes[0].set_ylabel("mean aggregation bias ‖p̂̄ − p̄‖₁")
    axes[0].set_title("aggregation bias vs its bound 2ε̄")
    axes[0].legend(fontsize=6, ncol=2)
    lim = max(r["eps_bar"] for b in res.values() for r in b["rows"]) * 1.05 or 1
    axes[1].plot([0, lim], [0, lim], ":", color="gray", label="Δα = ε̄")
    axes[1].set_xlabel("ε̄")
    axes[1].set_ylabel("mean |Δα|")
    axes[1].set_title("acceptance-rate change vs ε̄")
    axes[1].legend(fontsize=6, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = study_parser("federate", None)
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            a = load_model(str(build_tiny_model(Path(tmp) / "a", vocab_size=200, seed=0)))
            b = load_model(str(build_tiny_model(Path(tmp) / "b", vocab_size=200, seed=4)))
            drafter: Any = load_model(
                str(build_tiny_model(Path(tmp) / "d", vocab_size=200, seed=1))
            )
            workers = [Worker("tiny seed 0", a, 0.5), Worker("tiny seed 4", b, 0.5)]
            prompts = [[1, 5, 9], [1, 7, 3]][: args.prompts]
            desc = "two tiny random Llamas"
            drafter_name = "tiny seed 1"
        else:
            a = load_model("default")
            workers = [
                Worker("SmolLM2-135M fp32", a, 0.5),
                Worker("SmolLM2-135M int8-dynamic", int8_variant(a), 0.5),
            ]
            drafter = load_model("self:skip=12", base=a)
            drafter_name = "self:skip=12"
            desc = "SmolLM2-135M-Instruct fp32 + the same with int8 dynamic quantization"
            tok: Any = a.tokenizer
            prompts = []
            with open(DATA / "gsm8k_subset.jsonl") as f:
                for line in list(f)[: args.prompts]:
                    ids = tok.apply_chat_template(
                        [{"role": "user", "content": json.loads(line)["question"]}],
                        add_generation_prompt=True,
                    )
                    prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        vocab = int(a.vocab_size)
        res = evaluate(workers, drafter, prompts, args.tokens, args.gamma, vocab, args.seed)
    meta = {
        "workers": desc,
        "drafter": drafter_name,
        "gamma": args.gamma,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "vocab": vocab,
        "wall_s": round(time.time() - t0, 1),
    }
    (args.out / "federated.json").write_bytes(
        orjson.dumps(
            {"meta": meta, "results": res, "provenance": provenance()},
            option=orjson.OPT_INDENT_2,
        )
    )
    (args.out / "federated.md").write_text(markdown(res, meta))
    plot(res, args.out / "federated.png")
    print(f"wrote {args.out / 'federated.md'}, federated.json, federated.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
