"""Hand-written Triton kernels, for steps that torch.compile serves poorly across every bucket.

qk_norm_rope: Qwen3's per-head RMSNorm of q and k, then rotary embeddings, reading q and k straight
from the fused QKV projection. Compiled once with dynamic shapes (so that every bucket shares one
compilation), Inductor's version took 0.122 ms at 4,096 tokens and 0.466 ms at 16,384, against
0.071 / 0.268 compiled for one fixed shape (bench/results/gpu-2026-11-30-run11-qwen3): 10% of a
4,096-token step. This kernel reads q and k once and writes them once, one program per token over
all its heads, whatever the token count.
GPU only: triton ships with CUDA builds of torch, and the engine imports this module only there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, qkv_stride, eps,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_HEADS: tl.constexpr):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    half: tl.constexpr = HEAD_DIM // 2
    partner = (dims + half) % HEAD_DIM  # rotate_half pairs dimension i with i +- half
    present = heads < HEADS + KV_HEADS
    is_q = heads < HEADS
    row = qkv_ptr + token * qkv_stride + heads * HEAD_DIM
    x = tl.load(row + dims, mask=present, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner, mask=present, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.where(is_q, tl.load(q_weight_ptr + dims), tl.load(k_weight_ptr + dims)).to(tl.float32)
    weight_partner = tl.where(is_q, tl.load(q_weight_ptr + partner), tl.load(k_weight_ptr + partner)).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    # As transformers' Qwen3RMSNorm: the normalised value is rounded to the model's dtype before the
    # weight multiplies it, and the product is rounded too; the rotation then runs on those values.
    normed = ((x * rstd).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    normed_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * weight_partner).to(dtype).to(tl.float32)
    cos = tl.load(cos_ptr + token * HEAD_DIM + dims).to(tl.float32)
    sin = tl.load(sin_ptr + token * HEAD_DIM + dims).to(tl.float32)
    out = (normed * cos + tl.where(dims < half, -normed_partner, normed_partner) * sin).to(dtype)
    tl.store(q_ptr + token * HEADS * HEAD_DIM + heads * HEAD_DIM + dims, out, mask=is_q)
    tl.store(k_ptr + token * KV_HEADS * HEAD_DIM + (heads - HEADS) * HEAD_DIM + dims, out, mask=present & ~is_q)


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
        _qk_norm_rope_kernel[(tokens,)](qkv, q, k, q_weight, k_weight, cos.contiguous(), sin.contiguous(),
                                        qkv.stride(0), eps, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                        BLOCK_HEADS=triton.next_power_of_2(heads + kv_heads))
    return q, k, v
