"""Engine: a loaded model on one device, turning packed batches into vectors.

The model is a BERT-family encoder (engine.models.bert) or a Qwen3 decoder embedder
(engine.models.qwen3: Qwen3-Embedding, causal with last-token pooling; pplx-embed-v1, bidirectional
with mean pooling and int8 output), chosen by the config's model_type. step(batch) enqueues the
whole model (embeddings, layers, pooling, normalisation, quantisation) for one PackedBatch and
returns a LazyTensor at once; for a cross-encoder (a BERT *ForSequenceClassification checkpoint)
each sequence is a query-document pair and the result is its label logits instead of a vector, which
activate() turns into the model's scores: the activation stays out of the graph so that a caller may
have the logits themselves (text-embeddings-inference's raw_scores), and the sigmoid of a few numbers
costs the host nothing. On a GPU it
runs through lazily captured CUDA graphs (engine.graphs) with readback through a pinned ring
(engine.lazy), on the CPU eagerly with exact per-sequence attention. The same model code runs on
both. embed() is the convenience for callers that just want vectors for a list of token-id sequences.
Not here: tokenization and prompts (the caller puts a prompt's text in front of the input; the
model's prompts are in files.prompts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention import (FEW_SEQUENCES, Attention, AttentionLayout, FlashInferAttention, SdpaAttention,
                              TritonAttention, VarlenAttention, choose_backend, few_sequences_backend, triton_available)
from engine.batch import Packer, PackedBatch
from engine.checkpoint import config_errors, load_weights, position_offset, resolve_model
from engine.config import GPU_FP32, EngineConfig
from engine.errors import UserError
from engine.fused import Fused
from engine.graphs import GRAPH_MAX_TOKENS, GraphRunner, GraphStats, bucket_for
from engine.lazy import LazyTensor, PinnedRing
from engine.models.bert import BertConfig, BertModel
from engine.models.qwen3 import Qwen3Config, Qwen3Model, Qwen3Ops
from engine.pooling import DenseHead, finish, pool, pooled_rows, prunes_last_layer
from engine.spec import ModelSpec

FLASHINFER_WORKSPACE_BYTES = 128 << 20


class Engine:
    """One model on one device. Build it with Engine.load(); feed it PackedBatches through step().

    What it outputs (dim, pooling, normalize, max_length, quantization, num_labels, vector_dtype,
    settings()) is its ModelSpec's (engine.spec), copied here for the callers' convenience.
    """

    def __init__(self, model: BertModel | Qwen3Model, spec: ModelSpec, config: EngineConfig,
                 device: torch.device) -> None:
        self.model = model
        self.spec = spec
        self.files = spec.files
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.num_labels, self.sigmoid, self.quantization = spec.num_labels, spec.sigmoid, spec.quantization
        self.pooling, self.normalize, self.dim, self.max_length = spec.pooling, spec.normalize, spec.dim, spec.max_length
        # step() gives float32 always (an int8 model's values are whole numbers, exact in float32);
        # embed() and the writers give vector_dtype.
        self.vector_dtype = spec.vector_dtype
        self.vocab_size = spec.vocab_size
        self.ids_past_table = spec.ids_past_table  # step() then checks each batch's ids
        self.max_batch_tokens = config.batch_tokens(device, self.max_length)  # spec checked a user's budget
        self.attention = choose_backend(config.attention, device, model.head_dim)
        self.few_sequences_attention = few_sequences_backend(config.attention, self.attention, model.head_dim,
                                                             model.causal)
        self.prune = prunes_last_layer(self.pooling, model.causal)
        self.dense = DenseHead(spec.files.dense, device) if spec.files.dense and not self.num_labels else None
        # Pooling, truncation and normalisation in one kernel on a GPU; engine.pooling's torch ops elsewhere.
        self.pool_kernel: Callable[..., torch.Tensor] | None = None
        if device.type == "cuda" and triton_available():
            from engine.triton_kernels import pool_normalize

            self.pool_kernel = pool_normalize
        self.runner: GraphRunner | None = None
        # step() takes one thread at a time (its attention plans and lanes are the engine's own); embed()
        # holds this for its steps, so that threads may call it at once, as a web app's workers do.
        self._embed_lock = threading.Lock()
        self._flashinfer_workspaces: dict[int, torch.Tensor] = {}  # per lane: batches on several lanes run at once
        if device.type == "cuda":
            self.runner = GraphRunner(self.forward, self._make_attention, self.max_batch_tokens, config.max_seqs,
                                      self.max_length, device, config.cuda_graphs, config.lanes)
            self.ring = PinnedRing(config.pinned_slots, config.max_seqs, self.dim)
            if config.warmup and config.cuda_graphs:
                with torch.inference_mode():
                    self.runner.capture_all(self.max_batch_tokens)
        else:
            self.cpu_attention = SdpaAttention(causal=model.causal)

    @classmethod
    def load(cls, model: str | ModelSpec | None = None, config: EngineConfig | None = None) -> Engine:
        """Load `model`: a directory, a hub id, None for the default all-MiniLM-L6-v2, or the ModelSpec
        a caller worked out already with the same config."""
        config = config or EngineConfig()
        spec = model if isinstance(model, ModelSpec) else ModelSpec.of(resolve_model(model), config)
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        if device.type == "cuda" and dtype == torch.float32:
            raise UserError(GPU_FP32)
        fuse = device.type == "cuda" and config.compile
        network: BertModel | Qwen3Model
        with config_errors(spec.files):
            if spec.family == "bert":
                bert = BertConfig.from_hf(spec.files.config, position_offset(spec.files.config))
                network = BertModel(bert, Fused(fuse))
            else:
                qwen3 = Qwen3Config.from_hf(spec.files.config)
                network = Qwen3Model(qwen3, Qwen3Ops(fuse, qwen3.head_dim))
        network.load_hf_weights(load_weights(spec.files.path))
        network.requires_grad_(False)
        network.to(device=device, dtype=dtype).eval()
        return cls(network, spec, config, device)

    def forward(self, inputs: torch.Tensor, tokens: int, slots: int, attention: Attention) -> torch.Tensor:
        """The whole model on inputs laid out by PackedBatch.write_inputs -> float32 [slots, dim]."""
        input_ids, positions, token_types, seq_ids = inputs[: 4 * tokens].view(4, tokens)
        cu_seqlens = inputs[4 * tokens: 4 * tokens + slots + 1]
        rows = pooled_rows(cu_seqlens, self.pooling, tokens) if self.pooling != "mean" else None
        # Pruned, the model gives the pooled rows themselves, one per sequence.
        hidden = self.model(input_ids, positions, token_types, attention, rows if self.prune else None)
        if self.pool_kernel is not None and not self.num_labels:
            bounds, gather = cu_seqlens if rows is None else None, None if self.prune else rows
            if self.dense is None:  # pooling, truncation and normalisation in one kernel
                return finish(self.pool_kernel(hidden, self.dim, self.normalize, bounds, gather), None, False,
                              self.quantization)
            pooled = self.pool_kernel(hidden, hidden.shape[1], False, bounds, gather)  # Dense takes the whole vector
        else:
            pooled = hidden.float() if self.prune else pool(hidden, seq_ids, cu_seqlens, self.pooling)
            if self.num_labels:
                return self.model.classify(pooled.to(self.dtype)).float()
        if self.dense is not None:
            pooled = self.dense(pooled)
        return finish(pooled, self.dim, self.normalize, self.quantization)

    def step(self, batch: PackedBatch) -> LazyTensor:
        """Enqueue one batch; the LazyTensor resolves to float32 [batch.num_seqs, dim] in batch order (a
        cross-encoder: [batch.num_seqs, num_labels] logits, for activate()).

        On a GPU the batch runs on a stream of the engine's own (engine.graphs' lanes), so any thread
        may call it; one thread at a time.

        For an int8 model (vector_dtype "int8") the values are whole numbers in [-127, 127]: cast them
        with astype(np.int8), which is exact."""
        # torch.inference_mode through its C++ guard: the decorator's Python wrapper cost 3-4 us of a
        # step's host time on the H200 host (bench/results/gpu-2026-12-01-run125-write-inputs).
        with torch._C._InferenceMode(True):
            return self._step(batch)

    def _step(self, batch: PackedBatch) -> LazyTensor:
        if batch.max_seqlen > self.max_length:
            raise UserError(f"a sequence of {batch.max_seqlen} tokens is longer than the model's max length "
                            f"{self.max_length}; truncate it first")
        if self.ids_past_table:  # only then: the check costs 2 us of a 200 us batch-1 step
            self.check_ids(batch.input_ids)
        if self.runner is not None:
            return self.runner.run(batch, self.ring.readback)
        tokens, seqs = batch.num_tokens, batch.num_seqs
        inputs = np.empty(4 * tokens + seqs + 1, dtype=np.int32)
        batch.write_inputs(inputs, tokens, seqs)
        inputs_t = torch.from_numpy(inputs)
        self.cpu_attention.plan(AttentionLayout(inputs_t[4 * tokens:], batch.cu_seqlens.tolist(), batch.max_seqlen, tokens))
        return LazyTensor.done(self.forward(inputs_t, tokens, seqs, self.cpu_attention).numpy())

    def activate(self, logits: np.ndarray) -> np.ndarray:
        """A cross-encoder's scores from the logits step() gives: their sigmoid for a model whose files ask
        for one (spec.sigmoid: one label, by default), else the logits. A new array."""
        if not self.sigmoid:
            return np.array(logits, dtype=np.float32)
        return torch.sigmoid(torch.as_tensor(logits, dtype=torch.float32)).numpy()

    def check_ids(self, ids: np.ndarray) -> None:
        """UserError for a token id outside the embedding table, which on a GPU is a device-side assert
        that ends the process's CUDA context. step() checks when the tokenizer can give such ids (its
        added tokens past the table); embed(), which takes any ids, always."""
        if not len(ids):
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise UserError(f"a sequence holds token id {low if low < 0 else high}, outside the {self.vocab_size} rows "
                            "of the model's embedding table (a token its tokenizer adds that the weights never "
                            "learnt, or another tokenizer's id); leave that token out of the input")

    def embed(self, sequences: Sequence[Sequence[int]],
              token_type_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Vectors (a cross-encoder: scores) for token-id sequences, [len(sequences), dim] of vector_dtype, in order.

        Any thread may call it, several at once: their calls run one after another."""
        packer = Packer(self.max_batch_tokens, self.config.max_seqs)
        pending = []

        def run(batch: PackedBatch) -> None:
            if not self.ids_past_table:  # else step() checks
                self.check_ids(batch.input_ids)
            pending.append(self.step(batch))

        with self._embed_lock:
            for index, ids in enumerate(sequences):
                types = token_type_ids[index] if token_type_ids is not None else None
                if (batch := packer.add(ids, index, types)) is not None:
                    run(batch)
            if (batch := packer.flush()) is not None:
                run(batch)
            if not pending:
                return np.zeros((0, self.dim), dtype=self.vector_dtype)
            rows = np.concatenate([lazy.result() for lazy in pending])
        return (self.activate(rows) if self.num_labels else rows).astype(self.vector_dtype, copy=False)

    @property
    def stats(self) -> GraphStats:
        return self.runner.stats if self.runner is not None else GraphStats()

    def settings(self) -> dict[str, str]:
        return self.spec.settings()

    @property
    def attention_label(self) -> str:
        """The attention backend as a person reads it: one name, or also the one graphs of a few sequences run."""
        if self.few_sequences_attention == self.attention or not self.config.cuda_graphs:
            return self.attention
        return f"{self.attention} ({self.few_sequences_attention} in graphs of up to {FEW_SEQUENCES} sequences)"

    def _make_attention(self, slots: int | None, lane: int) -> Attention:
        backend = self.few_sequences_attention if slots is not None and slots <= FEW_SEQUENCES else self.attention
        if backend == "flashinfer":
            if lane not in self._flashinfer_workspaces:
                self._flashinfer_workspaces[lane] = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                                                device=self.device)
            return FlashInferAttention(self.model.num_heads, self.model.head_dim, self.dtype,
                                       self._flashinfer_workspaces[lane], causal=self.model.causal, slots=slots,
                                       num_kv_heads=self.model.num_kv_heads, pooled=self.prune,
                                       max_tokens=min(bucket_for(self.max_batch_tokens), GRAPH_MAX_TOKENS))
        if backend == "triton":
            return TritonAttention(causal=self.model.causal)
        return VarlenAttention(causal=self.model.causal)

