"""The verifier with padded forwards: ``cloud-verifier serve`` plus ``--emulate-verify-ms``.

Device-regime emulation for the benchmark (see :mod:`bench.studies.realtime`): every target forward
takes at least the given time, so a CPU target gets the timing of a cloud GPU while keeping its real
logits (and so its real acceptance). Everything else is the product's ``serve`` path, unchanged:
same settings, sources (command line, ``WANSPEC_*``, ``--config``), auth, TLS and shutdown.

    python -m bench.net.verifier --model default --token-file tokens --emulate-verify-ms 166

With ``--cloud-draft-model``, the verifier's own draft model is padded too, every draft forward
to ``--emulate-cloud-draft-ms`` (one draft token per forward after the first).

With ``--emulate-token-cost K`` the pads follow the simulation's cost rule instead of a constant
(:meth:`bench.lib.sim.Costs.forward_s`, what :mod:`bench.studies.capacity_validation` compares
against): a target forward of n tokens (its rows' ids summed) takes verify · (1 + K · (n − 5)) for n
≥ 5, interpolating to the decode pad at n = 1; a draft forward of B rows takes cloud draft ·
(1 + K · (B − 1)) (:meth:`bench.lib.sim.Costs.cloud_draft_step_s`). ``--emulate-report FILE``
writes, at exit, each padded model's forwards and the ones whose compute overran the pad.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import IO, Any

import torch

from bench.lib.costs import TREE_TOKEN_COST
from bench.lib.sim import Costs
from cloud_verifier.daemon.cli import add_serve_arguments, run_serve
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.draft_model import load_draft_target
from cloud_verifier.engine.targets import Target, load_target
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import PagedKV


class WrappedTarget:
    """A target that hands every call to ``inner`` (subclasses change :meth:`forward`)."""

    def __init__(self, inner: Target, description: str | None = None) -> None:
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.vocab_size = inner.vocab_size
        self.max_length = inner.max_length
        self.device = inner.device
        self.description = description or inner.description

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
        return self.inner.allocate(num_pages, page_size)

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
        return self.inner.forward(rows)


def tree_tokens(row: Row) -> int:
    """A row's tokens past its chain (a token tree's branches): 0 for a chain."""
    if row.parents is None:
        return 0
    chain = next((i for i, a in enumerate(row.parents) if a != i - 1), len(row.parents))
    return len(row.parents) - chain


#: A pad rule: the seconds a forward of these rows takes at least.
PadRule = Callable[[Seq[Row]], float]


def token_rule(verify_ms: float, decode_ms: float, token_cost: float) -> PadRule:
    """The simulation's rule for a target forward (:meth:`bench.lib.sim.Costs.forward_s`) of the
    rows' tokens summed: ``verify_ms`` at 5 tokens, ``decode_ms`` at 1 (0: ``verify_ms``),
    ``token_cost`` of ``verify_ms`` for each token past 5."""
    costs = Costs(
        verify_s=verify_ms / 1000.0, ar_s=(decode_ms or verify_ms) / 1000.0, token_cost=token_cost
    )
    return lambda rows: costs.forward_s(sum(len(r.ids) for r in rows))


def row_rule(step_ms: float, token_cost: float) -> PadRule:
    """The simulation's rule for a batched step of the cloud's draft model
    (:meth:`bench.lib.sim.Costs.cloud_draft_step_s`): ``step_ms`` for one row, ``token_cost`` of
    it for each row more."""
    costs = Costs(verify_s=step_ms / 1000.0, cloud_draft_per_verify=1.0, token_cost=token_cost)
    return lambda rows: costs.cloud_draft_step_s(len(rows))


class PaddedTarget(WrappedTarget):
    """Device-regime emulation: every (batched) forward takes at least ``pad_ms`` (sleeping
    the rest on the engine's thread), whatever the number of sessions in it: on a GPU a
    batch of a few sessions costs about what one does (see docs/benchmarks/verifier.md).
    Token-tree tokens are not free: each adds :data:`bench.lib.costs.TREE_TOKEN_COST` of the pad.
    ``rule`` (:func:`token_rule`, :func:`row_rule`) replaces that constant pad."""

    def __init__(
        self,
        inner: Target,
        pad_ms: float,
        decode_pad_ms: float = 0.0,
        rule: PadRule | None = None,
    ) -> None:
        how = "by the simulation's cost rule" if rule is not None else f"to {pad_ms:g} ms"
        super().__init__(inner, f"{inner.description}, forwards padded {how}")
        self.pad_s = pad_ms / 1000.0
        #: A forward whose every row is a one-token decode step (co-generation) is one step of
        #: autoregressive decoding: padded to this instead (0: pad_ms).
        self.decode_pad_s = decode_pad_ms / 1000.0 or self.pad_s
        self.rule = rule
        self.forwards = 0
        self.overruns = 0  # forwards whose compute took longer than the pad
        self.overrun_s = 0.0  # their compute beyond their pads, summed
        self.worst_overrun_s = 0.0

    def pad_for(self, rows: Seq[Row]) -> float:
        """The seconds a forward of ``rows`` takes at least."""
        if self.rule is not None:
            return self.rule(rows)
        decode = all(len(r.ids) == 1 for r in rows)
        pad = self.decode_pad_s if decode else self.pad_s
        return pad * (1 + TREE_TOKEN_COST * sum(tree_tokens(r) for r in rows))

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.forward(rows)
        rest = self.pad_for(rows) - (time.perf_counter() - t0)
        self.forwards += 1
        if rest > 0:
            time.sleep(rest)
        else:
            # The emulation is void where compute outruns the pad: say so, now and then.
            self.overruns += 1
            self.overrun_s -= rest
            self.worst_overrun_s = max(self.worst_overrun_s, -rest)
            if self.overruns in (1, 10) or self.overruns % 100 == 0:
                print(
                    f"bench.net.verifier: {self.overruns} of {self.forwards} forwards of "
                    f"{self.description} overran their pad (by {-rest * 1000:.0f} ms)",
                    file=sys.stderr,
                    flush=True,
                )
        return out

    def report(self) -> dict[str, Any]:
        """Its forwards, those that overran their pad, by how long in all and at worst
        (seconds)."""
        return {
            "forwards": self.forwards,
            "overruns": self.overruns,
            "overrun_s": self.overrun_s,
            "worst_overrun_s": self.worst_overrun_s,
        }


def padded_loader(
    pad_ms: float,
    decode_pad_ms: float = 0.0,
    rule: PadRule | None = None,
    made: list[PaddedTarget] | None = None,
) -> Callable[[VerifierSettings], Callable[[], Target]]:
    """A loader factory for :func:`cloud_verifier.daemon.cli.run_serve`: load ``settings.model``
    and, if ``pad_ms > 0``, pad its forwards to ``pad_ms`` (one-token decode steps to
    ``decode_pad_ms`` when given; by ``rule`` when given); the padded target is appended to
    ``made``."""

    def make_loader(settings: VerifierSettings) -> Callable[[], Target]:
        def loader() -> Target:
            target = load_target(
                settings.model,
                device=settings.device,
                dtype=settings.dtype,
                compile_forward=settings.compile,
            )
            if pad_ms <= 0:
                return target
            padded = PaddedTarget(target, pad_ms, decode_pad_ms, rule)
            if made is not None:
                made.append(padded)
            return padded

        return loader

    return make_loader


def padded_draft_loader(
    pad_ms: float,
    rule: PadRule | None = None,
    made: list[PaddedTarget] | None = None,
) -> Callable[[VerifierSettings], Callable[[Target], Target] | None]:
    """A draft loader factory for :func:`cloud_verifier.daemon.cli.run_serve`: load
    ``settings.cloud_draft_model`` beside the (unwrapped) target, every forward padded to
    ``pad_ms`` (by ``rule`` when given); the padded draft is appended to ``made``."""

    def make_loader(settings: VerifierSettings) -> Callable[[Target], Target] | None:
        spec = settings.cloud_draft_model
        if not spec:
            return None

        def loader(target: Target) -> Target:
            base = target.inner if isinstance(target, WrappedTarget) else target
            draft = load_draft_target(spec, base)
            if pad_ms <= 0:
                return draft
            padded = PaddedTarget(draft, pad_ms, rule=rule)
            if made is not None:
                made.append(padded)
            return padded

        return loader

    return make_loader


def _pad_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 600_000:
        raise argparse.ArgumentTypeError(f"must be in [0, 600000], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.net.verifier",
        description="cloud-verifier serve with every forward padded (benchmarks only).",
    )
    add_serve_arguments(parser)
    parser.add_argument(
        "--emulate-verify-ms",
        type=_pad_ms,
        default=0.0,
        help="pad every target forward to this many ms (default: 0, off)",
    )
    parser.add_argument(
        "--emulate-decode-ms",
        type=_pad_ms,
        default=0.0,
        help="pad a forward of one-token decode steps (co-generation) to this many ms instead "
        "(an autoregressive step; default: the verify pad)",
    )
    parser.add_argument(
        "--emulate-cloud-draft-ms",
        type=_pad_ms,
        default=0.0,
        help="pad every forward of the cloud draft model (--cloud-draft-model) to this many ms",
    )
    parser.add_argument(
        "--emulate-token-cost",
        type=float,
        default=None,
        help="pad by the simulation's cost rule (bench.lib.sim.Costs) with this cost per token "
        "(bench.lib.costs.TREE_TOKEN_COST): a target forward of n tokens to verify x "
        "(1 + K (n - 5)) (n >= 5; to the decode pad at n = 1), a cloud draft forward of B rows "
        "to its pad x (1 + K (B - 1)) (default: off, constant pads)",
    )
    parser.add_argument(
        "--emulate-report",
        type=Path,
        default=None,
        help="at exit, write each padded model's forwards and overruns to this JSON file",
    )
    return parser


def verifier_command(target: str, port: int, token_file: Path, args: Seq[str] = ()) -> list[str]:
    """``python -m bench.net.verifier`` (the padded verifier) on ``target`` at ``port``, quiet, no
    heartbeat, with ``args`` (pads, limits) after."""
    return [
        sys.executable, "-m", "bench.net.verifier", "--model", target, "--port", str(port),
        "--token-file", str(token_file), "--heartbeat", "0", "--log-level", "warning", *args,
    ]  # fmt: skip


@contextlib.contextmanager
def serving(
    cmds: Seq[Seq[str]], stderr: IO[bytes] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``cmds`` each in its own single-threaded process (offline: no hub), stdout discarded
    and stderr to ``stderr`` (None: this process's); terminated at the end (killed after 30 s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(list(c), env=env, stdout=subprocess.DEVNULL, stderr=stderr) for c in cmds
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Seq[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    k = args.emulate_token_cost
    if k is not None and k < 0:
        print(f"bench.net.verifier: --emulate-token-cost must be >= 0, got {k}", file=sys.stderr)
        return 2
    target_rule = draft_rule = None
    if k is not None:
        target_rule = token_rule(args.emulate_verify_ms, args.emulate_decode_ms, k)
        draft_rule = row_rule(args.emulate_cloud_draft_ms, k)
    targets: list[PaddedTarget] = []
    drafts: list[PaddedTarget] = []
    try:
        return run_serve(
            args,
            make_loader=padded_loader(
                args.emulate_verify_ms, args.emulate_decode_ms, target_rule, targets
            ),
            make_draft_loader=padded_draft_loader(args.emulate_cloud_draft_ms, draft_rule, drafts),
        )
    finally:
        if args.emulate_report is not None:
            report = {
                "target": [t.report() for t in targets],
                "cloud_draft": [d.report() for d in drafts],
            }
            args.emulate_report.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
