"""shared.service.config: precedence CLI > environment > TOML file > defaults, error messages,
and settings declared once (``setting``), closed sets as enums."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from cloud_verifier.daemon.settings import VerifierSettings
from shared.enums import TextEnum
from shared.service.config import (
    ConfigError,
    choices,
    load_settings,
    parse_bool,
    setting,
    setting_help,
    settings_fields,
)

pytestmark = pytest.mark.fast


class Letter(TextEnum):
    A = "a"
    B = "b"


@dataclass(frozen=True)
class S:
    name: str = "x"
    port: int = setting(80, min=1, max=65535, help="the port")
    ratio: float = 0.5
    fast: bool = False
    mode: Letter = Letter.A
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.mode == "b" and self.fast:
            raise ConfigError("fast", "cannot be combined with mode b")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults() -> None:
    assert load_settings(S) == S()


def test_precedence_cli_env_file_default(tmp_path: Path) -> None:
    toml = write(tmp_path, '[svc]\nname = "file"\nport = 1\nratio = 2\nmode = "b"\n')
    env = {"W_PORT": "2", "W_NAME": "env", "W_UNRELATED": "ignored", "OTHER_PORT": "9"}
    s = load_settings(
        S, toml_path=toml, env=env, env_prefix="W_", cli={"port": "3", "name": None}, section="svc"
    )
    assert (s.name, s.port, s.ratio, s.mode, s.fast, s.path) == ("env", 3, 2.0, "b", False, None)
    assert s.mode is Letter.B  # the member, parsed by value
    s = load_settings(S, toml_path=toml, env={}, env_prefix="W_", section="svc")
    assert (s.name, s.port) == ("file", 1)


def test_a_setting_outside_the_programs_table_is_refused(tmp_path: Path) -> None:
    """With a section, a top-level key that names a setting of the program was ignored (a
    missing [svc] header); it is refused, naming the key and where it belongs. Other programs'
    keys and tables in the same file are left alone."""
    toml = write(tmp_path, 'port = 9000\n[svc]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"'port'.*top level.*\[svc\] table"):
        load_settings(S, toml_path=toml, section="svc")
    other = write(tmp_path, 'verifier_url = "ws://x"\n[svc]\nport = 2\n[other]\nport = 3\n')
    assert load_settings(S, toml_path=other, section="svc").port == 2


def test_text_parsing() -> None:
    env = {"W_FAST": "yes", "W_PORT": "0x50", "W_RATIO": "1e-3", "W_PATH": "~/t"}
    s = load_settings(S, env=env, env_prefix="W_")
    assert s.fast and s.port == 80 and s.ratio == 1e-3 and s.path == Path("~/t").expanduser()
    assert load_settings(S, env={"W_PATH": ""}, env_prefix="W_").path is None
    assert load_settings(S, cli={"fast": True, "port": 8080}).port == 8080
    assert parse_bool(" Off ") is False


@pytest.mark.parametrize(
    ("kwargs", "key", "where", "what"),
    [
        ({"env": {"W_PORT": "eighty"}}, "port", "environment variable W_PORT", "integer"),
        ({"env": {"W_PORT": "70000"}}, "port", "W_PORT", "maximum 65535"),
        ({"env": {"W_FAST": "maybe"}}, "fast", "W_FAST", "boolean"),
        ({"cli": {"mode": "c"}}, "mode", "command line --mode", "not one of a, b"),
        ({"cli": {"colour": "red"}}, "colour", "command line --colour", "unknown setting"),
        ({"cli": {"fast": True, "mode": "b"}}, "fast", "command line --fast", "mode b"),
        ({"toml": "port = true\n"}, "port", "c.toml [port]", "expected an integer"),
        ({"toml": 'ratio = "1"\n'}, "ratio", "[ratio]", "expected a number"),
        ({"toml": "colour = 1\n"}, "colour", "[colour]", "unknown setting"),
        ({"toml": "port = \n"}, "config", "not valid TOML", ""),
    ],
)
def test_errors_name_key_and_source(
    tmp_path: Path, kwargs: dict[str, object], key: str, where: str, what: str
) -> None:
    toml = kwargs.pop("toml", None)
    path = write(tmp_path, str(toml)) if toml is not None else None
    with pytest.raises(ConfigError) as e:
        load_settings(S, toml_path=path, env_prefix="W_", **kwargs)  # type: ignore[arg-type]
    assert e.value.key == key
    assert where in str(e.value) and what in str(e.value)
    assert f"'{key}'" in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(S, toml_path=tmp_path / "absent.toml")


def test_section_of_shared_file(tmp_path: Path) -> None:
    toml = write(tmp_path, '[edge]\nwhatever = 1\n[verifier]\nport = 9000\nmodel = "null:64"\n')
    s = load_settings(VerifierSettings, toml_path=toml, env={}, section="verifier")
    assert (s.port, s.model) == (9000, "null:64")
    with pytest.raises(ConfigError, match="expected a table"):
        bad = write(tmp_path, "verifier = 1\n")
        load_settings(VerifierSettings, toml_path=bad, section="verifier")


def test_verifier_settings_cross_check(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(
            VerifierSettings,
            env={"WANSPEC_INSECURE_NO_AUTH": "1"},
            cli={"token_file": str(tmp_path / "t")},
        )
    assert e.value.key == "insecure_no_auth" and "WANSPEC_INSECURE_NO_AUTH" in str(e.value)


def test_setting_declares_help_and_bounds() -> None:
    f = {f.name: f for f in settings_fields(S)}
    assert setting_help(f["port"]) == "the port"
    assert (f["port"].default, f["port"].metadata["min"], f["port"].metadata["max"]) == (
        80,
        1,
        65535,
    )
    with pytest.raises(TypeError, match="'ratio' is not declared with setting"):
        setting_help(f["ratio"])
    with pytest.raises(ValueError, match="needs a help text"):
        setting(1, help=" ")


@dataclass(frozen=True)
class Choices:
    letter: Letter | None = None
    cache: Letter | Literal["auto"] = "auto"
    gamma: int | Literal["auto"] = "auto"
    unsupported: Literal["x", "y"] = "x"


def test_enums_are_closed_sets() -> None:
    """A TextEnum field is parsed by value from every source (TOML too: a string), beside a
    keyword (``E | Literal["auto"]``), or None; a bare Literal is refused: closed sets are
    enums."""
    assert choices(Letter) == ("a", "b")
    assert choices(Letter | None) == ("a", "b")
    assert choices(Letter | Literal["auto"]) == ("a", "b", "auto")
    assert choices(int | Literal["auto"]) is None  # open: a number, or the keyword
    cli = {"letter": " b ", "cache": "a", "gamma": "3"}
    c = load_settings(Choices, cli=cli)
    assert (c.letter, c.cache, c.gamma) == (Letter.B, Letter.A, 3)
    assert c.letter is Letter.B and c.cache is Letter.A
    assert load_settings(Choices, cli={"cache": "auto"}).cache == "auto"
    with pytest.raises(ConfigError, match=r"'c' is not one of a, b \(or 'auto'\)"):
        load_settings(Choices, cli={"cache": "c"})
    with pytest.raises(TypeError, match="unsupported settings type"):
        load_settings(Choices, cli={"unsupported": "y"})
