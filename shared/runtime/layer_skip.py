"""Layer-skip self-drafts (``self:skip=...`` / ``self:keep=N`` specs): a shallower copy of a
target model that keeps a subset of its decoder layers and shares every tensor with it (no copies).
"""

from __future__ import annotations

import copy
import re

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from shared.runtime.model_spec import ModelSpec, ModelSpecError, SpecKind

__all__ = ["kept_layers", "layer_skip_draft"]

_LAYER_KEY_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def kept_layers(spec: ModelSpec, n_layers: int, target_name: str) -> list[int]:
    """Target layers a self-draft keeps, ascending; ModelSpecError if none or out of range."""
    if spec.kind != SpecKind.SELF:
        raise ModelSpecError(f"model spec {spec.spec!r} is not a self-draft (self:...)")
    if spec.keep is not None:
        if spec.keep > n_layers:
            raise ModelSpecError(
                f"model spec {spec.spec!r}: keep={spec.keep} but {target_name} has "
                f"{n_layers} layers"
            )
        return list(range(spec.keep))
    bad = [i for i in spec.skip if i >= n_layers]
    if bad:
        raise ModelSpecError(
            f"model spec {spec.spec!r}: layer(s) {bad} out of range 0..{n_layers - 1}"
        )
    kept = [i for i in range(n_layers) if i not in spec.skip]
    if not kept:
        raise ModelSpecError(f"model spec {spec.spec!r}: skips every layer")
    return kept


def layer_skip_draft(spec: ModelSpec, target: PreTrainedModel, target_name: str) -> PreTrainedModel:
    """A shallower model sharing ``target``'s parameter tensors (no copies).

    ``target_name`` only appears in error messages. The draft is on ``target``'s device and dtype.
    """
    config = copy.deepcopy(target.config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        raise ModelSpecError(f"model spec {spec.spec!r}: only plain text models can self-draft")
    kept = kept_layers(spec, int(config.num_hidden_layers), target_name)
    old_of_new = dict(enumerate(kept))  # new layer index -> target layer index
    new_of_old = {old: new for new, old in old_of_new.items()}
    config.num_hidden_layers = len(kept)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        config.layer_types = [layer_types[i] for i in kept]

    # Parameters come from the target (keep_vars: the very same nn.Parameter objects).
    target_state = target.state_dict(keep_vars=True)
    draft_state: dict[str, torch.Tensor] = {}
    for key, tensor in target_state.items():
        m = _LAYER_KEY_RE.match(key)
        if m is None:
            draft_state[key] = tensor
        elif int(m.group(1)) in new_of_old:
            draft_state[f"model.layers.{new_of_old[int(m.group(1))]}.{m.group(2)}"] = tensor
    dtype = next(target.parameters()).dtype
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=dtype, attn_implementation=target.config._attn_implementation
        )
    draft.load_state_dict(draft_state, strict=True, assign=True)

    # Non-persistent buffers (rotary inv_freq...) are not in state_dict: share the target's.
    target_buffers = dict(target.named_buffers())
    for name, buf in list(draft.named_buffers()):
        if not buf.is_meta:
            continue
        m = _LAYER_KEY_RE.match(name)
        source = name if m is None else f"model.layers.{old_of_new[int(m.group(1))]}.{m.group(2)}"
        if source not in target_buffers:
            raise RuntimeError(f"self-draft: no target buffer for {name!r}")
        owner_name, _, attr = name.rpartition(".")
        owner = draft.get_submodule(owner_name)
        persistent = attr not in owner._non_persistent_buffers_set
        owner.register_buffer(attr, target_buffers[source], persistent=persistent)
    # Plain tensor attributes created under the meta device (e.g. cached rotary tables).
    for mod_name, module in draft.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                src = target.get_submodule(mod_name) if mod_name else target
                setattr(module, attr, getattr(src, attr))

    # Tying: lm_head must be the same Parameter as embed_tokens when the config ties them.
    if getattr(config, "tie_word_embeddings", False):
        out_emb = draft.get_output_embeddings()
        in_emb = draft.get_input_embeddings()
        if out_emb is not None and out_emb.weight is not in_emb.weight:
            out_emb.weight = in_emb.weight
    # Invariant: kept layers are renumbered 0..n-1 so the KV cache holds exactly n layers.
    for new_idx, layer in enumerate(draft.model.layers):
        attn = layer.self_attn
        if getattr(attn, "layer_idx", new_idx) != new_idx:
            attn.layer_idx = new_idx
    leftovers = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"self-draft: tensors left on the meta device: {leftovers[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    result: PreTrainedModel = draft  # from_config is untyped (Any)
    return result
