"""Settings from defaults, a TOML file, environment variables and the command line.

A program describes its settings as one frozen dataclass; :func:`load_settings` fills it from four
sources, highest precedence first:

1. the command line (a dict of field name → value; ``None`` means "not given"),
2. environment variables ``<PREFIX><FIELD NAME IN UPPER CASE>`` (e.g. ``WANSPEC_PORT``),
3. a TOML file (top-level keys, or one table of it with ``section=``; tables of other programs
   are then ignored),
4. the dataclass defaults.

Each setting is declared once, as a field made by :func:`setting`: its type (the annotation), its
default, its bounds and its help text. Everything else is derived from that declaration: the TOML
keys and environment variables (here), the command-line flags and their ``--help``
(:func:`shared.service.cli_args.add_setting_flags`), and the settings reference in the docs
(:mod:`shared.service.settings_doc`).

Values are checked against the field's type annotation: ``int``, ``float``, ``bool``, ``str``,
``pathlib.Path``, a :class:`~shared.enums.TextEnum` (a closed set: parsed by value),
``X | Literal["auto"]`` (a keyword beside a value), and ``X | None`` of those. Strings
(environment, command line) are parsed; TOML values must already have the right type (an enum's
value is a string). Bounds (``min``, ``max``) are checked on numbers; a ``__post_init__`` may raise
:class:`ConfigError` (source left empty) for checks across fields, and the source of the offending
key is filled in.

Every fault raises :class:`ConfigError` naming the key and where its value came from. Unknown keys
in the TOML file or the command-line dict are errors. Environment variables that carry the prefix
but name no field are ignored: several programs share one prefix and one environment.

Pure: no I/O except reading the TOML file; no asyncio.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from shared.enums import TextEnum
from shared.errors import WanspecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (the Jetson)
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "DType",
    "Device",
    "LogLevel",
    "Source",
    "Switch",
    "choices",
    "header_timeout_setting",
    "load_settings",
    "log_level_setting",
    "max_pending_connections_setting",
    "max_pending_per_address_setting",
    "parse_bool",
    "setting",
    "setting_help",
    "settings_fields",
    "threads_setting",
    "type_parts",
]

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class Device(TextEnum):
    """Where a model runs (both ends): ``auto`` is CUDA when torch sees a device, else the CPU
    (:func:`shared.runtime.device.resolve_device`)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DType(TextEnum):
    """A model's weight dtype; ``auto`` is each end's own choice for its device."""

    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Switch(TextEnum):
    """A feature that is on, off, or decided by the program (``auto``)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class LogLevel(TextEnum):
    """The least severe level logged (``logging``'s names, in lower case)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def setting(default: Any, *, help: str, min: float | None = None, max: float | None = None) -> Any:
    """One setting of a settings dataclass: ``name: type = setting(default, help=..., min=...,
    max=...)``. The help text and the bounds live in the field's metadata, where the loader, the
    command line and the docs read them (typed ``Any``, like :func:`dataclasses.field`, so the
    annotation stays the field's type)."""
    if not help.strip():
        raise ValueError("a setting needs a help text")
    meta: dict[str, Any] = {"help": help}
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    return dataclasses.field(default=default, metadata=meta)


def threads_setting() -> Any:
    """The ``threads`` setting, the same on both ends: torch's CPU threads."""
    return setting(
        None,
        min=1,
        max=1024,
        help="torch CPU threads (unset: torch's own choice, one per core); processes that share "
        "a machine's cores (a verifier beside an edge) each get their share, or both run slower",
    )


# --- settings both ends declare with the same meaning: one declaration each (default, bounds,
# help), so the two services' flags, --help and reference pages cannot drift apart. The three
# connection-guard settings configure the same shared.service.http_guard.ConnectionGuard in
# the verifier and in the edge's local API.


def header_timeout_setting() -> Any:
    """``header_timeout``: ConnectionGuard's header-read and keep-alive idle limit."""
    return setting(
        10.0,
        min=0.1,
        max=3600,
        help="seconds a connection may send nothing (new, or idle in keep-alive) before it is "
        "closed silently; a request's headers must be complete this long after its first byte, "
        "else 408 and closed (the clock restarts at a request's first byte, so a request that "
        "arrives as the idle limit runs out is served); a pending connection is held at most "
        "twice this",
    )


def max_pending_connections_setting() -> Any:
    """``max_pending_connections``: ConnectionGuard's cap on pending connections in all."""
    return setting(
        512,
        min=1,
        help="connections whose request has not reached a handler (half-sent, or idle in "
        "keep-alive), counted before any authentication work; when all are taken a new one "
        "evicts the oldest if that has waited at least min(1 s, header_timeout / 2), else it "
        "gets 503",
    )


def max_pending_per_address_setting() -> Any:
    """``max_pending_per_address``: ConnectionGuard's cap on pending connections per address."""
    return setting(
        128, min=1, help="such connections per client address (more: refused at once with 503)"
    )


def log_level_setting() -> Any:
    """``log_level``: the process's logging threshold."""
    return setting(LogLevel.INFO, help="the least severe level logged")


def setting_help(f: dataclasses.Field[Any]) -> str:
    """The help text declared with :func:`setting` (TypeError for a field declared otherwise:
    every setting has one)."""
    text = f.metadata.get("help")
    if not isinstance(text, str):
        raise TypeError(f"setting {f.name!r} is not declared with setting(..., help=...)")
    return text


def settings_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    """The settings of a settings dataclass (its init fields), in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.init]


class ConfigError(WanspecError, ValueError):
    """A setting that cannot be used. ``key`` names it, ``source`` says where it came from."""

    def __init__(self, key: str, message: str, source: str = "") -> None:
        self.key = key
        self.message = message
        self.source = source
        super().__init__(self._text())

    def _text(self) -> str:
        where = f" (from {self.source})" if self.source else ""
        return f"setting {self.key!r}{where}: {self.message}"

    def with_source(self, source: str) -> ConfigError:
        return ConfigError(self.key, self.message, source)


class Source:
    """Human-readable names of the places a value can come from."""

    DEFAULT = "default"

    @staticmethod
    def cli(key: str) -> str:
        return f"command line --{key.replace('_', '-')}"

    @staticmethod
    def env(name: str) -> str:
        return f"environment variable {name}"

    @staticmethod
    def file(path: Path, section: str | None, key: str) -> str:
        dotted = f"{section}.{key}" if section else key
        return f"config file {path} [{dotted}]"


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {text!r}")


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, allows None) for ``X | None`` / ``Optional[X]``; else (tp, False)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {tp!r}")
    return tp, False


def _literal_alternative(tp: Any) -> tuple[tuple[Any, ...], Any] | None:
    """(the keywords, the other type) for ``X | Literal[...]``; else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(tp)
    lits = [a for a in args if typing.get_origin(a) is typing.Literal]
    if len(args) != 2 or len(lits) != 1:
        return None
    other = args[0] if args[1] is lits[0] else args[1]
    return typing.get_args(lits[0]), other


def type_parts(tp: Any) -> tuple[Any, tuple[str, ...], bool]:
    """A setting's annotation taken apart: (the value type, the keywords allowed beside it,
    whether None is allowed): ``int | Literal["auto"]`` → ``(int, ("auto",), False)``."""
    choice = _literal_alternative(tp)
    words = tuple(str(w) for w in choice[0]) if choice is not None else ()
    inner, optional = _split_optional(choice[1] if choice is not None else tp)
    return inner, words, optional


def choices(tp: Any) -> tuple[str, ...] | None:
    """Every spelling a closed set accepts (an enum's values, then any keywords beside them:
    ``E | Literal["auto"]``), in declaration order; None for an open type (``int | Literal[...]``
    included)."""
    inner, words, _ = type_parts(tp)
    if isinstance(inner, type) and issubclass(inner, TextEnum):
        return (*inner.choices(), *words)
    return None


def _coerce(value: Any, tp: Any, *, from_text: bool) -> Any:
    """Convert/check ``value`` for annotation ``tp``; raise ValueError with a readable message.

    ``from_text``: the value came from the environment or the command line, so strings are parsed
    (an empty string means None for optional fields).
    """
    choice = _literal_alternative(tp)
    if choice is not None:
        # ``int | Literal["auto"]``: a keyword, or a value of the other type.
        words, other = choice
        if isinstance(value, str) and value.strip() in words:
            return value.strip()
        try:
            return _coerce(value, other, from_text=from_text)
        except ValueError as e:
            shown = " or ".join(repr(w) for w in words)
            raise ValueError(f"{e} (or {shown})") from None
    inner, optional = _split_optional(tp)
    if value is None or (optional and from_text and value == ""):
        if optional:
            return None
        raise ValueError("a value is required")
    if isinstance(inner, type) and issubclass(inner, TextEnum):
        if isinstance(value, inner):
            return value
        if isinstance(value, str):
            text = value.strip() if from_text else value
            if text in inner.choices():
                return inner(text)
        shown = ", ".join(inner.choices())
        raise ValueError(f"{value!r} is not one of {shown}")
    if inner is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            return parse_bool(value)
        raise ValueError(f"expected a boolean, got {type(value).__name__}")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""), 0)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        raise ValueError(f"expected a number, got {type(value).__name__}")
    if inner is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {type(value).__name__}")
    if inner is Path:
        if isinstance(value, Path):
            return value
        if isinstance(value, str) and value:
            return Path(value).expanduser()
        raise ValueError(f"expected a path, got {value!r}")
    raise TypeError(f"unsupported settings type {tp!r}")


def _check_bounds(value: Any, meta: Mapping[str, Any]) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise ValueError(f"{value} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{value} is above the maximum {hi}")


def _read_toml(path: Path, section: str | None, fields: Collection[str] = ()) -> dict[str, Any]:
    """The settings of ``path``: its top level, or its ``[section]`` table. With a section, a
    top-level key that names one of ``fields`` is refused (it would be ignored: a missing
    table header is an easy mistake)."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from e
    if section is None:
        return dict(data)
    for key, value in data.items():
        if not isinstance(value, dict) and key.replace("-", "_") in fields:
            raise ConfigError(
                key,
                f"is at the top level of {path}, where it is ignored: this program reads its "
                f"settings from the [{section}] table (put [{section}] above it)",
                str(path),
            )
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(section, "expected a table", str(path))
    return dict(table)


def load_settings(
    cls: type[T],
    *,
    toml_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "WANSPEC_",
    cli: Mapping[str, Any] | None = None,
    section: str | None = None,
) -> T:
    """Build ``cls`` (a frozen dataclass) from CLI > environment > TOML file > defaults.

    ``section``: read the TOML table ``[section]`` instead of the top level (other tables of the
    file are then ignored, so one file can configure several programs).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in settings_fields(cls)}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(key: str, raw: Any, source: str, *, from_text: bool) -> None:
        f = fields[key]
        try:
            value = _coerce(raw, hints[key], from_text=from_text)
            _check_bounds(value, f.metadata)
        except ValueError as e:
            raise ConfigError(key, str(e), source) from None
        values[key] = value
        sources[key] = source

    if toml_path is not None:
        table = _read_toml(toml_path, section, fields)
        for key, raw in table.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(key, "unknown setting", Source.file(toml_path, section, key))
            put(name, raw, Source.file(toml_path, section, key), from_text=False)
    for name in fields:
        var = env_prefix + name.upper()
        if env is not None and var in env:
            put(name, env[var], Source.env(var), from_text=True)
    for key, raw in (cli or {}).items():
        if key not in fields:
            raise ConfigError(key, "unknown setting", Source.cli(key))
        if raw is not None:
            put(key, raw, Source.cli(key), from_text=isinstance(raw, str))

    for name, f in fields.items():
        if (
            name not in values
            and f.default is dataclasses.MISSING
            and (f.default_factory is dataclasses.MISSING)
        ):
            raise ConfigError(name, "is required (no default)", Source.DEFAULT)
    try:
        return cls(**values)
    except ConfigError as e:
        if e.source:
            raise
        raise e.with_source(sources.get(e.key, Source.DEFAULT)) from None


def exposed_secret(mode: int, path: Path | str, key: str) -> str | None:
    """A warning when a secret file's permission bits (``mode``) let other users read it
    (group or others), else None."""
    if mode & 0o077 == 0:
        return None
    return f"{key} {path} is readable by other users (mode {mode & 0o777:04o}): chmod 600 {path}"
