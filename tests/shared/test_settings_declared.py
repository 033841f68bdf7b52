"""Each setting is declared once (``shared.service.config.setting``: type, default, bounds,
help), and every copy is derived from that declaration: the flags and their ``--help`` on both
ends, and the settings reference pages of the docs."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import pytest

import cloud_verifier.daemon.cli as verifier_cli
import cloud_verifier.daemon.settings as verifier_settings
import edge_agent.daemon.cli as edge_cli
import edge_agent.runtime.settings as edge_config
from shared.service.cli_args import flag_help
from shared.service.config import choices, setting_help, settings_fields

REPO = Path(__file__).resolve().parents[2]
ENDS = [
    (verifier_settings.VerifierSettings, verifier_settings.ENV_PREFIX),
    (edge_config.EdgeSettings, edge_config.ENV_PREFIX),
]


@pytest.mark.parametrize(("cls", "prefix"), ENDS)
def test_every_setting_has_help(cls: type[Any], prefix: str) -> None:
    for f in settings_fields(cls):
        assert setting_help(f).strip(), f.name  # TypeError: declared without setting()


@pytest.mark.parametrize(("cls", "prefix"), ENDS)
def test_closed_sets_are_enums(cls: type[Any], prefix: str) -> None:
    """No string Literal stands for a closed set (a twin of an enum to keep equal)."""
    for name, tp in typing.get_type_hints(cls).items():
        literals = [a for a in typing.get_args(tp) if typing.get_origin(a) is typing.Literal]
        assert typing.get_origin(tp) is not typing.Literal, name
        # A keyword beside a value (``int | Literal["auto"]``) is the one Literal allowed.
        assert all(typing.get_args(lit) == ("auto",) for lit in literals), name


def _settings_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    raise AssertionError(command)


def _check_flags(
    parser: argparse.ArgumentParser, cls: type[Any], prefix: str, unlisted: set[str]
) -> None:
    actions = _settings_actions(parser)
    hints = typing.get_type_hints(cls)
    for f in settings_fields(cls):
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.default is None  # not given: lower sources decide
        if f.name in unlisted:
            assert action.help == argparse.SUPPRESS, f.name
            continue
        shown = parser._get_formatter()._expand_help(action)
        assert shown == flag_help(f, prefix), f.name
        closed = choices(hints[f.name])
        assert action.choices == closed or (hints[f.name] is bool), f.name


def test_verifier_flags_are_derived() -> None:
    serve = _subparser(verifier_cli.build_parser(), "serve")
    _check_flags(serve, verifier_settings.VerifierSettings, verifier_settings.ENV_PREFIX, set())
    text = serve.format_help()
    for needle in ("--max-batch-sessions", "--kv-cache-tokens", "--resume-grace"):
        assert needle in text
    assert "80% of the GPU memory" in " ".join(text.split())


@pytest.mark.parametrize("command", edge_cli.COMMANDS)
def test_edge_flags_are_derived(command: str) -> None:
    parser = _subparser(edge_cli.build_parser(), command)
    unlisted = edge_cli._UNLISTED[command] | edge_cli._DEPRECATED
    _check_flags(parser, edge_config.EdgeSettings, edge_config.ENV_PREFIX, unlisted)


@pytest.mark.parametrize(
    ("page", "render"),
    [
        ("verifier-settings.md", verifier_settings.reference_page),
        ("edge-settings.md", edge_config.reference_page),
    ],
)
def test_reference_pages_are_generated(page: str, render: typing.Callable[[], str]) -> None:
    """The committed pages are what the declarations generate (regenerate them with the
    command at their top)."""
    assert (REPO / "docs" / "reference" / page).read_text() == render()


def test_reference_page_lists_every_setting() -> None:
    page = verifier_settings.reference_page()
    for f in settings_fields(verifier_settings.VerifierSettings):
        assert f"| `{f.name}` |" in page
    assert "| `prefix_cache` | one of `off`, `tenant`, `global`, `auto` | `auto` |" in page
    assert "| `port` | integer 0–65 535 | `8765` |" in page
