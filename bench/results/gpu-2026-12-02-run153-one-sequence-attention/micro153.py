"""run153: attention kernels for ONE causal sequence (Qwen3-0.6B: 16 q heads, 8 k/v heads, head_dim 128, bf16),
each timed as a CUDA graph of 20 calls: FlashInfer's ragged fa3 as the engine plans it, FlashInfer's single prefill,
torch SDPA through cuDNN (GQA native and k/v expanded), SDPA flash, varlen_attn, our Triton kernel.
Also: cuDNN's output strides and every variant's error against fp32 math."""
import json, sys, time, traceback
from pathlib import Path
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention import AttentionLayout, FlashInferAttention, TritonAttention, VarlenAttention

out_dir = Path(sys.argv[1]); out_dir.mkdir(parents=True, exist_ok=True)
results = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "nn.attention": sorted(n for n in dir(torch.nn.attention) if not n.startswith("__"))}
print(results, flush=True)
H, KV, D = 16, 8, 128
workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


def bhsd(t):  # [T, h, d] -> [1, h, T, d] view
    return t.transpose(0, 1).unsqueeze(0)


def time_graph(fn, calls=20, rounds=15):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize(); start = time.perf_counter(); graph.replay(); torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    times.sort()
    return round(times[len(times) // 2], 2)


for T in (128, 512, 1024, 2048, 4096, 8192):
    torch.manual_seed(T)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    expected = F.scaled_dot_product_attention(bhsd(q).float(), bhsd(k).float(), bhsd(v).float(), is_causal=True,
                                              enable_gqa=True)[0].transpose(0, 1)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    layout = AttentionLayout(cu, [0, T], T, T)
    fi = FlashInferAttention(H, D, torch.bfloat16, workspace, causal=True, slots=1, num_kv_heads=KV, pooled=False,
                             max_tokens=16384)
    fi.plan(layout)
    varlen = VarlenAttention(causal=True); varlen.plan(layout)
    triton = TritonAttention(causal=True); triton.plan(layout)

    def cudnn_gqa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    def cudnn_expand():
        ke, ve = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(bhsd(q), bhsd(ke), bhsd(ve), is_causal=True)[0].transpose(0, 1)

    ke, ve = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))

    def cudnn_pre_expanded():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(bhsd(q), bhsd(ke), bhsd(ve), is_causal=True)[0].transpose(0, 1)

    def flash_gqa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    variants = {"flashinfer_ragged": lambda: fi(q, k, v), "cudnn_gqa": cudnn_gqa, "cudnn_expand": cudnn_expand, "cudnn_pre_expanded": cudnn_pre_expanded,
                "sdpa_flash_gqa": flash_gqa, "varlen": lambda: varlen(q, k, v), "triton": lambda: triton(q, k, v)}
    row = {}
    for name, fn in variants.items():
        try:
            got = fn()
            error = (torch.linalg.norm(got.float() - expected) / torch.linalg.norm(expected)).item()
            us = time_graph(fn)
            flops = 4 * T * T * D * H / 2
            row[name] = {"us": us, "tflops": round(flops / us / 1e6, 1), "rel_error": round(error, 5),
                         "out_stride": list(got.stride()), "contiguous": got.is_contiguous()}
        except Exception as exc:
            row[name] = {"error": repr(exc)[:400]}
            traceback.print_exc(limit=-2)
        print(T, name, row[name], flush=True)
    results[str(T)] = row
    (out_dir / "micro153.json").write_text(json.dumps(results, indent=2))

print("\n| tokens | " + " | ".join(results["4096"]) + " |")
for T in (128, 512, 1024, 2048, 4096, 8192):
    print(f"| {T} | " + " | ".join(str(c.get("us", "err")) for c in results[str(T)].values()) + " |")
