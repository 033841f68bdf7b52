"""The settings reference pages of the docs, generated from the settings dataclasses.

Each end renders its page from its own declarations (:func:`settings_page` over the fields made
by :func:`shared.service.config.setting`): name, type, bounds, default and help text come from
there alone, so the page cannot drift from the program. ``python -m cloud_verifier.daemon.settings
FILE`` and ``python -m edge_agent.runtime.settings FILE`` rewrite the committed pages; a test holds
them equal to what these functions generate.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.service.cli_args import shown_default
from shared.service.config import choices, setting_help, settings_fields, type_parts

_TYPES = {bool: "true/false", int: "integer", float: "number", str: "text", Path: "path"}


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x:,}".replace(",", " ")


def type_text(tp: Any, meta: Mapping[str, Any]) -> str:
    """A setting's type in words: ``integer 1–64, or auto``, ``one of tenant, global, off``."""
    closed = choices(tp)
    if closed is not None:
        return "one of " + ", ".join(f"`{c}`" for c in closed)
    inner, words, optional = type_parts(tp)
    text = _TYPES[inner]
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        text += f" {_number(lo)}–{_number(hi)}"
    elif lo is not None:
        text += f" ≥ {_number(lo)}"
    elif hi is not None:
        text += f" ≤ {_number(hi)}"
    if words:
        text += ", or " + " or ".join(f"`{w}`" for w in words)
    if optional:
        text += " (optional)"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(cls: type[Any]) -> str:
    """One row per setting: name, type, default, help."""
    hints = typing.get_type_hints(cls)
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for f in settings_fields(cls):
        default = "unset" if f.default is None else f"`{_cell(shown_default(f.default))}`"
        rows.append(
            f"| `{f.name}` | {type_text(hints[f.name], f.metadata)} | {default} | "
            f"{_cell(setting_help(f))} |"
        )
    return "\n".join(rows) + "\n"


def settings_page(cls: type[Any], *, title: str, intro: str, regenerate: str) -> str:
    """The whole reference page: a title, ``intro`` (how the settings are given), the table.
    ``regenerate``: the command that rewrites the page (said at its top)."""
    return (
        f"# {title}\n\n"
        f"<!-- Generated from the settings' declarations by `{regenerate}`: do not edit by "
        "hand. -->\n\n"
        f"{intro.strip()}\n\n{settings_table(cls)}"
    )


def main(page: str, argv: Sequence[str]) -> int:
    """``python -m <settings module> [FILE]``: write the page to FILE, else print it."""
    if len(argv) > 1:
        print("usage: python -m <settings module> [FILE]", file=sys.stderr)
        return 2
    if argv:
        Path(argv[0]).write_text(page)
    else:
        sys.stdout.write(page)
    return 0
