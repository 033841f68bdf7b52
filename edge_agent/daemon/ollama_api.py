"""Ollama-compatible routes of ``edge-agent serve``, for the clients people run against local
models (Open WebUI, editors, the ``ollama`` libraries).

Routes: ``POST /api/chat``, ``POST /api/generate`` (NDJSON streaming by default, one object
with ``"stream": false``), ``GET /api/tags``, ``POST /api/show``, ``GET /api/version``, and
``GET``/``HEAD /`` ("Ollama is running", the probe clients send first).

They run on the OpenAI routes' path (:mod:`edge_agent.daemon.server`): the same chat template
(``chat_prompt``), bounds and parsers (:mod:`edge_agent.daemon.ollama_request` over
:mod:`edge_agent.daemon.api_request`), queue, generation (``EdgeService.stream``), statistics
(the ``"wanspec"`` object, the request metrics) and API key (``Authorization: Bearer``, as
Ollama's clients send ``OLLAMA_API_KEY``). Errors are Ollama's ``{"error": "..."}``, with the
OpenAI routes' status codes; an error after a stream began is its last line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, Final, Generic, Protocol, TypeVar

from aiohttp import hdrs, web

from edge_agent.daemon.api_errors import ApiError, from_http
from edge_agent.daemon.api_request import Body, build_pipeline, completion_budget
from edge_agent.daemon.http_stream import Writer, finish_stream, next_event, read_body
from edge_agent.daemon.ollama_request import (
    CHAT_KEYS,
    GENERATE_KEYS,
    OllamaOptions,
    cap_to_num_ctx,
    check_keys,
    dumps,
    error_text,
    num_predict_error,
    parse_chat_messages,
    parse_generate_prompt,
    parse_ollama_options,
    parse_stream,
)
from edge_agent.runtime.events import Failed, FailureKind, Finished, Piece, RuntimeEvent, last_event
from edge_agent.runtime.service import EdgeService, GenRequest
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.runtime.text import encode_prompt

log = logging.getLogger("wanspec.edge.ollama")

#: The Ollama release whose API these routes follow (``GET /api/version``; clients check it).
OLLAMA_API_VERSION: Final = "0.12.0"
NDJSON: Final = "application/x-ndjson"
NS_PER_S: Final = 1_000_000_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The completion tokens of an answer whose generation finished, set on the response for the
#: daemon's access log (``server.api_middleware``), by these routes and the OpenAI ones.
COMPLETION_TOKENS: Final = web.ResponseKey("wanspec_completion_tokens", int)


class ServerView(Protocol):
    """What these routes read of the server's state (``server.ServerState``)."""

    service: EdgeService
    api_key: str | None
    started: int  # when the daemon started (Unix time)

    @property
    def settings(self) -> EdgeSettings: ...


S = TypeVar("S", bound=ServerView)


@dataclass(frozen=True)
class ServerHooks(Generic[S]):
    """The OpenAI routes' own steps, handed over by the server when it registers these routes
    (it imports this module, so this module does not import it): its state, the chat template
    path, the mapping of a generation's failure to an :class:`ApiError` (and the exceptions
    it maps), the API key's comparison, the readiness check."""

    state: S
    chat_prompt: Callable[[S, dict[str, Any]], list[int]]
    failure_error: Callable[[Failed], ApiError]
    key_matches: Callable[[str, str], bool]
    require_ready: Callable[[S], None]


HOOKS = web.AppKey("wanspec_ollama_hooks", ServerHooks)


# ---------------------------------------------------------------------------- names and errors


def listed_name(model_id: str) -> str:
    """The served model as Ollama lists it: ``name:tag`` (``:latest`` when the id has none)."""
    return model_id if ":" in model_id else model_id + ":latest"


def served(model_id: str, name: object) -> bool:
    """Whether ``name`` names the served model: its id, or its listed ``name:tag``."""
    return isinstance(name, str) and name in (model_id, listed_name(model_id))


def check_model(state: ServerView, body: dict[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required", param="model")
    if not served(state.settings.model_id, name):
        listed = listed_name(state.settings.model_id)
        raise ApiError(404, f"model '{name}' not found; this server offers '{listed}'")
    return name


def error_response(e: ApiError) -> web.Response:
    headers = {} if e.retry_after is None else {"Retry-After": str(e.retry_after)}
    body = {**e.partial, "error": error_text(e)}
    return web.json_response(body, status=e.status, headers=headers or None, dumps=dumps)


def ollama_route(handler: Handler) -> Handler:
    """``handler`` behind the API key (when configured), its errors as Ollama's."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        hooks = request.app[HOOKS]
        key = hooks.state.api_key
        try:
            if key is not None:
                header = request.headers.get(hdrs.AUTHORIZATION, "")
                given = header[7:].strip() if header[:7].lower() == "bearer " else ""
                if not hooks.key_matches(given, key):
                    raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(from_http(e))
        except Exception as e:
            log.exception("internal error in %s", request.path)
            why = f"internal error ({type(e).__name__}: {e})"
            return error_response(hooks.failure_error(Failed(FailureKind.INTERNAL, why)))

    return wrapped


def created_at() -> str:
    """Now, as Ollama writes it: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------- responses


@dataclass
class Reply:
    """One generation's objects in its route's shape: ``message`` (chat) or ``response``."""

    model: str
    chat: bool
    started_ns: int  # the request's arrival (time.monotonic_ns)

    def text_fields(self, text: str) -> dict[str, Any]:
        if self.chat:
            return {"message": {"role": "assistant", "content": text}}
        return {"response": text}

    def chunk(self, text: str) -> dict[str, Any]:
        return {
            "model": self.model,
            "created_at": created_at(),
            **self.text_fields(text),
            "done": False,
        }

    def final(self, f: Finished, text: str) -> dict[str, Any]:
        """The last object: ``text`` (all of it, or "" when streamed), the reason and the
        durations (ns): ``prompt_eval`` until the first token, ``eval`` the rest."""
        total = time.monotonic_ns() - self.started_ns
        wall = int(float(f.stats.get("wall_s") or 0.0) * NS_PER_S)
        ttft_ms = f.stats.get("ttft_ms")
        prompt_eval = int(float(ttft_ms) * 1_000_000) if ttft_ms is not None else 0
        return {
            "model": self.model,
            "created_at": created_at(),
            **self.text_fields(text),
            "done": True,
            "done_reason": f.finish_reason,
            "total_duration": total,
            "load_duration": 0,  # the model is loaded once, when the daemon starts
            "prompt_eval_count": f.prompt_tokens,
            "prompt_eval_duration": prompt_eval,
            "eval_count": f.completion_tokens,
            "eval_duration": max(0, wall - prompt_eval),
            "wanspec": f.stats,
        }

    def loaded(self) -> dict[str, Any]:
        """The answer to an empty prompt: Ollama's "load the model" request (already loaded)."""
        return {
            "model": self.model,
            "created_at": created_at(),
            **self.text_fields(""),
            "done": True,
            "done_reason": "load",
        }


def _line(obj: Any) -> bytes:
    return dumps(obj).encode() + b"\n"


async def _stream(
    hooks: ServerHooks[Any],
    out: Writer,
    events: AsyncIterator[RuntimeEvent],
    reply: Reply,
) -> None:
    idle = _line(reply.chunk(""))
    keepalive = hooks.state.settings.stream_keepalive
    while True:
        ev = await next_event(out, events, keepalive, idle)
        if isinstance(ev, Failed):
            await out.write(_line({"error": error_text(hooks.failure_error(ev))}))
            break
        if isinstance(ev, Finished):
            out.resp[COMPLETION_TOKENS] = ev.completion_tokens
            await out.write(_line(reply.final(ev, "")))
            break
        if isinstance(ev, Piece):
            await out.write(_line(reply.chunk(ev.text)))


async def _stream_to_client(
    hooks: ServerHooks[Any],
    out: Writer,
    events: AsyncIterator[RuntimeEvent],
    reply: Reply,
    path: str,
) -> None:
    """Stream ``events`` as NDJSON lines and end the body (:func:`finish_stream`: only a
    client gone before the last line, done or error, dropped anything)."""
    await finish_stream(out, _stream(hooks, out, events, reply), f"an Ollama {path}", log)


def gen_request(state: ServerView, prompt_ids: list[int], opts: OllamaOptions) -> GenRequest:
    """The internal request, as the OpenAI routes build it for the same values."""
    s = state.settings
    try:
        budget = completion_budget(
            len(prompt_ids), opts.max_tokens, state.service.context_limit(), s.max_tokens
        )
    except ApiError as e:
        raise num_predict_error(e) from None
    return GenRequest(
        prompt_ids=prompt_ids,
        pipeline=build_pipeline(s, opts.sampling),
        max_tokens=cap_to_num_ctx(len(prompt_ids), budget, opts.num_ctx),
        seed=opts.seed if opts.seed is not None else s.seed,
        stop=opts.stop,
        timeout_s=opts.timeout_s,
    )


P = TypeVar("P")


@dataclass(frozen=True)
class _Asked(Generic[P]):
    """A generation request of either route, read and checked (:func:`_read_asked`): the
    route's ``reply`` shape, ``stream``, the options and the route's own ``prompt``."""

    hooks: ServerHooks[Any]
    reply: Reply
    stream: bool
    opts: OllamaOptions
    prompt: P

    def loaded(self) -> web.Response:
        """The answer to an empty prompt (:meth:`Reply.loaded`)."""
        return web.json_response(self.reply.loaded(), dumps=dumps)


async def _read_asked(
    request: web.Request, keys: tuple[str, ...], chat: bool, parse: Callable[[Body], P]
) -> _Asked[P]:
    """The checks both routes run, in one order, so that the first fault found is the one
    answered: the body, the model, the keys (``keys``), ``stream``, the options, the route's
    prompt (``parse``); only then the daemon's readiness, so a malformed request is a 400 even
    while the model loads."""
    started = time.monotonic_ns()
    hooks = request.app[HOOKS]
    body = await read_body(request)
    model = check_model(hooks.state, body)
    check_keys(body, keys)
    stream = parse_stream(body)
    opts = parse_ollama_options(body)
    prompt = parse(body)
    hooks.require_ready(hooks.state)
    return _Asked(hooks, Reply(model, chat, started), stream, opts, prompt)


async def _generate(
    request: web.Request, asked: _Asked[Any], prompt_ids: list[int]
) -> web.StreamResponse:
    hooks, reply, stream = asked.hooks, asked.reply, asked.stream
    state = hooks.state
    req = gen_request(state, prompt_ids, asked.opts)
    if stream and (refused := state.service.admission()) is not None:
        raise hooks.failure_error(refused)  # a full queue is a 429, before any header
    async with contextlib.aclosing(state.service.stream(req)) as events:
        if not stream:
            ev = await last_event(events)
            if isinstance(ev, Failed):
                err = hooks.failure_error(ev)
                partial = ev.partial
                if partial is not None:  # the text it had generated, and its statistics
                    err.partial = {
                        **reply.loaded(),
                        **reply.text_fields(partial.text),
                        "done": False,
                        "done_reason": None,
                        "eval_count": partial.completion_tokens,
                        "wanspec": partial.stats,
                    }
                raise err
            done = web.json_response(reply.final(ev, ev.text), dumps=dumps)
            done[COMPLETION_TOKENS] = ev.completion_tokens
            return done
        resp = web.StreamResponse(
            headers={
                hdrs.CONTENT_TYPE: NDJSON,
                hdrs.CACHE_CONTROL: "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        # The headers go at once; from here an error is the stream's last line.
        await resp.prepare(request)
        out = Writer(resp, state.settings.write_timeout)
        await _stream_to_client(hooks, out, events, reply, request.path)
        return resp


# ---------------------------------------------------------------------------- handlers


async def chat_handler(request: web.Request) -> web.StreamResponse:
    asked = await _read_asked(request, CHAT_KEYS, True, parse_chat_messages)
    if not asked.prompt:
        return asked.loaded()
    prompt_ids = asked.hooks.chat_prompt(asked.hooks.state, {"messages": asked.prompt})
    return await _generate(request, asked, prompt_ids)


async def generate_handler(request: web.Request) -> web.StreamResponse:
    asked = await _read_asked(request, GENERATE_KEYS, False, parse_generate_prompt)
    prompt, hooks = asked.prompt, asked.hooks
    if not prompt.text:
        return asked.loaded()
    loaded, _ = hooks.state.service.require()
    if prompt.raw or not getattr(loaded.tokenizer, "chat_template", None):
        # Raw, or a model with no template (Ollama's is then the prompt itself).
        try:
            prompt_ids = encode_prompt(loaded, prompt.text, chat=False)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
    else:
        prompt_ids = hooks.chat_prompt(hooks.state, {"messages": prompt.messages})
    return await _generate(request, asked, prompt_ids)


def details(state: ServerView) -> dict[str, Any]:
    """Ollama's ``details`` of the served model (what the daemon knows of it)."""
    loaded = state.service.loaded
    family = ""
    if loaded is not None and hasattr(loaded, "model"):
        family = str(getattr(loaded.model.config, "model_type", "") or "")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _modified_at(state: ServerView) -> str:
    return datetime.fromtimestamp(state.started, timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(state: ServerView) -> str:
    """A stable id of what is served: the model id with its draft and verifiers."""
    s = state.settings
    what = "\0".join([s.model_id, str(state.service.draft_name or s.draft), *s.verifier_urls])
    return hashlib.sha256(what.encode()).hexdigest()


async def tags_handler(request: web.Request) -> web.Response:
    state = request.app[HOOKS].state
    name = listed_name(state.settings.model_id)
    model = {
        "name": name,
        "model": name,
        "modified_at": _modified_at(state),
        "size": 0,  # the weights are on the verifier; the draft's are not the model served
        "digest": _digest(state),
        "details": details(state),
    }
    return web.json_response({"models": [model]}, dumps=dumps)


async def show_handler(request: web.Request) -> web.Response:
    state = request.app[HOOKS].state
    body = await read_body(request)
    if body.get("model") is None and isinstance(body.get("name"), str):
        body = {**body, "model": body["name"]}  # the older clients' key
    check_model(state, body)
    info: dict[str, Any] = {
        "general.architecture": details(state)["family"],
        "wanspec.draft": state.service.draft_name or state.settings.draft,
        "wanspec.verifiers": list(state.settings.verifier_urls),
    }
    limit = state.service.context_limit().tokens
    if limit is not None:
        info["context_length"] = limit
    template = ""
    loaded = state.service.loaded
    if loaded is not None:
        template = str(getattr(loaded.tokenizer, "chat_template", None) or "")
    out = {
        "modelfile": f"# served by wanspec's edge-agent\nFROM {info['wanspec.draft']}\n",
        "parameters": "",
        "template": template,
        "details": details(state),
        "model_info": info,
        "capabilities": ["completion"],
        "modified_at": _modified_at(state),
    }
    return web.json_response(out, dumps=dumps)


def wanspec_version() -> str:
    try:
        return metadata.version("wanspec")
    except metadata.PackageNotFoundError:
        return "unknown"


async def version_handler(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_API_VERSION, "wanspec": wanspec_version()})


async def root_handler(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


def add_ollama_routes(app: web.Application, hooks: ServerHooks[Any]) -> None:
    """Register the Ollama-compatible routes on the edge API ``app``, run by the server's
    ``hooks`` (``GET`` routes answer ``HEAD`` too)."""
    app[HOOKS] = hooks
    app.router.add_get("/", root_handler)
    app.router.add_get("/api/version", ollama_route(version_handler))
    app.router.add_get("/api/tags", ollama_route(tags_handler))
    app.router.add_post("/api/show", ollama_route(show_handler))
    app.router.add_post("/api/chat", ollama_route(chat_handler))
    app.router.add_post("/api/generate", ollama_route(generate_handler))
