"""run138: where the time of the two nearest misses goes now, kernel by kernel.

Qwen3-0.6B's shape, one 4,096-token input (issue 7: 10.78 ms against 10), and BERT-base's cross-encoder shape
with 5 pairs of 512 tokens (issue 5's model part: 1.31 of 2.24 ms against 2). Each engine at its defaults (auto
attention: FlashInfer where installed), the batch's graph captured, then: p50 of step + result with the device
drained (300 calls), and three replays under torch.profiler: every kernel name's count and GPU time per step,
the step's GPU span and idle time. Writes profile138.json and profile138.md to the folder given.
"""
from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import gpu_span_and_idle_us, percentiles
from engine import Engine, EngineConfig, PackedBatch
from tests.models import BERT_BASE, save_random_model
from tests.test_qwen3 import QWEN3_06B, save_random_qwen3


def measure(engine: Engine, batch: PackedBatch, steps: int = 3) -> dict:
    for _ in range(5):
        engine.step(batch).result()
    timing = percentiles(lambda: (engine.step(batch).result(), torch.cuda.synchronize()), 300)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            engine.step(batch).result()
            torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:140]][0] += 1
            kernels[event.name[:140]][1] += event.time_range.end - event.time_range.start
    span, idle = gpu_span_and_idle_us(trace)
    rows = sorted(([name, count / steps, total / steps] for name, (count, total) in kernels.items()), key=lambda r: -r[2])
    return {"p50_ms": timing["p50_ms"], "p99_ms": timing["p99_ms"], "kernels_per_step": sum(r[1] for r in rows),
            "kernel_us_per_step": sum(r[2] for r in rows), "span_us_3_steps": span, "idle_us_3_steps": idle,
            "kernels": rows}


def main() -> None:
    out = Path(sys.argv[1])
    folder = Path(tempfile.mkdtemp(prefix="embedctl-profile-"))
    rng = np.random.default_rng(0)
    results = {}
    qwen = Engine.load(str(save_random_qwen3(folder / "qwen3", device="cuda", **QWEN3_06B)), EngineConfig())
    results["qwen3-0.6b 1 x 4096"] = measure(qwen, PackedBatch.of([rng.integers(1000, 29000, 4096).astype(np.int32)]))
    results["qwen3-0.6b attention"] = qwen.attention_label
    del qwen
    torch.cuda.empty_cache()
    cross = Engine.load(str(save_random_model(folder / "cross", "BertForSequenceClassification", num_labels=1,
                                              **BERT_BASE)), EngineConfig())
    pairs = [rng.integers(1000, 29000, 512).astype(np.int32) for _ in range(5)]
    types = [np.repeat(np.array([0, 1], dtype=np.int32), [40, 472]) for _ in range(5)]
    results["cross-encoder 5 x 512"] = measure(cross, PackedBatch.of(pairs, token_type_ids=types))
    results["cross-encoder attention"] = cross.attention_label
    (out / "profile138.json").write_text(json.dumps(results, indent=1))
    lines = []
    for name, result in results.items():
        if isinstance(result, str):
            lines.append(f"{name}: {result}")
            continue
        lines += [f"## {name}: p50 {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f}; per step "
                  f"{result['kernels_per_step']:.0f} kernels, {result['kernel_us_per_step']:.0f} us; 3 steps: span "
                  f"{result['span_us_3_steps']:.0f} us, idle {result['idle_us_3_steps']:.0f}", "",
                  "| kernel | per step | us per step |", "|---|---|---|"]
        lines += [f"| {n} | {c:.0f} | {t:.1f} |" for n, c, t in result["kernels"][:30]]
        lines.append("")
    (out / "profile138.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
