"""BERT-family encoders (BERT, MiniLM, BGE, E5, GTE-style, XLM-RoBERTa) over packed token streams,
and their cross-encoder form (*ForSequenceClassification: the encoder plus a head on the first token).

The input is one flat stream of T tokens from many sequences laid back to back, with no padding;
attention stays inside each sequence through the `attend` function the engine passes in
(engine.attention). Parameter names are Hugging Face's, so checkpoints load by name; after loading,
query/key/value are fused into one matrix so each layer runs one QKV GEMM.
Not here: pooling, normalisation, the score activation, tokenization, reading files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import Attention
from engine.checkpoint import match_state_dict
from engine.errors import UserError
from engine.fused import ACTIVATIONS, Fused
from engine.spec import classifier_labels

# Checkpoints saved from BertModel have no prefix; those saved from task heads nest it.
PREFIXES = ("bert.", "roberta.", "model.")
ROBERTA_TYPES = ("roberta", "xlm-roberta")
# Tensors a checkpoint may carry that an embedding model never reads (a cross-encoder reads its pooler).
UNUSED = ("pooler.", "embeddings.position_ids", "cls.", "lm_head.")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int
    num_labels: int = 0  # 0: an embedder; more: a cross-encoder with that many label logits
    model_type: str = "bert"

    @classmethod
    def from_hf(cls, config: dict, position_offset: int) -> BertConfig:
        if config.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise UserError(f"activation {config['hidden_act']!r} is not supported; embedctl knows {', '.join(ACTIVATIONS)}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UserError(f"position_embedding_type {config['position_embedding_type']!r} is not supported; only absolute")
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"], num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"], hidden_act=config.get("hidden_act", "gelu"),
            max_position_embeddings=config.get("max_position_embeddings", 512),
            type_vocab_size=config.get("type_vocab_size", 2), layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            position_offset=position_offset, num_labels=classifier_labels(config), model_type=config.get("model_type", "bert"),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                fused: Fused) -> torch.Tensor:
        norm = self.LayerNorm
        return fused.embed_layer_norm(input_ids, position_ids, token_type_ids, self.word_embeddings.weight,
                                      self.position_embeddings.weight, self.token_type_embeddings.weight,
                                      norm.weight, norm.bias, norm.eps)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        self.qkv: nn.Linear | None = None
        self.heads = config.num_attention_heads
        self.act = config.hidden_act

    def fuse_qkv(self) -> None:
        """Replace query, key and value by one [3H, H] projection: one GEMM instead of three."""
        parts = self.attention.self
        hidden = parts.query.in_features
        self.qkv = nn.Linear(hidden, 3 * hidden, device=parts.query.weight.device, dtype=parts.query.weight.dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([parts.query.weight, parts.key.weight, parts.value.weight]))
            self.qkv.bias.copy_(torch.cat([parts.query.bias, parts.key.bias, parts.value.bias]))
        del self.attention.self

    def forward(self, x: torch.Tensor, attend: Attention, fused: Fused, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for every token, or with `rows` for those rows only (attend.pooled).
        Overwrites x: the output GEMMs sum into it (Fused.dense_add_layer_norm)."""
        tokens, hidden = x.shape
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, hidden // self.heads).unbind(1)
        if rows is None:
            context = attend(q, k, v)
        else:
            context, x = attend.pooled(q[rows], k, v), x[rows]
        x = fused.dense_add_layer_norm(context.flatten(1), self.attention.output.dense, x, self.attention.output.LayerNorm)
        intermediate = fused.dense_act(x, self.intermediate.dense, self.act)
        return fused.dense_add_layer_norm(intermediate, self.output.dense, x, self.output.LayerNorm)


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """token ids [T], positions [T], token types [T] -> hidden states [T, hidden_size], or with `rows`
    [S] those rows' only [S, hidden_size], the last layer computing no others."""

    causal = False  # an encoder: every token attends to its whole sequence

    def __init__(self, config: BertConfig, fused: Fused | None = None) -> None:
        super().__init__()
        self.config = config
        self.fused = fused or Fused(compile=False)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        if config.num_labels and config.model_type in ROBERTA_TYPES:
            self.classifier = RobertaClassificationHead(config)
        elif config.num_labels:
            self.pooler = BertPooler(config)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings - self.config.position_offset

    @property
    def num_labels(self) -> int:
        return self.config.num_labels

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict by name; a missing or unknown tensor is an error, never random."""
        self.load_state_dict(match_state_dict(self.state_dict(), weights, PREFIXES, UNUSED, "BERT"))
        for layer in self.encoder.layer:
            layer.fuse_qkv()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attend: Attention, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, position_ids + self.config.position_offset, token_type_ids, self.fused)
        last = len(self.encoder.layer) - 1
        for index, layer in enumerate(self.encoder.layer):
            x = layer(x, attend, self.fused, rows if index == last else None)
        return x

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's label logits [S, num_labels] from the hidden states of each pair's first token."""
        if isinstance(self.classifier, RobertaClassificationHead):
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_tokens)))
        return self.classifier(torch.tanh(self.pooler.dense(first_tokens)))

