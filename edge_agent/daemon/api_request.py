"""The body of a generation request to ``edge-agent serve``, parsed and checked.

Pure functions of the decoded JSON body (no I/O, no model): each parser has one job and raises
:class:`~edge_agent.daemon.api_errors.ApiError` (HTTP 400 in OpenAI's shape) naming the offending
field.
:func:`parse_request` runs them in a fixed order, so the first fault found is the one answered:

1. :func:`check_keys`: every key against :data:`REQUEST_KEYS`, all faults in one 400 (the keys
   the endpoint does not know, and those set to what we cannot do: tools, n > 1, penalties),
2. :func:`parse_streaming`: ``stream``, ``stream_options`` (:data:`STREAM_OPTIONS`),
3. :func:`parse_max_tokens`: ``max_completion_tokens``, else ``max_tokens``,
4. :func:`parse_sampling`: ``temperature``, ``top_p``, ``top_k``; :func:`parse_seed`,
5. :func:`parse_ignore_eos`,
6. :func:`parse_logprobs`: ``logprobs`` and ``top_logprobs`` (chat), ``logprobs`` (completions),
7. :func:`parse_speculation`: our extension object ``"wanspec": {gamma, depth, mode, correction,
   timeout}`` (:func:`parse_timeout` its ``timeout``),
8. :func:`build_pipeline`: the daemon's defaults with the request's values on top
   (``EdgeSettings.pipeline``, as the REPL's),
9. :func:`completion_budget`: the context (the draft's and the verifier's,
   :class:`ContextLimit`) bounds prompt + completion,
10. :func:`parse_stops`: ``stop``.

Every bound is the one declared in :mod:`edge_agent.session.pipeline_config` (the REPL and the
daemon's own defaults check the same). The prompt itself: :func:`parse_messages` (chat) and
:func:`parse_prompt` (completions); the body before all of them: :func:`decode_body` (a JSON
object, nested at most :data:`MAX_JSON_DEPTH` deep, its strings text: no lone surrogates).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeGuard, TypeVar

from edge_agent.daemon.api_errors import ApiError, bad_request
from edge_agent.daemon.unicode_text import SURROGATE
from edge_agent.runtime.context import ContextLimit
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.session.pipeline_config import Bounds, Mode, PipelineConfig, RequestOptions
from shared.enums import TextEnum
from shared.maths.rejection import CorrectionMode
from shared.wire.messages import MAX_TOP_LOGPROBS

Body = Mapping[str, Any]
E = TypeVar("E", bound=TextEnum)

MAX_STOPS = 4
#: The fields of the ``"wanspec"`` extension object.
SPECULATION_FIELDS = ("gamma", "depth", "mode", "correction", "timeout")
CHAT_ROLES = ("system", "developer", "user", "assistant")
#: Containers nested in a request body, the body itself counting 1. Real requests need about 4
#: (body, messages, a message, its content parts); deeper bodies are refused before any parser
#: (or an error message's json.dumps) recurses through them.
MAX_JSON_DEPTH = 32


# ---------------------------------------------------------------------------- the keys


class Endpoint(TextEnum):
    """The generation endpoints, whose request keys :data:`REQUEST_KEYS` lists."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


class KeyUse(TextEnum):
    """What a generation endpoint does with a request key. ``null`` is the key's absence, for
    every key the endpoint knows."""

    HONOURED = "honoured"  # read and checked by a parser below
    IGNORED = "ignored"  # accepted with any value: it cannot change the text nor what it is for
    OFF_ONLY = "off_only"  # accepted only at values that ask for nothing (``off``); else 400
    REFUSED = "refused"  # 400 at any value but null: not implemented


BOTH = (Endpoint.CHAT, Endpoint.COMPLETIONS)
CHAT = (Endpoint.CHAT,)
COMPLETIONS = (Endpoint.COMPLETIONS,)


@dataclass(frozen=True)
class RequestKey:
    """One key of a generation request's body: where it is known, what is done with it, and
    (``note``) why, in the docs' words. ``off``: the values an ``OFF_ONLY`` key accepts."""

    name: str
    use: KeyUse
    endpoints: tuple[Endpoint, ...]
    note: str
    off: tuple[Any, ...] = ()


_H, _I, _O, _R = KeyUse.HONOURED, KeyUse.IGNORED, KeyUse.OFF_ONLY, KeyUse.REFUSED
#: Every key the generation endpoints know, and the one place that says what each does: a key
#: not listed for an endpoint is refused there (400 ``unknown_parameter``), all such keys named
#: in one message. docs/edge/api.md lists this table (:func:`request_keys_markdown`).
REQUEST_KEYS: tuple[RequestKey, ...] = (
    RequestKey("model", _H, BOTH, "the served `model_id`; another: 404 `model_not_found`"),
    RequestKey("messages", _H, CHAT, "roles `system`, `developer`, `user`, `assistant`; text"),
    RequestKey("prompt", _H, COMPLETIONS, "a string, a list of one string, or token ids"),
    RequestKey("max_tokens", _H, BOTH, f"the completion's length, {Bounds.MAX_TOKENS.words()}"),
    RequestKey("max_completion_tokens", _H, BOTH, "the same; wins over `max_tokens`"),
    RequestKey("temperature", _H, BOTH, f"{Bounds.TEMPERATURE.words()} (0: greedy)"),
    RequestKey("top_p", _H, BOTH, Bounds.TOP_P.words()),
    RequestKey("top_k", _H, BOTH, f"an extension (as vLLM's), {Bounds.TOP_K.words()}; 0: off"),
    RequestKey("seed", _H, BOTH, f"{Bounds.SEED.words()} (what it fixes: below)"),
    RequestKey("stop", _H, BOTH, f"a string or up to {MAX_STOPS} strings"),
    RequestKey("stream", _H, BOTH, "Server-Sent Events ending with `data: [DONE]`"),
    RequestKey(
        "stream_options",
        _H,
        BOTH,
        "`include_usage` (a last chunk with `usage`); `include_obfuscation` ignored (no padding "
        "is sent); other keys refused",
    ),
    RequestKey("logprobs", _H, BOTH, "chat: a boolean; completions: 0 to 20 alternatives"),
    RequestKey("top_logprobs", _H, CHAT, "0 to 20, with `logprobs: true`"),
    RequestKey("ignore_eos", _H, BOTH, "an extension (as vLLM's): generate past the end token"),
    RequestKey(
        "wanspec", _H, BOTH, "an extension: `gamma`, `depth`, `mode`, `correction`, `timeout`"
    ),
    RequestKey("n", _O, BOTH, "one choice per request", (1,)),
    RequestKey("best_of", _O, COMPLETIONS, "one candidate per request", (1,)),
    RequestKey("presence_penalty", _O, BOTH, "penalties are not implemented", (0,)),
    RequestKey("frequency_penalty", _O, BOTH, "penalties are not implemented", (0,)),
    RequestKey("repetition_penalty", _O, BOTH, "vLLM's; penalties are not implemented", (1,)),
    RequestKey("min_p", _O, BOTH, "vLLM's; min-p sampling is not implemented", (0,)),
    RequestKey("logit_bias", _O, BOTH, "not implemented (it would bias draft and target)", ({},)),
    RequestKey("echo", _O, COMPLETIONS, "the prompt is not repeated in the answer", (False,)),
    RequestKey("suffix", _O, COMPLETIONS, "no insertion (fill-in-the-middle)", ("",)),
    RequestKey("tools", _O, CHAT, "tool calls are not supported", ([],)),
    RequestKey("functions", _O, CHAT, "tool calls are not supported", ([],)),
    RequestKey(
        "tool_choice",
        _O,
        CHAT,
        "with no tools, `none` and `auto` both mean text, the same text",
        ("none", "auto"),
    ),
    RequestKey(
        "function_call",
        _O,
        CHAT,
        "with no functions, `none` and `auto` mean text",
        ("none", "auto"),
    ),
    RequestKey(
        "parallel_tool_calls",
        _O,
        CHAT,
        "a boolean; with no tools it changes nothing",
        (True, False),
    ),
    RequestKey(
        "response_format",
        _O,
        CHAT,
        "plain text; `json_object` and `json_schema` need constrained decoding, not implemented",
        ({"type": "text"},),
    ),
    RequestKey("modalities", _O, CHAT, "text only", (["text"],)),
    RequestKey(
        "store", _O, CHAT, "nothing is stored (there is no route to read it back)", (False,)
    ),
    RequestKey("user", _I, BOTH, "an end-user id for OpenAI's abuse checks; nothing reads it"),
    RequestKey("safety_identifier", _I, CHAT, "the same as `user`"),
    RequestKey("metadata", _I, CHAT, "tags for stored completions; none are stored"),
    RequestKey("service_tier", _I, CHAT, "OpenAI's price and latency tier; all are served alike"),
    RequestKey(
        "prompt_cache_key",
        _I,
        CHAT,
        "a routing hint for OpenAI's cache; the verifier's prefix cache needs none",
    ),
    RequestKey("reasoning_effort", _R, CHAT, "not passed to the chat template"),
    RequestKey("verbosity", _R, CHAT, "not implemented"),
    RequestKey("prediction", _R, CHAT, "predicted outputs are not implemented"),
    RequestKey("audio", _R, CHAT, "text only"),
    RequestKey("web_search_options", _R, CHAT, "no web search"),
)
#: The keys of ``stream_options``: honoured (True) or accepted and ignored (False).
STREAM_OPTIONS = {"include_usage": True, "include_obfuscation": False}


def known_keys(endpoint: Endpoint) -> dict[str, RequestKey]:
    """The keys ``endpoint`` knows, by name."""
    return {k.name: k for k in REQUEST_KEYS if endpoint in k.endpoints}


def _json_equal(a: object, b: object) -> bool:
    """Equal as JSON values: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _refusal(key: RequestKey, value: object) -> str:
    """Why ``value`` of ``key`` is refused, in one clause."""
    note = key.note.replace("`", "")
    if key.use == KeyUse.OFF_ONLY:
        allowed = " or ".join(json.dumps(v) for v in key.off)
        return f"{key.name} ({note}: only {allowed} is accepted, got {json.dumps(value)})"
    return f"{key.name} ({note})"


def check_keys(body: Body, endpoint: Endpoint) -> None:
    """Refuse, in one 400, every key ``endpoint`` does not know (``unknown_parameter``) and
    every known one set to what it cannot do (``unsupported_parameter``); the honoured keys'
    values are the parsers' to check."""
    known = known_keys(endpoint)
    unknown = [k for k in body if k not in known]
    refused = []
    for name, value in body.items():
        key = known.get(name)
        if key is None or value is None or key.use in (KeyUse.HONOURED, KeyUse.IGNORED):
            continue
        if key.use == KeyUse.REFUSED or not any(_json_equal(value, v) for v in key.off):
            refused.append((name, _refusal(key, value)))
    if not unknown and not refused:
        return
    parts = []
    if unknown:
        elsewhere = Endpoint.COMPLETIONS if endpoint == Endpoint.CHAT else Endpoint.CHAT
        theirs = known_keys(elsewhere)
        names = [f"{k} (a {elsewhere} parameter)" if k in theirs else k for k in unknown]
        parts.append(f"unrecognized request argument(s) supplied: {', '.join(names)}")
    if refused:
        parts.append(f"not supported: {'; '.join(why for _, why in refused)}")
    first = unknown[0] if unknown else refused[0][0]
    code = "unknown_parameter" if unknown else "unsupported_parameter"
    raise bad_request(first, "; ".join(parts), code)


def request_keys_markdown() -> str:
    """The table of :data:`REQUEST_KEYS` as docs/edge/api.md shows it."""
    use_words = {
        KeyUse.HONOURED: "honoured",
        KeyUse.IGNORED: "accepted, ignored",
        KeyUse.REFUSED: "refused",
    }
    where = {BOTH: "both", CHAT: "chat", COMPLETIONS: "completions"}
    lines = ["| key | endpoint | handling | notes |", "|---|---|---|---|"]
    for k in REQUEST_KEYS:
        if k.use == KeyUse.OFF_ONLY:
            use = "only " + " or ".join(f"`{json.dumps(v)}`" for v in k.off)
        else:
            use = use_words[k.use]
        lines.append(f"| `{k.name}` | {where[k.endpoints]} | {use} | {k.note} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the body


def json_depth(value: object, limit: int) -> int:
    """How deep containers (objects, arrays) nest in ``value`` (a scalar: 0), counted up to
    ``limit + 1`` (enough to say "too deep"). Iterative: no recursion, whatever the input."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children: Any
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def lone_surrogate_field(body: Mapping[str, Any]) -> str | None:
    """The top-level field of ``body`` with a string (or an object key) holding a surrogate
    code point, or None. Iterative over the (depth-checked) containers."""
    for field, value in body.items():
        stack: list[object] = [field, value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if SURROGATE.search(v):
                    return str(field)
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return None


def _too_deep() -> ApiError:
    return ApiError(
        400,
        f"the request body nests JSON arrays/objects more than {MAX_JSON_DEPTH} levels deep",
        code="invalid_json",
    )


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body: a JSON object nested at most :data:`MAX_JSON_DEPTH` deep (400 else)."""
    try:
        body = json.loads(raw)
    except RecursionError:  # nested past the interpreter's recursion limit
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise _too_deep()
    field = lone_surrogate_field(body)
    if field is not None:
        raise ApiError(
            400,
            f"{field}: a string holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape not "
            "in a valid pair), which is not text",
            param=field,
            code="invalid_json",
        )
    return body


# ---------------------------------------------------------------------------- values


def is_int(v: object) -> TypeGuard[int]:
    """A JSON integer (``true``/``false`` are not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> TypeGuard[float]:
    """A finite JSON number (``true``/``false`` are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def opt_int(body: Body, key: str, lo: int, hi: int | None = None) -> int | None:
    """``body[key]``, an integer in ``lo..hi`` (``hi`` None: unbounded), or None if absent."""
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad_request(key, f"{key} must be an integer {rng}, got {json.dumps(v)}")
    return int(v)


def opt_num(body: Body, key: str, lo: float, hi: float, *, open_lo: bool = False) -> float | None:
    """``body[key]``, a number in ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``), or None."""
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v) or v > hi or v < lo or (open_lo and v == lo):
        side = "(" if open_lo else "["
        raise bad_request(key, f"{key} must be a number in {side}{lo}, {hi}], got {json.dumps(v)}")
    return float(v)


def opt_choice(body: Body, key: str, enum: type[E], param: str, message: str) -> E | None:
    """``body[key]`` as a member of ``enum``, or None if absent; else 400 on ``param``."""
    v = body.get(key)
    if v is None:
        return None
    try:
        return enum.parse(v)
    except ValueError:
        raise bad_request(param, message) from None


def opt_bool(body: Body, key: str, default: bool) -> bool:
    """``body[key]``, a JSON boolean, or ``default`` if absent (null reads as absent, as for
    every key); anything else is a 400 on ``key``."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(key, f"{key} must be a boolean")
    return v


def opt_object(body: Body, key: str, message: str) -> Mapping[str, Any]:
    """``body[key]`` as a JSON object; absent or falsy (null, 0, "", []) reads as ``{}``."""
    v = body.get(key) or {}
    if not isinstance(v, dict):
        raise bad_request(key, message)
    return v


# ---------------------------------------------------------------------------- field groups


@dataclass(frozen=True)
class Streaming:
    stream: bool = False
    include_usage: bool = False  # a last chunk with the usage before ``[DONE]``


def parse_streaming(body: Body) -> Streaming:
    stream = opt_bool(body, "stream", False)
    opts = opt_object(body, "stream_options", "stream_options must be an object")
    unknown = sorted(set(opts) - set(STREAM_OPTIONS))
    if unknown:
        raise bad_request(
            "stream_options",
            f"unknown stream_options field(s): {', '.join(unknown)} (known: "
            f"{', '.join(STREAM_OPTIONS)})",
            "unknown_parameter",
        )
    return Streaming(stream, bool(opts.get("include_usage", False)))


def parse_max_tokens(body: Body) -> int | None:
    """``max_completion_tokens`` (the current name) if given, else ``max_tokens``."""
    n = opt_int(body, "max_completion_tokens", Bounds.MAX_TOKENS.lo, Bounds.MAX_TOKENS.hi)
    return (
        n
        if n is not None
        else opt_int(body, "max_tokens", Bounds.MAX_TOKENS.lo, Bounds.MAX_TOKENS.hi)
    )


def parse_temperature(body: Body) -> float | None:
    """``temperature``: 0 (greedy), or large enough to sample with, within the bounds."""
    t = opt_num(body, "temperature", Bounds.TEMPERATURE.lo, Bounds.TEMPERATURE.hi)
    if t is not None and t not in Bounds.TEMPERATURE:
        raise bad_request(
            "temperature",
            f"temperature must be {Bounds.TEMPERATURE.words()}, got {t!r}: smaller ones leave "
            "nothing to sample from",
        )
    return t


def parse_sampling(body: Body) -> RequestOptions:
    """The request's own ``temperature``, ``top_p`` and ``top_k`` (None: the daemon's)."""
    return RequestOptions(
        temperature=parse_temperature(body),
        top_p=opt_num(
            body, "top_p", Bounds.TOP_P.lo, Bounds.TOP_P.hi, open_lo=Bounds.TOP_P.open_lo
        ),
        top_k=opt_int(body, "top_k", Bounds.TOP_K.lo, Bounds.TOP_K.hi),
    )


def parse_seed(body: Body) -> int | None:
    return opt_int(body, "seed", Bounds.SEED.lo, Bounds.SEED.hi)


def parse_ignore_eos(body: Body) -> bool:
    return opt_bool(body, "ignore_eos", False)


def parse_logprobs(body: Body, *, chat: bool, federated: bool) -> int | None:
    """How many alternatives to report per token, None for no log-probabilities.

    Chat (OpenAI's chat API): ``logprobs`` a boolean, ``top_logprobs`` 0..20 with it.
    Completions (the legacy API): ``logprobs`` an integer 0..20, the alternatives per token.
    A federated daemon has no single target to report: 400."""
    if chat:
        on = opt_bool(body, "logprobs", False)
        top = opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not on:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        n = (top or 0) if on else None
    else:
        n = opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        if body.get("top_logprobs") is not None:
            raise bad_request(
                "top_logprobs", "completions take the alternatives in logprobs (an integer)"
            )
    if n is not None and federated:
        raise bad_request(
            "logprobs",
            "logprobs are not available with federated verification (several targets, "
            "no one distribution to report)",
            "unsupported_parameter",
        )
    return n


def parse_speculation(body: Body, options: RequestOptions | None = None) -> RequestOptions:
    """``options`` (default: none given) with the ``"wanspec"`` object's values."""
    ext = opt_object(
        body, "wanspec", "wanspec must be an object of gamma, depth, mode, correction, timeout"
    )
    unknown = set(ext) - set(SPECULATION_FIELDS)
    if unknown:
        raise bad_request("wanspec", f"unknown wanspec field(s): {', '.join(sorted(unknown))}")
    return replace(
        options or RequestOptions(),
        gamma=opt_int(ext, "gamma", Bounds.GAMMA.lo, Bounds.GAMMA.hi),
        depth=opt_int(ext, "depth", Bounds.DEPTH.lo, Bounds.DEPTH.hi),
        mode=opt_choice(
            ext, "mode", Mode, "wanspec.mode", f"mode must be one of {', '.join(Mode.choices())}"
        ),
        correction=opt_choice(
            ext,
            "correction",
            CorrectionMode,
            "wanspec.correction",
            f"correction must be one of {CorrectionMode.choices()}",
        ),
    )


def parse_timeout(body: Body) -> float | None:
    """``wanspec.timeout``: the request's deadline in seconds (None: the daemon's
    ``request_timeout``). It bounds every wait of the request (the daemon's queue, the
    verifier's admission line) and its generation; past it the request ends with 504 and its
    text so far."""
    ext = opt_object(body, "wanspec", "wanspec must be an object")
    lo, hi = Bounds.TIMEOUT.lo, Bounds.TIMEOUT.hi
    v = opt_num(ext, "timeout", lo, hi)
    return None if v is None else float(v)


def parse_stops(body: Body) -> tuple[str, ...]:
    """``stop``: a string or a list of at most :data:`MAX_STOPS`; empty strings are dropped."""
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop", "stop must be a string or a list of strings")
    if len(items) > MAX_STOPS:
        raise bad_request("stop", f"at most {MAX_STOPS} stop sequences are supported")
    return tuple(s for s in items if s)


def build_pipeline(
    settings: EdgeSettings, options: RequestOptions, logprobs: int | None = None
) -> PipelineConfig:
    """The daemon's defaults with the request's values on top; 400 on a bad combination."""
    try:
        cfg = settings.pipeline(options)
    except ValueError as e:
        raise bad_request("wanspec", str(e)) from None
    try:
        return replace(cfg, logprobs=logprobs)
    except ValueError as e:
        raise bad_request("logprobs", str(e)) from None


def completion_budget(
    prompt_tokens: int, max_tokens: int | None, context: int | ContextLimit | None, default: int
) -> int:
    """The completion length: ``max_tokens``, else ``default`` capped by the room the
    ``context`` (the draft's as a number, or a :class:`ContextLimit`; None: unbounded) leaves
    after the prompt; 400 when they do not fit."""
    if isinstance(context, int):
        context = ContextLimit(context, None)
    limit = None if context is None else context.tokens
    if context is None or limit is None:
        return max_tokens or default
    room = limit - prompt_tokens
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; {context.words('is')}",
            param="messages",
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        over = context.words("of")
        raise ApiError(
            400,
            f"max_tokens {max_tokens} + {prompt_tokens} prompt tokens exceed {over}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens or min(default, room)


# ---------------------------------------------------------------------------- the whole request


@dataclass(frozen=True)
class ApiRequest:
    """What a generation request asks for, every default filled in."""

    pipeline: PipelineConfig
    max_tokens: int
    seed: int | None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    #: The request's deadline (seconds; None: the daemon's request_timeout).
    timeout_s: float | None = None


def parse_request(
    body: Body,
    settings: EdgeSettings,
    *,
    prompt_tokens: int,
    context: int | ContextLimit | None,
    chat: bool = True,
) -> ApiRequest:
    """The sampling, length and speculation fields shared by both generation endpoints.

    ``prompt_tokens``: the prompt's length; ``context``: the context (None: unbounded);
    ``chat``: the chat endpoint (else completions: ``logprobs`` is read their way).
    """
    check_keys(body, Endpoint.CHAT if chat else Endpoint.COMPLETIONS)
    streaming = parse_streaming(body)
    max_tokens = parse_max_tokens(body)
    sampling = parse_sampling(body)
    seed = parse_seed(body)
    ignore_eos = parse_ignore_eos(body)
    logprobs = parse_logprobs(body, chat=chat, federated=settings.federated)
    pipeline = build_pipeline(settings, parse_speculation(body, sampling), logprobs)
    budget = completion_budget(prompt_tokens, max_tokens, context, settings.max_tokens)
    return ApiRequest(
        pipeline=pipeline,
        max_tokens=budget,
        seed=seed if seed is not None else settings.seed,
        stop=parse_stops(body),
        ignore_eos=ignore_eos,
        stream=streaming.stream,
        include_usage=streaming.include_usage,
        timeout_s=parse_timeout(body),
    )


# ---------------------------------------------------------------------------- prompts


def message_text(i: int, content: object) -> str:
    """The text of ``messages[i].content``: a string, a list of text parts, or null."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad_request(f"messages[{i}].content", "only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"messages[{i}].content", "a text part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content", "content must be a string or a list of text parts")


def parse_messages(body: Body) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` for a chat template (a ``developer`` message is
    a ``system`` one)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "messages", "messages must be a non-empty list", "missing_required_parameter"
        )
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}]", "each message needs a string 'role'")
        role = m["role"]
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role", f"unsupported role {role!r}")
        clean.append(
            {
                "role": "system" if role == "developer" else role,
                "content": message_text(i, m.get("content")),
            }
        )
    return clean


def parse_prompt(body: Body, vocab_size: int) -> str | list[int]:
    """``prompt``: a non-empty string (to encode) or token ids in ``0..vocab_size - 1``; a list
    holding one of them is unwrapped."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt", "prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise bad_request("prompt", f"token ids must be in 0..{vocab_size - 1}")
        return [int(t) for t in prompt]
    if prompt is None:
        raise bad_request("prompt", "prompt is required", "missing_required_parameter")
    raise bad_request("prompt", "prompt must be a string, one-string list, or a list of token ids")
