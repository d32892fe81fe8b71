"""run148: where engine/small_batch.py's kernels spend 27-63 us: variants of its partial-sum step, timed as
CUDA graphs of 50 layers (MiniLM and BERT-base shapes, 16 real tokens in a 64-row tile)."""
import importlib.util, json, sys, time
from pathlib import Path
import torch
from engine.models.bert import BertConfig, BertLayer

src = Path("engine/small_batch.py").read_text()
body = """    fixed = (partial * FIXED_POINT_SCALE).to(tl.int64)
    tl.atomic_add(acc_ptr + rows[:, None] * HIDDEN + cols[None, :], fixed, mask=live[:, None], sem="relaxed")"""
assert body in src
variants = {
    "int64_atomics": src,
    "fp32_atomics": src.replace(body, """    tl.atomic_add(acc_ptr.to(tl.pointer_type(tl.float32)) + rows[:, None] * HIDDEN + cols[None, :], partial,
                  mask=live[:, None], sem="relaxed")"""),
    "int64_stores": src.replace(body, """    fixed = (partial * FIXED_POINT_SCALE).to(tl.int64)
    tl.store(acc_ptr + rows[:, None] * HIDDEN + cols[None, :], fixed, mask=live[:, None])"""),
    "fp32_stores": src.replace(body, """    tl.store(acc_ptr.to(tl.pointer_type(tl.float32)) + rows[:, None] * HIDDEN + cols[None, :], partial,
             mask=live[:, None])"""),
    "nothing_added": src.replace(body, "    pass"),
}
variants["fp32_stores_8warps"] = variants["fp32_stores"].replace("ROWS=FINISH_ROWS, num_warps=4", "ROWS=FINISH_ROWS, num_warps=8")
variants["int64_atomics_2stages"] = src.replace("ROWS=FINISH_ROWS, num_warps=4", "ROWS=FINISH_ROWS, num_warps=4, num_stages=2")
shapes = {"minilm": dict(hidden_size=384, num_attention_heads=12, intermediate_size=1536),
          "bert-base": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072)}
results = {}
for shape, dims in shapes.items():
    config = BertConfig(vocab_size=100, num_hidden_layers=1, hidden_act="gelu", max_position_embeddings=512,
                        type_vocab_size=2, layer_norm_eps=1e-12, position_offset=0, **dims)
    layer = BertLayer(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.03)
    layer.fuse_qkv()
    layer = layer.cuda().bfloat16()
    for name, text in variants.items():
        path = Path(f"/tmp/sbvar_{name}.py"); path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"sbvar_{name}", path)
        module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; spec.loader.exec_module(module)
        seq = torch.zeros(64, dtype=torch.int32, device="cuda")
        real = torch.tensor([16], dtype=torch.int32, device="cuda")
        x = torch.randn(64, dims["hidden_size"], device="cuda").bfloat16()
        small = module.SmallBatch(seq, real, dims["hidden_size"])
        for _ in range(3):
            small.layer(layer, x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(50):
                small.layer(layer, x)
        times = []
        for _ in range(20):
            torch.cuda.synchronize(); start = time.perf_counter(); graph.replay(); torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / 50 * 1e6)
        times.sort()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            small.layer(layer, x); torch.cuda.synchronize()
        kernels = {e.key: round(e.device_time_total / max(e.count, 1), 1) for e in prof.key_averages() if e.device_time_total > 0}
        results[f"{shape} {name}"] = {"layer_us_median": round(times[len(times) // 2], 1), "kernels_us": kernels}
        print(shape, name, results[f"{shape} {name}"], flush=True)
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "micro148.json").write_text(json.dumps(results, indent=2))
