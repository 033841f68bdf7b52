"""Offline loading of real causal language models: :func:`load_model` → :class:`LoadedModel`,
and of a model's tokenizer alone: :func:`load_tokenizer` → :class:`LoadedTokenizer`.

Every load is local: :func:`load_model` and :func:`load_tokenizer` first switch the process to
offline mode (:func:`enforce_offline`) and every ``from_pretrained`` call passes
``local_files_only=True``; nothing here ever reaches a model hub. Importing this module changes
nothing (no environment variables are set at import).

What a spec may name is in :mod:`shared.runtime.model_spec`; GGUF files are converted by
:mod:`shared.runtime.gguf`, ``self:`` drafts are built by :mod:`shared.runtime.layer_skip`, and
fingerprints come from :mod:`shared.runtime.fingerprint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shared.runtime.fingerprint import model_fingerprint
from shared.runtime.gguf import converted_gguf_folder
from shared.runtime.layer_skip import layer_skip_draft
from shared.runtime.model_spec import ModelSpec, ModelSpecError, SpecKind, parse_model_spec
from shared.wire.messages import Fingerprint

__all__ = ["LoadedModel", "LoadedTokenizer", "enforce_offline", "load_model", "load_tokenizer"]

_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass
class LoadedModel:
    """A model ready for inference: eval mode, no parameter requires grad."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    vocab_size: int  # logits width (config.vocab_size), may exceed len(tokenizer)
    fingerprint: Fingerprint

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_layers(self) -> int:
        return int(_text_config(self.model).num_hidden_layers)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A model's tokenizer and what a peer must know of the model, with no weights loaded.

    Invariant: ``name``, ``vocab_size`` and ``fingerprint`` are those :func:`load_model` gives
    for the same spec, so a verifier pairs with it as with the loaded model."""

    tokenizer: PreTrainedTokenizerBase
    name: str
    vocab_size: int  # logits width (config.vocab_size), may exceed len(tokenizer)
    fingerprint: Fingerprint
    #: The end-of-sequence ids of the model's generation config (generation_config.json, else
    #: the model config's, as a loaded model's ``generation_config`` has them).
    generation_eos_ids: tuple[int, ...]
    max_length: int | None  # max_position_embeddings, when the config has one


def enforce_offline() -> None:
    """Put this process (and the processes it starts from now on) in Hugging Face offline mode.

    Invariant after the call: nothing in this process downloads from a model hub. Sets
    ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE``; ``huggingface_hub`` reads them once, when it
    is first imported (transformers imports it), so its already-loaded flag is switched on too.
    Idempotent; called by :func:`load_model` and :func:`load_tokenizer`.
    """
    for name in _OFFLINE_ENV:
        os.environ[name] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _text_of(config: Any) -> Any:
    """The text model's part of ``config`` (a multimodal config nests it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _text_config(model: PreTrainedModel) -> Any:
    return _text_of(model.config)


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedModel:
    model.eval()  # type: ignore[no-untyped-call]
    model.requires_grad_(False)
    vocab_size = int(_text_config(model).vocab_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        vocab_size=vocab_size,
        fingerprint=model_fingerprint(tokenizer, vocab_size, name),
    )


def check_tp_size(config: Any, tp_size: int) -> None:
    """Tensor parallelism splits the attention heads and the KV heads evenly over the ranks:
    a clear error, before any weight is loaded, when they do not divide."""
    text = _text_of(config)
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if tp_size < 1 or heads % tp_size or kv % tp_size:
        raise ValueError(
            f"tensor parallelism over {tp_size} ranks needs the attention heads ({heads}) and "
            f"the KV heads ({kv}) to divide by {tp_size}"
        )


def _load_folder(
    folder: Path, name: str, device: str, dtype: torch.dtype, tp_size: int = 1
) -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tp_size > 1:
        # transformers' own tensor parallelism: each rank (torchrun) loads its shards onto its
        # device (cuda:LOCAL_RANK, or the CPU over gloo); layers all-reduce in their forward.
        from transformers.distributed.configuration_utils import DistributedConfig

        check_tp_size(AutoConfig.from_pretrained(str(folder), local_files_only=True), tp_size)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=dtype,
            local_files_only=True,
            distributed_config=DistributedConfig(tp_size=tp_size),
        )
        return _finish(model, tokenizer, name)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]
    return _finish(model, tokenizer, name)


def load_model(
    spec: str | ModelSpec,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    base: LoadedModel | None = None,
    tp_size: int = 1,
) -> LoadedModel:
    """Load a model offline. ``base`` is required for (and only used by) ``self:`` specs.
    ``tp_size`` > 1: this process is one rank of a tensor-parallel group (started by torchrun)
    and loads its shards of the model (``device`` is then the rank's own).

    A self-draft shares ``base``'s tensors, so it lives on ``base``'s device and dtype
    (``device``/``dtype`` are ignored for it).
    """
    enforce_offline()
    parsed = parse_model_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == SpecKind.SELF:
        if base is None:
            raise ModelSpecError(
                f"model spec {parsed.spec!r}: a self-draft needs the target model (base=...)"
            )
        draft = layer_skip_draft(parsed, base.model, base.name)
        suffix = parsed.spec.removeprefix("self:")
        return _finish(draft, base.tokenizer, f"{base.name}:{suffix}")
    folder, name = _folder_and_name(parsed)
    return _load_folder(folder, name, device, dtype, tp_size)


def load_draft(
    spec: str | ModelSpec,
    base: Callable[[], LoadedModel],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """A draft model. A ``self:`` spec shares the weights of the model ``base()`` returns
    (called only for one: a base may be costly to load), on its device and dtype; any other
    spec loads on its own, on ``device`` in ``dtype``."""
    parsed = parse_model_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == SpecKind.SELF:
        return load_model(parsed, base=base())
    return load_model(parsed, device=device, dtype=dtype)


def _folder_and_name(parsed: ModelSpec) -> tuple[Path, str]:
    """The Hugging Face folder a (non-self) spec loads from, converting a GGUF file once, and
    the model's name."""
    assert parsed.path is not None  # invariant of ModelSpec for non-self kinds
    if parsed.kind in (SpecKind.DEFAULT, SpecKind.GGUF):
        return converted_gguf_folder(parsed.path), parsed.path.name.removesuffix(".gguf")
    return parsed.path, parsed.hub_id if parsed.hub_id is not None else parsed.path.name


def _eos_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(t) for t in value)
    return ()


def load_tokenizer(spec: str | ModelSpec) -> LoadedTokenizer:
    """The tokenizer of the model ``spec`` names, offline, without its weights (a GGUF file is
    still converted once, as :func:`load_model` does). A ``self:`` spec names no tokenizer of
    its own: ModelSpecError."""
    enforce_offline()
    parsed = parse_model_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == SpecKind.SELF:
        raise ModelSpecError(
            f"model spec {parsed.spec!r}: a self-draft has no tokenizer of its own; "
            "name the model it is derived from"
        )
    folder, name = _folder_and_name(parsed)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    text = _text_of(config)
    vocab_size = int(text.vocab_size)
    # As a loaded model's generation_config: the folder's file, else derived from the config.
    if (folder / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    else:
        gen = GenerationConfig.from_model_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    return LoadedTokenizer(
        tokenizer=tokenizer,
        name=name,
        vocab_size=vocab_size,
        fingerprint=model_fingerprint(tokenizer, vocab_size, name),
        generation_eos_ids=_eos_list(getattr(gen, "eos_token_id", None)),
        max_length=int(limit) if limit is not None else None,
    )
