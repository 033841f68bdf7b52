"""Command-line parsing shared by ``edge-agent`` and ``cloud-verifier``: one flag per setting,
derived from the settings dataclass (:mod:`shared.service.config`), and a mistake in a
subcommand's flags answered with that subcommand's usage (argparse itself answers with the
top-level one, which lists no flag of the subcommand)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection, Sequence
from typing import Any

from shared.service.config import choices, setting_help, settings_fields


def shown_default(value: object) -> str:
    """A default as ``--help`` and the settings reference print it: as a TOML file spells it
    (``true``, ``""``), None as ``unset``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def flag_help(f: dataclasses.Field[Any], env_prefix: str) -> str:
    """A setting's ``--help`` text: its declared help, its default and its variable."""
    default = shown_default(f.default)
    return f"{setting_help(f)} (default: {default}; env {env_prefix}{f.name.upper()})"


def add_setting_flags(
    group: argparse._ActionsContainer,
    cls: type[Any],
    env_prefix: str,
    *,
    unlisted: Collection[str] = (),
) -> None:
    """One flag per setting of ``cls`` (``--max-sessions`` for ``max_sessions``), its default
    None (not given: lower sources decide). Booleans get ``--x`` and ``--no-x``; closed sets
    (enums) their choices. ``unlisted``: flags accepted but left out of ``--help``."""
    hints = typing.get_type_hints(cls)
    for f in settings_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        # argparse %-formats help texts ("80%" would be a format error).
        text = flag_help(f, env_prefix).replace("%", "%%")
        if f.name in unlisted:
            text = argparse.SUPPRESS
        if hints[f.name] is bool:  # either way beats the file and the environment
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
            continue
        group.add_argument(flag, choices=choices(hints[f.name]), help=text)


def setting_values(args: argparse.Namespace, cls: type[Any]) -> dict[str, Any]:
    """The settings given on the command line (None: not given), for ``load_settings(cli=)``."""
    return {f.name: getattr(args, f.name, None) for f in settings_fields(cls)}


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
