"""Hand-written Triton kernels, for steps that torch.compile and the libraries serve poorly at the
engine's shapes.

qk_norm_rope: Qwen3's per-head RMSNorm of q and k, then rotary embeddings, reading q and k straight
from the fused QKV projection. Compiled once with dynamic shapes (so that every bucket shares one
compilation), Inductor's version took 0.122 ms at 4,096 tokens and 0.466 ms at 16,384, against
0.071 / 0.268 compiled for one fixed shape (bench/results/gpu-2026-11-30-run11-qwen3): 10% of a
4,096-token step. This kernel reads q and k once and writes them once, each half of a head once,
in programs of up to eight heads of one token, whatever the token count: 16 us per call at 4,096
tokens (bench/results/gpu-2026-11-30-run18-qwen3-last-layer) where reading each element twice in
one program per token took 19 (run14); its memory traffic alone takes about 11.
ragged_attention: softmax(q k^T / sqrt(d)) v within each sequence of a packed batch, one program per
(sequence, head, block of query rows), looping over the sequence's keys with an online softmax
(FlashAttention's scheme); bidirectional or causal, grouped k/v heads, separate query and key
offsets (so one query row per sequence serves a pruned last layer). engine.attention.choose_backend
says where it beats the library kernels and by how much.
pool_normalize: a sequence's vector from its hidden states (the mean of its rows, or one row), cut to
the first `dim` components and L2-normalised, in one program per sequence. engine.pooling's torch
form takes five to seven kernels: an fp32 copy of every hidden state, index_add's atomics, a divide,
a norm and a divide again (about 57 us of MiniLM's 1,142 at 64 x 256 tokens, 11 of its 135 for one
16-token query: bench/results/gpu-2026-12-01-run114-triton-attention). Timed alone at 384 columns
(run120): 7.4 us against 72.9 at 64 x 256 tokens, 2.4 against 15.2 for one 16-token query.
GPU only: triton ships with CUDA builds of torch, and the engine imports this module only there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Heads per program: Qwen3-0.6B's 16 q + 8 k heads make three programs per token, none masked, and
# 12,288 programs at 4,096 tokens instead of 4,096 programs that each padded 24 heads to 32.
HEADS_PER_PROGRAM = 8


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, qkv_stride, eps,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_HEADS: tl.constexpr):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, half)[None, :]
    present = heads < HEADS + KV_HEADS
    is_q = heads < HEADS
    # rotate_half pairs dimension i with i + half: each half is read once, and rotated against the other.
    row = qkv_ptr + token * qkv_stride + heads * HEAD_DIM + dims
    x_lo = tl.load(row, mask=present, other=0.0).to(tl.float32)
    x_hi = tl.load(row + half, mask=present, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)) / HEAD_DIM + eps)[:, None]
    w_lo = tl.where(is_q, tl.load(q_weight_ptr + dims), tl.load(k_weight_ptr + dims)).to(tl.float32)
    w_hi = tl.where(is_q, tl.load(q_weight_ptr + half + dims), tl.load(k_weight_ptr + half + dims)).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    # As transformers' Qwen3RMSNorm: the normalised value is rounded to the model's dtype before the
    # weight multiplies it, and the product is rounded too; the rotation then runs on those values.
    n_lo = ((x_lo * rstd).to(dtype).to(tl.float32) * w_lo).to(dtype).to(tl.float32)
    n_hi = ((x_hi * rstd).to(dtype).to(tl.float32) * w_hi).to(dtype).to(tl.float32)
    # engine.models.qwen3.rotary repeats its angles, so both halves share the first half's cos and sin.
    cos = tl.load(cos_ptr + token * HEAD_DIM + dims).to(tl.float32)
    sin = tl.load(sin_ptr + token * HEAD_DIM + dims).to(tl.float32)
    out_lo = (n_lo * cos - n_hi * sin).to(dtype)
    out_hi = (n_hi * cos + n_lo * sin).to(dtype)
    q_out = q_ptr + token * HEADS * HEAD_DIM + heads * HEAD_DIM + dims
    k_out = k_ptr + token * KV_HEADS * HEAD_DIM + (heads - HEADS) * HEAD_DIM + dims
    tl.store(q_out, out_lo, mask=is_q)
    tl.store(q_out + half, out_hi, mask=is_q)
    tl.store(k_out, out_lo, mask=present & ~is_q)
    tl.store(k_out + half, out_hi, mask=present & ~is_q)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, heads: int,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """engine.models.qwen3's _qk_norm_rope in one kernel: q [T, heads, d] and k [T, kv_heads, d] new,
    v a view of qkv. head_dim must be a power of two (Qwen3's is 128)."""
    tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv.view(tokens, heads + 2 * kv_heads, head_dim)[:, heads + kv_heads:]
    if tokens:
        block_heads = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads + kv_heads))
        grid = (tokens, triton.cdiv(heads + kv_heads, block_heads))
        _qk_norm_rope_kernel[grid](qkv, q, k, q_weight, k_weight, cos.contiguous(), sin.contiguous(), qkv.stride(0),
                                   eps, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_HEADS=block_heads)
    return q, k, v


@triton.jit
def _ragged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_offsets_ptr, kv_offsets_ptr,
                             q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                             v_token_stride, v_head_stride, out_token_stride, out_head_stride, scale_log2,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(q_offsets_ptr + seq)
    q_rows = tl.load(q_offsets_ptr + seq + 1) - q_start
    if block * BLOCK_M >= q_rows:  # the grid covers the longest sequence; shorter ones end here
        return
    kv_start = tl.load(kv_offsets_ptr + seq)
    kv_rows = tl.load(kv_offsets_ptr + seq + 1) - kv_start
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    # A sequence's start times a token stride passes 2^31 past about 500k tokens (Qwen3-0.6B's QKV
    # rows are 4,096 wide), so the bases are 64-bit; offsets within one sequence stay 32-bit.
    q_base = q_ptr + q_start.to(tl.int64) * q_token_stride + head * q_head_stride
    out_base = out_ptr + q_start.to(tl.int64) * out_token_stride + head * out_head_stride
    q = tl.load(q_base + rows[:, None] * q_token_stride + dims[None, :], mask=(rows < q_rows)[:, None], other=0.0)
    kv_head = head // GROUP
    k_base = k_ptr + kv_start.to(tl.int64) * k_token_stride + kv_head * k_head_stride
    v_base = v_ptr + kv_start.to(tl.int64) * v_token_stride + kv_head * v_head_stride
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = kv_rows
    if CAUSAL:  # a causal row sees no key past itself, so the block's keys end with its last row
        end = tl.minimum(end, (block + 1) * BLOCK_M)
    for first in range(0, end, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        present = cols < kv_rows
        k = tl.load(k_base + cols[None, :] * k_token_stride + dims[:, None], mask=present[None, :], other=0.0)
        scores = tl.dot(q, k) * scale_log2
        keep = present[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        # Every block holds a key each row may see (its first column, or for a causal row past it
        # an earlier block's), so the running maximum is finite from the first block on.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        weights = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + cols[:, None] * v_token_stride + dims[None, :], mask=present[:, None], other=0.0)
        acc = tl.dot(weights.to(v.dtype), v, acc * rescale[:, None])
        row_max = new_max
    # A sequence without keys (an empty slot's pooled row) gives zeros, not 0 / 0.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(out_base + rows[:, None] * out_token_stride + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows < q_rows)[:, None])


@dataclass(frozen=True)
class AttentionTiles:
    """A launch configuration of ragged_attention: query rows and keys per step of a program, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


WIDE_TILES = AttentionTiles(128, 64, 4, 3)
TILES = AttentionTiles(64, 64, 4, 3)
ONE_ROW_TILES = AttentionTiles(16, 64, 4, 3)


def tiles_for(head_dim: int, max_rows: int, slots: int) -> AttentionTiles:
    """ragged_attention's launch configuration for a head_dim, the query rows it launches per sequence
    (in a graph the bucketed max_seqlen, engine.graphs.seqlen_for) and the sequence slots.

    From the configurations bench.kernels attention_triton times at each shape (bench/results/
    gpu-2026-12-01-run114-triton-attention, run116): 64 query rows, 64 keys a step, 4 warps and 3
    stages were the best, or within 3% of it, at every shape of 128 tokens or more at head_dim 32
    (MiniLM) and 128 (Qwen3), and at head_dim 64 (BERT-base) for one sequence (1 x 512 tokens:
    7.1 us against 10.7 with 128 rows, which leave most of the GPU's 132 SMs idle); for one 16-token
    query every configuration took 2.3-2.8 us. Head_dim 64 did best with 128 rows once a batch has
    sequences to fill the GPU (32 x 512 tokens: 94 us against 101; at 5 x 512 the two are level);
    so from 8 slots on, which is 5 to 8 sequences in a graph. With 64 rows three stages beat two by
    up to 15% from 256 tokens on (64 x 256 tokens at head_dim 32: 36 against 42 us); below that the
    two were within 0.2 us of each other. One query row per
    sequence (pooled(), a pruned last layer) takes 16-row tiles, the least tl.dot takes: not timed.
    """
    if max_rows == 1:
        return ONE_ROW_TILES
    return WIDE_TILES if head_dim == 64 and max_rows > 64 and slots >= 8 else TILES


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                     kv_offsets: torch.Tensor, max_q_rows: int, causal: bool, tiles: AttentionTiles) -> torch.Tensor:
    """q [Tq, heads, d], k and v [Tk, kv_heads, d] (any token stride, d contiguous); q_offsets and kv_offsets
    int32 [slots + 1] on the device, the same tensor unless each sequence has its own query rows (then
    bidirectional only); max_q_rows bounds each sequence's query rows. -> [Tq, heads, d], where rows
    past q_offsets[-1] are left unwritten. head_dim 32, 64 or 128 (what has run on the H200)."""
    tokens, heads, head_dim = q.shape
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and heads % k.shape[1] == 0
    assert not causal or q_offsets is kv_offsets, "a causal mask compares query and key positions of one layout"
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    slots = q_offsets.numel() - 1
    if slots and max_q_rows:
        grid = (slots, heads, triton.cdiv(max_q_rows, tiles.block_m))
        _ragged_attention_kernel[grid](
            q, k, v, out, q_offsets, kv_offsets, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), math.log2(math.e) / math.sqrt(head_dim),
            GROUP=heads // k.shape[1], HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@triton.jit
def _pool_normalize_kernel(hidden_ptr, offsets_ptr, rows_ptr, out_ptr, hidden_stride, out_stride, dim,
                           MEAN: tl.constexpr, GATHER: tl.constexpr, NORMALIZE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    slot = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    kept = cols < dim
    if MEAN:
        start = tl.load(offsets_ptr + slot)
        end = tl.load(offsets_ptr + slot + 1)
        # Summed across rows once at the end: a reduction per block would stall every load on it.
        sums = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for first in range(start, end, BLOCK_T):
            rows = first + tl.arange(0, BLOCK_T)
            block = tl.load(hidden_ptr + rows.to(tl.int64)[:, None] * hidden_stride + cols[None, :],
                            mask=(rows < end)[:, None] & kept[None, :], other=0.0)
            sums += block.to(tl.float32)
        vector = tl.sum(sums, 0) / tl.maximum(end - start, 1)  # an empty slot gives zeros
    else:
        row = tl.load(rows_ptr + slot).to(tl.int64) if GATHER else slot.to(tl.int64)
        vector = tl.load(hidden_ptr + row * hidden_stride + cols, mask=kept, other=0.0).to(tl.float32)
    if NORMALIZE:  # as F.normalize: a zero vector stays zero
        vector = vector / tl.maximum(tl.sqrt(tl.sum(vector * vector, 0)), 1e-12)
    tl.store(out_ptr + slot * out_stride + cols, vector, mask=kept)


# Elements a mean-pooling program loads at once (rows x columns padded to a power of two) and its
# warps, by the rows per sequence slot: a wide block for long sequences, a narrow one for short.
# From bench.kernels pooling (bench/results/gpu-2026-12-01-run120-pool-tiles-gc), graph replay at
# 384 / 768 / 1,024 columns: one 512-token sequence 10.4 / 16.4 / 16.3 us with 32,768 over 8 warps
# against 19.6 / 30.4 / 30.3 with 8,192 over 4 (torch's ops 22.3 / 24.5 / 24.5), 32 x 512 tokens
# 10.5 / 16.7 / 17.1 against 20.5 / 31.7 / 31.8 (torch 76 / 151 / 193); one 16-token query 2.4 /
# 2.4 / 2.5 us with 8,192 over 4 against 3.6-4.7 with the wide block (torch 15.2-17.8).
SHORT_POOL_BLOCK, LONG_POOL_BLOCK = (8192, 4), (32768, 8)
SHORT_POOL_ROWS = 64


def pool_normalize(hidden: torch.Tensor, dim: int, normalize: bool, cu_seqlens: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 [S, dim] from hidden [T, H] (H contiguous): with cu_seqlens (int32 [S + 1]) the mean of each
    sequence's rows (rows past cu_seqlens[-1] are padding, never read); else hidden[rows] (int [S]),
    or hidden itself when rows is None (a pruned last layer's one row per sequence). Only the first
    `dim` components are read; normalize L2-normalises those. block: (elements, warps), by default
    SHORT_POOL_BLOCK or LONG_POOL_BLOCK for the rows per slot."""
    assert hidden.stride(-1) == 1 and dim <= hidden.shape[1]
    slots = cu_seqlens.numel() - 1 if cu_seqlens is not None else rows.numel() if rows is not None else hidden.shape[0]
    out = torch.empty(slots, dim, dtype=torch.float32, device=hidden.device)
    if slots:
        elements, warps = block or (SHORT_POOL_BLOCK if hidden.shape[0] <= SHORT_POOL_ROWS * slots else LONG_POOL_BLOCK)
        block_d = triton.next_power_of_2(dim)
        _pool_normalize_kernel[(slots,)](
            hidden, cu_seqlens if cu_seqlens is not None else out, rows if rows is not None else out, out,
            hidden.stride(0), out.stride(0), dim, MEAN=cu_seqlens is not None, GATHER=rows is not None,
            NORMALIZE=normalize, BLOCK_T=max(1, elements // block_d), BLOCK_D=block_d, num_warps=warps)
    return out
