"""Shared fixtures: the real all-MiniLM-L6-v2 and small random-weight checkpoints (tests/models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import minilm_path, save_random_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return minilm_path()


@pytest.fixture
def random_bert(tmp_path: Path) -> Path:
    return save_random_model(tmp_path / "bert", pooling="mean")
