"""A Triton GEMM with SwiGLU in its epilogue: a candidate for Qwen3's gate_up projection that lost.

The engine runs cuBLAS's GEMM into [T, 2 * 3072], then FlashInfer's silu_and_mul, which reads that
back and writes half (about 17 us a layer at 4,096 tokens). Here each program keeps a gate and an up
accumulator for one output tile, so the intermediate never reaches memory and no second kernel runs.
It is right (bench.kernels qwen3_swiglu_gemm compares it with fp32), but Triton's GEMM (cp.async
pipelining and wgmma on Hopper, no TMA or warp specialisation) does not keep up with cuBLAS: at 4,096
tokens the best tile took 0.101 ms against 0.096 for F.linear + silu_and_mul, and at 16,384 tokens
0.402 against 0.363 (bench/results/gpu-2026-11-30-run25-tokenizer). The engine does not use it; it
is kept so that the measurement can be repeated on a newer Triton. GPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

@dataclass(frozen=True)
class TileConfig:
    """One program's output tile and K step, its grouping and launch options (see gate_up_silu)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}")


# Hopper-sensible tiles for Qwen3-0.6B's 1024 -> 2 x 3072. Shared memory per stage is an x tile and
# two weight tiles in bf16 (128x128x64: 48 KiB, so 4 stages take 192 of the 227 KiB an H100/H200
# block may use); registers hold two float32 accumulators (128x128 over 8 warps: 128 per thread).
# Compiled for sm_90 by Triton 3.4, 3.5 and 3.6 (no GPU needed), these use 174-228 registers a
# thread and spill none; 128x256 and 256x128 over 8 warps spill (and 128x256x64 in 3 stages
# wants 240 KiB of shared memory), so they are not swept.
GATE_UP_CONFIGS = (
    TileConfig(128, 128, 64, 8, 8, 4),
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 256, 64, 8, 8, 3),
    TileConfig(128, 128, 128, 8, 8, 2),
)
GATE_UP_DEFAULT = GATE_UP_CONFIGS[0]  # the fastest at 4,096 and 16,384 tokens in run25


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, tokens, inner, hidden, x_stride, w_stride, out_stride,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    # Grouped order: GROUP_M row tiles walk the column tiles together, so their x rows and the
    # weight's columns are read from L2 by neighbouring programs rather than from memory again.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(tokens, BLOCK_M), tl.cdiv(inner, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Ragged edges load wrapped rows (kept in bounds, never stored), so the K loop has no M or N mask.
    x_ptrs = x_ptr + (rows % tokens)[:, None] * x_stride + ks[None, :]
    # The weight as nn.Linear stores it, [2 * inner, hidden], read as [BLOCK_K, BLOCK_N] tiles of its
    # transpose: gate rows from cols, up rows from inner + cols.
    gate_ptrs = w_ptr + (cols % inner)[None, :] * w_stride + ks[:, None]
    up_ptrs = gate_ptrs + inner * w_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        if EVEN_K:  # Qwen3's 1024: unmasked, so loads vectorise and pipeline
            x = tl.load(x_ptrs)
            w_gate = tl.load(gate_ptrs)
            w_up = tl.load(up_ptrs)
        else:  # a hidden size BLOCK_K does not divide: right, but not tuned
            left = hidden - k * BLOCK_K
            x = tl.load(x_ptrs, mask=ks[None, :] < left, other=0.0)
            w_gate = tl.load(gate_ptrs, mask=ks[:, None] < left, other=0.0)
            w_up = tl.load(up_ptrs, mask=ks[:, None] < left, other=0.0)
        gate = tl.dot(x, w_gate, gate)
        up = tl.dot(x, w_up, up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # SwiGLU on the float32 accumulators, rounded once: silu(g) * u = g * u / (1 + exp(-g)).
    out = (gate * up / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    mask = (rows < tokens)[:, None] & (cols < inner)[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=mask)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                 config: TileConfig = GATE_UP_DEFAULT) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in one kernel, for weight the fused [2 * inner, hidden] gate_up
    projection as stored (gate rows first, no bias): [T, inner] in x's dtype, written into out when given."""
    tokens, hidden = x.shape
    inner = weight.shape[0] // 2
    if weight.shape != (2 * inner, hidden):
        raise ValueError(f"weight {tuple(weight.shape)} is not [2 * inner, {hidden}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if out is None:
        out = torch.empty(tokens, inner, dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, inner) or out.stride(1) != 1:
        raise ValueError(f"out must be [{tokens}, {inner}] with unit column stride, not {tuple(out.shape)}")
    if tokens:
        grid = (triton.cdiv(tokens, config.block_m) * triton.cdiv(inner, config.block_n),)
        _gate_up_silu_kernel[grid](x, weight, out, tokens, inner, hidden, x.stride(0), weight.stride(0), out.stride(0),
                                   BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                   GROUP_M=config.group_m, EVEN_K=hidden % config.block_k == 0,
                                   num_warps=config.num_warps, num_stages=config.num_stages)
    return out
