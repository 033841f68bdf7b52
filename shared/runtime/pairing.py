"""Whether a draft can pair with a target, in one line an operator can act on.

The rule is :meth:`~shared.wire.messages.Fingerprint.compatible_with`: a draft and a target
pair when their tokenizers hash alike and their logits have the same width (vocab size). This
module only words the verdict: which models, which setting to change, and a model of the right
family when the name says which family that is (:data:`FAMILIES`). Pure code: nothing here
loads a model or touches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.wire.messages import Fingerprint

__all__ = [
    "FAMILIES",
    "PAIRING_DOC",
    "Family",
    "family_of",
    "fingerprint_words",
    "mismatch_line",
]

#: The page that explains the rule and the recipes (relative to the repository).
PAIRING_DOC = "docs/model-pairs.md"
#: Hex digits of a tokenizer hash shown in a message (enough to tell two apart).
HASH_SHOWN = 12


@dataclass(frozen=True)
class Family:
    """Models that share one tokenizer, recognised by their names: a draft and a target that
    the docs pair (:data:`PAIRING_DOC`). ``pattern`` matches a model's name (its last path
    component, lower case)."""

    label: str
    pattern: re.Pattern[str]
    draft: str
    target: str


#: The documented pairs. A name that matches none gets generic advice.
FAMILIES: tuple[Family, ...] = (
    Family("Qwen3", re.compile(r"^qwen3-"), "Qwen/Qwen3-0.6B", "Qwen/Qwen3-32B"),
    Family(
        "Llama 3",
        re.compile(r"^(meta-)?llama-3(\.\d)?-"),
        "meta-llama/Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
    ),
    Family("SmolLM2", re.compile(r"^smollm2-"), "default", "default"),
)


def family_of(model_name: str) -> Family | None:
    """The documented family whose names ``model_name`` matches (a hub id, a folder's or a
    file's name), or None."""
    last = model_name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    return next((f for f in FAMILIES if f.pattern.match(last)), None)


def fingerprint_words(fp: Fingerprint) -> str:
    """``name (tokenizer 1a2b3c4d5e6f…, vocab 49152)``."""
    return f"{fp.model_name} (tokenizer {fp.tokenizer_hash[:HASH_SHOWN]}…, vocab {fp.vocab_size})"


def mismatch_line(
    draft: Fingerprint,
    target: Fingerprint,
    *,
    target_of: str = "the target",
    setting: str = "draft",
    config: str = "the edge's settings",
    speaker: str = "edge",
) -> str | None:
    """None when ``draft`` pairs with ``target``; else one line naming both models and what
    to change: ``setting`` (``draft``, or ``draft_base`` for a self-draft or ``draft = "none"``)
    in ``config``, or the target. ``target_of`` names whose target it is (``"the target"``,
    ``"wss://host:8765/v1/session's target"``); ``speaker`` starts the line (who says it)."""
    if draft.compatible_with(target) is None:
        return None
    fam = family_of(target.model_name)
    if fam is not None:
        change = f'set {setting} = "{fam.draft}" (a {fam.label} model, as the target is)'
    else:
        change = f"set {setting} to a model that shares {target.model_name}'s tokenizer"
    other = family_of(draft.model_name)
    serve = f", e.g. {other.target}" if other is not None else ""
    return (
        f"{speaker}: {setting} {fingerprint_words(draft)} does not share the tokenizer of "
        f"{target_of} {fingerprint_words(target)}: {change} in {config}, or serve a "
        f"target of the {setting}'s family{serve} ({PAIRING_DOC})"
    )
