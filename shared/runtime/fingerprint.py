"""Model fingerprints: what a draft and a target compare at handshake to prove they can pair.

A :class:`~shared.wire.messages.Fingerprint` holds the tokenizer hash, the logits width and the
model name; drafts and targets must agree on the first two (:meth:`Fingerprint.compatible_with`).
"""

from __future__ import annotations

import hashlib
import json

from transformers import PreTrainedTokenizerBase

from shared.wire.messages import Fingerprint

__all__ = ["model_fingerprint", "tokenizer_hash"]


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hex sha256 of the tokenizer's vocab (token -> id, sorted) plus its special token ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")
    }
    payload = {
        "vocab": vocab,
        "special": special,
        "all_special_ids": sorted(set(tokenizer.all_special_ids)),
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def model_fingerprint(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, name: str
) -> Fingerprint:
    """The fingerprint of a model named ``name`` with ``vocab_size`` logits and ``tokenizer``."""
    return Fingerprint(
        tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=vocab_size, model_name=name
    )
