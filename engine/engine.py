"""Engine: a loaded model on one device, turning packed batches into vectors.

The model is a BERT-family encoder (engine.models.bert) or a Qwen3 decoder embedder
(engine.models.qwen3: Qwen3-Embedding, causal with last-token pooling; pplx-embed-v1, bidirectional
with mean pooling and int8 output), chosen by the config's model_type. step(batch) enqueues the
whole model (embeddings, layers, pooling, normalisation, quantisation) for one PackedBatch and
returns a LazyTensor at once; for a cross-encoder (a BERT *ForSequenceClassification checkpoint)
each sequence is a query-document pair and the result is its score instead of a vector. On a GPU it
runs through lazily captured CUDA graphs (engine.graphs) with readback through a pinned ring
(engine.lazy), on the CPU eagerly with exact per-sequence attention. The same model code runs on
both. embed() is the convenience for callers that just want vectors for a list of token-id sequences.
Not here: tokenization and prompts (the caller puts a prompt's text in front of the input; the
model's prompts are in files.prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from engine.attention import Attention, AttentionLayout, FlashInferAttention, SdpaAttention, VarlenAttention, choose_backend
from engine.batch import Packer, PackedBatch
from engine.checkpoint import ModelFiles, load_weights, position_offset, resolve_model, weights_digest
from engine.config import EngineConfig
from engine.errors import UserError
from engine.fused import Fused
from engine.graphs import GraphRunner, GraphStats
from engine.lazy import LazyTensor, PinnedRing
from engine.models.bert import BertConfig, BertModel
from engine.models.qwen3 import Qwen3Config, Qwen3Model, Qwen3Ops
from engine.pooling import finish, pool

BERT_FAMILY = ("bert", "roberta", "xlm-roberta")
QWEN3_FAMILY = ("qwen3", "bidirectional_pplx_qwen3")
FLASHINFER_WORKSPACE_BYTES = 128 << 20


class Engine:
    """One model on one device. Build it with Engine.load(); feed it PackedBatches through step()."""

    def __init__(self, model: BertModel | Qwen3Model, files: ModelFiles, config: EngineConfig,
                 device: torch.device) -> None:
        self.model = model
        self.files = files
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.num_labels = model.num_labels
        self.quantization = None if self.num_labels else files.quantization
        # What results hold: step() gives float32 always (an int8 model's values are whole numbers,
        # exact in float32); embed() and the writers give vector_dtype.
        self.vector_dtype = "int8" if self.quantization == "int8" else "float32"
        if self.num_labels:
            if config.dim is not None or config.normalize:
                raise UserError(f"{files.name} is a cross-encoder: it scores pairs and has no vectors to cut "
                                "or normalise; drop --dim and --normalize")
            self.pooling, self.normalize, self.dim = "cls", False, self.num_labels
            self.sigmoid = self.num_labels == 1 and not _activation(files.config).endswith("Identity")
        else:
            self.pooling = files.pooling
            self.normalize = files.normalize if config.normalize is None else config.normalize
            hidden = model.config.hidden_size
            if config.dim is not None and config.dim > hidden:
                raise UserError(f"--dim {config.dim} is larger than the model's {hidden} dimensions; pick at most {hidden}")
            self.dim = config.dim or hidden
            if self.quantization and self.normalize:
                raise UserError(f"{files.name} outputs {self.quantization} vectors (round(tanh(x) * 127)), which "
                                "are compared by cosine and not normalised; drop --normalize")
        self.max_length = min(config.max_length or files.max_length, model.max_positions)
        self.max_batch_tokens = config.batch_tokens(device, self.max_length)
        if self.max_length > self.max_batch_tokens:
            raise UserError(f"--max-batch-tokens {self.max_batch_tokens} is smaller than the max length "
                            f"{self.max_length}; raise it or lower --max-length")
        self.attention = choose_backend(config.attention, device, model.head_dim)
        self.runner: GraphRunner | None = None
        self._flashinfer_workspace: torch.Tensor | None = None
        if device.type == "cuda":
            self.runner = GraphRunner(self.forward, self._make_attention, self.max_batch_tokens, config.max_seqs,
                                      self.max_length, device, config.cuda_graphs)
            self.ring = PinnedRing(config.pinned_slots, config.max_seqs, self.dim)
            if config.warmup and config.cuda_graphs:
                with torch.inference_mode():
                    self.runner.capture_all(self.max_batch_tokens)
        else:
            self.cpu_attention = SdpaAttention(causal=model.causal)

    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None) -> Engine:
        """Load `model` (a directory, a hub id, or None for the default all-MiniLM-L6-v2)."""
        config = config or EngineConfig()
        files = resolve_model(model)
        model_type = files.config.get("model_type")
        device = config.torch_device()
        fuse = device.type == "cuda" and config.compile
        network: BertModel | Qwen3Model
        if model_type in BERT_FAMILY:
            network = BertModel(BertConfig.from_hf(files.config, position_offset(files.config)), Fused(fuse))
        elif model_type in QWEN3_FAMILY:
            network = Qwen3Model(Qwen3Config.from_hf(files.config), Qwen3Ops(fuse))
        else:
            raise UserError(f"model type {model_type!r} is not supported yet; embedctl runs "
                            f"{', '.join(BERT_FAMILY + QWEN3_FAMILY)} models")
        network.load_hf_weights(load_weights(files.path))
        network.requires_grad_(False)
        network.to(device=device, dtype=config.torch_dtype(device)).eval()
        return cls(network, files, config, device)

    def forward(self, inputs: torch.Tensor, tokens: int, slots: int, attention: Attention) -> torch.Tensor:
        """The whole model on inputs laid out by PackedBatch.write_inputs -> float32 [slots, dim]."""
        input_ids, positions, token_types, seq_ids = inputs[: 4 * tokens].view(4, tokens)
        cu_seqlens = inputs[4 * tokens: 4 * tokens + slots + 1]
        hidden = self.model(input_ids, positions, token_types, attention)
        pooled = pool(hidden, seq_ids, cu_seqlens, self.pooling)
        if self.num_labels:
            logits = self.model.classify(pooled.to(self.dtype)).float()
            return torch.sigmoid(logits) if self.sigmoid else logits
        return finish(pooled, self.config.dim, self.normalize, self.quantization)

    @torch.inference_mode()
    def step(self, batch: PackedBatch) -> LazyTensor:
        """Enqueue one batch; the LazyTensor resolves to float32 [batch.num_seqs, dim] in batch order.

        For an int8 model (vector_dtype "int8") the values are whole numbers in [-127, 127]: cast them
        with astype(np.int8), which is exact."""
        if batch.max_seqlen > self.max_length:
            raise UserError(f"a sequence of {batch.max_seqlen} tokens is longer than the model's max length "
                            f"{self.max_length}; truncate it first")
        if self.runner is not None:
            return self.ring.readback(self.runner.run(batch), batch.num_seqs)
        tokens, seqs = batch.num_tokens, batch.num_seqs
        inputs = np.empty(4 * tokens + seqs + 1, dtype=np.int32)
        batch.write_inputs(inputs, tokens, seqs)
        inputs_t = torch.from_numpy(inputs)
        self.cpu_attention.plan(AttentionLayout(inputs_t[4 * tokens:], batch.cu_seqlens.tolist(), batch.max_seqlen, tokens))
        return LazyTensor.done(self.forward(inputs_t, tokens, seqs, self.cpu_attention).numpy())

    def embed(self, sequences: Sequence[Sequence[int]],
              token_type_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Vectors (a cross-encoder: scores) for token-id sequences, [len(sequences), dim] of vector_dtype, in order."""
        packer = Packer(self.max_batch_tokens, self.config.max_seqs)
        pending = []
        for index, ids in enumerate(sequences):
            types = token_type_ids[index] if token_type_ids is not None else None
            if (batch := packer.add(ids, index, types)) is not None:
                pending.append(self.step(batch))
        if (batch := packer.flush()) is not None:
            pending.append(self.step(batch))
        if not pending:
            return np.zeros((0, self.dim), dtype=self.vector_dtype)
        return np.concatenate([lazy.result() for lazy in pending]).astype(self.vector_dtype, copy=False)

    @property
    def stats(self) -> GraphStats:
        return self.runner.stats if self.runner is not None else GraphStats()

    @cached_property
    def weights_sha256(self) -> str:
        return weights_digest(self.files.path)

    def settings(self) -> dict[str, str]:
        """What decides the vectors: recorded with every output so a mismatch can be caught later."""
        if self.num_labels:
            return {"model": self.files.name, "weights_sha256": self.weights_sha256, "labels": str(self.num_labels),
                    "activation": "sigmoid" if self.sigmoid else "identity", "max_length": str(self.max_length)}
        settings = {
            "model": self.files.name,
            "weights_sha256": self.weights_sha256,
            "dim": str(self.dim),
            "pooling": self.pooling,
            "normalize": str(self.normalize).lower(),
            "max_length": str(self.max_length),
        }
        if self.quantization:  # only then, so tables written before quantisation existed still match
            settings["quantization"] = self.quantization
        return settings

    def _make_attention(self, slots: int | None) -> Attention:
        if self.attention == "flashinfer":
            if self._flashinfer_workspace is None:
                self._flashinfer_workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            return FlashInferAttention(self.model.num_heads, self.model.head_dim, self.dtype,
                                       self._flashinfer_workspace, causal=self.model.causal, slots=slots,
                                       num_kv_heads=self.model.num_kv_heads)
        return VarlenAttention(causal=self.model.causal)


def _activation(config: dict) -> str:
    """The score activation sentence-transformers' CrossEncoder records (default: sigmoid for one label)."""
    return (config.get("sentence_transformers") or {}).get("activation_fn") or "Sigmoid"
