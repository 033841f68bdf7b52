"""TLS for the verifier: the server context built from ``tls_cert``/``tls_key`` (PEM files).

With both set, ``serve`` listens for ``wss://`` (and ``https://`` for /health, /metrics) only.
TLS 1.2 is the floor; the edge verifies the certificate by default (``LinkSettings.ssl=True``),
so a self-signed certificate needs its CA given to the edge.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from shared.service.config import ConfigError


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side context for ``cert`` (a PEM chain) and its private ``key``.

    Raises :class:`ConfigError` naming the setting when a file cannot be used.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not path.is_file():
            raise ConfigError(name, f"{path} is not a readable file")
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            "tls_cert", f"cannot load {cert} with key {key}: {getattr(e, 'reason', None) or e}"
        ) from None
    return ctx
