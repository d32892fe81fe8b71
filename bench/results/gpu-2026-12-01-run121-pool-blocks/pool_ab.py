"""run121: pool_normalize against engine.pooling's torch ops, alternating in one process on one engine per arm:
batch-1 step().result() p50 at 16 / 128 / 512 tokens (MiniLM real weights; BERT-base random, mean pooling) and
MiniLM model-only tokens/s on the corpus (Engine.embed), rounds alternating."""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
import pyarrow.parquet as pq
import torch
import embedctl
from engine import Engine, EngineConfig, PackedBatch
from tests.models import BERT_BASE, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
corpus = sys.argv[2]
results = {}
texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()[:10000]
ids = embedctl.load(".bundle/minilm").tokenizer.encode(texts).ids


def p50(engine, batch, n=300):
    for _ in range(20):
        engine.step(batch).result()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        s = time.perf_counter(); engine.step(batch).result(); times.append((time.perf_counter() - s) * 1e6)
    return float(np.percentile(times, 50))


models = {"minilm": ".bundle/minilm",
          "bert-base": str(save_random_model(Path(tempfile.mkdtemp()) / "bert", "BertModel", pooling="mean", normalize=True, **BERT_BASE))}
for name, path in models.items():
    arms = {"kernel": Engine.load(path, EngineConfig(warmup=False)), "torch": Engine.load(path, EngineConfig(warmup=False))}
    arms["torch"].pool_kernel = False
    assert arms["kernel"].pool_kernel
    for length in (16, 128, 512):
        batch = PackedBatch.of([np.arange(1000, 1000 + length, dtype=np.int32)])
        a, b = arms["kernel"].step(batch).result(), arms["torch"].step(batch).result()
        rounds = {arm: [] for arm in arms}
        for _ in range(4):
            for arm, engine in arms.items():
                rounds[arm].append(round(p50(engine, batch), 1))
        results[f"{name} 1x{length}"] = {**rounds, "max_abs_diff": float(np.abs(a - b).max())}
        print(name, length, rounds, flush=True)
    tokens = sum(map(len, ids))
    rates = {arm: [] for arm in arms}
    for engine in arms.values():
        engine.embed(ids); engine.embed(ids)  # captures
    for _ in range(3):
        for arm, engine in arms.items():
            torch.cuda.synchronize(); s = time.perf_counter(); engine.embed(ids); torch.cuda.synchronize()
            rates[arm].append(round(tokens / (time.perf_counter() - s) / 1e6, 3))
    results[f"{name} model-only Mtok/s"] = rates
    print("throughput", rates, flush=True)
    del arms
    torch.cuda.empty_cache()
(out / "pool_ab.json").write_text(json.dumps(results, indent=1))
