"""The TLS context of every connection to a verifier (sessions and probes alike)."""

from __future__ import annotations

import ssl


def ssl_context(ca_file: str | None, insecure: bool) -> ssl.SSLContext | bool:
    """``insecure``: no verification (False); ``ca_file``: trust that CA; else the system's."""
    if insecure:
        return False
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return True
