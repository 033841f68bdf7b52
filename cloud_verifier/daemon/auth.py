"""Bearer-token authentication, checked before the WebSocket upgrade.

A token file holds one token per line (several for rotation); blank lines and ``#`` comments are
ignored. The file is re-read when it may have changed: at once when its size, modification time
or inode changes, and otherwise by content (SHA-256) at most every ``recheck_s`` seconds, so a
same-length rotation that keeps the mtime is seen too; :meth:`Authenticator.refresh` with
``force=True`` (the verifier's SIGHUP) re-reads it at once. A file that has become empty,
unparsable or unreadable keeps the previous tokens: ``error`` says why, the error is logged once
per distinct problem, and the verifier exports it as a metric (a half-written rotation never
locks every client out). Tokens that a reload removes are announced to the listeners
(:meth:`Authenticator.on_revoke`; the verifier closes their sessions).

Comparison is constant-time (:func:`hmac.compare_digest`) against every token, on the header's
raw bytes (aiohttp decodes header bytes that are not UTF-8 as surrogates; they are encoded back,
never raised on: a token with byte 0xff is simply wrong).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from shared.errors import WanspecError
from shared.service.config import exposed_secret

log = logging.getLogger(__name__)


#: The key :meth:`Authenticator.identify` gives everyone when authentication is off.
ANONYMOUS = "anonymous"

#: A token file larger than this is not a token file (read no further).
MAX_TOKEN_FILE = 1 << 20

#: Called with the keys (:func:`token_key`) of tokens a reload removed.
RevokeListener = Callable[[frozenset[str]], None]


class AuthError(WanspecError, ValueError):
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


def token_key(token: str) -> str:
    """A non-secret name for a token (logs, per-token accounting): its SHA-256 prefix."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


_Sig = tuple[int, int, int]  # size, mtime_ns, inode


class Authenticator:
    """Checks ``Authorization: Bearer <token>`` headers. ``enabled=False`` lets everyone in.

    ``recheck_s``: how often (at most) the token file is re-read by content when neither its
    size, mtime nor inode changed; 0 = never (only a changed stat or ``refresh(force=True)``).
    """

    def __init__(
        self,
        tokens: Iterable[str] = (),
        *,
        token_file: Path | None = None,
        enabled: bool = True,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.recheck_s = recheck_s
        self._clock = clock
        self._static = tuple(tokens)
        self._file = token_file
        self._file_sig: _Sig | None = None
        self._file_digest: bytes | None = None
        self._file_tokens: tuple[str, ...] = ()
        self._encoded: tuple[bytes, ...] = ()
        self._checked_at = -math.inf
        self._listeners: list[RevokeListener] = []
        #: Reloads that changed the tokens; failed reads (previous tokens kept).
        self.reloads = 0
        self.errors = 0
        #: What is wrong with the token file now (None: it was last read fine).
        self.error: str | None = None
        if enabled:
            if token_file is not None:
                self._file_tokens, self._file_sig, self._file_digest = self._read()
                self._checked_at = clock()
            self._encode()
            if not self._tokens():
                where = f" in {token_file}" if token_file is not None else ""
                raise AuthError(f"no bearer token configured{where}")

    @classmethod
    def insecure(cls) -> Authenticator:
        return cls(enabled=False)

    @property
    def token_file(self) -> Path | None:
        return self._file

    @property
    def count(self) -> int:
        """Tokens accepted now."""
        return len(self._tokens())

    def on_revoke(self, listener: RevokeListener, *, remove: bool = False) -> None:
        """Call ``listener`` with the keys of the tokens each reload removes (``remove``: stop
        calling it)."""
        if remove:
            self._listeners.remove(listener)
        else:
            self._listeners.append(listener)

    # ------------------------------------------------------------------ the token file

    def _tokens(self) -> tuple[str, ...]:
        return self._static + self._file_tokens

    def _encode(self) -> None:
        self._encoded = tuple(t.encode("utf-8", "surrogateescape") for t in self._tokens())

    def _stat(self) -> _Sig | None:
        assert self._file is not None
        try:
            st = os.stat(self._file)
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    def _read(self) -> tuple[tuple[str, ...], _Sig, bytes]:
        """(tokens, stat signature, SHA-256 of the content). Raises AuthError."""
        assert self._file is not None
        try:
            with open(self._file, "rb") as f:
                st = os.fstat(f.fileno())
                raw = f.read(MAX_TOKEN_FILE + 1)
        except OSError as e:
            raise AuthError(f"cannot read token file {self._file}: {e.strerror or e}") from e
        if len(raw) > MAX_TOKEN_FILE:
            raise AuthError(f"token file {self._file} is larger than {MAX_TOKEN_FILE} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise AuthError(f"token file {self._file} is not UTF-8 text") from None
        tokens = parse_tokens(text, f"token file {self._file}")
        warning = exposed_secret(st.st_mode, self._file, "token file")
        if warning is not None and (st.st_size, st.st_mtime_ns, st.st_ino) != self._file_sig:
            log.warning("%s", warning)  # (once per version of the file)
        return tokens, (st.st_size, st.st_mtime_ns, st.st_ino), hashlib.sha256(raw).digest()

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the token file if it may have changed (see the class); True when the accepted
        tokens changed. Never raises: a file that cannot be used keeps the previous tokens
        (``error``, ``errors``)."""
        if not self.enabled or self._file is None:
            return False
        now = self._clock()
        sig = self._stat()
        due = self.recheck_s > 0 and now - self._checked_at >= self.recheck_s
        if not force and not due and sig == self._file_sig:
            return False
        self._checked_at = now
        try:
            tokens, sig, digest = self._read()
            if not tokens:
                raise AuthError(f"token file {self._file} holds no token")
        except AuthError as e:
            self._file_sig = sig
            self._failed(str(e))
            return False
        self._file_sig = sig
        if self.error is not None:
            log.info("token file %s is usable again", self._file)
            self.error = None
        if digest == self._file_digest:
            return False
        before = {token_key(t) for t in self._tokens()}
        self._file_tokens, self._file_digest = tokens, digest
        self._encode()
        self.reloads += 1
        after = {token_key(t) for t in self._tokens()}
        removed = frozenset(before - after)
        log.info(
            "token file %s reloaded: %d token(s), %d added, %d removed",
            self._file,
            len(after),
            len(after - before),
            len(removed),
        )
        if removed:
            for listener in self._listeners:
                listener(removed)
        return True

    def _failed(self, message: str) -> None:
        self.errors += 1
        if message != self.error:
            log.error("%s; keeping the %d previous token(s)", message, self.count)
        self.error = message

    # ------------------------------------------------------------------ checks

    def check(self, header: str | None) -> bool:
        """True when ``header`` (the Authorization value) carries a configured token."""
        return self.identify(header) is not None

    def identify(self, header: str | None) -> str | None:
        """Which token ``header`` carries: a stable, non-secret key of it (a hash prefix, the
        unit of per-token limits), ``"anonymous"`` when authentication is off, or None when the
        header carries no configured token (malformed headers included)."""
        if not self.enabled:
            return ANONYMOUS
        if header is None:
            return None
        scheme, _, presented = header.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return None
        self.refresh()
        try:
            # Header bytes that are not UTF-8 arrive as surrogates: back to the raw bytes.
            given = presented.encode("utf-8", "surrogateescape")
        except UnicodeError:
            return None
        match: str | None = None
        # No early exit: time does not depend on which token matched.
        for tok, enc in zip(self._tokens(), self._encoded, strict=True):
            if hmac.compare_digest(given, enc):
                match = tok
        return None if match is None else token_key(match)
