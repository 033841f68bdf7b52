"""Command-line parsing shared by ``edge-agent`` and ``cloud-verifier``: a mistake in a
subcommand's flags is answered with that subcommand's usage (argparse itself answers with the
top-level one, which lists no flag of the subcommand)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown flag after a subcommand is reported by the
    subcommand's parser (its usage, status 2)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        for action in parser._actions:  # argparse keeps its subparsers here (no public API)
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                action.choices[command].error(f"unrecognized arguments: {' '.join(extra)}")
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
