"""OpenAI's ``logprobs`` objects from a generation's
:class:`~edge_agent.session.generation.TokenLogprob`
entries: the chat API's (``{"content": [{token, logprob, bytes, top_logprobs}]}``) and the
legacy completions API's (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

Pure functions of the entries and a decoder (token id → its text); a token's text is its
decoding alone, and ``bytes`` that text's UTF-8 (a token holding part of a multi-byte
character decodes to U+FFFD, as in other servers). A token no verifier scored (the draft's own
while none answered) has ``logprob`` null.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from edge_agent.session.events import TokenLogprob

Decode = Callable[[int], str]


def _item(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """The chat API's ``choices[0].logprobs`` (or a chunk's) for ``tokens``."""
    return {
        "content": [
            {
                **_item(decode(t.token), t.logprob),
                "top_logprobs": [_item(decode(i), lp) for i, lp in t.top],
            }
            for t in tokens
        ]
    }


def completion_logprobs(
    tokens: Sequence[TokenLogprob], decode: Decode, offset: int = 0
) -> dict[str, Any]:
    """The completions API's ``choices[0].logprobs`` for ``tokens``, whose text starts at
    character ``offset`` of the completion (a stream's later chunks)."""
    texts = [decode(t.token) for t in tokens]
    offsets = []
    at = offset
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{decode(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }
