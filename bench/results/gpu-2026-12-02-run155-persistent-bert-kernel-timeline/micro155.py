"""run155: engine/small_batch.cu (a whole BERT in one persistent kernel for batches of at most 64 tokens) against the
per-operation path: correctness against the model in fp32 (per row cosine of the last hidden states) and time, each as a
CUDA graph of 20 forwards, MiniLM (real weights) and BERT-base (random weights), bf16."""
import copy, json, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch

from bench.common import checkpoints
from engine import Engine, EngineConfig, PackedBatch
from engine.attention import AttentionLayout, SdpaAttention
from engine.fused import Fused
from engine.graphs import seqlen_for, slots_for
from engine.small_batch import SMALL_BATCH_TOKENS

out_dir = Path(sys.argv[1]); out_dir.mkdir(parents=True, exist_ok=True)
results = {}
rng = np.random.default_rng(0)


def laid_out(lengths, tokens):
    batch = PackedBatch.of([rng.integers(1000, 29000, n).astype(np.int32) for n in lengths])
    slots = slots_for(batch.num_seqs, tokens, 512)
    host = np.zeros(4 * tokens + slots + 1, dtype=np.int32)
    batch.write_inputs(host, tokens, slots)
    inputs = torch.from_numpy(host).cuda()
    cu = host[4 * tokens:].tolist()
    return batch, inputs, slots, cu


def graph_us(fn, calls=20, rounds=20):
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
    return round(sorted(times)[len(times) // 2], 1)


with tempfile.TemporaryDirectory() as folder:
    for name, path in checkpoints(["minilm", "bert-base"], Path(".bundle/minilm"), Path(folder)).items():
        engine = Engine.load(str(path), EngineConfig())
        print(name, "small batch:", engine.small_batch_state, "attention", engine.attention_label, flush=True)
        row = results[name] = {"state": engine.small_batch_state}
        if engine.small_batch is None:
            continue
        model = engine.model
        reference = copy.deepcopy(model).float()
        reference.fused = Fused(compile=False)
        for lengths in ([16], [1], [5, 9], [7, 20, 30], [64], [13] * 4, [2] * 8):
            tokens = 64
            batch, inputs, slots, cu = laid_out(lengths, tokens)
            ids, positions, types, _ = inputs[: 4 * tokens].view(4, tokens)
            n = batch.num_tokens
            exact = SdpaAttention(); exact.plan(AttentionLayout(inputs[4 * tokens:], cu, max(lengths), tokens))
            with torch.inference_mode():
                expected = reference(ids.long(), positions.long(), types.long(), exact)[:n].float()
                ours = engine.small_batch(inputs, tokens, slots).float()
                attention = engine._make_attention(slots, 0)
                attention.plan(AttentionLayout(inputs[4 * tokens:], cu, seqlen_for(max(lengths), tokens, 512), tokens))
                per_op = model(ids, positions, types, attention)[:n].float()
            cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()
            entry = {"kernel_min_cos": round(cos(ours[:n], expected), 6), "per_op_min_cos": round(cos(per_op, expected), 6),
                     "padding_rows_zero": bool((ours[n:] == 0).all().item()),
                     "kernel_max_abs": round((ours[:n] - expected).abs().max().item(), 4),
                     "per_op_max_abs": round((per_op - expected).abs().max().item(), 4)}
            if lengths in ([16], [1], [64], [7, 20, 30]):
                with torch.inference_mode():
                    entry["kernel_us"] = graph_us(lambda: engine.small_batch(inputs, tokens, slots))
                    entry["per_op_us"] = graph_us(lambda: model(ids, positions, types, attention))
            if lengths in ([16], [1], [64]):
                layers = len(model.encoder.layer)
                stamps = torch.zeros(2 + 10 * layers, dtype=torch.int64, device="cuda")
                engine.small_batch.params.timeline = stamps.data_ptr()
                for _ in range(3):
                    engine.small_batch(inputs, tokens, slots)
                torch.cuda.synchronize()
                engine.small_batch.params.timeline = None
                t = stamps.cpu().numpy().astype(np.float64) / 1000.0  # us
                # per layer: A work, sync, attention, sync, C work, sync, E work, sync, F work, sync
                marks = t[1:-1].reshape(layers, 10)
                starts = np.concatenate([[t[0]], marks[:-1, 9]])
                parts = np.stack([marks[:, 0] - starts, marks[:, 1] - marks[:, 0], marks[:, 2] - marks[:, 1],
                                  marks[:, 3] - marks[:, 2], marks[:, 4] - marks[:, 3], marks[:, 5] - marks[:, 4],
                                  marks[:, 6] - marks[:, 5], marks[:, 7] - marks[:, 6], marks[:, 8] - marks[:, 7],
                                  marks[:, 9] - marks[:, 8]], axis=1)
                names = ["qkv", "sync1", "attend", "sync2", "out", "sync3", "up", "sync4", "down", "sync5"]
                entry["timeline_us_mean_per_layer"] = dict(zip(names, np.round(parts[1:].mean(axis=0) if layers > 1 else parts[0], 2).tolist()))
                entry["timeline_total_us"] = round(t[-1] - t[0], 1)
                entry["timeline_first_layer"] = dict(zip(names, np.round(parts[0], 2).tolist()))
                entry["timeline_final_us"] = round(t[-1] - marks[-1, 9], 2)
            row[str(lengths)] = entry
            print(name, lengths, entry, flush=True)
        del engine, model, reference
        torch.cuda.empty_cache()
(out_dir / "micro155.json").write_text(json.dumps(results, indent=2))
