"""GGUF → transformers conversion: a GGUF file becomes a float32 Hugging Face model folder, once.

The converted folder lives in the cache (``<cache_dir>/converted/<sha256[:16]>``, see
:func:`shared.runtime.model_cache.cache_dir`), keyed by the GGUF file's content hash, so every later
load of the same file is a plain folder load. Reads local files only (``local_files_only=True``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.runtime.model_cache import cache_dir, file_sha256

__all__ = ["conversion_folder", "converted_gguf_folder"]

_COMPLETE_MARKER = "wanspec-converted.json"


def conversion_folder(gguf: Path) -> tuple[Path, bool]:
    """Where :func:`converted_gguf_folder` keeps the conversion of ``gguf``, and whether it is
    there already (False: the next load converts the file first, once)."""
    final = cache_dir() / "converted" / file_sha256(gguf)[:16]
    return final, (final / _COMPLETE_MARKER).is_file()


def converted_gguf_folder(gguf: Path) -> Path:
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
        with _quiet_bars():
            tokenizer, model = _convert(gguf)
        # The GGUF weights are dequantised already; drop the quantizer so saving is allowed.
        setattr(model, "hf_quantizer", None)  # noqa: B010 - attribute is typed non-Optional
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with _quiet_bars():
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


def _convert(gguf: Path) -> tuple[Any, Any]:
    """The tokenizer and the dequantised model of ``gguf`` (transformers' own conversion)."""
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    return tokenizer, model


@contextlib.contextmanager
def _quiet_bars() -> Iterator[None]:
    """Off a terminal (a service's log), the conversion's progress bars go nowhere: its GGUF
    reader draws them with tqdm itself, which no setting reaches once tqdm is imported. On a
    terminal they stay (a first conversion takes a while)."""
    if sys.stderr.isatty():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield
