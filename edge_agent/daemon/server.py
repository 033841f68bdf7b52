"""``edge-agent serve``: an OpenAI-compatible local API in front of :class:`EdgeService`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming as Server-Sent
Events ending with ``data: [DONE]``, or not), ``GET /v1/models``, ``GET /v1/models/{model}``,
``GET /health``, ``GET /metrics``; docs/edge/api.md documents each (a test checks).
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Every response of a
generation carries our extension ``"wanspec": {...}`` (acceptance, bytes, rounds, RTT; in the
last chunk when streaming). Request bodies are checked by the pure parsers of
:mod:`edge_agent.daemon.api_request`; errors are :class:`~edge_agent.daemon.api_errors.ApiError`.

Connections are guarded before any work (:mod:`shared.service.http_guard`, as on the verifier):
request headers must arrive within ``header_timeout``, and connections whose request has not reached
a handler are capped (``max_pending_connections``, ``max_pending_per_address``; more get 503 at
once). ``serve`` binds the port through the guard's :class:`~shared.service.http_guard.Listener`.

Each request answered is one line of the access log (:data:`ACCESS_LOG`, by the middleware that
counts the requests): method, path, status, a generation's completion tokens, seconds.

Tasks and their owners: the model load, the verifier probe and the systemd watchdog run in tasks
created and cancelled-and-awaited by a cleanup context. Request handlers are cancelled when
their client disconnects (``handler_cancellation``), which cancels their generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import hdrs, web

from edge_agent.daemon.api_errors import ApiError, bad_request, from_http
from edge_agent.daemon.api_logprobs import Decode, chat_logprobs, completion_logprobs
from edge_agent.daemon.api_request import (
    ApiRequest,
    parse_messages,
    parse_prompt,
    parse_request,
)
from edge_agent.daemon.http_stream import Writer, finish_stream, next_event, read_body
from edge_agent.daemon.ollama_api import COMPLETION_TOKENS, ServerHooks, add_ollama_routes
from edge_agent.daemon.progress import Progress, quiet_hub_progress
from edge_agent.model.tasks import cancel_all
from edge_agent.runtime.events import (
    Failed,
    FailureKind,
    Finished,
    Partial,
    Piece,
    RuntimeEvent,
    last_event,
)
from edge_agent.runtime.monitor import Availability
from edge_agent.runtime.report import plural
from edge_agent.runtime.service import EdgeService, GenRequest
from edge_agent.runtime.settings import EdgeSettings, listen_error, read_secret_file
from edge_agent.runtime.text import NoChatTemplate, encode_chat, encode_prompt
from edge_agent.session.events import TokenLogprob
from shared.enums import TextEnum
from shared.service.http_guard import ConnectionGuard, Listener, http_logger
from shared.service.metrics import CONTENT_TYPE
from shared.service.sdnotify import Notifier
from shared.service.status import ServiceStatus, StopSignals

log = logging.getLogger("wanspec.edge.server")
#: One line per request answered (``POST /v1/chat/completions 200 42 tokens 1.93 s``), the
#: access log: its own logger, so an operator can route or silence it alone.
ACCESS_LOG = logging.getLogger("wanspec.edge.access")
#: Routes polled by monitors (systemd, load balancers, Prometheus): their lines are DEBUG, so
#: the probes do not bury the requests in the access log.
PROBE_PATHS: Final = frozenset({"/health", "/metrics"})
#: The logger of aiohttp's request handlers (:func:`make_runner`): a malformed request is a
#: rate-limited INFO line, not an ERROR with a traceback.
HTTP_LOG = http_logger("wanspec.edge.http")


# ---------------------------------------------------------------------------- state


@dataclass
class ServerState:
    service: EdgeService
    guard: ConnectionGuard  # pending connections: the header timeout and the caps
    api_key: str | None = None
    notifier: Notifier = field(default_factory=lambda: Notifier(None))
    progress: Progress | None = None
    status: ServiceStatus = ServiceStatus.LOADING
    reason: str = "loading the draft model"
    started: int = field(default_factory=lambda: int(time.time()))
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set_status(self, status: ServiceStatus, reason: str) -> None:
        self.status, self.reason = status, reason
        self.changed.set()

    @property
    def settings(self) -> EdgeSettings:
        return self.service.settings


STATE = web.AppKey("wanspec_edge_state", ServerState)


# ---------------------------------------------------------------------------- request parsing


def chat_prompt(state: ServerState, body: dict[str, Any]) -> list[int]:
    """The token ids of ``messages`` under the draft's chat template."""
    messages = parse_messages(body)
    loaded, _ = state.service.require()
    try:
        return encode_chat(loaded, messages, hint="use /v1/completions")
    except NoChatTemplate as e:
        raise ApiError(400, str(e)) from None
    except Exception as e:  # template errors (e.g. roles out of order) are the request's fault
        raise bad_request("messages", f"the chat template refused these messages: {e}") from None


def completion_prompt(state: ServerState, body: dict[str, Any]) -> list[int]:
    """The token ids of ``prompt``: given as ids, or the encoded text."""
    loaded, _ = state.service.require()
    prompt = parse_prompt(body, loaded.vocab_size)
    if isinstance(prompt, list):
        return prompt
    try:
        return encode_prompt(loaded, prompt, chat=False)
    except ValueError as e:
        raise bad_request("prompt", str(e)) from None


def gen_request(api: ApiRequest, prompt_ids: list[int]) -> GenRequest:
    return GenRequest(
        prompt_ids=prompt_ids,
        pipeline=api.pipeline,
        max_tokens=api.max_tokens,
        seed=api.seed,
        stop=api.stop,
        ignore_eos=api.ignore_eos,
        timeout_s=api.timeout_s,
    )


# ---------------------------------------------------------------------------- handlers


def _check_model(state: ServerState, body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "model", "you must provide a model parameter", "missing_required_parameter"
        )
    if model != state.settings.model_id:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server offers {state.settings.model_id!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _require_ready(state: ServerState) -> None:
    if not state.service.ready:
        raise ApiError(
            503, f"not ready: {state.reason}", type_="server_error", code="model_loading"
        )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _usage(f: Finished | Partial) -> dict[str, Any]:
    """OpenAI's ``usage``: ``prompt_tokens_details.cached_tokens`` is the prompt tokens the
    verifier took from its prefix cache (``wanspec.prompt_cached_tokens``; a resumed session
    may report a hit again: never more than the prompt)."""
    cached = min(int(f.stats.get("prompt_cached_tokens", 0)), f.prompt_tokens)
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def failure_error(f: Failed, partial: dict[str, Any] | None = None) -> ApiError:
    """A generation's failure as the API answers it; ``partial``: the members that carry what
    it had generated (non-streaming answers: the text so far, in the endpoint's shape)."""
    if f.kind == FailureKind.QUEUE_FULL:
        return ApiError(
            429, f.message, type_="rate_limit_error", code="queue_full", retry_after=f.retry_after
        )
    if f.kind in (FailureKind.NO_VERIFIER, FailureKind.DEADLINE):
        timed_out = f.kind == FailureKind.DEADLINE
        return ApiError(
            504 if timed_out else 503,
            f.message,
            type_="server_error",
            code="request_timeout" if timed_out else "verifier_unavailable",
            retry_after=f.retry_after,
            partial=partial,
        )
    if f.kind == FailureKind.PROMPT_TOO_LONG:
        return bad_request("messages", f.message, "context_length_exceeded")
    if f.kind == FailureKind.VERIFIER_ERROR:
        return ApiError(502, f.message, type_="server_error", code=f"verifier_{f.code}")
    return ApiError(500, f.message, type_="server_error")


@dataclass
class _Shape:
    """One response's choices in its endpoint's shape (chat or completions), with OpenAI's
    logprobs objects when the request asked (``decode`` set): each chunk carries its piece's
    tokens, the last chunk the rest (tokens with no text of their own, as an end token)."""

    chat: bool
    decode: Decode | None = None
    sent_tokens: int = 0
    sent_chars: int = 0  # completions: the text_offset of the next token

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.decode is None:
            return None
        self.sent_tokens += len(tokens)
        if self.chat:
            return chat_logprobs(tokens, self.decode)
        out = completion_logprobs(tokens, self.decode, self.sent_chars)
        self.sent_chars += sum(len(t) for t in out["tokens"])
        return out

    def _choice(self, text: str, logprobs: Any, finish: str | None, *, full: bool) -> Any:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if full:
            msg = {"role": "assistant", "content": text}
            return {"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, piece: Piece) -> dict[str, Any]:
        return {
            "choices": [self._choice(piece.text, self._logprobs(piece.tokens), None, full=False)]
        }

    def last_chunk(self, f: Finished) -> dict[str, Any]:
        lp = self._logprobs(f.logprobs[self.sent_tokens :])
        return {"choices": [self._choice("", lp, f.finish_reason, full=False)]}

    def final(self, f: Finished) -> dict[str, Any]:
        lp = self._logprobs(f.logprobs)
        return {"choices": [self._choice(f.text, lp, f.finish_reason, full=True)]}

    def partial(self, p: Partial) -> dict[str, Any]:
        """A failed generation's text so far, as ``final`` would give it (no finish_reason:
        it did not finish), with its usage and statistics."""
        choices = [self._choice(p.text, None, None, full=True)]
        return {"choices": choices, "usage": _usage(p), "wanspec": p.stats}


def _decoder(state: ServerState) -> Decode:
    tok = state.service.require()[0].tokenizer

    def decode(token: int) -> str:
        return str(tok.decode([token], skip_special_tokens=False))

    return decode


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    model = _check_model(state, body)
    _require_ready(state)
    prompt_ids = chat_prompt(state, body) if chat else completion_prompt(state, body)
    api = parse_request(
        body,
        state.settings,
        prompt_tokens=len(prompt_ids),
        context=state.service.context_limit(),
        chat=chat,
    )
    shape = _Shape(chat, _decoder(state) if api.pipeline.logprobs is not None else None)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": model}
    if api.stream and (refused := state.service.admission()) is not None:
        raise failure_error(refused)  # a full queue is a 429, before any header
    async with contextlib.aclosing(state.service.stream(gen_request(api, prompt_ids))) as events:
        if not api.stream:
            ev = await last_event(events)
            if isinstance(ev, Failed):
                partial = ev.partial
                extra = None if partial is None else {**head, **shape.partial(partial)}
                raise failure_error(ev, extra)
            out = {**head, **shape.final(ev), "usage": _usage(ev), "wanspec": ev.stats}
            done = web.json_response(out, dumps=lambda o: json.dumps(o, ensure_ascii=False))
            done[COMPLETION_TOKENS] = ev.completion_tokens
            return done
        head["object"] = obj + ".chunk" if chat else obj
        resp = web.StreamResponse(
            headers={
                hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
                hdrs.CACHE_CONTROL: "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        # The headers go at once (a client sees the request accepted, even while it waits for a
        # place or a verifier); from here an error is an event of the stream.
        await resp.prepare(request)
        out_ = Writer(resp, state.settings.write_timeout)
        await _stream_events(
            out_, events, head, shape, api.include_usage, state.settings.stream_keepalive, rid
        )
        return resp


#: The SSE comment that keeps a quiet stream open (clients and proxies ignore comments).
KEEPALIVE: Final = b": keep-alive\n\n"


async def _stream_events(
    out: Writer,
    events: AsyncIterator[RuntimeEvent],
    head: dict[str, Any],
    shape: _Shape,
    include_usage: bool,
    keepalive: float,
    rid: str,
) -> None:
    """Stream ``events`` as SSE chunks, ending with ``data: [DONE]`` (:func:`finish_stream`:
    only a client gone before [DONE] dropped anything)."""
    lines = _write_events(out, events, head, shape, include_usage, keepalive)
    await finish_stream(out, lines, rid, log)


async def _write_events(
    out: Writer,
    events: AsyncIterator[RuntimeEvent],
    head: dict[str, Any],
    shape: _Shape,
    include_usage: bool,
    keepalive: float,
) -> None:
    if shape.chat:
        await out.write(_sse({**head, **_role()}))
    while True:
        ev = await next_event(out, events, keepalive, KEEPALIVE)
        if isinstance(ev, Failed):
            await out.write(_sse(failure_error(ev).body()))
            break
        if not isinstance(ev, (Piece, Finished)):
            continue  # (round trips and waits: the stats and /health say them)
        if isinstance(ev, Finished):
            out.resp[COMPLETION_TOKENS] = ev.completion_tokens
            last = {**head, **shape.last_chunk(ev), "wanspec": ev.stats}
            await out.write(_sse(last))
            if include_usage:
                await out.write(_sse({**head, "choices": [], "usage": _usage(ev)}))
            break
        await out.write(_sse({**head, **shape.chunk(ev)}))
    await out.write(b"data: [DONE]\n\n")


def _role() -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    }


async def chat_handler(request: web.Request) -> web.StreamResponse:
    return await _generate(request, True)


async def completions_handler(request: web.Request) -> web.StreamResponse:
    return await _generate(request, False)


def _model_card(state: ServerState) -> dict[str, Any]:
    draft = state.service.draft_name
    return {
        "id": state.settings.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "wanspec",
        "wanspec": {
            "draft": draft if draft is not None else state.settings.draft,
            "verifiers": list(state.settings.verifier_urls),
        },
    }


async def models_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def model_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.match_info["model"] != state.settings.model_id:
        raise ApiError(
            404,
            f"the model {request.match_info['model']!r} does not exist",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(state))


class EdgeHealth(TextEnum):
    """What /health says beyond the process's life (:class:`ServiceStatus`) once it is ready."""

    UNAVAILABLE = "unavailable"  # 503: no verifier answers (fallback none), or no valid token
    BUSY = "busy"  # 503: the verifiers are alive but take no new session now (fallback none)
    SATURATED = "saturated"  # 503: every generation slot is held and none makes progress
    DEGRADED = "degraded"  # 200: no verifier: answering with the draft alone (fallback draft)


def health(state: ServerState, now: float | None = None) -> tuple[int, dict[str, Any]]:
    """The status code and body of /health at ``now`` (monotonic; default: the clock's)."""
    svc = state.service
    s = state.settings
    link = svc.monitor.describe()
    at = time.monotonic() if now is None else now
    # A slot that took no step (no token, no text taken by its client) for a keep-alive
    # interval is stalled: waiting for a verifier, or for a client that stopped reading (whose
    # write is given up after write_timeout).
    stalled = svc.stalled_slots(at, s.stream_keepalive)
    body: dict[str, Any] = {
        "status": state.status,
        "reason": state.reason,
        "link": link,
        "fallback": s.fallback,
        "queue": {
            "busy": svc.queue.busy,
            "active": svc.queue.active,
            "waiting": svc.queue.waiting,
            "stalled": stalled,
        },
        "pending_connections": state.guard.pending,
    }
    if svc.loaded is not None:
        body["draft"] = svc.draft_name
    if state.status != ServiceStatus.READY:
        return 503, body
    # Ready means able to serve: not when every request would be refused for its token.
    missing = svc.monitor.missing_token(svc.has_token)
    if missing is not None:
        body["status"] = EdgeHealth.UNAVAILABLE
        body["reason"] = missing
        return 503, body
    available = svc.monitor.availability
    if available != Availability.UP:
        if s.fallback == "none":
            if available == Availability.BUSY:
                body["status"] = EdgeHealth.BUSY
                body["reason"] = (
                    f"the verifier is busy ({svc.monitor.state}): new requests wait for it, "
                    f"up to verifier_wait = {s.verifier_wait:g} s"
                )
            else:
                body["status"] = EdgeHealth.UNAVAILABLE
                body["reason"] = "no verifier is reachable and no fallback is configured"
            return 503, body
        body["status"] = EdgeHealth.DEGRADED
        body["reason"] = "no verifier is reachable: answering with the draft alone (unverified)"
    if stalled >= svc.queue.max_active:
        body["status"] = EdgeHealth.SATURATED
        body["reason"] = (
            f"all {svc.queue.max_active} generation slots are held and none made progress for "
            f"{s.stream_keepalive:g} s; {svc.queue.waiting} requests wait"
        )
        return 503, body
    return 200, body


async def health_handler(request: web.Request) -> web.Response:
    status, body = health(request.app[STATE])
    return web.json_response(body, status=status)


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    svc = state.service
    svc.metrics.queue_waiting.set(svc.queue.waiting)
    return web.Response(
        body=svc.metrics.render().encode(), headers={hdrs.CONTENT_TYPE: CONTENT_TYPE}
    )


# ---------------------------------------------------------------------------- middleware


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _key_matches(given: str, key: str) -> bool:
    """Constant-time comparison; a key with non-ASCII bytes (undecodable) simply does not match
    (a 401, never a 500)."""
    try:
        raw = given.encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, key.encode())


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Headers complete: the connection is no longer pending (``shared.service.http_guard``) until
    this request is answered. The outermost middleware, so nothing runs before it."""
    guard = request.app[STATE].guard
    guard.request_started(request.transport)
    try:
        return await handler(request)
    finally:
        guard.request_finished(request.transport)


def access_line(
    request: web.Request, code: str, resp: web.StreamResponse | None, seconds: float
) -> str:
    """The access log's line of one request: ``POST /v1/chat/completions 200 42 tokens 1.93 s``
    (the completion tokens where a generation finished; the path without its query)."""
    tokens = None if resp is None else resp.get(COMPLETION_TOKENS)
    counted = "" if tokens is None else " " + plural(tokens, "token")
    return f"{request.method} {request.path} {code}{counted} {seconds:.2f} s"


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    is_api = request.path.startswith("/v1/")
    code = "500"
    resp: web.StreamResponse | None = None
    started = time.monotonic()
    try:
        try:
            if is_api and state.api_key is not None:
                header = request.headers.get(hdrs.AUTHORIZATION, "")
                given = header[7:].strip() if header[:7].lower() == "bearer " else ""
                if not _key_matches(given, state.api_key):
                    raise ApiError(
                        401,
                        "missing or wrong API key (Authorization: Bearer ...)",
                        code="invalid_api_key",
                    )
            resp = await handler(request)
        except web.HTTPException as e:
            if not is_api or e.status < 400:
                code = str(e.status)
                raise
            resp = from_http(e).response()
        except ApiError as e:
            resp = e.response()
        except asyncio.CancelledError:
            code = "499"  # the client went away
            raise
        except Exception as e:
            log.exception("internal error in %s", endpoint)
            why = f"internal error ({type(e).__name__}: {e})"
            resp = failure_error(Failed(FailureKind.INTERNAL, why)).response()
        code = str(resp.status)
        return resp
    finally:
        state.service.metrics.requests.inc(endpoint=endpoint, code=code)
        level = logging.DEBUG if request.path in PROBE_PATHS else logging.INFO
        if ACCESS_LOG.isEnabledFor(level):
            line = access_line(request, code, resp, time.monotonic() - started)
            ACCESS_LOG.log(level, "%s", line)


# ---------------------------------------------------------------------------- app and serve


async def _load(state: ServerState) -> None:
    progress = state.progress or Progress(state.notifier)
    try:
        async with progress.spinner():
            await state.service.load(progress.report)
    except Exception as e:
        log.error("the draft model failed to load: %s", e, exc_info=e)
        state.notifier.notify(f"STATUS=draft model failed to load: {e}")
        state.set_status(ServiceStatus.FAILED, f"the draft model failed to load: {e}")
        return
    log.info("%s", state.service.describe())
    loaded, _ = state.service.require()
    what = "cloud-only (no draft model)" if state.settings.cloud_only else loaded.name
    state.set_status(ServiceStatus.READY, f"serving {what}")


def _link_status(state: ServerState) -> None:
    if state.status == ServiceStatus.READY:
        link = state.service.monitor.state
        state.notifier.notify(f"STATUS=serving; verifier {link}")


async def _watchdog(state: ServerState, interval: float) -> None:
    """WATCHDOG=1 while the loop runs and the model worker answers."""
    while True:
        ok = True
        if state.status == ServiceStatus.READY:
            try:
                await asyncio.wait_for(state.service.worker.run(lambda: None), interval * 1.5)
            except asyncio.TimeoutError:
                ok = False
                log.error("the model worker did not answer within %.1f s", interval * 1.5)
        if ok:
            state.notifier.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.service.monitor.changed = lambda: _link_status(state)
    tasks = [
        asyncio.create_task(_load(state), name="wanspec-edge-load"),
        asyncio.create_task(state.service.monitor.run(), name="wanspec-edge-probe"),
    ]
    interval = state.notifier.watchdog_interval
    if interval is not None:
        tasks.append(asyncio.create_task(_watchdog(state, interval), name="wanspec-edge-watchdog"))
    try:
        yield
    finally:
        await cancel_all(tasks)
        await state.service.close()


def build_app(
    service: EdgeService,
    *,
    api_key: str | None = None,
    notifier: Notifier | None = None,
    progress: Progress | None = None,
) -> web.Application:
    """The API app; the model loads in the background once the app starts."""
    s = service.settings
    app = web.Application(
        middlewares=[guard_middleware, api_middleware], client_max_size=s.max_body
    )
    guard = ConnectionGuard(
        header_timeout=s.header_timeout,
        max_pending=s.max_pending_connections,
        max_pending_per_address=s.max_pending_per_address,
        metrics=service.metrics.http,
        logger=log,
    )
    app[STATE] = ServerState(
        service=service,
        guard=guard,
        api_key=api_key,
        notifier=notifier or Notifier(None),
        progress=progress,
    )
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_post("/v1/completions", completions_handler)
    app.router.add_get("/v1/models", models_handler)
    app.router.add_get("/v1/models/{model}", model_handler)
    add_ollama_routes(
        app,
        ServerHooks(app[STATE], chat_prompt, failure_error, _key_matches, _require_ready),
    )
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(_background_ctx)
    return app


def make_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """A runner that cancels a request's handler when its client disconnects, logging request
    errors through :data:`HTTP_LOG`. Serve it through :func:`make_listener` (as ``serve``
    does): that is where the connection guard applies."""
    kwargs.setdefault("logger", HTTP_LOG)
    # The access log is the middleware's (ACCESS_LOG, with the tokens): not aiohttp's as well.
    kwargs.setdefault("access_log", None)
    # The guard closes connections idle between requests after header_timeout; this is only
    # aiohttp's own backstop.
    kwargs.setdefault("keepalive_timeout", max(75.0, app[STATE].settings.header_timeout))
    return web.AppRunner(app, handler_cancellation=True, **kwargs)


def make_listener(app: web.Application, host: str, port: int) -> Listener:
    """The API's listening sockets, serving through the app's connection guard: ``bind()`` it
    (OSError: the address is not usable), then ``start(runner)`` once the runner is set up."""
    return Listener(app[STATE].guard, host, port)


async def serve(settings: EdgeSettings) -> int:
    """Run until SIGTERM/SIGINT. 0, or 1 when the draft model failed to load."""
    notifier = Notifier.from_env()
    quiet_hub_progress()
    api_key = (
        read_secret_file(settings.api_key_file, "api_key_file") if settings.api_key_file else None
    )
    service = EdgeService(settings)
    app = build_app(service, api_key=api_key, notifier=notifier, progress=Progress(notifier))
    state = app[STATE]
    runner = make_runner(app, shutdown_timeout=5.0, access_log=None)
    listener = make_listener(app, settings.host, settings.port)
    stop = StopSignals(state.changed, log).install()
    rc = 0
    try:
        try:
            await listener.bind()  # before the model load starts
        except OSError as e:  # checked before loading; this is the race that check leaves
            raise listen_error(settings, (settings.host, settings.port), e) from None
        await runner.setup()  # starts the model load and the verifier probe
        await listener.start(runner)
        for addr in listener.addresses:
            log.info("edge-agent API on http://%s:%d/v1", addr[0], addr[1])
        announced = False
        while True:
            await state.changed.wait()
            state.changed.clear()
            if stop.stopping:
                break
            if state.status == ServiceStatus.FAILED:
                rc = 1
                break
            if state.status == ServiceStatus.READY and not announced:
                # The API listens and the draft is loaded: only now is the service up.
                link = state.service.monitor.state
                notifier.notify(f"READY=1\nSTATUS=serving; verifier {link}")
                log.info("ready: %s (verifier %s)", state.reason, link)
                announced = True
    finally:
        state.set_status(ServiceStatus.STOPPING, "shutting down")
        notifier.notify("STOPPING=1\nSTATUS=stopping")
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()
        stop.remove()
    return rc
