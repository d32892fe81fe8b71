"""Ragged attention over packed sequences: one call, four backends.

Every backend computes softmax(q k^T / sqrt(d)) v inside each sequence of a packed batch (cu_seqlens
gives the boundaries), with no padding and no KV cache; bidirectional (encoders, pplx-embed) or causal
(Qwen3-Embedding: each token sees itself and the tokens before it), and with fewer k/v heads than
q heads (grouped-query attention: each k/v head serves heads // kv_heads consecutive q heads):
- "sdpa": torch's scaled_dot_product_attention once per sequence. Exact, runs anywhere; the CPU
  path and the test oracle. Its Python loop over sequences rules it out of CUDA graphs.
- "varlen": torch.nn.attention.varlen.varlen_attn, PyTorch's built-in FlashAttention-2. CUDA only,
  any head_dim, graph-capturable once max_seqlen is fixed per bucket.
- "flashinfer": FlashInfer's ragged prefill (fa3 on Hopper). head_dim 64/128/256 only; needs a host
  side plan() per batch, which the engine runs before launching or replaying the batch.
- "triton": engine.triton_kernels.ragged_attention, our own kernel. CUDA only, head_dim 32, 64 or
  128, graph-capturable as varlen is.
choose_backend() picks one per model, and few_sequences_backend() one for graphs of a few sequences;
the rules and the measurements behind them are written there.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.config import GPU_ATTENTION
from engine.errors import UserError

FLASHINFER_HEAD_DIMS = (64, 128, 256)
TRITON_HEAD_DIMS = (32, 64, 128)  # those measured and tested on the H200
# CUDA graphs of at most this many sequence slots may take another backend than the model's (few_sequences_backend).
FEW_SEQUENCES = 4


class Attention(Protocol):
    """What every backend offers: plan() on the host for a batch, then call on q [T, heads, d] and
    k, v [T, kv_heads, d]; and pooled() for a model's last layer when only one row per sequence
    is read (see engine.pooling.prunes_last_layer)."""

    def plan(self, layout: AttentionLayout) -> None: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query per sequence slot, q [slots, heads, d], attending to its whole sequence in k, v
        without a mask -> [slots, heads, d]; an empty slot's row is zeros."""


@dataclass
class AttentionLayout:
    """Where each sequence of a batch starts and ends, on the device and on the host.

    tokens is the length of q, k and v: past cu_seqlens[-1] when a graph bucket pads the batch.
    """

    cu_seqlens: torch.Tensor  # int32 [slots + 1] on the model's device
    cu_seqlens_host: list[int]
    max_seqlen: int
    tokens: int


class SdpaAttention:
    """Exact attention, one scaled_dot_product_attention per sequence."""

    def __init__(self, causal: bool = False) -> None:
        self.causal = causal
        self.layout: AttentionLayout | None = None

    def plan(self, layout: AttentionLayout) -> None:
        self.layout = layout

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        bounds = self.layout.cu_seqlens_host
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], self.causal)
        return out

    def pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(q)
        bounds = self.layout.cu_seqlens_host
        for slot, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end > start:
                out[slot: slot + 1] = _sdpa(q[slot: slot + 1], k[start:end], v[start:end], causal=False)
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """One sequence: q [Lq, heads, d] against k, v [Lk, kv_heads, d] -> [Lq, heads, d]."""
    # [L, heads, d] -> [1, heads, L, d]: the 4-D form reaches torch's fused CPU kernel, the 3-D form
    # a math fallback five times slower.
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                         is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


class DeviceOffsetsAttention:
    """What the backends that read cu_seqlens from device memory (and so replay in a CUDA graph) share:
    plan() only keeps the layout, and pooled() needs query offsets 0, 1, ..., slots on the device."""

    def __init__(self) -> None:
        self.layout: AttentionLayout | None = None
        self.query_offsets: dict[int, torch.Tensor] = {}  # by slot count

    def plan(self, layout: AttentionLayout) -> None:
        self.layout = layout

    def one_query_each(self, slots: int, device: torch.device) -> torch.Tensor:
        """Offsets giving each sequence slot one query row, for pooled()."""
        if slots not in self.query_offsets:  # once per slot count; a graph's before its capture
            self.query_offsets[slots] = torch.arange(slots + 1, dtype=torch.int32, device=device)
        return self.query_offsets[slots]


class VarlenAttention(DeviceOffsetsAttention):
    """PyTorch's FlashAttention-2 varlen kernel; reads cu_seqlens from device memory, so it replays."""

    def __init__(self, causal: bool = False) -> None:
        from torch.nn.attention.varlen import varlen_attn

        super().__init__()
        self.varlen_attn = varlen_attn
        self.window = (-1, 0) if causal else (-1, -1)
        # torch 2.13 takes enable_gqa; older releases (the H200 had 2.11) may not: there k and v get
        # their heads repeated instead.
        self.native_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        k, v, options = self._grouped(q, k, v)
        return self.varlen_attn(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen,
                                layout.max_seqlen, window_size=self.window, **options)

    def pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        k, v, options = self._grouped(q, k, v)
        return self.varlen_attn(q, k, v, self.one_query_each(q.shape[0], q.device), layout.cu_seqlens, 1,
                                layout.max_seqlen, window_size=(-1, -1), **options)

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """k and v as varlen_attn takes them with fewer k/v heads than q heads, and its options."""
        if k.shape[1] == q.shape[1]:
            return k, v, {}
        if self.native_gqa:
            return k, v, {"enable_gqa": True}
        return (*(t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v)), {})


class TritonAttention(DeviceOffsetsAttention):
    """engine.triton_kernels.ragged_attention: one program per sequence, head and block of query rows,
    reading cu_seqlens from device memory (so it replays), launching blocks for max_seqlen rows per
    sequence as varlen does (engine.graphs buckets it)."""

    def __init__(self, causal: bool = False) -> None:
        from engine.triton_kernels import ragged_attention, tiles_for

        super().__init__()
        self.ragged_attention, self.tiles_for = ragged_attention, tiles_for
        self.causal = causal

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        return self.ragged_attention(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, self.causal,
                                     self.tiles_for(q.shape[-1], layout.max_seqlen, len(layout.cu_seqlens_host) - 1))

    def pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.ragged_attention(q, k, v, self.one_query_each(q.shape[0], q.device), self.layout.cu_seqlens, 1,
                                     False, self.tiles_for(q.shape[-1], 1, q.shape[0]))


class FlashInferAttention:
    """FlashInfer's ragged prefill. plan() is host work (about 0.3 ms) that a run needs first.

    In graph mode the wrapper owns fixed index buffers, so one instance serves one graph shape;
    unused slots are zero-length sequences. FlashInfer insists that the last offset equals the
    length of q, so one extra sequence always covers the bucket's padding tokens (empty when there
    are none); their rows are discarded by pooling. The instances of one lane (engine.graphs) share
    one scratch workspace: they run one after another on the lane's stream.
    A plan lives in its wrapper's own index buffers and integer workspace (the shared workspace
    only holds each run's temporaries), so a batch laid out exactly like the one this instance
    planned last reuses that plan: a repeated query, or pairs all cut at max_length, skip the
    0.3 ms of host work. With `pooled`, a second wrapper plans pooled() over the same sequences:
    a new layout then costs two plans, and each graph shape holds two plan workspaces.
    FlashInfer gives every wrapper an 8 MiB integer workspace for its plan, and as much page-locked
    on the host. With one wrapper per graph shape (two when pooled) that came to 7.2 GiB on the
    device and 4.6 GiB page-locked for BERT-base's 489 shapes, 16 / 8 GiB for Qwen3-0.6B's
    (bench/results/gpu-2026-11-30-run64-warmup-flashinfer), so a graph shape's wrappers get
    workspaces sized for what a plan of its slots can hold in the engine's largest graph bucket
    (plan_workspace_bytes): under 1 MiB each, 2.5x less memory in all (run65). Sizing them by each
    shape's own token count would save a few hundred MiB more.
    """

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype, workspace: torch.Tensor,
                 causal: bool = False, slots: int | None = None, num_kv_heads: int | None = None,
                 pooled: bool = False, max_tokens: int | None = None) -> None:
        """slots and max_tokens: a graph shape's sequence slots and the most tokens it can have; None for eager runs."""
        if slots and max_tokens is None:
            raise ValueError("a graph shape's FlashInferAttention needs max_tokens, which sizes its plan workspace")
        self.num_heads, self.head_dim, self.dtype, self.causal = num_heads, head_dim, dtype, causal
        self.num_kv_heads, self.max_tokens = num_kv_heads or num_heads, max_tokens
        self.planned = torch.cuda.Event()
        self.planned_indptr: list[int] | None = None
        # Sequence offsets; their last entry is the padding sequence's end (the bucket's token count).
        self.indptr = torch.zeros(slots + 2, dtype=torch.int32, device=workspace.device) if slots else None
        self.wrapper = self._wrapper(workspace, self.indptr)
        # pooled(): one query row per slot over the same sequences, under a plan of its own.
        query_offsets = torch.zeros(slots + 2, dtype=torch.int32, device=workspace.device) if slots else None
        self.pooled_wrapper = self._wrapper(workspace, query_offsets) if pooled else None

    def _wrapper(self, workspace: torch.Tensor, query_offsets: torch.Tensor | None):  # noqa: ANN202 - flashinfer's type
        import flashinfer

        if query_offsets is None:
            return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=query_offsets, kv_indptr_buf=self.indptr)
        # Its default 8 MiB go back to torch's caches, where the next wrapper's constructor finds them.
        plan_workspace = torch.empty(plan_workspace_bytes(self.num_heads, len(self.indptr) - 2, self.max_tokens),
                                     dtype=torch.uint8, device=workspace.device)
        wrapper.reset_workspace_buffer(workspace, plan_workspace)
        return wrapper

    def plan(self, layout: AttentionLayout) -> None:
        indptr = layout.cu_seqlens_host + [layout.tokens]
        if indptr == self.planned_indptr:
            return
        # plan() rewrites a page-locked buffer that the previous plan's copy to the device may
        # still be reading while the GPU works through earlier batches: wait until the stream has
        # passed that copy (and so everything queued before it), not for the whole device.
        self.planned.synchronize()
        indptr_t = torch.tensor(indptr, dtype=torch.int32)
        self.wrapper.plan(indptr_t, indptr_t, self.num_heads, self.num_kv_heads, self.head_dim,
                          causal=self.causal, q_data_type=self.dtype)
        if self.pooled_wrapper is not None:
            # Query offsets 0, 1, ..., slots, slots: a row for each slot, none for the padding sequence.
            one_query_each = torch.arange(len(indptr), dtype=torch.int32).clamp(max=len(indptr) - 2)
            self.pooled_wrapper.plan(one_query_each, indptr_t, self.num_heads, self.num_kv_heads, self.head_dim,
                                     causal=False, q_data_type=self.dtype)
        self.planned.record()
        self.planned_indptr = indptr

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q, k, v)

    def pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.pooled_wrapper is not None, "FlashInferAttention was built without pooled=True"
        return self.pooled_wrapper.run(q, k, v)


def plan_workspace_bytes(num_heads: int, slots: int, max_tokens: int) -> int:
    """An upper bound on the integer workspace FlashInfer's plan() fills for a CUDA-graph wrapper of
    `slots` sequences (and the padding one) over at most max_tokens tokens.

    From FlashInfer 0.7's scheduler (include/flashinfer/attention/scheduler.cuh): the Hopper plan
    (PrefillSM90Plan) keeps 7 int32 arrays of at most (ceil(rows / 128) + sequences) work items per
    query head; the Ampere one (PrefillPlan) keeps 4 arrays of at most max(2 * SMs / kv heads,
    rows * group / 16 + sequences) query tiles (group: query heads per k/v head, at most num_heads)
    and rows + 1 merge offsets. Eight arrays of (rows / 16 + sequences) per head bound the tiles and
    the merge offsets; the 64 KiB of slack covers the SM-count minimum, alignment and the small fields.
    """
    return 32 * num_heads * (max_tokens // 16 + slots + 2) + (64 << 10)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(requested: str, device: torch.device, head_dim: int) -> str:
    """The backend name for a model, from the user's request and what this machine can run.

    On the CPU only sdpa exists. On a GPU, "auto" takes FlashInfer where its kernels cover the
    head_dim (64/128/256) and it is installed, our Triton kernel for head_dim 32 (MiniLM's) and for
    64 and 128 where FlashInfer is not installed, and varlen_attn for the rest. The evidence,
    on the H200 (bench/results/gpu-2026-12-01-run114-triton-attention to run117; kernels inside
    CUDA graphs):
    - head_dim 32 (MiniLM, 12 heads): Triton 36 us against varlen's 55 at 64 x 256 tokens, 25 / 41
      at 128 x 128, 62 / 85 at 32 x 512, 2.4 / 5.8 for one 16-token query. MiniLM on the corpus,
      model-only, 13.5M tok/s against 11.6M; batch 1 at 16 tokens 0.259 ms against 0.288 (run116).
    - head_dim 64 (BERT-base): FlashInfer's fa3 is faster at full batches (80 us against 94 at
      32 x 512; BERT-base model-only 2.58M tok/s against 2.45M, run115), which is what index runs;
      Triton is faster for a few sequences, which few_sequences_backend gives it, with its figures.
      The cross-encoder's 5 / 25 / 50 pairs all through Triton: 2.11 / 6.90 / 11.78 ms against
      2.01 / 6.60 / 11.28 (run117), and 2.42, 2.46 against 2.56, 2.66 for 5 pairs alternating
      (run115): no clear winner for the model as a whole, so it keeps FlashInfer.
    - head_dim 128 causal (Qwen3-0.6B, 16 heads, 8 k/v heads): fa3 139 us at one 4,096-token
      sequence (494 TFLOP/s), Triton 222, varlen 375; at 512 tokens 11.0 / 11.6 / 33.4.
    FlashInfer cannot run head_dim 32. Pass --attention to override.
    """
    if device.type != "cuda":
        if requested not in ("auto", "sdpa"):
            raise UserError(GPU_ATTENTION.format(requested))  # "auto" device that has no GPU
        return "sdpa"
    if requested == "flashinfer":
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise UserError(f"FlashInfer does not support head_dim {head_dim}; use --attention varlen")
        if not flashinfer_available():
            raise UserError("--attention flashinfer needs the flashinfer-python package; pip install 'embedctl[gpu]'")
        return "flashinfer"
    if requested == "triton":
        if head_dim not in TRITON_HEAD_DIMS:
            raise UserError(f"--attention triton runs head_dim 32, 64 or 128, not {head_dim}; use --attention varlen")
        if not triton_available():
            raise UserError("--attention triton needs the triton package, which CUDA builds of torch install; use --attention varlen")
        return "triton"
    if requested == "sdpa":
        raise UserError("--attention sdpa is the CPU backend (its per-sequence loop cannot be captured in a "
                        "CUDA graph); use varlen, flashinfer or triton on a GPU")
    if requested == "auto":
        if head_dim in FLASHINFER_HEAD_DIMS and flashinfer_available():
            return "flashinfer"
        return "triton" if head_dim in TRITON_HEAD_DIMS and triton_available() else "varlen"
    return requested


def few_sequences_backend(requested: str, backend: str, head_dim: int, causal: bool) -> str:
    """The backend for CUDA graphs of at most FEW_SEQUENCES sequence slots, given the model's (choose_backend).
    Batches that run eagerly (a shape's first hit, --eager) keep the model's backend.

    Triton where "auto" chose FlashInfer for a bidirectional head_dim 64 model (BERT-base): for one
    16-token query its kernel takes 2.5 us against fa3's 5.9 (bench/results/gpu-2026-12-01-run114-
    triton-attention). BERT-base batch 1 at 16 / 128 / 512 tokens took 0.450 / 0.480 / 0.581 ms through
    Triton against 0.604 / 0.626 / 0.730 through FlashInfer (run117), and 0.389 / 0.458 / 0.577 through
    this rule against 0.490 / 0.481 / 0.619 (run123); a BERT-base cross-encoder, whose reranking steps
    are mostly of one or two pairs, 1.94 / 6.68 / 10.93 ms for 5 / 25 / 50 pairs against 2.01 / 6.60 /
    11.17 (run123). At 5 x 512 tokens (8 slots) the kernels are close (16 against 20 us) and fa3 wins
    full batches (80 against 94 us at 32 x 512), so larger graphs keep FlashInfer. Every other model
    keeps it too: fa3 is faster for one causal head_dim 128 sequence as well (Qwen3: 11.0 against 11.6 us
    at 512 tokens, 139 against 222 at 4,096), and other shapes have not been measured.
    Otherwise the model's backend, and always the one the user asked for by name.
    """
    if requested == "auto" and backend == "flashinfer" and head_dim == 64 and not causal and triton_available():
        return "triton"
    return backend
