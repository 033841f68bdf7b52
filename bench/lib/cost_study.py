"""How a forward's cost grows with a size, measured on this machine: the options, the medians,
the least-squares slope and the record the draft-batch and tree-cost studies share
(:class:`CostStudy`), and the verify row with tree tokens that the tree-cost and GPU studies
time (:func:`tree_row`).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.lib.cli import study_parser
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from testkit.provenance import machine_info, provenance


@dataclass(frozen=True)
class CostStudy:
    """How a forward's cost grows with a size (a batch's branches, a verify's tree tokens):
    ``unit`` names the size, ``what`` the forward timed, ``base`` the size costs are relative
    to, ``emulated`` the bench's GPU-class slope; ``keys`` are the record's names for the
    medians, the measured slope and the emulated one."""

    unit: str
    what: str
    base: int
    emulated: float
    keys: tuple[str, str, str]

    def parser(self, name: str, doc: str | None) -> argparse.ArgumentParser:
        """The options every study takes (the target, the context, the steps, the warm-up, the
        record); the tool adds its sizes and its own."""
        p = study_parser(name, doc, paragraph=True)
        p.add_argument("--target", default="default")
        p.add_argument("--context", type=int, default=256)
        p.add_argument("--steps", type=int, default=12, help=f"measured {self.what}s per size")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--out", type=Path, default=None)
        return p

    def run(
        self,
        args: argparse.Namespace,
        sizes: list[int],
        times: Callable[[int, int, int], list[float]],
    ) -> None:
        """``times(size, steps, seed)`` for each size: ``args.warmup`` steps first, unmeasured
        (seed: the size), then the median of ``args.steps`` (seed: 100 + the size); the slope
        relative to ``base``; the record to ``args.out``."""
        median: dict[int, float] = {}
        for n in sizes:
            times(n, args.warmup, n)
            median[n] = statistics.median(times(n, args.steps, 100 + n))
            ms, per = 1000 * median[n], f"per {self.what} ({args.steps} steps)"
            print(f"{self.unit}={n}: median {ms:.1f} ms {per}", flush=True)
        fit = cost_slope(median, self.base)
        if fit is not None:
            x = self.unit if self.base == 0 else f"({self.unit} − {self.base})"
            print(
                f"cost({self.unit}) / cost({self.base}) ≈ 1 + {fit:.4f} {x} on this CPU; the "
                f"bench emulates a GPU-class device: 1 + {self.emulated:.4f} {x}"
            )
        if args.out:
            medians, measured, emulated = self.keys
            record = {
                "machine": machine_info(),
                "settings": {k: str(v) for k, v in vars(args).items()},
                medians: {str(n): median[n] for n in sizes},
                measured: fit,
                emulated: self.emulated,
                "provenance": provenance(),
            }
            args.out.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")


def cost_slope(median: dict[int, float], base: int) -> float | None:
    """The least-squares slope a of cost(n) / cost(base) = 1 + a (n − base) over the sizes
    measured (the extra cost per unit of batch or tree), or None when the first size measured
    is not ``base``."""
    sizes = list(median)
    if sizes[0] != base:
        return None
    xs = [n - base for n in sizes]
    ys = [median[n] / median[base] - 1 for n in sizes]
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / max(1, sum(x * x for x in xs))


BRANCH = 4  # tokens per branch (its first token and 3 after it)


def tree_row(slot: SlotPages, start: int, chain: list[int], extra: list[int]) -> Row:
    """The chain (its first id the last cached token), then ``extra`` in branches of
    :data:`BRANCH`, the k-th forking before chain position 1 + k mod γ."""
    ids, parents = list(chain), list(range(-1, len(chain) - 1))
    gamma = len(chain) - 1
    for k, i in enumerate(range(0, len(extra), BRANCH)):
        part = extra[i : i + BRANCH]
        parents.append(k % gamma)  # after chain token k mod γ: replaces the next one
        parents += range(len(ids), len(ids) + len(part) - 1)
        ids += part
    tree = tuple(parents) if extra else None
    return Row(slot, start, tuple(ids), len(ids), tree)
