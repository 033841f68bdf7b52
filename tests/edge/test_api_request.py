"""The request parsers of ``edge-agent serve`` as pure functions (no server, no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import (
    MAX_STOPS,
    REQUEST_KEYS,
    STREAM_OPTIONS,
    ApiRequest,
    Endpoint,
    KeyUse,
    Streaming,
    build_pipeline,
    check_keys,
    completion_budget,
    message_text,
    opt_int,
    opt_num,
    parse_ignore_eos,
    parse_logprobs,
    parse_max_tokens,
    parse_messages,
    parse_prompt,
    parse_request,
    parse_sampling,
    parse_seed,
    parse_speculation,
    parse_stops,
    parse_streaming,
)
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.session.pipeline_config import Mode, RequestOptions
from shared.maths.rejection import CorrectionMode

pytestmark = pytest.mark.fast


def fault(fn: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args, **kwargs)
    return e.value


# ---------------------------------------------------------------------------- values


def test_opt_int_bounds_and_json_types() -> None:
    assert opt_int({}, "n", 1) is None
    assert opt_int({"n": None}, "n", 1) is None
    assert opt_int({"n": 3}, "n", 1) == 3
    assert opt_int({"n": 64}, "n", 1, 64) == 64
    e = fault(opt_int, {"n": 0}, "n", 1)
    assert (e.status, e.param, e.code) == (400, "n", "invalid_value")
    assert e.message == "n must be an integer >= 1, got 0"
    assert fault(opt_int, {"g": 65}, "g", 1, 64).message == "g must be an integer in 1..64, got 65"
    for bad in (True, 1.0, "1", [1]):
        fault(opt_int, {"n": bad}, "n", 0)


def test_opt_num_closed_and_open_ranges() -> None:
    assert opt_num({"t": 0}, "t", 0.0, 2.0) == 0.0
    assert isinstance(opt_num({"t": 1}, "t", 0.0, 2.0), float)
    assert opt_num({"p": 1.0}, "p", 0.0, 1.0, open_lo=True) == 1.0
    e = fault(opt_num, {"p": 0}, "p", 0.0, 1.0, open_lo=True)
    assert e.message == "p must be a number in (0.0, 1.0], got 0"
    assert fault(opt_num, {"t": 5}, "t", 0.0, 2.0).message == (
        "t must be a number in [0.0, 2.0], got 5"
    )
    for bad in (False, "0.5", float("nan"), float("inf")):
        fault(opt_num, {"t": bad}, "t", 0.0, 2.0)


# ---------------------------------------------------------------------------- field groups


# ---------------------------------------------------------------------------- the keys

ENDPOINTS = list(Endpoint)
#: A value no honoured key's parser takes.
BOGUS = {"bogus": 1}


def keys_of(use: KeyUse) -> list[tuple[str, Endpoint]]:
    return [(k.name, e) for k in REQUEST_KEYS if k.use == use for e in k.endpoints]


def test_the_table_names_each_key_once_and_its_off_values_for_off_only_keys() -> None:
    names = [k.name for k in REQUEST_KEYS]
    assert len(names) == len(set(names))
    for k in REQUEST_KEYS:
        assert bool(k.off) == (k.use == KeyUse.OFF_ONLY), k.name
        assert k.endpoints and k.note


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unknown_keys_are_all_named_in_one_400(endpoint: Endpoint) -> None:
    body = {"min_p": 0, "zzz": 1, "repetition_penalty": 1.0, "frobnicate": None, "user": "u"}
    e = fault(check_keys, body, endpoint)
    assert (e.status, e.param, e.code) == (400, "zzz", "unknown_parameter")
    assert e.message == "unrecognized request argument(s) supplied: zzz, frobnicate"
    e = fault(parse_request, {**body, "n": 3}, EdgeSettings(), prompt_tokens=1, context=None,
              chat=endpoint == Endpoint.CHAT)  # fmt: skip
    assert e.message == (
        "unrecognized request argument(s) supplied: zzz, frobnicate; not supported: n (one "
        "choice per request: only 1 is accepted, got 3)"
    )


def test_a_key_of_the_other_endpoint_is_unknown_and_says_whose_it_is() -> None:
    e = fault(check_keys, {"messages": []}, Endpoint.COMPLETIONS)
    assert e.message == (
        "unrecognized request argument(s) supplied: messages (a /v1/chat/completions parameter)"
    )
    e = fault(check_keys, {"prompt": "x", "echo": False}, Endpoint.CHAT)
    assert (e.param, e.code) == ("prompt", "unknown_parameter")
    assert "echo (a /v1/completions parameter)" in e.message


@pytest.mark.parametrize(("key", "endpoint"), keys_of(KeyUse.OFF_ONLY))
def test_an_off_only_key_is_accepted_off_and_refused_on(key: str, endpoint: Endpoint) -> None:
    (spec,) = [k for k in REQUEST_KEYS if k.name == key]
    for off in (None, *spec.off):
        check_keys({key: off}, endpoint)
    for on in ({"x": 1}, ["x"], "x", 7, True, False):
        if json.dumps(on) in {json.dumps(v) for v in spec.off}:
            continue
        e = fault(check_keys, {key: on}, endpoint)
        assert (e.param, e.code) == (key, "unsupported_parameter")
        assert e.message.startswith(f"not supported: {key} (")


def test_off_values_compare_as_json() -> None:
    check_keys({"n": 1.0, "presence_penalty": 0.0, "tool_choice": "none"}, Endpoint.CHAT)
    for body in ({"n": True}, {"presence_penalty": False}, {"echo": 0}):
        e = fault(check_keys, body, Endpoint.COMPLETIONS)
        assert e.code == "unsupported_parameter"
    e = fault(check_keys, {"response_format": {"type": "json_object"}}, Endpoint.CHAT)
    assert e.message == (
        "not supported: response_format (plain text; json_object and json_schema need "
        'constrained decoding, not implemented: only {"type": "text"} is accepted, got '
        '{"type": "json_object"})'
    )


@pytest.mark.parametrize(("key", "endpoint"), keys_of(KeyUse.REFUSED))
def test_a_refused_key_is_refused_at_any_value_but_null(key: str, endpoint: Endpoint) -> None:
    check_keys({key: None}, endpoint)
    values: list[Any] = ["low", False, {}, 0]
    for value in values:
        e = fault(check_keys, {key: value}, endpoint)
        assert (e.param, e.code) == (key, "unsupported_parameter")


@pytest.mark.parametrize(("key", "endpoint"), keys_of(KeyUse.IGNORED))
def test_an_ignored_key_changes_nothing(key: str, endpoint: Endpoint) -> None:
    s = EdgeSettings()
    plain = parse_request({}, s, prompt_tokens=1, context=None, chat=endpoint == Endpoint.CHAT)
    for value in ("u-1", {"a": "b"}, 3, True):
        r = parse_request(
            {key: value}, s, prompt_tokens=1, context=None, chat=endpoint == Endpoint.CHAT
        )
        assert r == plain


@pytest.mark.parametrize(("key", "endpoint"), keys_of(KeyUse.HONOURED))
def test_an_honoured_key_is_read_a_bad_value_refused_by_name(key: str, endpoint: Endpoint) -> None:
    """Each honoured key has a parser: a value none takes is a 400 naming the key."""
    if key == "model":
        return  # the server's (it 404s a model it does not serve): tests/edge/test_edge_server.py
    if key == "messages":
        e = fault(parse_messages, {key: BOGUS})
    elif key == "prompt":
        e = fault(parse_prompt, {key: BOGUS}, 100)
    else:
        chat = endpoint == Endpoint.CHAT
        body = {key: BOGUS, "logprobs": True} if key == "top_logprobs" else {key: BOGUS}
        e = fault(parse_request, body, EdgeSettings(), prompt_tokens=1, context=None, chat=chat)
    assert e.status == 400
    assert e.param == key


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_known_key_may_be_null(endpoint: Endpoint) -> None:
    body = {k.name: None for k in REQUEST_KEYS if endpoint in k.endpoints}
    r = parse_request(
        body, EdgeSettings(), prompt_tokens=1, context=None, chat=endpoint == Endpoint.CHAT
    )
    assert r == parse_request(
        {}, EdgeSettings(), prompt_tokens=1, context=None, chat=endpoint == Endpoint.CHAT
    )


def test_logprobs_fields() -> None:
    """Chat: logprobs a boolean, top_logprobs 0..20 with it; completions: logprobs 0..20;
    refused on a federated daemon (no single target)."""
    assert parse_logprobs({}, chat=True, federated=False) is None
    assert parse_logprobs({"logprobs": False}, chat=True, federated=False) is None
    assert parse_logprobs({"logprobs": True}, chat=True, federated=False) == 0
    assert parse_logprobs({"logprobs": True, "top_logprobs": 5}, chat=True, federated=False) == 5
    assert parse_logprobs({"logprobs": 3}, chat=False, federated=False) == 3
    assert parse_logprobs({"logprobs": 0}, chat=False, federated=False) == 0
    for body, chat, param in [
        ({"logprobs": 1}, True, "logprobs"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"logprobs": True}, False, "logprobs"),
        ({"logprobs": -1}, False, "logprobs"),
        ({"logprobs": 2, "top_logprobs": 2}, False, "top_logprobs"),
    ]:
        assert fault(parse_logprobs, body, chat=chat, federated=False).param == param
    e = fault(parse_logprobs, {"logprobs": True}, chat=True, federated=True)
    assert (e.param, e.code) == ("logprobs", "unsupported_parameter")
    assert parse_logprobs({"logprobs": False}, chat=True, federated=True) is None


def test_streaming() -> None:
    assert parse_streaming({}) == Streaming(False, False)
    assert parse_streaming({"stream": None}) == Streaming(False, False)
    assert parse_streaming({"stream": True, "stream_options": {"include_usage": True}}) == (
        Streaming(True, True)
    )
    assert parse_streaming({"stream": True, "stream_options": None}) == Streaming(True, False)
    assert fault(parse_streaming, {"stream": "yes"}).message == "stream must be a boolean"
    assert fault(parse_streaming, {"stream_options": [1]}).param == "stream_options"
    assert parse_streaming({"stream": True, "stream_options": dict.fromkeys(STREAM_OPTIONS, True)})
    e = fault(parse_streaming, {"stream_options": {"include_usage": True, "x": 1, "a": 2}})
    assert (e.param, e.code) == ("stream_options", "unknown_parameter")
    assert e.message == (
        "unknown stream_options field(s): a, x (known: include_usage, include_obfuscation)"
    )


def test_max_tokens_prefers_the_new_name() -> None:
    assert parse_max_tokens({}) is None
    assert parse_max_tokens({"max_tokens": 7}) == 7
    assert parse_max_tokens({"max_completion_tokens": 5, "max_tokens": 7}) == 5
    assert fault(parse_max_tokens, {"max_tokens": -3}).param == "max_tokens"
    assert fault(parse_max_tokens, {"max_completion_tokens": 0}).param == "max_completion_tokens"


def test_sampling() -> None:
    assert parse_sampling({}) == RequestOptions()
    s = parse_sampling({"temperature": 0.7, "top_p": 0.9, "top_k": 40})
    assert s == RequestOptions(temperature=0.7, top_p=0.9, top_k=40)
    assert parse_seed({"seed": 0}) == 0
    assert parse_seed({"seed": 2**64 - 1}) == 2**64 - 1
    assert fault(parse_seed, {"seed": -1}).param == "seed"  # numpy refuses negative seeds
    assert fault(parse_seed, {"seed": 2**64}).param == "seed"
    assert fault(parse_sampling, {"temperature": 5}).param == "temperature"
    e = fault(parse_sampling, {"temperature": 1e-5})
    assert e.message.startswith("temperature must be 0 or at least 0.0001, at most 2, got 1e-05")
    assert fault(parse_sampling, {"top_p": 0}).param == "top_p"
    assert fault(parse_sampling, {"top_k": -1}).param == "top_k"


def test_ignore_eos() -> None:
    assert parse_ignore_eos({}) is False
    assert parse_ignore_eos({"ignore_eos": True}) is True
    assert parse_ignore_eos({"ignore_eos": None}) is False  # null is absence, as for every key
    assert fault(parse_ignore_eos, {"ignore_eos": 1}).message == "ignore_eos must be a boolean"


def test_speculation_extension() -> None:
    assert parse_speculation({}) == RequestOptions()
    assert parse_speculation({"wanspec": None}) == RequestOptions()
    spec = parse_speculation(
        {"wanspec": {"gamma": 8, "depth": 3, "mode": "stop-and-wait", "correction": "topk"}},
        RequestOptions(temperature=0.5),
    )
    assert spec == RequestOptions(0.5, None, None, 8, 3, Mode.STOP_AND_WAIT, CorrectionMode.TOPK)
    assert isinstance(spec.mode, Mode) and isinstance(spec.correction, CorrectionMode)
    e = fault(parse_speculation, {"wanspec": [1]})
    assert e.message == "wanspec must be an object of gamma, depth, mode, correction, timeout"
    e = fault(parse_speculation, {"wanspec": {"zeta": 1, "alpha": 2}})
    assert (e.param, e.message) == ("wanspec", "unknown wanspec field(s): alpha, zeta")
    assert fault(parse_speculation, {"wanspec": {"gamma": 65}}).param == "gamma"
    assert fault(parse_speculation, {"wanspec": {"depth": 128}}).param == "depth"
    e = fault(parse_speculation, {"wanspec": {"mode": "fast"}})
    assert (e.param, e.message) == ("wanspec.mode", "mode must be one of pipelined, stop-and-wait")
    for bad in ("exact", 1, ["topk"]):
        e = fault(parse_speculation, {"wanspec": {"correction": bad}})
        assert e.param == "wanspec.correction"
        assert e.message.startswith("correction must be one of")


def test_stops() -> None:
    assert parse_stops({}) == ()
    assert parse_stops({"stop": "\n"}) == ("\n",)
    assert parse_stops({"stop": ["a", "", "b"]}) == ("a", "b")
    assert parse_stops({"stop": ""}) == ()
    assert fault(parse_stops, {"stop": 3}).message == "stop must be a string or a list of strings"
    assert fault(parse_stops, {"stop": ["a", 1]}).param == "stop"
    e = fault(parse_stops, {"stop": ["x"] * (MAX_STOPS + 1)})
    assert e.message == f"at most {MAX_STOPS} stop sequences are supported"


def test_pipeline_takes_the_requests_values_over_the_settings() -> None:
    s = EdgeSettings(
        temperature=0.5, gamma=4, mode=Mode.PIPELINED, correction=CorrectionMode.CANDIDATES
    )
    p = build_pipeline(s, RequestOptions())
    assert (p.gamma, p.mode, p.correction, p.sampling.temperature) == (
        4, Mode.PIPELINED, CorrectionMode.CANDIDATES, 0.5,
    )  # fmt: skip
    request = RequestOptions(temperature=0.0, top_k=5, gamma=6, depth=1, mode=Mode.STOP_AND_WAIT)
    p = build_pipeline(s, request)
    assert (p.gamma, p.depth, p.mode, p.sampling.greedy, p.sampling.top_k) == (
        6, 1, Mode.STOP_AND_WAIT, True, 5,
    )  # fmt: skip


def test_completion_budget() -> None:
    assert completion_budget(10, None, None, 512) == 512
    assert completion_budget(10, 7, None, 512) == 7
    assert completion_budget(10, None, 100, 512) == 90  # the default is capped by the room
    assert completion_budget(10, 90, 100, 512) == 90
    e = fault(completion_budget, 10, 91, 100, 512)
    assert (e.param, e.code) == ("max_tokens", "context_length_exceeded")
    assert e.message == "max_tokens 91 + 10 prompt tokens exceed this model's context of 100"
    e = fault(completion_budget, 100, None, 100, 512)
    assert (e.param, e.code) == ("messages", "context_length_exceeded")
    assert e.message == "the prompt has 100 tokens; this model's context is 100"


# ---------------------------------------------------------------------------- the whole request


def test_parse_request_fills_in_the_defaults() -> None:
    s = EdgeSettings(max_tokens=64, seed=7)
    r = parse_request({}, s, prompt_tokens=5, context=None)
    assert r == ApiRequest(pipeline=s.pipeline(), max_tokens=64, seed=7)
    r = parse_request(
        {"stream": True, "stop": "x", "seed": 1, "max_tokens": 3, "ignore_eos": True},
        s,
        prompt_tokens=5,
        context=20,
    )
    assert (r.stream, r.include_usage, r.stop, r.seed, r.max_tokens, r.ignore_eos) == (
        True, False, ("x",), 1, 3, True,
    )  # fmt: skip
    assert parse_request({}, s, prompt_tokens=5, context=20).max_tokens == 15


def test_parse_request_answers_the_first_fault_in_a_fixed_order() -> None:
    s = EdgeSettings()
    body: dict[str, Any] = {
        "n": 2,
        "stream": "x",
        "max_tokens": 0,
        "temperature": 9,
        "ignore_eos": 1,
        "wanspec": {"mode": "?"},
        "stop": 1,
    }
    order = ["n", "stream", "max_tokens", "temperature", "ignore_eos", "wanspec.mode"]
    for param in order:
        e = fault(parse_request, body, s, prompt_tokens=5, context=None)
        assert e.param == param
        del body[param.split(".")[0]]
    # The length is checked before the stop sequences.
    e = fault(parse_request, body, s, prompt_tokens=50, context=50)
    assert e.code == "context_length_exceeded"
    assert fault(parse_request, body, s, prompt_tokens=5, context=None).param == "stop"


# ---------------------------------------------------------------------------- prompts


def test_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = parse_messages(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": parts},
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    e = fault(parse_messages, {"messages": []})
    assert (e.param, e.code) == ("messages", "missing_required_parameter")
    assert fault(parse_messages, {"messages": [{"content": "x"}]}).param == "messages[0]"
    e = fault(parse_messages, {"messages": [{"role": "tool", "content": "x"}]})
    assert (e.param, e.message) == ("messages[0].role", "unsupported role 'tool'")
    e = fault(message_text, 2, [{"type": "image_url"}])
    assert (e.param, e.message) == ("messages[2].content", "only text content parts are supported")
    assert fault(message_text, 0, [{"type": "text"}]).message == "a text part needs a string 'text'"
    assert fault(message_text, 0, 5).param == "messages[0].content"


def test_prompt() -> None:
    assert parse_prompt({"prompt": "hi"}, 100) == "hi"
    assert parse_prompt({"prompt": ["hi"]}, 100) == "hi"
    assert parse_prompt({"prompt": [1, 2, 99]}, 100) == [1, 2, 99]
    assert parse_prompt({"prompt": [[4, 5]]}, 100) == [4, 5]
    assert fault(parse_prompt, {"prompt": [1, 100]}, 100).message == "token ids must be in 0..99"
    assert fault(parse_prompt, {"prompt": ""}, 100).message == "prompt must not be empty"
    e = fault(parse_prompt, {}, 100)
    assert (e.param, e.code) == ("prompt", "missing_required_parameter")
    for bad in ([], [True], ["a", "b"], 3):
        assert fault(parse_prompt, {"prompt": bad}, 100).param == "prompt"
