"""The request parsers of ``edge-agent serve`` as pure functions (no server, no model)."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import (
    MAX_STOPS,
    ApiRequest,
    Streaming,
    build_pipeline,
    check_unsupported,
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
from edge_agent.daemon.config import EdgeSettings
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


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"n": 2}, "n", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"best_of": 3}, "best_of", "invalid_value"),
    ],
)
def test_unsupported_fields_are_refused(body: dict[str, Any], param: str, code: str) -> None:
    e = fault(check_unsupported, body)
    assert (e.status, e.param, e.code) == (400, param, code)


def test_unsupported_fields_are_fine_when_off() -> None:
    check_unsupported(
        {"logprobs": False, "tools": [], "logit_bias": {}, "echo": 0, "suffix": None, "n": 1,
         "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0}
    )  # fmt: skip
    assert fault(check_unsupported, {"n": 2}).message == "only n=1 is supported"


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
    assert fault(parse_ignore_eos, {"ignore_eos": None}).message == "ignore_eos must be a boolean"


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
    assert e.message == "wanspec must be an object of gamma, depth, mode, correction"
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
