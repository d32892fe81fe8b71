"""Experiment: a Triton linear for small token counts, LayerNorm folded into its consumers.

linear(a, w, b, norm_a=LN?, gelu?, residual=r, norm_r=LN?) = gelu?(LN?(a) @ w^T + b) + LN?(r)
LN (a pending LayerNorm: weight, bias, eps) is applied on the fly from row statistics each program
computes itself, so no LayerNorm kernel runs between layers.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _row_stats(ptr, rows, row_in, stride, width, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    total = tl.zeros([BLOCK_M], tl.float32)
    for first in range(0, width, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)
        x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_in[:, None] & (cols < width)[None, :],
                    other=0.0).to(tl.float32)
        total += tl.sum(x, 1)
    mean = total / width
    squares = tl.zeros([BLOCK_M], tl.float32)
    for first in range(0, width, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)
        inside = row_in[:, None] & (cols < width)[None, :]
        x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        centred = tl.where(inside, x - mean[:, None], 0.0)
        squares += tl.sum(centred * centred, 1)
    return mean, tl.rsqrt(squares / width + eps)


@triton.jit
def _linear_kernel(a_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, a_gamma_ptr, a_beta_ptr, r_gamma_ptr, r_beta_ptr,
                   M, N, K, a_stride, w_stride, res_stride, out_stride, a_eps, r_eps,
                   NORM_A: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, NORM_R: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    dtype = w_ptr.dtype.element_ty
    if NORM_A:
        a_mean, a_rstd = _row_stats(a_ptr, rows, row_in, a_stride, K, a_eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, K, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * a_stride + ks[None, :], mask=row_in[:, None], other=0.0)
        if NORM_A:
            gamma = tl.load(a_gamma_ptr + ks).to(tl.float32)
            beta = tl.load(a_beta_ptr + ks).to(tl.float32)
            a = ((a.to(tl.float32) - a_mean[:, None]) * a_rstd[:, None] * gamma[None, :] + beta[None, :]).to(dtype)
        w = tl.load(w_ptr + cols[None, :] * w_stride + ks[:, None], mask=col_in[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    acc += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if RESIDUAL:
        inside = row_in[:, None] & col_in[None, :]
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if NORM_R:
            r_mean, r_rstd = _row_stats(res_ptr, rows, row_in, res_stride, N, r_eps, BLOCK_M, BLOCK_K)
            gamma = tl.load(r_gamma_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
            beta = tl.load(r_beta_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
            r = (r - r_mean[:, None]) * r_rstd[:, None] * gamma[None, :] + beta[None, :]
        acc += r
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(dtype), mask=row_in[:, None] & col_in[None, :])


CONFIG = dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)


def linear(a, weight, bias, norm_a=None, gelu=False, residual=None, norm_r=None, config=None, out=None):
    config = config or CONFIG
    m, k = a.shape
    n = weight.shape[0]
    block_k = config["block_k"] if k % config["block_k"] == 0 else 32
    out = torch.empty(m, n, dtype=a.dtype, device=a.device) if out is None else out
    dummy = bias
    grid = (triton.cdiv(n, config["block_n"]), triton.cdiv(m, config["block_m"]))
    _linear_kernel[grid](
        a, weight, bias, residual if residual is not None else a, out,
        norm_a.weight if norm_a is not None else dummy, norm_a.bias if norm_a is not None else dummy,
        norm_r.weight if norm_r is not None else dummy, norm_r.bias if norm_r is not None else dummy,
        m, n, k, a.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        norm_a.eps if norm_a is not None else 0.0, norm_r.eps if norm_r is not None else 0.0,
        NORM_A=norm_a is not None, GELU=gelu, RESIDUAL=residual is not None, NORM_R=norm_r is not None,
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], BLOCK_K=block_k,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


class Layer(torch.nn.Module):
    """A BERT layer's dense parts (attention's context taken as the QKV output's q part, to skip attention)."""

    def __init__(self, hidden, inner, device, dtype):
        super().__init__()
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.o = torch.nn.Linear(hidden, hidden)
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-12)
        self.up = torch.nn.Linear(hidden, inner)
        self.down = torch.nn.Linear(inner, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-12)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.05)
            self.ln1.weight.add_(1.0)
            self.ln2.weight.add_(1.0)
        self.to(device=device, dtype=dtype)


def reference_chain(x, layers):
    """fp32 math, the model as transformers runs it (context = q part of qkv)."""
    x = x.float()
    for L in layers:
        hidden = x.shape[1]
        qkv = F.linear(x, L.qkv.weight.float(), L.qkv.bias.float())
        ctx = qkv[:, :hidden]
        x = F.layer_norm(F.linear(ctx, L.o.weight.float(), L.o.bias.float()) + x, (hidden,), L.ln1.weight.float(), L.ln1.bias.float(), 1e-12)
        h = F.gelu(F.linear(x, L.up.weight.float(), L.up.bias.float()))
        x = F.layer_norm(F.linear(h, L.down.weight.float(), L.down.bias.float()) + x, (hidden,), L.ln2.weight.float(), L.ln2.bias.float(), 1e-12)
    return x


def triton_chain(x, layers, config=None):
    y, norm = x, None
    for L in layers:
        hidden = y.shape[1]
        qkv = linear(y, L.qkv.weight, L.qkv.bias, norm_a=norm, config=config)
        ctx = qkv[:, :hidden]
        y_attn = linear(ctx, L.o.weight, L.o.bias, residual=y, norm_r=norm, config=config)
        h = linear(y_attn, L.up.weight, L.up.bias, norm_a=L.ln1, gelu=True, config=config)
        y = linear(h, L.down.weight, L.down.bias, residual=y_attn, norm_r=L.ln1, config=config)
        norm = L.ln2
    return F.layer_norm(y, (y.shape[1],), norm.weight, norm.bias, norm.eps)


def engine_chain(fused, layers):
    from engine.fused import Fused  # noqa: F401

    def run(x):
        x = x.clone()
        for L in layers:
            hidden = x.shape[1]
            qkv = L.qkv(x)
            ctx = qkv[:, :hidden]
            x = fused.dense_add_layer_norm(ctx, L.o, x, L.ln1)
            h = fused.dense_act(x, L.up, "gelu")
            x = fused.dense_add_layer_norm(h, L.down, x, L.ln2)
        return x
    return run


def main():
    sys.path.insert(0, ".")
    from engine.fused import Fused
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    configs = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
               for bm, bn, bk, w, s in ((16, 32, 128, 4, 3), (16, 64, 64, 4, 3), (16, 16, 128, 4, 4),
                                        (32, 32, 128, 4, 3), (64, 32, 64, 4, 3), (16, 32, 64, 2, 4),
                                        (16, 64, 128, 4, 2), (64, 64, 64, 4, 3))]
    if device.type == "cpu":
        configs = configs[:2]
    shapes = {"minilm": (384, 1536, 6), "bert-base": (768, 3072, 12)}
    tokens_list = (16, 64, 128, 256, 512) if device.type == "cuda" else (16, 40)
    fused = Fused(compile=device.type == "cuda")
    for name, (hidden, inner, depth) in shapes.items():
        if device.type == "cpu":
            depth = 2
        torch.manual_seed(0)
        layers = [Layer(hidden, inner, device, dtype) for _ in range(depth)]
        for tokens in tokens_list:
            x = F.layer_norm(torch.randn(tokens, hidden, device=device), (hidden,)).to(dtype)
            ref = reference_chain(x, layers)
            runs = {"engine": engine_chain(fused, layers)}
            for c in configs:
                runs["triton " + "x".join(str(c[key]) for key in ("block_m", "block_n", "block_k")) +
                     f" w{c['num_warps']} s{c['num_stages']}"] = (lambda x, c=c: triton_chain(x, layers, c))
            for label, fn in runs.items():
                try:
                    with torch.inference_mode():
                        out = fn(x)
                        cos = F.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
                        err = (out.float() - ref).abs().max().item()
                        us = time_graph(fn, x) if device.type == "cuda" else float("nan")
                    print(f"{name} T={tokens} {label}: {us:.2f} us/layer-chain ({us / depth:.2f} per layer) cos {cos:.6f} max_err {err:.3e}", flush=True)
                except Exception as error:  # noqa: BLE001
                    print(f"{name} T={tokens} {label}: ERROR {type(error).__name__}: {str(error)[:200]}", flush=True)


def time_graph(fn, x, calls=20, repeats=30):
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    times.sort()
    return times[len(times) // 2]


if __name__ == "__main__":
    main()
