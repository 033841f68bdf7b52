"""Bearer-token authentication, checked before the WebSocket upgrade.

A token file holds one token per line (several for rotation); blank lines and ``#`` comments are
ignored. The file is re-read when its size or modification time changes, so tokens rotate without
a restart. Comparison is constant-time (:func:`hmac.compare_digest`) against every token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


#: The key :meth:`Authenticator.identify` gives everyone when authentication is off.
ANONYMOUS = "anonymous"


class AuthError(ValueError):
    """The token file cannot be used (the message names it)."""


def parse_tokens(text: str, source: str = "token file") -> tuple[str, ...]:
    tokens: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        tok = line.strip()
        if not tok or tok.startswith("#"):
            continue
        if any(c.isspace() for c in tok):
            raise AuthError(f"{source}, line {n}: a token may not contain whitespace")
        tokens.append(tok)
    return tuple(tokens)


def generate_token() -> str:
    """A fresh random token (for tests and the loopback demo)."""
    return secrets.token_urlsafe(32)


class Authenticator:
    """Checks ``Authorization: Bearer <token>`` headers. ``enabled=False`` lets everyone in."""

    def __init__(
        self,
        tokens: Iterable[str] = (),
        *,
        token_file: Path | None = None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self._static = tuple(tokens)
        self._file = token_file
        self._file_key: tuple[int, int] | None = None
        self._file_tokens: tuple[str, ...] = ()
        if enabled:
            self._reload()
            if not self._tokens():
                where = f" in {token_file}" if token_file is not None else ""
                raise AuthError(f"no bearer token configured{where}")

    @classmethod
    def insecure(cls) -> Authenticator:
        return cls(enabled=False)

    def _reload(self) -> None:
        if self._file is None:
            return
        try:
            st = os.stat(self._file)
            key = (st.st_size, st.st_mtime_ns)
            if key == self._file_key:
                return
            text = self._file.read_text(encoding="utf-8")
        except OSError as e:
            raise AuthError(f"cannot read token file {self._file}: {e.strerror or e}") from e
        self._file_tokens = parse_tokens(text, f"token file {self._file}")
        self._file_key = key

    def _tokens(self) -> tuple[str, ...]:
        return self._static + self._file_tokens

    def check(self, header: str | None) -> bool:
        """True when ``header`` (the Authorization value) carries a configured token."""
        return self.identify(header) is not None

    def identify(self, header: str | None) -> str | None:
        """Which token ``header`` carries: a stable, non-secret key of it (a hash prefix, the
        unit of per-token limits), ``"anonymous"`` when authentication is off, or None when the
        header carries no configured token."""
        if not self.enabled:
            return ANONYMOUS
        if header is None:
            return None
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        try:
            self._reload()
        except AuthError as e:  # keep the tokens we had; the file may be mid-rotation
            log.warning("%s; keeping the previous tokens", e)
        given = presented.strip().encode()
        match: str | None = None
        for tok in self._tokens():  # no early exit: time does not depend on which token matched
            if hmac.compare_digest(given, tok.encode()):
                match = tok
        return None if match is None else token_key(match)


def token_key(token: str) -> str:
    """A non-secret name for a token (logs, per-token accounting): its SHA-256 prefix."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]
