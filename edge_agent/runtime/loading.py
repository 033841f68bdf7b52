"""What the edge loads, and the words for it: the draft model (a ``self:`` draft shares the
weights of ``draft_base``) or, with ``draft = "none"``, the target family's tokenizer alone; the
setting to change when the edge does not pair with a verifier's target; the line naming where
the draft runs. Blocking: the service calls these on its model worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edge_agent.runtime.settings import CONFIG_ENV, EdgeSettings
from shared.runtime.device import placement, resolve_device, resolve_dtype
from shared.runtime.gguf import conversion_folder
from shared.runtime.model_spec import SpecKind, parse_model_spec
from shared.runtime.models import (
    LoadedModel,
    LoadedTokenizer,
    load_draft,
    load_model,
    load_tokenizer,
)


def load_draft_model(s: EdgeSettings, report: Callable[[str], None]) -> LoadedModel:
    """The draft (blocking): ``self:`` drafts share the weights of ``draft_base``."""
    import torch

    device = resolve_device(s.device)
    name = resolve_dtype(s.dtype, device, on_cuda="float16")
    dtype = getattr(torch, name)

    def base() -> LoadedModel:
        report(
            converting_line(s.draft_base)
            or f"loading {s.draft_base} ({device}, {name}) for the self-draft {s.draft}"
        )
        loaded = load_model(s.draft_base, device=device, dtype=dtype)
        report(f"deriving the self-draft {s.draft} (weights shared)")
        return loaded

    if parse_model_spec(s.draft).kind != SpecKind.SELF:
        report(converting_line(s.draft) or f"loading draft {s.draft} ({device}, {name})")
    return load_draft(s.draft, base, device=device, dtype=dtype)


def converting_line(spec: str) -> str | None:
    """The progress line of a load of ``spec`` (``default`` or a ``.gguf``) that converts its
    GGUF file first: the first start with that file, which takes a while; None when there is
    nothing to convert (another kind of spec, or the conversion is in the cache already)."""
    parsed = parse_model_spec(spec)
    if parsed.kind not in (SpecKind.DEFAULT, SpecKind.GGUF) or parsed.path is None:
        return None
    folder, cached = conversion_folder(parsed.path)
    if cached:
        return None
    return (
        f"converting {spec} ({parsed.path.name}) to a Hugging Face folder, once: later starts "
        f"load it from the cache ({_home_short(folder)})"
    )


def _home_short(path: Path) -> str:
    """``path`` with the home folder written ``~``."""
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def loading_line(s: EdgeSettings) -> str:
    """What :meth:`EdgeService.load` is about to load, for a progress display."""
    if s.cloud_only:
        return f"loading the tokenizer of {s.draft_base} (draft none: the verifier drafts)"
    return f"loading the draft {s.draft}"


def pairing_setting(s: EdgeSettings) -> str:
    """The setting to change when the edge's tokenizer does not pair with a target: with
    ``draft = "none"`` the tokenizer is ``draft_base``'s, else ``draft`` (a self-draft too:
    naming a model of the target's family there is the direct fix)."""
    return "draft_base" if s.cloud_only else "draft"


def tokenizer_spec(s: EdgeSettings) -> str:
    """The model whose tokenizer the edge uses: ``draft_base`` for a self-draft or
    ``draft = "none"``, else ``draft``."""
    if s.cloud_only or s.draft.strip().startswith("self:"):
        return s.draft_base
    return s.draft


def settings_place(env: Mapping[str, str]) -> str:
    """Where an operator changes the edge's settings, as a mismatch line names it."""
    configured = env.get(CONFIG_ENV)
    if configured:
        return configured
    return "edge.toml (/etc/wanspec/edge.toml for the systemd unit)"


def load_edge_tokenizer(s: EdgeSettings, report: Callable[[str], None]) -> LoadedTokenizer:
    """``draft = "none"`` (blocking): the tokenizer of ``draft_base`` alone, no weights."""
    report(converting_line(s.draft_base) or loading_line(s))
    return load_tokenizer(s.draft_base)


def device_line(loaded: Any) -> str:
    """One line naming the draft and where it runs: ``cpu (float32, 4 threads)`` or
    ``cuda:0 (Orin, float16)``. ``loaded``: a :class:`shared.runtime.models.LoadedModel`."""
    return f"draft {loaded.name} on {placement(loaded.model)}"
