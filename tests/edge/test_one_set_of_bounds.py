"""One set of bounds for a generation's options: the daemon's settings (config file, flags,
environment: ``EdgeSettings``), the REPL's ``/set`` and the API's request body accept and refuse
the same values, at and around every bound :class:`Bounds` declares."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import parse_request
from edge_agent.daemon.chat import ChatOptions
from edge_agent.runtime.settings import ENV_PREFIX, EdgeSettings, load_edge_settings
from edge_agent.session.pipeline_config import Bounds, Range
from shared.service.config import ConfigError

pytestmark = pytest.mark.fast

#: Every option with a bound: each is a setting, a REPL key and a request key.
OPTIONS = ("gamma", "depth", "temperature", "top_p", "top_k", "max_tokens", "seed")
#: The request's deadline: a setting (``request_timeout``) and a request key
#: (``wanspec.timeout``); the REPL waits as long as its user does.
DEADLINE = "timeout"


def probes(r: Range[Any]) -> list[float]:
    """Values at and just beyond each end of ``r`` (and inside its gap)."""
    if isinstance(r.lo, int) and isinstance(r.hi, int):
        return [r.lo - 1, r.lo, r.hi, r.hi + 1]
    out = [r.lo - 0.5, r.lo, r.lo + 1e-9, r.hi, r.hi + 1e-6]
    if r.gap_below is not None:
        out += [r.gap_below / 2, r.gap_below]
    return out


def config_ok(key: str, value: float) -> bool:
    """As an operator sets it (an environment variable: read as the file and the flags are)."""
    try:
        load_edge_settings(env={f"{ENV_PREFIX}{key.upper()}": repr(value)})
    except ConfigError:
        return False
    return True


def repl_ok(key: str, value: float) -> bool:
    try:
        ChatOptions.from_settings(EdgeSettings()).with_setting(key, repr(value))
    except ValueError:
        return False
    return True


def api_ok(key: str, value: float) -> bool:
    body: dict[str, Any] = {key: value}
    if key in ("gamma", "depth"):
        body = {"wanspec": body}
    elif key == "wanspec_timeout":
        body = {"wanspec": {"timeout": value}}
    try:
        parse_request(body, EdgeSettings(), prompt_tokens=1, context=None)
    except ApiError:
        return False
    return True


def test_every_bounded_option_is_listed() -> None:
    declared = {name.lower() for name, v in vars(Bounds).items() if isinstance(v, Range)}
    assert declared == {*OPTIONS, DEADLINE}


def test_config_and_api_agree_on_the_request_deadline() -> None:
    for value in probes(Bounds.TIMEOUT):
        want = value in Bounds.TIMEOUT
        assert (
            config_ok("request_timeout", value),
            api_ok("wanspec_timeout", value),
        ) == (want, want), value


@pytest.mark.parametrize("key", OPTIONS)
def test_config_repl_and_api_agree_at_every_bound(key: str) -> None:
    bound = Bounds.of(key)
    for value in probes(bound):
        want = value in bound
        assert (config_ok(key, value), repl_ok(key, value), api_ok(key, value)) == (
            want, want, want,
        ), (key, value)  # fmt: skip
