"""run139: what the 0.8 ms (Qwen3-0.6B, 1 x 4,096 tokens) and 0.4 ms (BERT-base cross-encoder, 5 x 512) of a step
that are not kernels (run138) are made of.

Per model, after the batch's graph is captured: p50 of step + result with the device drained (as the suites time
it); p50 of the lane's captured graph replayed alone and drained (no staging, plan or readback: the host's launch
and the graph's own kernels and gaps); and one step under torch.profiler, its GPU span from the input copy to the
readback and the idle time inside it. So: step - replay is the host's work around the graph, replay - kernels the
launch and the gaps between kernels. Run once as it is and once with CUBLAS_WORKSPACE_CONFIG=:0:0 (cuBLAS without a
workspace: no memset before the coopA GEMMs, 55 in a Qwen3 step), each in a process of its own. The cross-encoder also
with attention=triton (no FlashInfer plan on the host).
Writes split139.json to the folder given.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def measure(engine, batch) -> dict:  # noqa: ANN001 - engine.Engine and PackedBatch, imported in the child
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import gpu_span_and_idle_us, percentiles

    for _ in range(5):
        engine.step(batch).result()
    step = percentiles(lambda: (engine.step(batch).result(), torch.cuda.synchronize()), 300)
    lane = engine.runner.lanes[0]
    graphs = [g.graph for g in lane.graphs.values() if g.graph is not None]
    assert len(graphs) == 1, f"{len(graphs)} graphs on lane 0"
    replay = percentiles(lambda: (graphs[0].replay(), torch.cuda.synchronize()), 300)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        engine.step(batch).result()
        torch.cuda.synchronize()
    span, idle = gpu_span_and_idle_us(trace)
    kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    return {"step_p50_ms": step["p50_ms"], "replay_p50_ms": replay["p50_ms"], "profiled_span_us": span,
            "profiled_idle_us": idle, "profiled_busy_us": busy, "gpu_ops": len(kernels)}


def child(folder: Path) -> None:
    from engine import Engine, EngineConfig, PackedBatch
    from tests.models import BERT_BASE, save_random_model
    from tests.test_qwen3 import QWEN3_06B, save_random_qwen3

    rng = np.random.default_rng(0)
    qwen_path, cross_path = folder / "qwen3", folder / "cross"
    if not qwen_path.exists():
        save_random_qwen3(qwen_path, device="cuda", **QWEN3_06B)
        save_random_model(cross_path, "BertForSequenceClassification", num_labels=1, **BERT_BASE)
    out = {}
    qwen = Engine.load(str(qwen_path), EngineConfig())
    out["qwen3 1 x 4096"] = measure(qwen, PackedBatch.of([rng.integers(1000, 29000, 4096).astype(np.int32)]))
    del qwen
    cross = Engine.load(str(cross_path), EngineConfig())
    pairs = [rng.integers(1000, 29000, 512).astype(np.int32) for _ in range(5)]
    types = [np.repeat(np.array([0, 1], dtype=np.int32), [40, 472]) for _ in range(5)]
    out["cross-encoder 5 x 512"] = measure(cross, PackedBatch.of(pairs, token_type_ids=types))
    del cross
    triton = Engine.load(str(cross_path), EngineConfig(attention="triton"))
    out["cross-encoder 5 x 512, triton"] = measure(triton, PackedBatch.of(pairs, token_type_ids=types))
    print(json.dumps(out), flush=True)


def main() -> None:
    if sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
        return
    out = Path(sys.argv[1])
    folder = Path(tempfile.mkdtemp(prefix="embedctl-split-"))
    arms = {"as it is": {}, "no cuBLAS workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}}
    rounds = []
    for round_index in range(1):
        for arm, extra in arms.items():
            result = subprocess.run([sys.executable, __file__, "--child", str(folder)], capture_output=True, text=True,
                                    env={**os.environ, **extra})
            if result.returncode != 0:
                print(f"{arm} failed:\n{result.stderr[-3000:]}", flush=True)
                continue
            row = {"arm": arm, "round": round_index, **json.loads(result.stdout.strip().splitlines()[-1])}
            rounds.append(row)
            print(json.dumps(row), flush=True)
    (out / "split139.json").write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
