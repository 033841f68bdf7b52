"""The body of a request to the edge daemon's Ollama-compatible routes, parsed and checked.

Pure functions of the decoded JSON body (no I/O, no model), raising
:class:`~edge_agent.daemon.api_errors.ApiError` (the routes answer it as Ollama's ``{"error":
"..."}``). The values are checked by the same parsers and bounds as the OpenAI routes
(:mod:`edge_agent.daemon.api_request`, :class:`~edge_agent.session.pipeline_config.Bounds`), so
both APIs build the same internal request for the same values.

Every key is either used, listed in :data:`IGNORED_OPTIONS` / :data:`IGNORED_KEYS` (ignoring it
cannot change the text), accepted only at its neutral value (:data:`NEUTRAL_OPTIONS`,
:data:`OFF_KEYS`), or refused with a 400 that names it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from edge_agent.daemon.api_errors import ApiError, bad_request
from edge_agent.daemon.api_request import (
    Body,
    is_int,
    is_num,
    opt_bool,
    opt_int,
    opt_object,
    parse_sampling,
    parse_speculation,
    parse_stops,
    parse_timeout,
)
from edge_agent.session.pipeline_config import Bounds, Range, RequestOptions

#: The ``options`` used, each mapped onto the OpenAI route's field of the same meaning.
USED_OPTIONS: Final = ("temperature", "top_p", "top_k", "seed", "num_predict", "stop", "num_ctx")
#: ``options`` about where and how the model runs, never about the text: accepted, ignored.
IGNORED_OPTIONS: Final = (
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "num_keep",  # which tokens a context shift keeps: the daemon never shifts its context
)
#: ``options`` accepted only at the value that turns them off (the text is then unchanged).
NEUTRAL_OPTIONS: Final[Mapping[str, float]] = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
}
#: ``options`` that act only through a neutral one above: with it off, they change nothing.
DEPENDENT_OPTIONS: Final = ("repeat_last_n", "penalize_newline", "mirostat_tau", "mirostat_eta")
#: Top-level keys accepted and ignored: how long Ollama keeps a model loaded (the daemon keeps
#: its one model loaded as long as it runs).
IGNORED_KEYS: Final = ("keep_alive",)
#: Top-level keys accepted only absent, null or "off" (false, "", [], {}), with the reason.
OFF_KEYS: Final[Mapping[str, str]] = {
    "format": "format (JSON output) is not supported",
    "tools": "tools are not supported",
    "logprobs": "logprobs are not supported on the Ollama routes (use /v1/chat/completions)",
    "top_logprobs": "top_logprobs are not supported on the Ollama routes",
    "images": "images are not supported (text models only)",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "template": "template is not supported (the model's own chat template is used)",
    "context": "context is not supported: send the conversation to /api/chat instead",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}
#: The keys of each route's body.
CHAT_KEYS: Final = ("model", "messages", "stream", "options", "wanspec")
GENERATE_KEYS: Final = ("model", "prompt", "system", "raw", "stream", "options", "wanspec")
#: The keys of one chat message; the others are accepted only when off.
MESSAGE_KEYS: Final = ("role", "content")
MESSAGE_OFF_KEYS: Final[Mapping[str, str]] = {
    "images": "images are not supported (text models only)",
    "tool_calls": "tool calls are not supported",
    "tool_name": "tool messages are not supported",
    "thinking": "thinking content is not supported",
}
OFF_VALUES: Final[tuple[object, ...]] = (None, False, "", [], {})
#: Top-level keys accepted only absent or null: even ``false`` changes what Ollama does.
NULL_ONLY_KEYS: Final[Mapping[str, str]] = {
    "think": "think is not supported (the model's thinking is not separated from its answer, "
    "nor turned off)",
}


def _is_off(value: object) -> bool:
    return any(value == off and type(value) is type(off) for off in OFF_VALUES)


def _names(keys: list[str]) -> str:
    return ", ".join(sorted(keys))


def check_keys(body: Body, used: tuple[str, ...]) -> None:
    """Refuse keys set to what the daemon cannot do, and keys it does not know."""
    for key, why in OFF_KEYS.items():
        if not _is_off(body.get(key)):
            raise bad_request(key, why, "unsupported_parameter")
    for key, why in NULL_ONLY_KEYS.items():
        if body.get(key) is not None:
            raise bad_request(key, why, "unsupported_parameter")
    known = (*used, *OFF_KEYS, *NULL_ONLY_KEYS, *IGNORED_KEYS)
    unknown = [k for k in body if k not in known]
    if unknown:
        raise bad_request(unknown[0], f"unknown field(s): {_names(unknown)}", "unknown_parameter")


def parse_stream(body: Body) -> bool:
    """``stream``: true unless given false (Ollama streams by default)."""
    return opt_bool(body, "stream", True)


def parse_options(body: Body) -> Mapping[str, Any]:
    """``options``: an object whose every key is used, ignored, or at its neutral value."""
    options = opt_object(body, "options", "options must be an object")
    bad = []
    for key, value in options.items():
        if key in USED_OPTIONS or key in IGNORED_OPTIONS or key in DEPENDENT_OPTIONS:
            continue
        if key in NEUTRAL_OPTIONS and (
            value is None or (is_num(value) and value == NEUTRAL_OPTIONS[key])
        ):
            continue
        bad.append(key)
    if bad:
        neutral = [k for k in bad if k in NEUTRAL_OPTIONS]
        detail = "; ".join(f"{k} must be {NEUTRAL_OPTIONS[k]:g} (off)" for k in sorted(neutral))
        raise bad_request(
            "options." + sorted(bad)[0],
            f"unsupported option(s): {_names(bad)}" + (f" ({detail})" if detail else ""),
            "unsupported_parameter",
        )
    return options


@dataclass(frozen=True)
class OllamaOptions:
    """What ``options`` (and the ``wanspec`` extension) ask for, in the OpenAI route's terms:
    ``max_tokens`` from ``num_predict`` (None: the daemon's default), ``num_ctx`` a cap on
    prompt + completion below the model's own context (None: none)."""

    sampling: RequestOptions
    max_tokens: int | None
    seed: int | None
    stop: tuple[str, ...]
    num_ctx: int | None
    #: ``wanspec.timeout``: the request's deadline (seconds; None: request_timeout).
    timeout_s: float | None = None


def _opt_int_or_none(options: Body, key: str, bound: Range[int], none: str) -> int | None:
    """``options[key]``: an integer in ``bound``, or -1 (Ollama's "none": ``none`` says what it
    means) and absent, both None; the error names both ways."""
    v = options.get(key)
    if v is None or (v == -1 and is_int(v)):
        return None
    if not is_int(v) or v not in bound:
        raise bad_request(
            f"options.{key}",
            f"options.{key} must be -1 ({none}) or an integer {bound.words()}, got {json.dumps(v)}",
        )
    return int(v)


def parse_num_predict(options: Body) -> int | None:
    """``num_predict``: the completion's length; -1 (Ollama's default, "no limit") and absent
    are the daemon's default."""
    return _opt_int_or_none(options, "num_predict", Bounds.MAX_TOKENS, "no limit")


def parse_ollama_seed(options: Body) -> int | None:
    """``seed``: -1 (llama.cpp's "random") and absent are no seed."""
    return _opt_int_or_none(options, "seed", Bounds.SEED, "random")


def parse_ollama_options(body: Body) -> OllamaOptions:
    options = parse_options(body)
    return OllamaOptions(
        sampling=parse_speculation(body, parse_sampling(options)),
        max_tokens=parse_num_predict(options),
        seed=parse_ollama_seed(options),
        stop=parse_stops(options),
        num_ctx=opt_int(options, "num_ctx", 1),
        timeout_s=parse_timeout(body),
    )


def cap_to_num_ctx(prompt_tokens: int, budget: int, num_ctx: int | None) -> int:
    """The completion length ``budget`` within ``num_ctx`` (prompt + completion); 400 when the
    prompt alone fills it."""
    if num_ctx is None:
        return budget
    if prompt_tokens >= num_ctx:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; options.num_ctx is {num_ctx}",
            param="options.num_ctx",
            code="context_length_exceeded",
        )
    return min(budget, num_ctx - prompt_tokens)


def num_predict_error(e: ApiError) -> ApiError:
    """An error of the completion budget, naming Ollama's option instead of OpenAI's field."""
    if e.param != "max_tokens":
        return e
    return ApiError(
        e.status, e.message.replace("max_tokens", "num_predict", 1), param="options.num_predict"
    )


# ---------------------------------------------------------------------------- prompts


def parse_chat_messages(body: Body) -> list[dict[str, Any]]:
    """``messages`` as the OpenAI route takes them (``[{"role", "content"}]``), or ``[]``:
    Ollama's "load the model" request. Roles and contents are checked by the OpenAI route's
    parser when the prompt is built."""
    messages = body.get("messages")
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise bad_request("messages", "messages must be a list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]", "each message must be an object")
        for key, why in MESSAGE_OFF_KEYS.items():
            if not _is_off(m.get(key)):
                raise bad_request(f"messages[{i}].{key}", why, "unsupported_parameter")
        unknown = [k for k in m if k not in MESSAGE_KEYS and k not in MESSAGE_OFF_KEYS]
        if unknown:
            raise bad_request(f"messages[{i}]", f"unknown message field(s): {_names(unknown)}")
        out.append({"role": m.get("role"), "content": m.get("content")})
    return out


@dataclass(frozen=True)
class GeneratePrompt:
    """``/api/generate``'s prompt: ``raw`` text to encode as it is, or ``messages`` for the
    chat template (an optional system message, then the prompt as the user's). ``text`` empty:
    Ollama's "load the model" request."""

    text: str
    raw: bool
    messages: list[dict[str, Any]]


def parse_generate_prompt(body: Body) -> GeneratePrompt:
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad_request("prompt", "prompt must be a string")
    raw = opt_bool(body, "raw", False)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad_request("system", "system must be a string")
    if raw and system:
        raise bad_request("system", "system has no place in a raw prompt (raw: true)")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return GeneratePrompt(prompt, raw, messages)


def error_text(e: ApiError) -> str:
    """Ollama's error string for ``e``: its message, naming the field where the message does
    not already."""
    if e.param is None or e.param.split(".")[-1].split("[")[0] in e.message:
        return e.message
    return f"{e.param}: {e.message}"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
