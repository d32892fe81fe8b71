"""Elementwise steps fused into one kernel each on a GPU, through torch.compile; plain torch elsewhere.

Per layer, BERT adds a residual and normalises twice; unfused that is an add kernel and a LayerNorm
kernel, five passes over the activations, which profiling put at 16-23% of GPU time. Here the
output GEMM adds the residual itself (reading it in its epilogue) and one compiled kernel adds the
bias and normalises: two passes. The embedding sum (three lookups, two adds, LayerNorm) becomes one
kernel too, which matters most for single short queries, where every launch counts.
Compilation happens once per process on first use (dynamic shapes, so every bucket shares it) and
always on an eager run, never inside a CUDA graph capture. The CPU path stays uncompiled.

The feed-forward's first GEMM takes its bias and GELU in cuBLASLt's epilogue on a GPU
(torch._addmm_activation), so the [T, intermediate] activations are written once and never re-read
by a GELU kernel: on the H200 (bench/results/gpu-2026-11-30-run10-kernels) MiniLM's 16,384 x 384 ->
1536 step took 0.046 ms instead of 0.073, BERT-base's 0.136 instead of 0.188, the GELU kernel having
been 15% of MiniLM's GPU time. The epilogue computes GELU's tanh form; against the exact erf GELU in
float32 it scored cosine 0.999999 where erf in bf16 scored 0.999997: the difference (at most 5e-4)
is below bf16's resolution and about fp16's, the two dtypes a GPU runs (engine.config.GPU_FP32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def _add_layer_norm(x: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float) -> torch.Tensor:
    return F.layer_norm(x + addend, (x.shape[-1],), weight, bias, eps)


def _embed_layer_norm(input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                      words: torch.Tensor, position_table: torch.Tensor, type_table: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    x = words[input_ids] + position_table[positions] + type_table[token_types]
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _dense_gelu_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


class Fused:
    """The fused steps, compiled or not; one instance per model."""

    def __init__(self, compile: bool) -> None:
        wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if compile else (lambda fn: fn)
        self.add_layer_norm = wrap(_add_layer_norm)
        self.embed_layer_norm = wrap(_embed_layer_norm)
        self.gpu = compile

    def dense_add_layer_norm(self, x: torch.Tensor, dense: torch.nn.Linear, residual: torch.Tensor,
                             norm: torch.nn.LayerNorm) -> torch.Tensor:
        """LayerNorm(dense(x) + residual), overwriting `residual`.

        The GEMM sums into the residual's memory (beta = 1) and the norm kernel adds the bias, so
        the norm reads one [T, H] tensor instead of two (bench/kernels.py qwen3_residual measured
        the same move for Qwen3, faster at every size). GEMM and residual are summed in float32
        and rounded once; the bias joins in the norm's float32 arithmetic.
        """
        residual.addmm_(x, dense.weight.t())
        return self.add_layer_norm(residual, dense.bias, norm.weight, norm.bias, norm.eps)

    def dense_act(self, x: torch.Tensor, dense: torch.nn.Linear, act: str) -> torch.Tensor:
        """act(dense(x)): with a GELU on a GPU in the GEMM's epilogue, else as two steps."""
        if self.gpu and act in GELUS:
            return _dense_gelu_epilogue(x, dense.weight, dense.bias)
        return ACTIVATIONS[act](dense(x))
