"""Shared pytest fixtures: tiny random models built in-process (fast, offline)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama folder, vocab 64, seed 0 (the "target")."""
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_target"), vocab_size=64, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tokenizer as ``tiny_model_dir``, different weights (seed 1): the "draft"."""
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_draft"), vocab_size=64, seed=1)
