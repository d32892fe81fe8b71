"""Hand-written Triton kernels, for steps that torch.compile serves poorly across every bucket.

qk_norm_rope: Qwen3's per-head RMSNorm of q and k, then rotary embeddings, reading q and k straight
from the fused QKV projection. Compiled once with dynamic shapes (so that every bucket shares one
compilation), Inductor's version took 0.122 ms at 4,096 tokens and 0.466 ms at 16,384, against
0.071 / 0.268 compiled for one fixed shape (bench/results/gpu-2026-11-30-run11-qwen3): 10% of a
4,096-token step. This kernel reads q and k once and writes them once, each half of a head once,
in programs of up to eight heads of one token, whatever the token count: 16 us per call at 4,096
tokens (bench/results/gpu-2026-11-30-run18-qwen3-last-layer) where reading each element twice in
one program per token took 19 (run14); its memory traffic alone takes about 11.
GPU only: triton ships with CUDA builds of torch, and the engine imports this module only there.
"""

from __future__ import annotations

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
