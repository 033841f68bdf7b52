"""The tokens a generation may hold: one owner for the context bound every front door checks a
request's prompt and budget against. Light on purpose (no torch): the request parsers import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContextLimit:
    """The tokens a generation may hold, prompt and completion: the least of the draft's
    context and the verifier's (the ``max_context`` its connection's Ready announced); None
    where unknown (no draft model, no verifier reached yet) or unbounded."""

    draft: int | None
    verifier: int | None

    @property
    def tokens(self) -> int | None:
        known = [n for n in (self.draft, self.verifier) if n is not None]
        return min(known) if known else None

    def words(self, verb: str = "is") -> str:
        """The limit in words, naming both numbers where both are known: ``verb`` "is" (the
        context is N ...) or "of" (the context of N ...)."""
        if self.draft is not None and self.verifier is not None:
            return (
                f"the context {verb} {self.tokens} (the draft's {self.draft}, the verifier's "
                f"{self.verifier})"
            )
        if self.verifier is not None:
            return f"the verifier's context {verb} {self.verifier}"
        return f"this model's context {verb} {self.draft}"
