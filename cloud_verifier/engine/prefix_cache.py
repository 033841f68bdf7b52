"""What the sessions of different bearer tokens (tenants) may share on one verifier: who shares
the KV pool's prefix cache (:class:`PrefixCache`, the ``prefix_cache`` setting).

Pure: no I/O, no torch (the verifier's settings name these values before any model loads).
"""

from __future__ import annotations

from shared.enums import TextEnum


class PrefixCache(TextEnum):
    """Who shares the KV pool's prefix cache (:mod:`shared.runtime.kv_pool`). A hit is a
    timing side channel (it tells that someone sent the same prefix), so by default a prefix
    is shared only among the sessions of one bearer token (cf. vLLM's ``cache_salt``)."""

    OFF = "off"
    TENANT = "tenant"  # one namespace per bearer token
    GLOBAL = "global"  # one namespace for every session
