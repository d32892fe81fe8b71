"""run109: where one step's host time goes. For a MiniLM-shaped model (batch 1 x 16 tokens) and a
BERT-base cross-encoder (1 x 16, 5 x 512), graphs replayed: p50 of each part of Engine.step on the host
(lane choice, staging, attention plan, graph launch, readback enqueue), of step() whole, of the wait in
result(), and of the device's span; then torch.profiler's CPU table for 30 steps; then the basic costs on
this host (a stream context, an event record/query, a small H2D copy, a one-kernel graph's replay)."""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
import torch
import engine.graphs as graphs
from engine import Engine, EngineConfig, PackedBatch
from tests.models import BERT_BASE, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)
N = 300
timings: dict[str, list[float]] = {}


def timed(name, fn):
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timings.setdefault(name, []).append((time.perf_counter() - s) * 1e6)
    return wrapper


def p50(values):
    return round(float(np.percentile(values, 50)), 1) if values else None


results = {"configs": {}}
replay = torch.cuda.CUDAGraph.replay
torch.cuda.CUDAGraph.replay = timed("graph_replay", replay)
for name, cls, shape, extra in (("minilm", "BertModel", MINILM, dict(pooling="mean", normalize=True)),
                                ("bert_base_ce", "BertForSequenceClassification", BERT_BASE, dict(num_labels=1))):
    path = save_random_model(Path(tempfile.mkdtemp()) / name, cls, **extra, **shape)
    engine = Engine.load(str(path), EngineConfig(warmup=False))
    runner = engine.runner
    runner._free_lane = timed("free_lane", runner._free_lane)
    runner._stage = timed("stage", runner._stage)
    engine.ring.readback = timed("readback_enqueue", engine.ring.readback)
    attention_classes = set()
    for batch_name, seqs, length in (("1x16", 1, 16), ("1x128", 1, 128), ("5x512", 5, 512)):
        if name == "minilm" and seqs > 1:
            continue
        batch = PackedBatch.of([np.arange(1000, 1000 + length, dtype=np.int32) % 30000] * seqs,
                               token_type_ids=[np.zeros(length, np.int32)] * seqs if name == "bert_base_ce" else None)
        for _ in range(20):
            engine.step(batch).result()
        for lane in runner.lanes:
            for g in lane.graphs.values():
                cls_ = type(g.attention)
                if cls_ not in attention_classes:
                    cls_.plan = timed("attention_plan", cls_.plan)
                    attention_classes.add(cls_)
        timings.clear()
        step_t, wait_t, device_t, total_t = [], [], [], []
        for _ in range(N):
            stream = runner.lanes[0].stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            s = time.perf_counter()
            lazy = engine.step(batch)
            m = time.perf_counter()
            lazy.result()
            e = time.perf_counter()
            end.record(runner.lanes[runner.last_used].stream)
            end.synchronize()
            step_t.append((m - s) * 1e6); wait_t.append((e - m) * 1e6); total_t.append((e - s) * 1e6)
            device_t.append(start.elapsed_time(end) * 1e3)
        row = {part: p50(values) for part, values in timings.items()}
        row.update(step=p50(step_t), result_wait=p50(wait_t), total=p50(total_t), device_span=p50(device_t),
                   lanes=len(runner.lanes), attention=engine.attention)
        results["configs"][f"{name} {batch_name}"] = row
        print(name, batch_name, json.dumps(row), flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(30):
                engine.step(batch).result()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        with open(out / "profiles.txt", "a") as f:
            f.write(f"== {name} {batch_name}\n{table}\n")
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        results["configs"][f"{name} {batch_name}"]["kernels_per_step"] = round(sum(e.count for e in kernels) / 30, 1)
        results["configs"][f"{name} {batch_name}"]["kernel_us_per_step"] = round(sum(e.self_device_time_total for e in kernels) / 30, 1)
        print(name, batch_name, "kernels/step", results["configs"][f"{name} {batch_name}"]["kernels_per_step"],
              "kernel us/step", results["configs"][f"{name} {batch_name}"]["kernel_us_per_step"], flush=True)
    del engine, runner
    torch.cuda.empty_cache()

# basic costs on this host
s = torch.cuda.Stream(); ev = torch.cuda.Event(); x = torch.zeros(64, device="cuda"); h = torch.zeros(64).pin_memory()
basic = {}
def bench(label, fn, n=2000):
    for _ in range(50): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    basic[label] = round((time.perf_counter() - t) / n * 1e6, 2)
def ctx():
    with torch.cuda.stream(s):
        pass
bench("stream_context", ctx)
bench("event_record", lambda: ev.record(s))
bench("event_query", ev.query)
bench("h2d_copy_64_floats", lambda: x.copy_(h, non_blocking=True))
bench("d2h_copy_64_floats", lambda: h.copy_(x, non_blocking=True))
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x + 1
bench("replay_1_kernel_graph", g.replay, 500)
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2):
    y = x
    for _ in range(150):
        y = y + 1
torch.cuda.synchronize()
bench("replay_150_kernel_graph", g2.replay, 200)
torch.cuda.synchronize()
results["basic_us"] = basic
print("basic", json.dumps(basic), flush=True)
(out / "step109.json").write_text(json.dumps(results, indent=1))
