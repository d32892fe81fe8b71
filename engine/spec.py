"""ModelSpec: what a model outputs, worked out from its files and the user's options alone.

Vectors or scores, their width, pooling, normalisation, quantisation and the max length: all of it
follows from config.json, the sentence-transformers files and EngineConfig, with no weights loaded
and no torch imported. A pipeline can therefore tell what its output already holds (the settings a
stored vector was made with) before it pays for starting a GPU and loading a model; an unchanged
re-index never pays at all. Engine builds on the same spec, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from engine.checkpoint import (ModelFiles, config_errors, files_digest, position_offset, tokenizer_ids,
                               weights_digest)
from engine.config import EngineConfig
from engine.errors import UserError

BERT_FAMILY = ("bert", "roberta", "xlm-roberta")
QWEN3_FAMILY = ("qwen3", "bidirectional_pplx_qwen3")
# Settings recorded since a later version: a table written before lacks them and is taken as matching on them,
# and content keys leave them out (with them every stored row's key would change, and every row be re-embedded).
LATER_SETTINGS = frozenset({"files_sha256"})


@dataclass(frozen=True)
class ModelSpec:
    """A model's outputs. num_labels > 0: a cross-encoder, whose outputs are num_labels scores per pair."""

    files: ModelFiles
    family: str  # "bert" or "qwen3": which network engine.models builds
    num_labels: int
    pooling: str
    normalize: bool
    dim: int
    max_length: int
    quantization: str | None  # "int8": round(tanh(x) * 127); None: float32
    sigmoid: bool  # a one-label cross-encoder squashes its score
    # The tokenizer adds tokens past the embedding table (Qwen3-Embedding-4B's <think> and others past its
    # 151,665 rows), which no text without them reaches: Engine.step then checks each batch's ids.
    ids_past_table: bool

    @classmethod
    def of(cls, files: ModelFiles, config: EngineConfig) -> ModelSpec:
        """The spec for `files` run with `config`; UserError for a model or an option that cannot work.

        Every check that needs no torch is here, so that a run with nothing to embed refuses a
        bad option as a run with work would (EngineConfig checks the options among themselves)."""
        with config_errors(files):
            return cls._of(files, config)

    @classmethod
    def _of(cls, files: ModelFiles, config: EngineConfig) -> ModelSpec:
        model_type = files.config.get("model_type")
        if model_type in BERT_FAMILY:
            family, labels = "bert", classifier_labels(files.config)
            max_positions = files.config.get("max_position_embeddings", 512) - position_offset(files.config)
        elif model_type in QWEN3_FAMILY:
            family, labels = "qwen3", 0  # Qwen3 cross-encoders are not supported
            max_positions = files.config.get("max_position_embeddings", 32768)
        else:
            raise UserError(f"model type {model_type!r} is not supported yet; embedctl runs "
                            f"{', '.join(BERT_FAMILY + QWEN3_FAMILY)} models")
        vocab_size = files.config["vocab_size"]
        ids = tokenizer_ids(files.tokenizer_file)
        if ids.words > vocab_size or ids.framing >= vocab_size:
            given = f"words {ids.words} ids" if ids.words > vocab_size else f"every text the token id {ids.framing}"
            raise UserError(f"{files.tokenizer_file} gives {given} but config.json's vocab_size is {vocab_size}: the "
                            "tokenizer and the weights are not one model's; put the model's own tokenizer.json "
                            "beside them")
        ids_past_table = ids.largest >= vocab_size
        if config.max_length is not None and config.max_length > max_positions:
            raise UserError(f"--max-length {config.max_length} is past the {max_positions} positions {files.name} "
                            f"was trained for; pick at most {max_positions}")
        max_length = min(config.max_length or files.max_length, max_positions)
        if config.max_batch_tokens is not None and config.max_batch_tokens < max_length:
            raise UserError(f"--max-batch-tokens {config.max_batch_tokens} is smaller than the max length "
                            f"{max_length}; raise it or lower --max-length")
        if labels:
            if config.dim is not None or config.normalize:
                raise UserError(f"{files.name} is a cross-encoder: it scores pairs and has no vectors to cut "
                                "or normalise; drop --dim and --normalize")
            sigmoid = _sigmoid(files, labels)
            return cls(files, family, labels, "cls", False, labels, max_length, None, sigmoid, ids_past_table)
        width = files.config["hidden_size"]
        for layer in files.dense:
            if layer.in_features != width:
                raise UserError(f"{layer.path}: a Dense module of {layer.in_features} inputs cannot follow "
                                f"{width} dimensions; check that the model's modules belong together")
            width = layer.out_features
        if config.dim is not None and config.dim > width:
            raise UserError(f"--dim {config.dim} is larger than the model's {width} dimensions; pick at most {width}")
        if config.dim is None and files.truncate_dim is not None and files.truncate_dim > width:
            raise UserError(f"{files.name}: its truncate_dim {files.truncate_dim} (config_sentence_transformers.json) "
                            f"is larger than its {width} dimensions; repair the model's files, or pass --dim")
        normalize = files.normalize if config.normalize is None else config.normalize
        if files.quantization and normalize:
            raise UserError(f"{files.name} outputs {files.quantization} vectors (round(tanh(x) * 127)), which "
                            "are compared by cosine and not normalised; drop --normalize")
        # truncate_dim cuts the vector (Matryoshka) as --dim does, normalised after the cut: sentence-transformers
        # cuts its normalised vector, so that its rows have the same directions (cosine 1) but not unit length.
        return cls(files, family, 0, files.pooling, normalize, config.dim or files.truncate_dim or width, max_length,
                   files.quantization, False, ids_past_table)

    @property
    def vocab_size(self) -> int:
        """The rows of the model's embedding table."""
        return int(self.files.config["vocab_size"])

    @property
    def vector_dtype(self) -> str:
        """What results hold: int8 for an int8 model (its float32 values are whole numbers), else float32."""
        return "int8" if self.quantization == "int8" else "float32"

    @cached_property
    def weights_sha256(self) -> str:
        return weights_digest(self.files.path, [layer.path for layer in self.files.dense])

    @cached_property
    def files_sha256(self) -> str:
        return files_digest(self.files.path)

    def settings(self) -> dict[str, str]:
        """What decides the outputs: recorded with every output so a mismatch can be caught later."""
        if self.num_labels:
            return {"model": self.files.name, "weights_sha256": self.weights_sha256, "files_sha256": self.files_sha256,
                    "labels": str(self.num_labels), "activation": "sigmoid" if self.sigmoid else "identity",
                    "max_length": str(self.max_length)}
        settings = {
            "model": self.files.name,
            "weights_sha256": self.weights_sha256,
            "files_sha256": self.files_sha256,
            "dim": str(self.dim),
            "pooling": self.pooling,
            "normalize": str(self.normalize).lower(),
            "max_length": str(self.max_length),
        }
        if self.quantization:  # only then, so tables written before quantisation existed still match
            settings["quantization"] = self.quantization
        return settings


def classifier_labels(config: dict) -> int:
    """How many logits a *ForSequenceClassification checkpoint outputs; 0 for an embedding model."""
    if not any(arch.endswith("ForSequenceClassification") for arch in config.get("architectures") or ()):
        return 0
    return len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))


def _sigmoid(files: ModelFiles, labels: int) -> bool:
    """Whether the cross-encoder's scores are squashed, as sentence-transformers' CrossEncoder decides:
    the activation its files record, else a sigmoid for one label and none for more."""
    recorded = files.score_activation
    if recorded is None:
        return labels == 1
    kind = str(recorded).rsplit(".", 1)[-1]
    if kind not in ("Sigmoid", "Identity"):
        raise UserError(f"{files.name} records the score activation {recorded!r}; embedctl applies a sigmoid or none")
    return kind == "Sigmoid"
