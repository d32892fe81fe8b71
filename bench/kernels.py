"""Kernel micro-benchmarks at the engine's own shapes: where its GPU forward pass can get faster.

Candidate kernels run side by side in bf16, each checked against a float32 reference (max abs error
and cosine next to its time, so a fast but wrong kernel shows):
  gelu_epilogue          BERT's intermediate GEMM + GELU: erf and tanh GELU, cuBLASLt's GELU epilogue,
                         torch.compile (default mode: cuBLAS GEMM plus one fused bias+GELU kernel)
  attention_hd32/_hd64   MiniLM / BERT-base attention: varlen_attn, FlashInfer (head_dim 32 padded to
                         64), dense SDPA per forced backend, compiled flex_attention (hd32 only)
  attention_causal_long  Qwen3-0.6B causal GQA attention at 4,096 / 512 / 128 tokens, with TFLOP/s
  attention_triton       engine.triton_kernels.ragged_attention per tile config against varlen_attn,
                         FlashInfer and dense SDPA, at MiniLM's, BERT-base's and Qwen3's shapes
  pooling                mean / last-token pooling and L2 norm: engine.pooling's torch ops against
                         engine.triton_kernels.pool_normalize per block (elements loaded at once, warps)
  qwen3_gemms            Qwen3-0.6B's four GEMMs per layer at 128 to 16,384 tokens, with TFLOP/s
  qwen3_elementwise      Qwen3's SwiGLU and q/k norm + rotary: compiled as the engine does, static, eager, FlashInfer
  qwen3_residual         Qwen3's output GEMMs with the residual added by the GEMM (addmm_) then RMSNorm,
                         against the GEMM then one add + RMSNorm kernel
  qwen3_blas             Qwen3's GEMMs through cuBLAS (torch's default) against cuBLASLt, with memsets per call
  qwen3_gemm_forms       Qwen3's qkv and gate_up GEMMs as F.linear, addmm with a zero bias, mm on a transposed weight
  qwen3_swiglu_gemm      Qwen3's gate_up GEMM with SwiGLU in a Triton GEMM's epilogue, per tile config, against
                         cuBLAS then FlashInfer's silu_and_mul (the engine) and cuBLAS then torch's silu * up
  qwen3_gemm_workspace   Qwen3's qkv and gate_up F.linear with cuBLAS's default workspace and without one
                         (CUBLAS_WORKSPACE_CONFIG=:0:0, each in its own process): time, kernels and memsets per call
  layer_breakdown        the engine (random weights) on one replayed step: GPU time, time the GPU sat
                         idle inside the step, top kernels (encoder_breakdown: MiniLM and BERT-base only;
                         qwen3_breakdown: Qwen3-0.6B with the auto backend, FlashInfer where installed)
  triton_breakdown       layer_breakdown of MiniLM and BERT-base with the library attention and with triton,
                         also at 5 x 512 tokens (the cross-encoder's five pairs)
  big_batches            MiniLM and BERT-base tokens/s through Engine.step at 16k / 32k / 64k tokens
A time is the median of --repeats loops of K calls (K so that a loop takes about 2 ms) timed with
CUDA events, divided by K: `ms` launches the calls from Python (host overhead shows where the host is
the slower side), `graph_ms` replays the same K calls captured as one CUDA graph (GPU time, as the
engine's graphs see it; TFLOP/s use it where capture worked). Inputs stay in L2 where they fit.

    python3 -m bench.kernels --out bench-out/kernels [--repeats 50] [--only attention_hd32,qwen3_gemms]
prints a table per experiment and writes results.json and report.md under --out. A failing candidate
or experiment is recorded as an error string and the rest still run. FlashInfer is optional (its rows
then read "flashinfer not installed"); on a fresh machine it JIT-compiles about 70 s per module on
first use (fa3 at head_dim 64 and 128, fa2 at 64).
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import gpu_span_and_idle_us
from engine import Engine, EngineConfig, PackedBatch
from engine.attention import AttentionLayout, SdpaAttention
from engine.graphs import bucket_for
from tests.models import BERT_BASE, save_random_model
from tests.test_qwen3 import QWEN3_06B, save_random_qwen3

if TYPE_CHECKING:  # engine.triton_kernels imports triton, which a CPU machine may lack
    from engine.triton_kernels import AttentionTiles

DEVICE, DTYPE = "cuda", torch.bfloat16
BF16_CEILING = 796e12  # FLOP/s, measured on the H200 (8192^3 matmul; ../shared/gpu/README.md)
LOOP_SECONDS, MAX_CALLS, WARMUP = 2e-3, 50, 3
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
MINILM_L6 = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512)
QWEN3_GEMMS = {"qkv": (1024, 4096), "o_proj": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}

Row = dict[str, object]
Call = Callable[[], torch.Tensor]


# ---- timing and checking --------------------------------------------------------------------------

def short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def median_ms(launch: Callable[[], object], calls: int, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def measure(call: Call, repeats: int) -> Row:
    """ms per call from an eager loop, and graph_ms from the same loop replayed as one CUDA graph."""
    for _ in range(WARMUP):
        call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    torch.cuda.synchronize()
    calls = max(1, min(MAX_CALLS, round(LOOP_SECONDS / (time.perf_counter() - started))))

    def loop() -> None:
        for _ in range(calls):
            call()

    row: Row = {"ms": median_ms(loop, calls, repeats)}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop()
        row["graph_ms"] = median_ms(graph.replay, calls, repeats)
    except Exception as error:  # noqa: BLE001 - not every library call can be captured; the eager time stands
        torch.cuda.synchronize()
        row["graph_ms"] = f"no graph: {short(error)}"
    return row


def accuracy(out: torch.Tensor, reference: torch.Tensor) -> Row:
    # float64: a float32 cosine over 10^8 elements drifts by 1e-3 or more, more than bf16 kernels differ
    out, reference = out.double().reshape(-1), reference.double().reshape(-1)
    return {"max_abs_err": (out - reference).abs().max().item(),
            "cosine": F.cosine_similarity(out, reference, dim=0).item()}


def run_candidate(shape: str, name: str, build: Callable[[], Call], reference: torch.Tensor, repeats: int,
                  flops: float | None = None) -> Row:
    """Build the candidate (setup untimed), check it against the reference, then time it."""
    row: Row = {"shape": shape, "candidate": name}
    with warnings.catch_warnings(record=True) as caught:  # SDPA says why a forced backend cannot run
        warnings.simplefilter("always")
        try:
            call = build()
            row.update(accuracy(call(), reference))
            row.update(measure(call, repeats))
        except Exception as error:  # noqa: BLE001 - an unsupported config is a result, not a crash
            reasons = "; ".join(dict.fromkeys(filter(None, (str(w.message).split("\n", 1)[0][:200] for w in caught))))
            row["error"] = short(error) + (f" ({reasons})" if reasons else "")
    if flops and "ms" in row:
        seconds = (row["graph_ms"] if isinstance(row["graph_ms"], float) else row["ms"]) / 1e3
        row["tflop_s"] = flops / seconds / 1e12
        row["of_ceiling"] = flops / seconds / BF16_CEILING
    return row


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE) * scale


# ---- 1. GEMM + GELU -------------------------------------------------------------------------------

def _linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b))


def gelu_epilogue(repeats: int) -> list[Row]:
    candidates = {
        "linear + gelu erf (engine)": _linear_gelu,
        "_addmm_activation gelu epilogue (tanh)": lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True),
        "linear + gelu tanh": lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "compiled linear + gelu erf": torch.compile(_linear_gelu, dynamic=False),
    }
    rows = []
    for tokens, hidden, inner in ((16384, 384, 1536), (16384, 768, 3072), (128, 768, 3072)):
        x, w, b = randn(tokens, hidden), randn(inner, hidden, scale=hidden ** -0.5), randn(inner, scale=0.1)
        reference = F.gelu(F.linear(x.float(), w.float(), b.float()))
        for name, fn in candidates.items():
            rows.append(run_candidate(f"T={tokens} {hidden}->{inner}", name, lambda: functools.partial(fn, x, w, b),
                                      reference, repeats, flops=2 * tokens * hidden * inner))
    return rows


# ---- 2-4. attention -------------------------------------------------------------------------------

def import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError:
        raise RuntimeError("flashinfer not installed") from None
    return flashinfer


@functools.cache
def flashinfer_workspace() -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def varlen_gqa_native() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # then build_varlen fails, and says so in its row
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def build_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
                 causal: bool) -> Call:
    """varlen_attn as engine.attention.VarlenAttention calls it (k/v heads repeated without native GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    options: dict[str, object] = {"window_size": (-1, 0) if causal else (-1, -1)}
    if k.shape[1] == q.shape[1]:
        return lambda: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **options)
    if varlen_gqa_native():
        return lambda: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, enable_gqa=True, **options)
    group = q.shape[1] // k.shape[1]
    return lambda: varlen_attn(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                               cu, cu, max_seqlen, max_seqlen, **options)


def build_flashinfer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_host: list[int], causal: bool,
                     backend: str, pad_to: int | None = None, prepadded: bool = False) -> Call:
    """FlashInfer ragged prefill, planned once here. pad_to zero-pads head_dim (same scores, scale kept
    at the true head_dim); the call then pads, runs and copies the true columns back, or with
    `prepadded` runs on inputs padded outside the timing and returns a view."""
    flashinfer = import_flashinfer()
    head_dim = q.shape[-1]
    width = pad_to or head_dim
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(flashinfer_workspace(), "NHD", backend=backend)
    indptr = torch.tensor(cu_host, dtype=torch.int32)
    wrapper.plan(indptr, indptr, q.shape[1], k.shape[1], width, causal=causal, sm_scale=head_dim ** -0.5,
                 q_data_type=DTYPE)
    if width == head_dim:
        return lambda: wrapper.run(q, k, v)
    pad = functools.partial(F.pad, pad=(0, width - head_dim))
    if prepadded:
        qp, kp, vp = pad(q), pad(k), pad(v)
        return lambda: wrapper.run(qp, kp, vp)[..., :head_dim]
    return lambda: wrapper.run(pad(q), pad(k), pad(v))[..., :head_dim].contiguous()


def build_dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int, backend: str,
                     causal: bool) -> Call:
    """SDPA with one backend forced, on [seqs, heads, L, d] made outside the timing (equal lengths)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (t.view(seqs, -1, *t.shape[1:]).transpose(1, 2).contiguous() for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]

    def call() -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)  # a view in packed order, so no copy is timed

    return call


def build_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int) -> Call:
    """Compiled flex_attention on the packed layout [1, heads, T, d] with a same-sequence block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = q.shape[0]
    seq_ids = torch.arange(seqs, device=DEVICE).repeat_interleave(tokens // seqs)

    def same_sequence(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex's mask_mod signature
        return seq_ids[q_idx] == seq_ids[kv_idx]

    mask = create_block_mask(same_sequence, None, None, tokens, tokens, device=DEVICE)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    flex = compiled_flex()
    return lambda: flex(qf, kf, vf, block_mask=mask)[0].transpose(0, 1)


def build_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
                 causal: bool, tiles: AttentionTiles) -> Call:
    from engine.triton_kernels import ragged_attention

    return lambda: ragged_attention(q, k, v, cu, cu, max_seqlen, causal, tiles)


# (block_m, block_n, num_warps, num_stages) of engine.triton_kernels.AttentionTiles, tried at every shape.
# run114 also tried (128, 128, 8, 2), (128, 32, 4, 2) and (64, 32, 4, 2): the last was the best only for one
# 16-token query, by 0.1-0.2 us; the others never, and up to 2.0x slower.
TRITON_TILE_GRID = ((64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3))


def attention_rows(shapes: tuple[tuple[int, int], ...], heads: int, kv_heads: int, head_dim: int, causal: bool,
                   flashinfer: dict[str, dict], flex: bool, repeats: int, triton: bool = False) -> list[Row]:
    """Every candidate on packed batches of `seqs` sequences of `length` tokens; flashinfer maps a row
    name to build_flashinfer's options; triton adds ragged_attention with the engine's tiles and each of TRITON_TILE_GRID."""
    rows = []
    for seqs, length in shapes:
        tokens = seqs * length
        # Views of one projection's output, strided as the engine's models hand them to attention.
        q, k, v = randn(tokens, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
        cu_host = list(range(0, tokens + 1, length))
        cu = torch.tensor(cu_host, dtype=torch.int32, device=DEVICE)
        exact = SdpaAttention(causal=causal)
        exact.plan(AttentionLayout(cu, cu_host, length, tokens))
        reference = exact(q.float(), k.float(), v.float())
        flops = 4 * seqs * length * length * heads * head_dim / (2 if causal else 1)
        varlen = "varlen_attn" + (" (k/v heads repeated)" if kv_heads != heads and not varlen_gqa_native() else "")
        candidates: dict[str, Callable[[], Call]] = {varlen: lambda: build_varlen(q, k, v, cu, length, causal)}
        for name, options in flashinfer.items():
            candidates[name] = lambda options=options: build_flashinfer(q, k, v, cu_host, causal, **options)
        for backend in SDPA_BACKENDS:
            candidates[f"dense sdpa {backend}"] = lambda backend=backend: build_dense_sdpa(q, k, v, seqs, backend, causal)
        if flex:
            candidates["flex_attention compiled, document mask"] = lambda: build_flex(q, k, v, seqs)
        if triton:
            from engine.triton_kernels import AttentionTiles, tiles_for

            # What the engine picks for this exact batch; a graph of it would launch the bucketed max_seqlen.
            engine_tiles = tiles_for(head_dim, length, seqs)
            for tiles in dict.fromkeys((engine_tiles, *(AttentionTiles(*t) for t in TRITON_TILE_GRID))):
                label = " (the engine's)" if tiles == engine_tiles else ""
                candidates[f"triton {tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}{label}"] = (
                    lambda tiles=tiles: build_triton(q, k, v, cu, length, causal, tiles))
        for name, build in candidates.items():
            rows.append(run_candidate(f"{seqs}x{length}", name, build, reference, repeats, flops))
    return rows


def attention_hd32(repeats: int) -> list[Row]:
    flashinfer = {"flashinfer auto, pad 32->64 + run + slice": {"backend": "auto", "pad_to": 64},
                  "flashinfer auto, run() alone on padded": {"backend": "auto", "pad_to": 64, "prepadded": True}}
    return attention_rows(((64, 256), (128, 128)), 12, 12, 32, False, flashinfer, True, repeats)


def attention_hd64(repeats: int) -> list[Row]:
    flashinfer = {f"flashinfer {backend}": {"backend": backend} for backend in ("fa3", "fa2")}
    return attention_rows(((32, 512), (128, 128)), 12, 12, 64, False, flashinfer, False, repeats)


def attention_causal_long(repeats: int) -> list[Row]:
    flashinfer = {f"flashinfer {backend}": {"backend": backend} for backend in ("fa3", "auto")}
    return attention_rows(((1, 4096), (1, 512), (1, 128)), 16, 8, 128, True, flashinfer, False, repeats)


def attention_triton(repeats: int) -> list[Row]:
    fa3 = {"flashinfer fa3": {"backend": "fa3"}}
    return (attention_rows(((1, 16), (64, 256), (128, 128), (32, 512)), 12, 12, 32, False, {}, False, repeats, triton=True)
            + attention_rows(((1, 16), (1, 128), (1, 512), (5, 512), (32, 512), (128, 128)), 12, 12, 64, False, fa3, False,
                             repeats, triton=True)
            + attention_rows(((1, 4096), (1, 512)), 16, 8, 128, True, fa3, False, repeats, triton=True))


# ---- 4b. pooling ----------------------------------------------------------------------------------

POOLING_SHAPES = ((1, 16), (1, 512), (64, 256), (32, 512), (128, 128))
# (elements, warps): engine.triton_kernels' short and long blocks, and one between them.
POOL_BLOCKS = ((8192, 4), (16384, 8), (32768, 8))


def pooling(repeats: int) -> list[Row]:
    from engine.pooling import finish, pool, pooled_rows
    from engine.triton_kernels import pool_normalize

    rows: list[Row] = []
    for hidden_size in (384, 768, 1024):
        for seqs, length in POOLING_SHAPES:
            tokens = seqs * length
            hidden = randn(bucket_for(tokens), hidden_size)  # a graph's padding rows after the last sequence
            cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=DEVICE)
            seq_ids = torch.full((hidden.shape[0],), seqs, dtype=torch.int32, device=DEVICE)
            seq_ids[:tokens] = torch.arange(tokens, device=DEVICE) // length
            shape = f"H={hidden_size} {seqs}x{length}"
            for mode in ("mean", "last"):
                reference = finish(pool(hidden.float(), seq_ids, cu, mode), None, True)
                torch_ops = lambda mode=mode: lambda: finish(pool(hidden, seq_ids, cu, mode), None, True)  # noqa: E731
                candidates: dict[str, Callable[[], Call]] = {f"{mode} torch (engine.pooling)": torch_ops}
                if mode == "mean":
                    for block in (None, *POOL_BLOCKS):
                        name = f"{block[0]} w{block[1]}" if block else "(the engine's block)"
                        label = f"{mode} pool_normalize {name}"
                        candidates[label] = lambda block=block: functools.partial(
                            pool_normalize, hidden, hidden_size, True, cu_seqlens=cu, block=block)
                else:
                    candidates[f"{mode} pool_normalize"] = lambda mode=mode: functools.partial(
                        pool_normalize, hidden, hidden_size, True, rows=pooled_rows(cu, mode, hidden.shape[0]))
                for name, build in candidates.items():
                    rows.append(run_candidate(shape, name, build, reference, repeats))
    return rows


# ---- 5. Qwen3 GEMMs -------------------------------------------------------------------------------

def qwen3_gemms(repeats: int) -> list[Row]:
    rows: list[Row] = []
    for tokens in (128, 512, 4096, 16384):
        layer = []
        for name, (k_in, n_out) in QWEN3_GEMMS.items():
            x, w = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5)
            reference = x.float() @ w.float().t()
            layer.append(run_candidate(f"T={tokens}", f"{name} {k_in}->{n_out}", lambda: functools.partial(F.linear, x, w),
                                       reference, repeats, flops=2 * tokens * k_in * n_out))
        rows += layer
        if all(isinstance(r.get("graph_ms"), float) for r in layer):
            ms = sum(r["graph_ms"] for r in layer)
            flops = sum(2 * tokens * k * n for k, n in QWEN3_GEMMS.values())
            rows.append({"shape": f"T={tokens}", "candidate": "layer (sum, graph_ms)", "graph_ms": ms,
                         "tflop_s": flops / ms / 1e9, "of_ceiling": flops / ms * 1e3 / BF16_CEILING,
                         "x28 layers ms": 28 * ms})
    return rows


# ---- 5b. Qwen3 elementwise -----------------------------------------------------------------------

def qwen3_elementwise(repeats: int) -> list[Row]:
    """SwiGLU and q/k RMSNorm + rotary as the engine compiles them (dynamic shapes) against static
    compilation, plain torch, and FlashInfer's silu_and_mul."""
    from engine.models.qwen3 import _qk_norm_rope, _silu_mul, rotary

    static = functools.partial(torch.compile, dynamic=False, fullgraph=True)
    dynamic = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    rows: list[Row] = []
    for tokens in (128, 4096, 16384):
        gate_up = randn(tokens, 2 * 3072)
        reference = _silu_mul(gate_up.float())
        silu = {"compiled dynamic (engine)": dynamic(_silu_mul), "compiled static": static(_silu_mul),
                "eager silu * up": _silu_mul}
        try:
            silu["flashinfer silu_and_mul"] = import_flashinfer().activation.silu_and_mul
        except Exception as error:  # noqa: BLE001 - recorded as a row
            rows.append({"shape": f"T={tokens}", "candidate": "flashinfer silu_and_mul", "error": short(error)})
        for name, fn in silu.items():
            rows.append(run_candidate(f"silu_mul T={tokens}", name, lambda fn=fn: functools.partial(fn, gate_up),
                                      reference, repeats))
        qkv = randn(tokens, (16 + 2 * 8) * 128)
        q_weight, k_weight = randn(128, scale=0.1) + 1, randn(128, scale=0.1) + 1
        cos, sin = rotary(torch.arange(tokens, device="cuda"), 128, 1e6, torch.bfloat16)
        args = (q_weight, k_weight, cos, sin, 1e-6, 16, 8)
        reference = torch.cat([t.reshape(tokens, -1) for t in _qk_norm_rope(qkv.float(), *(a.float() if isinstance(a, torch.Tensor) else a for a in args))], 1)
        for name, fn in {"compiled dynamic (engine)": dynamic(_qk_norm_rope), "compiled static": static(_qk_norm_rope)}.items():
            def build(fn=fn) -> Call:
                return lambda: torch.cat([t.reshape(tokens, -1) for t in fn(qkv, *args)], 1)
            rows.append(run_candidate(f"qk_norm_rope T={tokens}", name + " (+ cat for the check)", build, reference, repeats))
    return rows


def qwen3_residual(repeats: int) -> list[Row]:
    """The residual add in the output GEMM (addmm_ into the residual, as the engine runs it), then
    RMSNorm, against the GEMM alone and then one add + RMSNorm kernel. That baseline writes only the
    normed output, where the engine's former add + RMSNorm also wrote the sum: the gain it shows
    is a lower bound."""
    from engine.models.qwen3 import _rms_norm

    dynamic = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    norm = dynamic(_rms_norm)
    add_norm = dynamic(lambda out, residual, weight, eps: _rms_norm(out + residual, weight, eps))
    rows: list[Row] = []
    for tokens in (128, 4096, 16384):
        for name in ("o_proj", "down"):
            k_in, n_out = QWEN3_GEMMS[name]
            x, w, residual = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5), randn(tokens, n_out)
            weight = randn(n_out, scale=0.1) + 1
            reference = _rms_norm(residual.float() + x.float() @ w.float().t(), weight.float(), 1e-6)
            candidates = {
                "linear, then add + RMSNorm compiled": lambda: lambda: add_norm(F.linear(x, w), residual, weight, 1e-6),
                # The residual grows with every timed call (values do not change the timing); the
                # first call, which is checked, adds once.
                "addmm_ into the residual, then RMSNorm compiled": lambda: (
                    lambda acc=residual.clone(): lambda: norm(acc.addmm_(x, w.t()), weight, 1e-6))(),
            }
            for candidate, build in candidates.items():
                rows.append(run_candidate(f"{name} T={tokens}", candidate, build, reference, repeats,
                                          flops=2 * tokens * k_in * n_out))
    return rows


def qwen3_blas(repeats: int) -> list[Row]:
    """Qwen3-0.6B's GEMMs as the engine calls them (F.linear; addmm_ into the residual for o_proj and
    down) through cuBLAS, torch's default, against cuBLASLt (torch.backends.cuda.preferred_blas_library),
    with the memsets each call adds to the stream (cuBLAS's cooperative kernels zero a workspace)."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[Row] = []
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            for tokens in (128, 4096):
                for name, (k_in, n_out) in QWEN3_GEMMS.items():
                    x, w = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5)
                    reference = x.float() @ w.float().t()
                    if name in ("o_proj", "down"):
                        residual = torch.zeros(tokens, n_out, device=DEVICE, dtype=DTYPE)
                        call = functools.partial(residual.addmm_, x, w.t())
                    else:
                        call = functools.partial(F.linear, x, w)
                    row = run_candidate(f"T={tokens} {name} {k_in}->{n_out}", library, lambda call=call: call, reference,
                                        repeats, flops=2 * tokens * k_in * n_out)
                    with profile(activities=[ProfilerActivity.CUDA]) as trace:
                        call()
                        torch.cuda.synchronize()
                    row["memsets"] = sum(e.count for e in trace.key_averages() if "Memset" in e.key)
                    rows.append(row)
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return rows


def qwen3_gemm_forms(repeats: int) -> list[Row]:
    """Qwen3's wide GEMMs (qkv, gate_up), whose cuBLAS kernels ran at 80-83% of the ceiling against
    87-90% for o_proj and down at 4,096 tokens (run23), in other forms cuBLAS picks kernels for
    differently: F.linear as the engine calls it, addmm with a zero bias (cuBLASLt's bias epilogue),
    and a plain mm on the weight stored transposed ([in, out], so the GEMM is NN instead of TN)."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[Row] = []
    for tokens in (128, 4096, 16384):
        for name in ("qkv", "gate_up"):
            k_in, n_out = QWEN3_GEMMS[name]
            x, w = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5)
            zero_bias, w_t = torch.zeros(n_out, device=DEVICE, dtype=DTYPE), w.t().contiguous()
            reference = x.float() @ w.float().t()
            forms = {"F.linear (engine)": functools.partial(F.linear, x, w),
                     "addmm, zero bias": functools.partial(torch.addmm, zero_bias, x, w.t()),
                     "mm, weight stored [in, out]": functools.partial(torch.mm, x, w_t)}
            for form, call in forms.items():
                row = run_candidate(f"T={tokens} {name} {k_in}->{n_out}", form, lambda call=call: call, reference,
                                    repeats, flops=2 * tokens * k_in * n_out)
                with profile(activities=[ProfilerActivity.CUDA]) as trace:
                    call()
                    torch.cuda.synchronize()
                kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
                row["memsets"] = sum(e.count for e in kernels if "Memset" in e.key)
                row["kernel"] = max(kernels, key=lambda e: e.self_device_time_total).key[:60] if kernels else ""
                rows.append(row)
    return rows


def qwen3_swiglu_gemm(repeats: int) -> list[Row]:
    """Qwen3's gate_up GEMM with SwiGLU in its epilogue (bench.triton_swiglu.gate_up_silu: one Triton
    kernel, the [T, 6144] intermediate never written) against the engine's path, cuBLAS then
    FlashInfer's silu_and_mul, and cuBLAS then torch's silu * up; one row per tile config. F.linear
    alone is timed too, checked against its own float32 product: the floor the unfused paths build on.
    speedup_vs_engine: the engine path's graph_ms over the row's."""
    from engine.models.qwen3 import _silu_mul

    k_in, n_out = QWEN3_GEMMS["gate_up"]
    inner = n_out // 2
    try:
        import_flashinfer()
        from flashinfer.activation import silu_and_mul

        engine_name = "F.linear + flashinfer silu_and_mul (engine)"
    except Exception as error:  # noqa: BLE001 - the torch steps stand in, and the row's name says so
        silu_and_mul, engine_name = _silu_mul, f"F.linear + F.silu(g) * u, not flashinfer ({short(error)})"
    try:
        from bench.triton_swiglu import GATE_UP_CONFIGS, GATE_UP_DEFAULT, gate_up_silu

        configs, triton_error = GATE_UP_CONFIGS, None
    except Exception as error:  # noqa: BLE001 - the cuBLAS rows still run
        configs, triton_error = (), short(error)
    rows: list[Row] = []
    for tokens in (128, 512, 4096, 16384):
        shape, flops = f"T={tokens} {k_in}->2x{inner}", 2 * tokens * k_in * n_out
        x, w = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5)
        gate_up = x.float() @ w.float().t()
        reference = _silu_mul(gate_up)
        layer = [run_candidate(shape, "F.linear alone (no SwiGLU; vs its own fp32 product)",
                               lambda: functools.partial(F.linear, x, w), gate_up, repeats, flops)]
        del gate_up
        out = torch.empty(tokens, inner, device=DEVICE, dtype=DTYPE)
        candidates: dict[str, Callable[[], Call]] = {
            engine_name: lambda: lambda: silu_and_mul(F.linear(x, w)),
            "F.linear + torch silu*mul": lambda: lambda: _silu_mul(F.linear(x, w)),
        }
        for config in configs:
            name = f"triton fused {config}" + (" (default)" if config == GATE_UP_DEFAULT else "")
            candidates[name] = lambda config=config: functools.partial(gate_up_silu, x, w, out, config=config)
        for name, build in candidates.items():
            layer.append(run_candidate(shape, name, build, reference, repeats, flops))
        if triton_error:
            layer.append({"shape": shape, "candidate": "triton fused", "error": triton_error})
        engine_ms = layer[1].get("graph_ms")
        for row in layer:
            if isinstance(engine_ms, float) and isinstance(row.get("graph_ms"), float):
                row["speedup_vs_engine"] = engine_ms / row["graph_ms"]
        rows += layer
    return rows


WORKSPACE_SETTINGS = {"default": None, "none (:0:0)": ":0:0"}  # label -> CUBLAS_WORKSPACE_CONFIG


def gemm_workspace_rows(repeats: int, workspace: str) -> list[Row]:
    """qwen3_gemm_workspace's half in a child process, whose CUBLAS_WORKSPACE_CONFIG the parent set
    before this process's first cuBLAS call: F.linear for qkv and gate_up, timed as run_candidate
    times, then kernels (memsets included) per call under the profiler over a few eager calls."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[Row] = []
    calls = 10
    for tokens in (4096, 16384):
        for name in ("qkv", "gate_up"):
            k_in, n_out = QWEN3_GEMMS[name]
            x, w = randn(tokens, k_in), randn(n_out, k_in, scale=k_in ** -0.5)
            timed = run_candidate(f"T={tokens} {k_in}->{n_out}", name, lambda: functools.partial(F.linear, x, w),
                                  x.float() @ w.float().t(), repeats, flops=2 * tokens * k_in * n_out)
            row: Row = {"shape": timed.pop("shape"), "gemm": timed.pop("candidate"), "workspace": workspace, **timed}
            rows.append(row)
            if "error" in row:
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as trace:
                for _ in range(calls):
                    F.linear(x, w)
                torch.cuda.synchronize()
            kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            row["kernels_per_call"] = sum(e.count for e in kernels) / calls
            row["memsets_per_call"] = sum(e.count for e in kernels if "Memset" in e.key) / calls
            row["kernel"] = max(kernels, key=lambda e: e.self_device_time_total).key[:60] if kernels else ""
    try:  # torch.backends.cuda.cublas_workspace_size is newer than some torch builds; asked last, to change nothing
        size: object = torch.backends.cuda.cublas_workspace_size()
    except Exception as error:  # noqa: BLE001 - then the memset counts alone say whether the setting took
        size = f"unknown ({short(error)[:60]})"
    for row in rows:
        row["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "(unset)")
        row["workspace_bytes"] = size
    return rows


def qwen3_gemm_workspace(repeats: int) -> list[Row]:
    """Whether cuBLAS without a workspace (CUBLAS_WORKSPACE_CONFIG=:0:0) drops the memsets in front of
    Qwen3's qkv and gate_up GEMMs (its cooperative kernels zero part of the workspace) and what its
    other kernels cost. The variable is read when torch first sets up cuBLAS, which this process has
    long done, so each setting runs gemm_workspace_rows in a fresh Python; rows pair up per GEMM."""
    code = ("import json, sys\nfrom bench.kernels import gemm_workspace_rows\n"
            "print('ROWS ' + json.dumps(gemm_workspace_rows(int(sys.argv[1]), sys.argv[2]), default=str))")
    rows: list[Row] = []
    for label, setting in WORKSPACE_SETTINGS.items():
        env = {key: value for key, value in os.environ.items() if key != "CUBLAS_WORKSPACE_CONFIG"}
        if setting is not None:
            env["CUBLAS_WORKSPACE_CONFIG"] = setting
        try:
            done = subprocess.run([sys.executable, "-c", code, str(repeats), label], cwd=Path(__file__).resolve().parents[1],
                                  env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            rows.append({"workspace": label, "error": "child timed out after 300 s"})
            continue
        found = [line[5:] for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if done.returncode or not found:
            last = (done.stderr.strip().splitlines() or [""])[-1][:300]
            rows.append({"workspace": label, "error": f"child exited {done.returncode}: {last}"})
            continue
        rows += json.loads(found[-1])
    order: dict[tuple, int] = {}
    for row in rows:
        order.setdefault((row.get("shape"), row.get("gemm")), len(order))
    return sorted(rows, key=lambda row: order[(row.get("shape"), row.get("gemm"))])


# ---- 6-7. the engine ------------------------------------------------------------------------------

@functools.cache
def model_dir(name: str) -> Path:
    """A random-weight checkpoint of a model's shape, built once per run (random weights time like real ones)."""
    # tests.models copies MiniLM's tokenizer files from here when they exist (bench/run_on_gpu.sh's
    # default); nothing here tokenizes, so a stub tokenizer.json satisfies the loader otherwise.
    os.environ.setdefault("EMBEDCTL_TEST_MODEL", ".bundle/minilm")
    directory = Path(tempfile.mkdtemp(prefix="embedctl-kernels-")) / name
    if name == "Qwen3-0.6B":
        save_random_qwen3(directory, device=DEVICE, **QWEN3_06B)
    else:
        save_random_model(directory, pooling="mean", normalize=True, **(MINILM_L6 if name == "MiniLM-L6" else BERT_BASE))
    if not (directory / "tokenizer.json").is_file():
        (directory / "tokenizer.json").write_text("{}")
    return directory


def random_batch(seqs: int, length: int) -> PackedBatch:
    rng = np.random.default_rng(seqs * length)
    return PackedBatch.of([rng.integers(1000, 29000, length).astype(np.int32) for _ in range(seqs)])


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def profile_step(engine: Engine, batch: PackedBatch, label: str, repeats: int) -> list[Row]:
    """Eager first hit, capture, replay; wall ms of replayed steps; then one step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step(batch).result()
    walls = []
    for _ in range(min(repeats, 20)):
        started = time.perf_counter()
        engine.step(batch).result()
        walls.append((time.perf_counter() - started) * 1e3)
    replays = engine.stats.replays
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        engine.step(batch).result()
    kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    span, idle = gpu_span_and_idle_us(trace)
    rows: list[Row] = [{"config": label, "kernel": "(all GPU work of one step)", "calls": sum(e.count for e in kernels),
                        "total_us": total, "pct": 100.0, "step_wall_ms": statistics.median(walls),
                        "gpu_span_us": span, "gpu_idle_us": idle,
                        "ran": "graph replay" if engine.stats.replays > replays else "eager"}]
    for event in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        rows.append({"config": label, "kernel": event.key[:80], "calls": event.count,
                     "total_us": event.self_device_time_total, "pct": 100 * event.self_device_time_total / total})
    return rows


ENCODER_BATCHES, QWEN3_BATCHES = ((64, 256), (1, 16)), ((1, 128), (1, 4096), (32, 512))
BREAKDOWN_CONFIGS = (("MiniLM-L6", "auto", ENCODER_BATCHES), ("BERT-base", "auto", ENCODER_BATCHES),
                     ("Qwen3-0.6B", "auto", QWEN3_BATCHES), ("Qwen3-0.6B", "varlen", QWEN3_BATCHES))
TRITON_BATCHES = ENCODER_BATCHES + ((5, 512),)
TRITON_CONFIGS = tuple((model, backend, TRITON_BATCHES) for model in ("MiniLM-L6", "BERT-base")
                       for backend in ("varlen", "flashinfer", "triton") if (model, backend) != ("MiniLM-L6", "flashinfer"))


def layer_breakdown(repeats: int, configs: tuple = BREAKDOWN_CONFIGS) -> list[Row]:
    rows: list[Row] = []
    for model, backend, batches in configs:
        # Qwen3 as bench/gpu_qwen3.py runs it with graphs: a 16,384-token budget and max length.
        options = {"max_batch_tokens": 16384, "max_length": 16384} if model.startswith("Qwen3") else {}
        try:
            # One lane: a profile of one step's kernels, which further lanes would overlap with the next step's.
            engine = Engine.load(str(model_dir(model)), EngineConfig(attention=backend, lanes=1, **options))
            for seqs, length in batches:
                label = f"{model} {engine.attention_label} {seqs}x{length}"
                try:
                    rows += profile_step(engine, random_batch(seqs, length), label, repeats)
                except Exception as error:  # noqa: BLE001 - one batch shape failing leaves the others
                    rows.append({"config": label, "error": short(error)})
            del engine
        except Exception as error:  # noqa: BLE001 - a backend that cannot load is a result
            rows.append({"config": f"{model} {backend}", "error": short(error)})
        free_gpu()
    return rows


def big_batches(repeats: int) -> list[Row]:
    rows: list[Row] = []
    for model, length in (("MiniLM-L6", 256), ("BERT-base", 512)):
        try:
            engine = Engine.load(str(model_dir(model)), EngineConfig(max_batch_tokens=65536, lanes=1))
            for tokens in (16384, 32768, 65536):
                rows.append({"model": model, "attention": engine.attention_label, "tokens": tokens,
                             "batch": f"{tokens // length}x{length}", **steps_per_second(engine, tokens // length, length)})
            del engine
        except Exception as error:  # noqa: BLE001 - one model failing leaves the other
            rows.append({"model": model, "error": short(error)})
        free_gpu()
    return rows


def steps_per_second(engine: Engine, seqs: int, length: int, steps: int = 20) -> Row:
    """Tokens/s over `steps` steps after warm-up, and whether they replayed a graph or ran eagerly."""
    batch = random_batch(seqs, length)
    for _ in range(3):  # eager, capture, replay (three eager steps past GRAPH_MAX_TOKENS)
        engine.step(batch).result()
    replays, eager = engine.stats.replays, engine.stats.eager_runs
    torch.cuda.synchronize()
    started = time.perf_counter()
    for lazy in [engine.step(batch) for _ in range(steps)]:
        lazy.result()
    seconds = time.perf_counter() - started
    if engine.stats.replays - replays == steps:
        ran = "graph replay"
    else:
        ran = "eager" if engine.stats.eager_runs - eager == steps else "mixed"
    return {"ran": ran, "ms_per_step": seconds / steps * 1e3, "tokens_per_s": batch.num_tokens * steps / seconds}


# ---- driver ---------------------------------------------------------------------------------------

EXPERIMENTS: dict[str, Callable[[int], list[Row]]] = {
    "gelu_epilogue": gelu_epilogue,
    "attention_hd32": attention_hd32,
    "attention_hd64": attention_hd64,
    "attention_causal_long": attention_causal_long,
    "qwen3_gemms": qwen3_gemms,
    "qwen3_elementwise": qwen3_elementwise,
    "qwen3_residual": qwen3_residual,
    "qwen3_blas": qwen3_blas,
    "qwen3_gemm_forms": qwen3_gemm_forms,
    "qwen3_swiglu_gemm": qwen3_swiglu_gemm,
    "qwen3_gemm_workspace": qwen3_gemm_workspace,
    "layer_breakdown": layer_breakdown,
    "encoder_breakdown": functools.partial(layer_breakdown, configs=BREAKDOWN_CONFIGS[:2]),
    "qwen3_breakdown": functools.partial(layer_breakdown, configs=BREAKDOWN_CONFIGS[2:3]),
    "attention_triton": attention_triton,
    "pooling": pooling,
    "triton_breakdown": functools.partial(layer_breakdown, configs=TRITON_CONFIGS),
    "big_batches": big_batches,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/kernels"), help="folder for results.json and report.md")
    parser.add_argument("--repeats", type=int, default=50, help="timed loops per candidate (the median is kept)")
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated, from: {', '.join(EXPERIMENTS)}")
    args = parser.parse_args()
    args.only = [name for name in args.only.split(",") if name]
    unknown = [name for name in args.only if name not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    return args


def cell(column: str, value: object) -> str:
    if isinstance(value, float):
        if column == "cosine":
            return f"{value:.6f}"
        if column == "of_ceiling":
            return f"{value:.0%}"
        return f"{value:.3e}" if column == "max_abs_err" else f"{value:.4g}"
    return str(value).replace("|", "/").replace("\n", " ")


def table(rows: list[Row]) -> str:
    columns = [c for c in dict.fromkeys(key for row in rows for key in row) if c != "error"]
    columns += ["error"] if any("error" in row for row in rows) else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def section(name: str, entry: dict) -> str:
    body = table(entry["rows"]) if "rows" in entry else f"failed: {entry['error']}"
    return f"## {name} ({entry['seconds']} s)\n\n{body}\n"


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels measures CUDA kernels and needs an NVIDIA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        flashinfer_version = import_flashinfer().__version__
    except RuntimeError as error:
        flashinfer_version = str(error)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "flashinfer": flashinfer_version, "repeats": args.repeats, "experiments": {}}
    header = (f"# Kernel micro-benchmarks\n\n{results['device']}, torch {results['torch']} (CUDA {results['cuda']}), "
              f"flashinfer {flashinfer_version}; bf16; median of {args.repeats} loops per candidate. "
              "ms: eager loop / K calls; graph_ms: the same K calls as one CUDA graph; errors vs fp32.\n")
    sections = [header]
    print(header, flush=True)
    for name in args.only:
        started = time.perf_counter()
        try:
            entry: dict = {"rows": EXPERIMENTS[name](args.repeats)}
        except Exception as error:  # noqa: BLE001 - one experiment failing leaves the others
            entry = {"error": short(error), "traceback": traceback.format_exc()}
        entry["seconds"] = round(time.perf_counter() - started, 1)
        results["experiments"][name] = entry
        sections.append(section(name, entry))
        print(sections[-1], flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (args.out / "report.md").write_text("\n".join(sections))
        free_gpu()


if __name__ == "__main__":
    main()
