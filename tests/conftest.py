"""Shared pytest fixtures: tiny random models built in-process (fast, offline)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from shared.runtime.models import LoadedModel

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama folder, vocab 64, seed 0 (the "target")."""
    from testkit.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_target"), vocab_size=64, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tokenizer as ``tiny_model_dir``, different weights (seed 1): the "draft"."""
    from testkit.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_draft"), vocab_size=64, seed=1)


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    """``tiny_model_dir`` loaded, once per test module (a module may define its own)."""
    from shared.runtime.models import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def draft(tiny_draft_dir: Path) -> LoadedModel:
    """``tiny_draft_dir`` loaded, once per test module."""
    from shared.runtime.models import load_model

    return load_model(str(tiny_draft_dir))
