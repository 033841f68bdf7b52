"""The aiohttp application: ``/v1/session`` (WebSocket), ``/health``, ``/metrics``. This module
only wires the parts, each a module of its own job:

* :mod:`~cloud_verifier.daemon.state`: what the parts share (``VerifierState`` under ``STATE``)
  and the connection objects (a connection's bounded sends and closes, its streams);
* :mod:`~cloud_verifier.daemon.limits`: the session's and the engine's limits from the settings;
* :mod:`~cloud_verifier.daemon.routes`: the HTTP routes and the guard's middleware;
* :mod:`~cloud_verifier.daemon.connection`: one connection and its streams;
* :mod:`~cloud_verifier.daemon.admission`: admission and tenancy (refusals, the admission line,
  the bearer tokens' reload and revocation);
* :mod:`~cloud_verifier.daemon.parking`: lost sessions kept for resumption;
* :mod:`~cloud_verifier.daemon.session_loop`: one session's loop, from its Hello to its end;
* :mod:`~cloud_verifier.daemon.lifecycle`: the service's life (the model's load, the engine's
  health, the systemd watchdog, drain and shutdown).

Tasks and their owners: the model load, the systemd watchdog and the token-file poll each run in
a task created and cancelled-and-awaited by a cleanup context; session handlers are aiohttp's
request tasks, and ``on_shutdown`` closes their WebSockets with GOING_AWAY so they end. Closing
the sessions of a revoked token runs in tasks kept in ``VerifierState.closers``.

Serve it with :func:`make_runner` and a :class:`~shared.service.http_guard.Listener` (as
``cloud-verifier serve`` does): that adds the header-read timeout and the caps on connections that
have not reached a handler yet (``state.guard``; the middleware tells it when a request starts).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from cloud_verifier.daemon.admission import token_ctx
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.lifecycle import close_connections, engine_ctx, watchdog_ctx
from cloud_verifier.daemon.limits import engine_limits, limits_from
from cloud_verifier.daemon.metrics import VerifierMetrics
from cloud_verifier.daemon.parking import parked_ctx
from cloud_verifier.daemon.routes import (
    guard_middleware,
    health_handler,
    metrics_handler,
    session_handler,
)
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.draft_model import load_draft_target
from cloud_verifier.engine.engine import Engine
from cloud_verifier.engine.targets import Target, compiles, load_target
from cloud_verifier.session.admission import AdmissionLine
from shared.service.http_guard import ConnectionGuard, http_logger
from shared.service.sdnotify import Notifier

#: ``STATE`` is re-exported: the benchmarks (``bench/overhead.py``) reach the state through it.
__all__ = ["HTTP_LOG", "STATE", "build_app", "default_draft_loader", "make_runner"]

#: The logger of the verifier's aiohttp request handlers (:func:`make_runner`): a malformed
#: request (aiohttp answers it 400 itself) is a rate-limited INFO line without a traceback,
#: not an ERROR with one (:func:`shared.service.http_guard.http_logger`).
HTTP_LOG = http_logger("cloud_verifier.http")


def default_draft_loader(settings: VerifierSettings) -> Callable[[Target], Target] | None:
    """Loads ``settings.cloud_draft_model`` beside the target (None: no cloud draft model)."""
    spec = settings.cloud_draft_model
    if not spec:
        return None

    def load(target: Target) -> Target:
        compiled = compiles(settings.compile, str(target.device))
        return load_draft_target(spec, target, compile_forward=compiled)

    return load


def build_app(
    settings: VerifierSettings,
    *,
    auth: Authenticator,
    engine: Engine | None = None,
    loader: Callable[[], Target] | None = None,
    draft_loader: Callable[[Target], Target] | None = None,
    notifier: Notifier | None = None,
    metrics: VerifierMetrics | None = None,
) -> web.Application:
    """The verifier app. ``loader`` (run on the model worker) defaults to loading
    ``settings.model``; pass ``engine`` to observe it (tests count its forwards)."""
    if loader is None:

        def loader() -> Target:
            return load_target(
                settings.model,
                device=settings.device,
                dtype=settings.dtype,
                compile_forward=settings.compile,
            )

    app = web.Application(middlewares=[guard_middleware])
    metrics = metrics or VerifierMetrics()
    app[STATE] = VerifierState(
        settings=settings,
        engine=engine or Engine(engine_limits(settings)),
        auth=auth,
        metrics=metrics,
        limits=limits_from(settings),
        loader=loader,
        draft_loader=draft_loader or default_draft_loader(settings),
        notifier=notifier or Notifier(None),
        guard=ConnectionGuard(
            header_timeout=settings.header_timeout,
            max_pending=settings.max_pending_connections,
            max_pending_per_address=settings.max_pending_per_address,
            metrics=metrics.http,
        ),
    )
    app[STATE].line = AdmissionLine(settings.admission_queue, settings.admission_queue_per_token)
    metrics.slots_total.set(settings.max_sessions)
    app.router.add_get("/v1/session", session_handler)
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(engine_ctx)
    app.cleanup_ctx.append(watchdog_ctx)
    app.cleanup_ctx.append(token_ctx)
    app.cleanup_ctx.append(parked_ctx)
    app.on_shutdown.append(close_connections)
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner ``serve`` uses: no access log, aiohttp's request errors through
    :data:`HTTP_LOG` (malformed requests: rate-limited INFO lines)."""
    settings = app[STATE].settings
    return web.AppRunner(
        app,
        shutdown_timeout=settings.shutdown_timeout,
        access_log=None,
        logger=HTTP_LOG,
        # The guard closes connections idle between requests after header_timeout; this is
        # only aiohttp's own (hour-long by default) backstop.
        keepalive_timeout=max(75.0, settings.header_timeout),
    )
