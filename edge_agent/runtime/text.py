"""Text in, text out: the pieces every edge front door shares.

Prompts to token ids (:func:`encode_prompt`, :func:`encode_chat`: the chat template, written
once), the ids that end a generation (:func:`eos_ids`), committed ids to streamed text
(:class:`TextStreamer`) and the cut at a stop string (:class:`StopScanner`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shared.errors import WanspecError
from shared.runtime.models import LoadedModel, LoadedTokenizer


class NoChatTemplate(WanspecError, ValueError):
    """The model's tokenizer has no chat template (a base model): prompts go as plain text."""


def eos_ids(loaded: LoadedModel | LoadedTokenizer) -> list[int]:
    """The ids that end a generation: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    tok_eos = loaded.tokenizer.eos_token_id
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    if isinstance(loaded, LoadedTokenizer):
        ids.update(loaded.generation_eos_ids)
        return sorted(ids)
    gen_cfg = getattr(loaded.model, "generation_config", None)
    cfg_eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, list):
        ids.update(int(t) for t in cfg_eos)
    return sorted(ids)


def encode_chat(
    loaded: LoadedModel | LoadedTokenizer, messages: Sequence[dict[str, str]], *, hint: str
) -> list[int]:
    """The token ids of ``messages`` (``[{"role", "content"}]``) under the model's chat template,
    ready for the assistant's turn. Raises :class:`NoChatTemplate` (its message ends with
    ``hint``: what to use instead) and whatever the template raises for messages it refuses
    (roles out of order)."""
    tok: Any = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise NoChatTemplate(f"{loaded.name} has no chat template; {hint}")
    ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_prompt(loaded: LoadedModel | LoadedTokenizer, prompt: str, *, chat: bool) -> list[int]:
    """``prompt`` as token ids: one user message under the chat template (``chat``), else the
    plain text with the tokenizer's special tokens."""
    if chat:
        return encode_chat(
            loaded, [{"role": "user", "content": prompt}], hint="use --no-chat-template"
        )
    tok: Any = loaded.tokenizer
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return [int(t) for t in ids]


class TextStreamer:
    """Turns committed token ids into text increments (whole characters only)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None]) -> None:
        self.tok = tokenizer
        self.write = write
        self.ids: list[int] = []
        self.emitted = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # Hold back a trailing partial UTF-8 sequence until its next token arrives.
        if text.endswith("\ufffd"):
            return
        if len(text) > self.emitted:
            self.write(text[self.emitted :])
            self.emitted = len(text)

    def text(self) -> str:
        out: str = self.tok.decode(self.ids, skip_special_tokens=True)
        return out


class StopScanner:
    """Cuts streamed text at the first stop string, holding back text that might begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``hit`` (and drops the rest) when a stop string appears."""
        if self.hit:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.hit = self.pending[:cut], "", True
            return out
        n = max(0, len(self.pending) - self.keep)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out
