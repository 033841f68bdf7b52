"""The life of a service process (the verifier, the edge daemon), as `/health` reports it."""

from __future__ import annotations

from shared.enums import TextEnum


class ServiceStatus(TextEnum):
    LOADING = "loading"  # the port listens while the model loads; /health answers 503
    READY = "ready"
    FAILED = "failed"  # the model failed to load; /health says why
    STOPPING = "stopping"  # draining after SIGTERM
