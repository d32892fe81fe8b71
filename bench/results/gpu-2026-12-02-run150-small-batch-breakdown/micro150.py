"""run150: where engine/small_batch.py's kernel time goes (run149's coalesced reads changed nothing): variants of its partial-sum step,
timed as CUDA graphs of 50 layers, and a race check: 3,000 runs of one layer on one input must give one result."""
import importlib.util, json, sys, time
from pathlib import Path
import torch
from engine.models.bert import BertConfig, BertLayer

src = Path("engine/small_batch.py").read_text()
body = """    fixed = (partial * FIXED_POINT_SCALE).to(tl.int64)
    tl.atomic_add(acc_ptr + rows[:, None] * HIDDEN + cols[None, :], fixed, mask=live[:, None], sem="relaxed")"""
assert body in src
eight = src.replace("ROWS=FINISH_ROWS, num_warps=4", "ROWS=FINISH_ROWS, num_warps=8")
last = "    if _last_program(counter_ptr, tl.num_programs(0)):"
assert eight.count(last) == 2
variants = {
    "8warps": eight,
    "8warps_no_finish": eight.replace(last, "    if tl.program_id(0) < 0:"),  # the branch compiled, never taken
    "8warps_4stages": eight.replace("num_warps=8", "num_warps=8, num_stages=4"),
    "8warps_16rows": eight.replace("BLOCK_T=SMALL_BATCH_TOKENS", "BLOCK_T=16"),
    "8warps_16rows_no_finish": eight.replace("BLOCK_T=SMALL_BATCH_TOKENS", "BLOCK_T=16").replace(last, "    if tl.program_id(0) < 0:"),
    "4warps_16rows": src.replace("BLOCK_T=SMALL_BATCH_TOKENS", "BLOCK_T=16"),
}
shapes = {"small-bert": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128),
          "minilm": dict(hidden_size=384, num_attention_heads=12, intermediate_size=1536),
          "bert-base": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072)}
results = {}
shapes = {sys.argv[2]: shapes[sys.argv[2]]}  # one shape per process: a fault ends the process's CUDA context
for shape, dims in shapes.items():
    config = BertConfig(vocab_size=100, num_hidden_layers=1, hidden_act="gelu", max_position_embeddings=512,
                        type_vocab_size=2, layer_norm_eps=1e-12, position_offset=0, **dims)
    layer = BertLayer(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.03)
    layer.fuse_qkv()
    layer = layer.cuda().bfloat16()
    for name, text in variants.items():
      try:
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
          if False:  # the fixed-point sums make every run bitwise the same, unless programs race
              seq[:16] = torch.tensor([0] * 5 + [1] * 7 + [2] * 4, dtype=torch.int32)
              start_x = torch.randn(64, dims["hidden_size"], device="cuda").bfloat16()
              first = start_x.clone(); small.layer(layer, first)
              differing = 0
              for _ in range(1000):
                  again = start_x.clone(); small.layer(layer, again)
                  differing += int(not torch.equal(again[:16], first[:16]))
              torch.cuda.synchronize()
              results[f"{shape} {name}"]["runs_differing_of_1000"] = differing
          print(shape, name, results[f"{shape} {name}"], flush=True)
      except Exception as error:  # a variant that fails to compile is reported, not fatal
        results[f"{shape} {name}"] = {"error": repr(error)[:500]}; print(shape, name, repr(error)[:500], flush=True)
        import traceback; traceback.print_exc(limit=-4); break
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / f"micro150-{sys.argv[2]}.json").write_text(json.dumps(results, indent=2))
