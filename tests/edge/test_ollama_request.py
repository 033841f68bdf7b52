"""The Ollama routes' request mapping (:mod:`edge_agent.daemon.ollama_request`): pure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.ollama_api import OLLAMA_API_VERSION, listed_name, served
from edge_agent.daemon.ollama_request import (
    CHAT_KEYS,
    DEPENDENT_OPTIONS,
    GENERATE_KEYS,
    IGNORED_KEYS,
    IGNORED_OPTIONS,
    MESSAGE_OFF_KEYS,
    NEUTRAL_OPTIONS,
    NULL_ONLY_KEYS,
    OFF_KEYS,
    USED_OPTIONS,
    cap_to_num_ctx,
    check_keys,
    error_text,
    num_predict_error,
    parse_chat_messages,
    parse_generate_prompt,
    parse_ollama_options,
    parse_stream,
)
from edge_agent.session.pipeline_config import Bounds, Mode, RequestOptions

pytestmark = pytest.mark.fast

DOC = Path(__file__).resolve().parents[2] / "docs" / "edge" / "ollama.md"


def refused(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_options_map_onto_the_openai_fields_with_the_same_bounds() -> None:
    o = parse_ollama_options(
        {
            "options": {
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 40,
                "seed": 7,
                "num_predict": 12,
                "stop": ["\n", ""],
                "num_ctx": 2048,
            },
            "wanspec": {"gamma": 3, "mode": "pipelined"},
        }
    )
    assert o.sampling == RequestOptions(
        temperature=0.7, top_p=0.9, top_k=40, gamma=3, mode=Mode.PIPELINED
    )
    assert (o.max_tokens, o.seed, o.stop, o.num_ctx) == (12, 7, ("\n",), 2048)
    # Ollama's "no value" numbers are the daemon's defaults.
    o = parse_ollama_options({"options": {"num_predict": -1, "seed": -1}})
    assert (o.max_tokens, o.seed) == (None, None)
    assert parse_ollama_options({}).sampling == RequestOptions()


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"temperature": 0.00001}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"num_predict": 0}, "num_predict"),
        ({"num_predict": Bounds.MAX_TOKENS.hi + 1}, "num_predict"),
        ({"seed": -2}, "seed"),
        ({"stop": 3}, "stop"),
        ({"num_ctx": 0}, "num_ctx"),
    ],
)
def test_out_of_bounds_options_are_refused_by_name(options: dict[str, Any], names: str) -> None:
    assert names in error_text(refused(parse_ollama_options, {"options": options}))


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("num_predict", -2, "-1 (no limit) or an integer in 1..1048576, got -2"),
        ("num_predict", 0, "-1 (no limit) or an integer in 1..1048576, got 0"),
        ("num_predict", 2.5, "-1 (no limit) or an integer in 1..1048576, got 2.5"),
        ("seed", -2, "-1 (random) or an integer in 0..18446744073709551615, got -2"),
    ],
)
def test_the_refusal_of_a_number_with_a_minus_one_says_minus_one_is_allowed(
    option: str, value: float, words: str
) -> None:
    """-1 is Ollama's "no limit" (num_predict) and "random" (seed): the error names it beside
    the range, rather than hiding an accepted value."""
    e = refused(parse_ollama_options, {"options": {option: value}})
    assert error_text(e) == f"options.{option} must be {words}"
    assert e.param == f"options.{option}"


def test_unsupported_options_are_refused_naming_each_and_neutral_ones_accepted() -> None:
    e = refused(
        parse_ollama_options,
        {"options": {"min_p": 0.05, "repeat_penalty": 1.1, "temperature": 0, "zzz": 1}},
    )
    msg = error_text(e)
    assert "min_p, repeat_penalty, zzz" in msg and "repeat_penalty must be 1" in msg
    assert e.param == "options.min_p"
    # At the value that turns them off, and the options that change no text, are accepted.
    neutral = {**NEUTRAL_OPTIONS, **dict.fromkeys(IGNORED_OPTIONS, 4), "repeat_last_n": 64}
    assert parse_ollama_options({"options": neutral}).sampling == RequestOptions()
    assert "options must be an object" in error_text(
        refused(parse_ollama_options, {"options": [1]})
    )


def test_top_level_keys_used_ignored_off_or_refused() -> None:
    # What the official client sends by default (tools: [], no format) passes.
    check_keys({"model": "m", "messages": [], "tools": [], "stream": True}, CHAT_KEYS)
    check_keys({"model": "m", "prompt": "p", "keep_alive": "5m", "format": ""}, GENERATE_KEYS)
    for body, name in [
        ({"format": "json"}, "format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"think": False}, "think"),
        ({"images": ["aGk="]}, "images"),
        ({"context": [1, 2]}, "context"),
        ({"suffix": "end"}, "suffix"),
        ({"logprobs": True}, "logprobs"),
        ({"bogus": 1, "another": 2}, "another, bogus"),
    ]:
        e = refused(check_keys, {"model": "m", **body}, GENERATE_KEYS)
        assert name in error_text(e), (body, error_text(e))
    # /api/generate's keys are not /api/chat's.
    assert "prompt" in error_text(refused(check_keys, {"prompt": "p"}, CHAT_KEYS))


def test_stream_defaults_to_true() -> None:
    assert parse_stream({}) is True and parse_stream({"stream": None}) is True
    assert parse_stream({"stream": False}) is False
    assert "stream" in error_text(refused(parse_stream, {"stream": "no"}))


def test_chat_messages_keep_role_and_content_and_refuse_images_and_tools() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "images": None}]
    assert parse_chat_messages({"messages": msgs}) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]
    assert parse_chat_messages({}) == [] and parse_chat_messages({"messages": []}) == []
    e = refused(parse_chat_messages, {"messages": [{"role": "user", "images": ["x"]}]})
    assert e.param == "messages[0].images"
    e = refused(parse_chat_messages, {"messages": [{"role": "user", "name": "x"}]})
    assert "name" in error_text(e)
    assert "messages" in error_text(refused(parse_chat_messages, {"messages": "hi"}))


def test_generate_prompt_raw_or_templated_with_its_system_message() -> None:
    p = parse_generate_prompt({"prompt": "hi", "system": "be brief"})
    assert not p.raw and p.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    p = parse_generate_prompt({"prompt": "hi", "raw": True})
    assert p.raw and p.text == "hi"
    assert parse_generate_prompt({}).text == ""  # Ollama's "load the model"
    assert "system" in error_text(
        refused(parse_generate_prompt, {"prompt": "x", "raw": True, "system": "s"})
    )
    assert "prompt" in error_text(refused(parse_generate_prompt, {"prompt": [1, 2]}))


def test_num_ctx_caps_the_completion_and_refuses_a_prompt_that_fills_it() -> None:
    assert cap_to_num_ctx(10, 100, None) == 100
    assert cap_to_num_ctx(10, 100, 50) == 40
    assert cap_to_num_ctx(10, 5, 50) == 5
    assert "num_ctx is 10" in error_text(refused(cap_to_num_ctx, 10, 5, 10))


def test_budget_errors_name_num_predict() -> None:
    e = ApiError(400, "max_tokens 99 + 3 prompt tokens exceed the context", param="max_tokens")
    assert error_text(num_predict_error(e)).startswith("num_predict 99")
    other = ApiError(400, "the prompt has 9 tokens", param="messages")
    assert num_predict_error(other) is other


def test_model_names_with_and_without_their_tag() -> None:
    assert listed_name("wanspec") == "wanspec:latest" and listed_name("qwen3:0.6b") == "qwen3:0.6b"
    assert served("wanspec", "wanspec") and served("wanspec", "wanspec:latest")
    assert not served("wanspec", "wanspec:7b") and not served("wanspec", None)
    assert served("qwen3:0.6b", "qwen3:0.6b") and not served("qwen3:0.6b", "qwen3")


def test_the_docs_name_every_field_and_option_with_its_handling() -> None:
    """docs/edge/ollama.md's tables list each key of the parser's tables (as `key`), the
    neutral value of each option accepted only off, and the version /api/version reports."""
    text = DOC.read_text()
    keys = {*CHAT_KEYS, *GENERATE_KEYS, *IGNORED_KEYS, *OFF_KEYS, *NULL_ONLY_KEYS}
    options = {*USED_OPTIONS, *IGNORED_OPTIONS, *NEUTRAL_OPTIONS, *DEPENDENT_OPTIONS}
    missing = [k for k in sorted(keys | options | set(MESSAGE_OFF_KEYS)) if f"`{k}`" not in text]
    assert missing == []
    for option, off in NEUTRAL_OPTIONS.items():
        assert f"`{option}` ({off:g})" in text, option
    assert f'"version": "{OLLAMA_API_VERSION}"' in text
