"""Tiny random models for smoke runs and tests: a small Llama plus a word-level tokenizer, written
to a folder that :func:`shared.runtime.models.load_model` loads like any Hugging Face model folder.

Built in-process and offline; the weights are random (from a seed), so the
text means nothing, but drafts and targets built with the same ``vocab_size`` share a tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["build_tiny_model"]

_TINY_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def _tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    # ids: <unk>=0 <s>=1 </s>=2 <pad>=3, then t0..t{vocab_size-5}; exactly vocab_size entries.
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for i in range(vocab_size - len(_TINY_SPECIALS)):
        vocab[f"t{i}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder set: tokenizers then joins decoded tokens with single spaces.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    folder: Path, *, vocab_size: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0
) -> Path:
    """Write a tiny random Llama (weights from ``seed``) plus a word-level tokenizer to ``folder``.

    The tokenizer depends only on ``vocab_size``, so models of different seeds share its hash.
    """
    if vocab_size < len(_TINY_SPECIALS) + 1:
        raise ValueError(f"vocab_size must be >= {len(_TINY_SPECIALS) + 1}, got {vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peakier logits than the default 0.02: distinct greedy choices
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    rng_guard = torch.random.fork_rng(devices=[])
    with rng_guard:  # don't disturb the caller's global RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    _tiny_tokenizer(vocab_size).save_pretrained(str(folder))
    return folder
