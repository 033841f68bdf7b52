"""The GPU-class costs the benchmark emulates, in one place, and how each follows from a GPU
measurement.

The measurement they come from is committed in ``docs/results/gpu_costs.json`` (values, model
shapes, GPU, how it was made); ``python -m bench gpu`` re-measures it on a CUDA device and
writes a file of the same format; docs/benchmarks/costs.md describes the setup. The constants
below equal that file's ``costs`` (tests/system/test_bench_costs.py checks it): a new
measurement is adopted by re-running ``bench.studies.gpu`` and copying its ``measured`` figures
here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The committed measurement (relative to the repository root).
GPU_COSTS_FILE = Path("docs/results/gpu_costs.json")
#: How the docs and results files name where a cost comes from.
SOURCE = f"the H200 measurement in {GPU_COSTS_FILE} (python -m bench gpu re-measures it)"

#: Sessions in the batched verify, tokens per session (1 + γ, γ = 4).
BATCH = 8
ROW_TOKENS = 5

#: Measured on an H200 (docs/results/gpu_costs.json, ``measured``): a Qwen3-32B-shaped verify of
#: 5 tokens after a 512-token context, one session, eager and compiled; 8 sessions, eager; a
#: Qwen3-0.6B-shaped decode step, compiled. Milliseconds.
VERIFY_EAGER_B1_MS = 68.9
VERIFY_EAGER_B8_MS = 73.9
VERIFY_COMPILED_B1_MS = 24.6
DRAFT_STEP_COMPILED_MS = 2.7
MEASURED: dict[str, float] = {
    "verify_eager_b1_ms": VERIFY_EAGER_B1_MS,
    f"verify_eager_b{BATCH}_ms": VERIFY_EAGER_B8_MS,
    "verify_compiled_b1_ms": VERIFY_COMPILED_B1_MS,
    "draft_step_compiled_ms": DRAFT_STEP_COMPILED_MS,
}


def slope(median: dict[int, float], base: int) -> float:
    """The least-squares slope a of cost(n) / cost(base) = 1 + a (n − base) over the sizes in
    ``median`` (which must hold ``base``): the extra cost per unit of batch or tree."""
    xs = [n - base for n in median]
    ys = [median[n] / median[base] - 1 for n in median]
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / max(1, sum(x * x for x in xs))


def _sized(measured: dict[str, Any], prefix: str) -> dict[int, float]:
    """``{size: ms}`` of the keys ``<prefix><size>_ms`` (e.g. ``draft_batch_eager_b``)."""
    out: dict[int, float] = {}
    for k, v in measured.items():
        if k.startswith(prefix) and k.endswith("_ms") and v is not None:
            size = k.removeprefix(prefix).removesuffix("_ms")
            if size.isdigit():
                out[int(size)] = float(v)
    return dict(sorted(out.items()))


def derive(measured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The emulated costs from a measurement (``bench.studies.gpu``'s ``measured``): each a
    ``value`` and the ``basis`` it was computed from. A cost measured directly (a batched draft step
    against branches, a verify against tree tokens) is used when present; otherwise it is
    estimated from the batched verify (8 sessions × 5 tokens against 1 × 5, eager)."""
    out: dict[str, dict[str, Any]] = {}
    b1, b8 = measured.get("verify_eager_b1_ms"), measured.get(f"verify_eager_b{BATCH}_ms")
    extra = None if not (b1 and b8) else float(b8) / float(b1) - 1
    # Each cost: measured directly (a slope over sizes, the base size among them), else
    # estimated from the batched verify's extra cost spread over what the batch added.
    direct = (
        ("draft_batch_cost", "draft_batch_eager_b", 1, "B", BATCH - 1, "the extra cost of "
         "each session beyond the first in one batched forward"),
        ("tree_token_cost", "tree_eager_n", 0, "N", ROW_TOKENS * (BATCH - 1), "{n} more tokens in "
         "one forward"),
    )  # fmt: skip
    for key, prefix, base, var, spread, what in direct:
        sized = _sized(measured, prefix)
        if base in sized and len(sized) > 1:
            step = f"({var} - {base})" if base else var
            basis = f"slope of {prefix}<{var}>_ms / {prefix}{base}_ms = 1 + a {step}"
            out[key] = {"value": slope(sized, base), "basis": basis}
        elif extra is not None:
            ratio = f"(verify_eager_b{BATCH}_ms / verify_eager_b1_ms - 1) / {spread}"
            basis = f"{ratio}: {what.format(n=spread)}"
            out[key] = {"value": extra / spread, "basis": basis}
    for mode in ("compiled", "eager"):
        d, v = measured.get(f"draft_step_{mode}_ms"), measured.get(f"verify_{mode}_b1_ms")
        if d and v:
            out["cloud_draft_per_verify"] = {
                "value": float(d) / float(v),
                "basis": f"draft_step_{mode}_ms / verify_{mode}_b1_ms",
            }
            break
    return out


_COSTS = derive(MEASURED)
#: The emulated cost of each branch beyond the first in a batched draft forward, as a fraction
#: of one step (≈ 0.0104): a batched draft step of B branches costs 1 + a (B − 1) steps.
DRAFT_BATCH_COST: float = _COSTS["draft_batch_cost"]["value"]
#: The emulated cost of each token-tree token (a branch token beyond the chain) in a verify, as
#: a fraction of the verify (≈ 0.0021).
TREE_TOKEN_COST: float = _COSTS["tree_token_cost"]["value"]
#: A draft step of the verifier's own draft model, in verifies (≈ 0.11): the emulated regime
#: keeps this ratio.
CLOUD_DRAFT_PER_VERIFY: float = _COSTS["cloud_draft_per_verify"]["value"]


#: A roofline alternative to the linear cost model (capacity must not rest on one model): a
#: verify of n tokens costs OVERHEAD + max(FLOOR, n · PER_TOKEN) ms, with the memory-bound floor
#: and the compute per token from the GPU's published peaks and the target's size, and the
#: overhead what the measured one-session eager verify spends beyond that floor.
H200_PEAK_BF16_TFLOPS = 989.5  # NVIDIA H200 SXM datasheet, dense BF16 tensor core
H200_HBM_TBPS = 4.8  # NVIDIA H200 SXM datasheet, HBM3e bandwidth
TARGET_PARAMS = 32.8e9  # Qwen3-32B (its model card), the shape gpu_costs.json measured
ROOFLINE_FLOOR_MS = TARGET_PARAMS * 2 / (H200_HBM_TBPS * 1e12) * 1e3  # the bf16 weights, read once
ROOFLINE_PER_TOKEN_MS = 2 * TARGET_PARAMS / (H200_PEAK_BF16_TFLOPS * 1e12) * 1e3
ROOFLINE_OVERHEAD_MS = VERIFY_EAGER_B1_MS - ROOFLINE_FLOOR_MS
ROOFLINE_RULE = (
    "a forward of n tokens costs verify_s · (o + max(f, n · c)) / (o + f): f the memory-bound "
    "floor (the target's bf16 weights over the H200's published HBM bandwidth), c the compute per "
    "token (2 · parameters over the H200's published dense BF16 peak), o the measured "
    "one-session eager verify beyond f"
)


def roofline_ms(tokens: int) -> float:
    """A verify forward of ``tokens`` tokens under the roofline model, in ms."""
    return ROOFLINE_OVERHEAD_MS + max(ROOFLINE_FLOOR_MS, tokens * ROOFLINE_PER_TOKEN_MS)
