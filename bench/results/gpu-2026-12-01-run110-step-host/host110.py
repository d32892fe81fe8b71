"""run110: one step's host costs measured cleanly (no profiler in the process), and A/B of leaner variants of
GraphRunner.run (the lane's stream made current without torch.cuda.stream's context) and _stage (views of the
staging buffers kept per size), alternating, for a MiniLM-shaped model (1 x 16 tokens) and a BERT-base
cross-encoder (1 x 16 and 5 x 512)."""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
import torch
import engine.graphs as graphs
from engine import Engine, EngineConfig, PackedBatch
from engine.attention import AttentionLayout
from tests.models import BERT_BASE, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)
results = {"basic_us": {}, "ab": {}}


def per_call(fn, n=3000):
    for _ in range(100):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t) / n * 1e6, 2)


orig_run, orig_stage = graphs.GraphRunner.run, graphs.GraphRunner._stage


def private_run(self, batch, read):
    lane = self._free_lane()
    lane.batches += 1
    stream = lane.stream
    caller = torch._C._cuda_getCurrentStream(stream.device_index)
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)
    try:
        result = read(self._run(lane, batch)[: batch.num_seqs], stream)
        lane.done.record(stream)
    finally:
        torch._C._cuda_setStream(stream_id=caller[0], device_index=caller[1], device_type=caller[2])
    return result


def public_run(self, batch, read):
    lane = self._free_lane()
    lane.batches += 1
    caller = torch.cuda.current_stream(self.device)
    torch.cuda.set_stream(lane.stream)
    try:
        result = read(self._run(lane, batch)[: batch.num_seqs], lane.stream)
        lane.done.record(lane.stream)
    finally:
        torch.cuda.set_stream(caller)
    return result


def views_stage(self, lane, batch, tokens, slots, max_seqlen):
    lane.turn ^= 1
    staged = lane.staged[lane.turn]
    staged.synchronize()
    size = 4 * tokens + slots + 1
    host = lane.staging_host[lane.turn]
    batch.write_inputs(host, tokens, slots)
    views = getattr(lane, "views", None)
    if views is None:
        views = lane.views = {}
    key = (lane.turn, size, tokens)
    if key not in views:
        views[key] = (lane.inputs[:size], lane.staging[lane.turn][:size], lane.inputs[4 * tokens: size])
    device, staging, cu_seqlens = views[key]
    device.copy_(staging, non_blocking=True)
    staged.record(lane.stream)
    return AttentionLayout(cu_seqlens, host[4 * tokens: size].tolist(), max_seqlen, tokens)


variants = {"orig": (orig_run, orig_stage), "private_run": (private_run, orig_stage),
            "public_run": (public_run, orig_stage), "private_run+views": (private_run, views_stage)}

for name, cls, shape, extra, batches in (
        ("minilm", "BertModel", MINILM, dict(pooling="mean", normalize=True), ((1, 16),)),
        ("bert_base_ce", "BertForSequenceClassification", BERT_BASE, dict(num_labels=1), ((1, 16), (5, 512)))):
    path = save_random_model(Path(tempfile.mkdtemp()) / name, cls, **extra, **shape)
    engine = Engine.load(str(path), EngineConfig(warmup=False))
    runner = engine.runner
    for seqs, length in batches:
        batch = PackedBatch.of([np.arange(1000, 1000 + length, dtype=np.int32) % 30000] * seqs,
                               token_type_ids=[np.zeros(length, np.int32)] * seqs if cls != "BertModel" else None)
        for _ in range(20):
            engine.step(batch).result()
        reference = engine.step(batch).result().copy()
        times = {v: [] for v in variants}
        for round_ in range(6):
            for v, (run, stage) in variants.items():
                graphs.GraphRunner.run, graphs.GraphRunner._stage = run, stage
                assert np.array_equal(engine.step(batch).result(), reference), v
                for _ in range(10):
                    engine.step(batch).result()
                for _ in range(100):
                    s = time.perf_counter()
                    engine.step(batch).result()
                    times[v].append((time.perf_counter() - s) * 1e6)
        graphs.GraphRunner.run, graphs.GraphRunner._stage = orig_run, orig_stage
        row = {v: round(float(np.percentile(t, 50)), 1) for v, t in times.items()}
        results["ab"][f"{name} {seqs}x{length}"] = row
        print(name, f"{seqs}x{length}", json.dumps(row), flush=True)
        if name == "minilm":
            lane = runner.lanes[0]
            host = lane.staging_host[0]
            s = lane.stream
            b = results["basic_us"]
            b["write_inputs_1x16"] = per_call(lambda: batch.write_inputs(host, 64, 1))
            def ctx():
                with torch.cuda.stream(s):
                    pass
            b["stream_context"] = per_call(ctx)
            b["current_stream"] = per_call(torch.cuda.current_stream)
            b["set_stream"] = per_call(lambda: torch.cuda.set_stream(torch.cuda.default_stream()))
            b["private_get_set"] = per_call(lambda: torch._C._cuda_setStream(*torch._C._cuda_getCurrentStream(0)))
            b["slice_2_and_copy"] = per_call(lambda: lane.inputs[:69].copy_(lane.staging[0][:69], non_blocking=True))
            d, st = lane.inputs[:69], lane.staging[0][:69]
            b["copy_cached_views"] = per_call(lambda: d.copy_(st, non_blocking=True))
            ev = torch.cuda.Event()
            b["event_record"] = per_call(lambda: ev.record(s))
            b["event_query"] = per_call(ev.query)
            b["event_synchronize_done"] = per_call(ev.synchronize)
            b["packed_batch_of_1x16"] = per_call(lambda: PackedBatch.of([np.arange(16, dtype=np.int32)]))
            b["free_lane"] = per_call(runner._free_lane)
            torch.cuda.synchronize()
            print("basic", json.dumps(b), flush=True)
    del engine, runner
    torch.cuda.empty_cache()
(out / "host110.json").write_text(json.dumps(results, indent=1))
