"""What the studies' command lines share: the parser of ``python -m bench NAME``
(:func:`study_parser`), the acceptance traces the simulated studies read (:func:`add_traces`),
and the options of a study that runs its own verifier in a working folder
(:func:`add_verifier_run`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def study_parser(
    name: str, doc: str | None, *, paragraph: bool = False, full: bool = False
) -> argparse.ArgumentParser:
    """``python -m bench NAME``'s parser, described by the first line of ``doc`` (the study's
    docstring; ``paragraph``: its first paragraph; ``full``: all of it)."""
    text = doc or ""
    if not full:
        text = text.split("\n\n" if paragraph else "\n")[0]
    return argparse.ArgumentParser(prog=f"python -m bench {name}", description=text or None)


def add_traces(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--traces", type=Path, required=True, help="acceptance traces (bench.lib.traces)"
    )


def add_verifier_run(p: argparse.ArgumentParser, preset: str, preset_help: str, out: Path) -> None:
    """The preset's flag, ``--out`` (default ``out``), ``--no-plot``, ``--workdir`` and the
    verifier's settings both such studies take (None: the preset's value)."""
    p.add_argument(preset, action="store_true", help=preset_help)
    p.add_argument("--out", type=Path, help=f"default: {out}")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--workdir", type=Path, help="keep the models and the verifier log here")
    p.add_argument("--model", help="target model spec, or tiny (default: default)")
    p.add_argument("--threads", type=int, help="the verifier's torch threads (1)")
    p.add_argument(
        "--max-queue-delay", type=float, help="the verifier's admission setting (its default)"
    )
    p.add_argument("--seed", type=int)
