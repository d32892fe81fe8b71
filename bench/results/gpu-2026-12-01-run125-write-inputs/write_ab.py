"""run125: PackedBatch.write_inputs in fewer numpy calls (the working tree) against 398695e's, and Engine.step
entered through torch's C++ inference-mode guard instead of the decorator, alternating on one
engine in one process: batch-1 step().result() p50 for MiniLM (real weights) at 16 / 128 tokens, and the
call alone on this host."""
import json, sys, time
from pathlib import Path
import numpy as np
import torch
from engine import Engine, EngineConfig, PackedBatch


def old_write_inputs(self, out, tokens, slots):  # 398695e's
    n, seqs = self.num_tokens, self.num_seqs
    lengths = np.diff(self.cu_seqlens)
    rows = out[: 4 * tokens].reshape(4, tokens)
    rows[:, n:] = 0
    rows[0, :n] = self.input_ids
    rows[1, :n] = np.arange(n, dtype=np.int32) - np.repeat(self.cu_seqlens[:-1], lengths)
    rows[2, :n] = self.token_type_ids
    rows[3, :n] = np.repeat(np.arange(seqs, dtype=np.int32), lengths)
    rows[3, n:] = slots
    cu_seqlens = out[4 * tokens: 4 * tokens + slots + 1]
    cu_seqlens[: seqs + 1] = self.cu_seqlens
    cu_seqlens[seqs + 1:] = n


new_write_inputs = PackedBatch.write_inputs
decorated_step = Engine.step
raw_step = Engine.step.__wrapped__


def guarded_step(self, batch):  # the same inference mode through torch's C++ guard, without the decorator's Python
    with torch._C._InferenceMode(True):
        return raw_step(self, batch)


ARMS = {"old": (old_write_inputs, decorated_step), "new": (new_write_inputs, decorated_step),
        "new+guard": (new_write_inputs, guarded_step)}
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
engine = Engine.load(".bundle/minilm", EngineConfig(warmup=False, max_length=512))
results = {}
for length in (16, 128):
    batch = PackedBatch.of([np.arange(1000, 1000 + length, dtype=np.int32)])
    host = np.empty(4 * 16384 + 513, dtype=np.int32)
    rounds = {arm: [] for arm in ARMS}
    calls = {arm: [] for arm in ARMS}
    for _ in range(5):
        for arm, (fn, step) in ARMS.items():
            PackedBatch.write_inputs, Engine.step = fn, step
            for _ in range(30):
                engine.step(batch).result()
            times = []
            for _ in range(300):
                torch.cuda.synchronize()
                s = time.perf_counter(); engine.step(batch).result(); times.append((time.perf_counter() - s) * 1e6)
            rounds[arm].append(round(float(np.percentile(times, 50)), 1))
            s = time.perf_counter()
            for _ in range(2000):
                fn(batch, host, 64 if length == 16 else 128, 1)
            calls[arm].append(round((time.perf_counter() - s) / 2000 * 1e6, 2))
    results[f"minilm 1x{length}"] = {"step_p50_us": rounds, "write_inputs_us": calls}
    print(length, json.dumps(results[f"minilm 1x{length}"]), flush=True)
(out / "write_ab.json").write_text(json.dumps(results, indent=1))
