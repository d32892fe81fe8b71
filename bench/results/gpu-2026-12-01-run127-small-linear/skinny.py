"""Experiment (run127): a Triton linear for the few-token batches of batch-1 latency against cuBLAS as the engine
calls it, at BERT-base's and MiniLM's four GEMMs per layer.

The profiles of one 16-token query (bucket 64) put BERT-base's GEMMs at 4-5 us each (run114: QKV 4.8, the
output GEMM 5.2 + a split-K reduce 1.8 + a memset 0.9, up + GELU 5.2, down 3.8): 0.7-0.9 TB/s of weights,
a fifth of the H200's bandwidth. Here each candidate runs in a CUDA graph over enough distinct weight copies
that they do not fit in L2 (as a model's layers do not), and is checked against float32.
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _small_linear(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                  HAS_BIAS: tl.constexpr, GELU: tl.constexpr, ACCUMULATE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_in, col_in = rows[:, None] < M, cols[None, :] < N
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * w_stride + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K // BLOCK_K):
        a = tl.load(x_ptrs, mask=row_in, other=0.0)
        w = tl.load(w_ptrs, mask=col_in, other=0.0)
        acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    out_ptrs = out_ptr + rows[:, None] * out_stride + cols[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=row_in & col_in, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_in & col_in)


@triton.jit
def _split_k_linear(x_ptr, w_ptr, part_ptr, M, N, K, x_stride, w_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """Partial sums of K / SPLIT columns each into part[split, M, N] (float32), no atomics: deterministic."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    share = K // SPLIT
    ks = pid_k * share + tl.arange(0, BLOCK_K)
    row_in, col_in = rows[:, None] < M, cols[None, :] < N
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * w_stride + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, share // BLOCK_K):
        a = tl.load(x_ptrs, mask=row_in, other=0.0)
        w = tl.load(w_ptrs, mask=col_in, other=0.0)
        acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(part_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=row_in & col_in)


@triton.jit
def _split_k_finish(part_ptr, b_ptr, out_ptr, M, N, out_stride, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                    ACCUMULATE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for split in range(SPLIT):
        acc += tl.load(part_ptr + split * M * N + offsets, mask=inside, other=0.0)
    rows, cols = offsets // N, offsets % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if ACCUMULATE:
        acc += tl.load(out_ptr + rows * out_stride + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def small_linear(x, w, b, out, gelu, accumulate, block_m, block_n, block_k, warps, stages, split=1, part=None):
    m, k = x.shape
    n = w.shape[0]
    if split == 1:
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        _small_linear[grid](x, w, b if b is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                            HAS_BIAS=b is not None, GELU=gelu, ACCUMULATE=accumulate, BLOCK_M=block_m,
                            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    else:
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
        _split_k_linear[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, SPLIT=split, num_warps=warps, num_stages=stages)
        _split_k_finish[(triton.cdiv(m * n, 1024),)](part, b if b is not None else w, out, m, n, out.stride(0),
                                                     HAS_BIAS=b is not None, GELU=gelu, ACCUMULATE=accumulate,
                                                     SPLIT=split, BLOCK=1024, num_warps=4)
    return out


SHAPES = {  # op: (N, K, bias in the GEMM, GELU, accumulate into the residual) as engine.fused runs them
    "minilm": {"qkv": (1152, 384, True, False, False), "o": (384, 384, False, False, True),
               "up": (1536, 384, True, True, False), "down": (384, 1536, False, False, True)},
    "bert-base": {"qkv": (2304, 768, True, False, False), "o": (768, 768, False, False, True),
                  "up": (3072, 768, True, True, False), "down": (768, 3072, False, False, True)},
}
CONFIGS = [  # block_m, block_n, block_k, warps, stages, split
    *[(64, n, k, 4, s, 1) for n, k, s in itertools.product((16, 32, 64), (64, 128), (3, 4))],
    (64, 16, 256, 4, 3, 1), (64, 32, 128, 2, 4, 1), (64, 32, 128, 8, 4, 1), (32, 32, 128, 4, 4, 1),
    (64, 64, 128, 4, 3, 2), (64, 64, 128, 4, 3, 4), (64, 32, 128, 4, 3, 2), (64, 32, 128, 4, 3, 4),
]
L2_BYTES = 160 << 20  # weight copies per op: more than three times the H200's 50 MB L2


def median_us(graph, calls, repeats=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def timed(run_one, copies):
    for i in range(3):
        run_one(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            run_one(i)
    return median_us(graph, copies)


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    rows = []
    for model, ops in SHAPES.items():
        for m in (64, 128, 256):
            for op, (n, k, has_bias, gelu, accumulate) in ops.items():
                copies = max(8, min(256, L2_BYTES // (n * k * 2)))
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
                bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(copies)]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ ws[0].float().t()
                if has_bias:
                    ref = ref + bs[0].float()
                if gelu:
                    ref = F.gelu(ref)
                if accumulate:
                    ref = ref + residual.float()
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

                def cublas(i):
                    if accumulate:
                        return outs[i].addmm_(x, ws[i].t())
                    if gelu:
                        return torch._addmm_activation(bs[i], x, ws[i].t(), use_gelu=True)
                    return F.linear(x, ws[i], bs[i] if has_bias else None)

                def check(result):
                    return F.cosine_similarity(result.float().reshape(-1), ref.reshape(-1), dim=0).item()

                base = {"model": model, "tokens": m, "op": op, "n": n, "k": k, "copies": copies}
                outs[0].copy_(residual)
                rows.append({**base, "candidate": "cublas (engine)", "cosine": check(cublas(0)), "us": timed(cublas, copies)})
                for config in CONFIGS:
                    bm, bn, bk, warps, stages, split = config
                    if k % (bk * split):
                        continue
                    part = torch.empty(split, m, n, device="cuda", dtype=torch.float32) if split > 1 else None

                    def triton_one(i, config=config, part=part):
                        return small_linear(x, ws[i], bs[i] if has_bias else None, outs[i], gelu, accumulate,
                                            *config[:5], split=config[5], part=part)
                    name = f"triton m{bm} n{bn} k{bk} w{warps} s{stages}" + (f" split{split}" if split > 1 else "")
                    try:
                        outs[0].copy_(residual)
                        cosine = check(triton_one(0))
                        rows.append({**base, "candidate": name, "cosine": cosine, "us": timed(triton_one, copies)})
                    except Exception as error:  # noqa: BLE001
                        rows.append({**base, "candidate": name, "error": str(error)[:200]})
                best = min((r for r in rows if r.get("tokens") == m and r["model"] == model and r["op"] == op
                            and "us" in r and r["candidate"] != "cublas (engine)"), key=lambda r: r["us"])
                engine_row = next(r for r in rows if r["model"] == model and r["tokens"] == m and r["op"] == op
                                  and r["candidate"] == "cublas (engine)")
                print(f"{model} {m} {op}: cublas {engine_row['us']:.2f} us, best {best['candidate']} {best['us']:.2f} us "
                      f"(cos {best['cosine']:.6f})", flush=True)
                del ws, bs, outs
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "skinny.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | tokens | op | candidate | us | cosine |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['op']} | {r['candidate']} | "
                     f"{r.get('us', r.get('error', '')) if 'error' in r else round(r['us'], 2)} | {round(r.get('cosine', 0), 6)} |")
    (out_dir / "skinny.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
