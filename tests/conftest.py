"""Shared fixtures: the real all-MiniLM-L6-v2 (shipped offline) and small random-weight checkpoints.

Random checkpoints are built with transformers itself and saved in Hugging Face format, so loading
them exercises the same by-name path as a downloaded model; they borrow MiniLM's tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.checkpoint import resolve_model

SMALL_BERT = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=128)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return resolve_model(None).path


def save_random_model(directory: Path, model_class: str = "BertModel", pooling: str | None = None,
                      normalize: bool = False, seed: int = 0, **config_overrides: object) -> Path:
    """A random-weight Hugging Face checkpoint with sentence-transformers files, in `directory`."""
    import transformers

    torch.manual_seed(seed)
    config_class = transformers.XLMRobertaConfig if "Roberta" in model_class else transformers.BertConfig
    model = getattr(transformers, model_class)(config_class(**{**SMALL_BERT, **config_overrides}))
    model.save_pretrained(directory)
    shutil.copy(resolve_model(None).tokenizer_file, directory / "tokenizer.json")
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
        (directory / "1_Pooling" / "config.json").write_text(json.dumps({keys[pooling]: True}))
    return directory


@pytest.fixture
def random_bert(tmp_path: Path) -> Path:
    return save_random_model(tmp_path / "bert", pooling="mean")
