"""The verifier's connection guard: a header-read timeout and caps on pending connections,
enforced before any authentication work (:mod:`shared.service.http_guard`, which the edge's API uses
too, holds the mechanism and its rules).

:class:`ConnectionGuard` is built by ``build_app`` from ``header_timeout``,
``max_pending_connections`` and ``max_pending_per_address`` and records into
:class:`~cloud_verifier.stats.VerifierMetrics` (``wanspec_http_*``); :class:`Listener` binds the
sockets of ``cloud-verifier serve`` before the model loads. :data:`HTTP_LOG` is the logger given
to aiohttp's request handlers: a malformed request (aiohttp answers it 400 itself) is a
rate-limited INFO line without a traceback instead of an ERROR with one.
"""

from __future__ import annotations

from shared.service.http_guard import ConnectionGuard, Listener, http_logger

__all__ = ["HTTP_LOG", "ConnectionGuard", "Listener"]

#: The logger of the verifier's aiohttp request handlers (``make_runner``).
HTTP_LOG = http_logger("cloud_verifier.http")
