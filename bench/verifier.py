"""The verifier with padded forwards: ``cloud-verifier serve`` plus ``--emulate-verify-ms``.

Device-regime emulation for the benchmark (see :mod:`bench.run`): every target forward takes at
least the given time, so a CPU target gets the timing of a cloud GPU while keeping its real logits
(and so its real acceptance). Everything else is the product's ``serve`` path, unchanged: same
settings, sources (command line, ``WANSPEC_*``, ``--config``), auth, TLS and shutdown.

    python -m bench.verifier --model default --token-file tokens --emulate-verify-ms 166
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from cloud_verifier.cli import add_serve_arguments, run_serve
from cloud_verifier.engine import Logits, Sequence, Target, load_target
from cloud_verifier.settings import VerifierSettings


class PaddedSequence:
    """Device-regime emulation: every forward takes at least ``pad_s`` (sleeping the rest).

    Runs on the model worker thread, so sleeping there is the delay.
    """

    def __init__(self, inner: Sequence, pad_s: float) -> None:
        self._inner = inner
        self._pad_s = pad_s

    @property
    def length(self) -> int:
        return self._inner.length

    def extend(self, ids: Seq[int], *, last_rows: int | None = None) -> Logits:
        t0 = time.perf_counter()
        out = self._inner.extend(ids, last_rows=last_rows)
        rest = self._pad_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return out

    def last_logits(self) -> Logits:
        return self._inner.last_logits()

    def crop(self, n: int) -> None:
        self._inner.crop(n)


class PaddedTarget:
    """A target whose sequences pad each forward to ``pad_ms`` (see :class:`PaddedSequence`)."""

    def __init__(self, inner: Target, pad_ms: float) -> None:
        self.inner = inner
        self.pad_s = pad_ms / 1000.0
        self.fingerprint = inner.fingerprint
        self.vocab_size = inner.vocab_size
        self.max_length = inner.max_length
        self.description = f"{inner.description}, forwards padded to {pad_ms:g} ms"

    def new_sequence(self) -> PaddedSequence:
        return PaddedSequence(self.inner.new_sequence(), self.pad_s)


def padded_loader(pad_ms: float) -> Callable[[VerifierSettings], Callable[[], Target]]:
    """A loader factory for :func:`cloud_verifier.cli.run_serve`: load ``settings.model`` and,
    if ``pad_ms > 0``, pad its forwards to ``pad_ms``."""

    def make_loader(settings: VerifierSettings) -> Callable[[], Target]:
        def loader() -> Target:
            target = load_target(settings.model, device=settings.device, dtype=settings.dtype)
            return PaddedTarget(target, pad_ms) if pad_ms > 0 else target

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
        prog="python -m bench.verifier",
        description="cloud-verifier serve with every forward padded (benchmarks only).",
    )
    add_serve_arguments(parser)
    parser.add_argument(
        "--emulate-verify-ms",
        type=_pad_ms,
        default=0.0,
        help="pad every target forward to this many ms (default: 0, off)",
    )
    return parser


def main(argv: Seq[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_serve(args, make_loader=padded_loader(args.emulate_verify_ms))


if __name__ == "__main__":
    sys.exit(main())
