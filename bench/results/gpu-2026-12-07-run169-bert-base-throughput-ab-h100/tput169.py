"""run169: is BERT-base's model-only throughput (2.54-2.58M tok/s since run115, 2.87M in run42 on b25fad4) lower
because of the engine's changes since b25fad4, or the machine? And does a 64 MiB cuBLASLt workspace help? The same ids, model and GPU through both engines,
in processes of their own, alternating; each arm also profiles ten 16,384-token steps by kernel.
    python3 .ab/tput169.py CORPUS MODEL_DIR OUT   (arms: the repo root, .ab/b25fad4 = git archive b25fad4 engine)
"""
import itertools, json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ARM = r'''
import json, sys, time
import numpy as np, torch
from engine import Engine, EngineConfig, PackedBatch
data = np.load(sys.argv[1])
ids = np.split(data["flat"], np.cumsum(data["lengths"])[:-1])
tokens = int(data["lengths"].sum())
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
out = {}
for attention in sys.argv[3].split(","):
    engine = Engine.load(sys.argv[2], EngineConfig(attention=attention, max_length=512, lanes=3))
    def timed():
        sync(); started = time.perf_counter(); engine.embed(ids); sync()
        return time.perf_counter() - started
    first = timed()
    passes = [tokens / timed() for _ in range(3)]
    row = {"first": tokens / first, "passes": passes, "best": max(passes)}
    if sys.argv[4] == "profile":
        picked, total, index = [], 0, 0
        while total < 16384:
            seq = ids[index % len(ids)][: 16384 - total]; picked.append(seq); total += len(seq); index += 1
        batch = PackedBatch.of(picked)
        for _ in range(4):
            engine.step(batch).result()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            for _ in range(10):
                engine.step(batch).result()
        events = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        row["kernel_us_per_step"] = round(sum(e.self_device_time_total for e in events) / 10)
        row["kernels"] = [(e.key[:90], e.count // 10, round(e.self_device_time_total / 10))
                          for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]]
    out[attention] = row
    print(sys.argv[5], attention, json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    del engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
print("RESULT " + json.dumps(out), flush=True)
'''


def main() -> None:
    corpus, model, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, os.getcwd())
    from pipelines.tokenize import TextTokenizer
    texts = list(itertools.islice(itertools.cycle(pq.read_table(corpus, columns=["text"]).column("text").to_pylist()), int(os.environ.get("DOCS", 10_000))))
    ids = TextTokenizer(Path(model) / "tokenizer.json", 512).encode(texts).ids
    np.savez(out / "ids.npz", flat=np.concatenate(ids).astype(np.int32), lengths=np.array([len(s) for s in ids]))
    print("tokens", sum(map(len, ids)), flush=True)
    # head+lt64: cuBLASLt (the GELU epilogue's GEMM) given a 64 MiB workspace, in case a larger one admits faster kernels
    arms = {"head": (os.getcwd(), {}), "b25fad4": (str(Path(".ab/b25fad4").resolve()), {}),
            "head+lt64": (os.getcwd(), {"CUBLASLT_WORKSPACE_SIZE": "65536"})}
    results = {}
    for round_, order in enumerate([["head", "b25fad4", "head+lt64"], ["head+lt64", "b25fad4", "head"]]):
        for arm in order:
            root, extra = arms[arm]
            env = dict(os.environ, PYTHONPATH=root + ":" + os.environ.get("PYTHONPATH", ""), **extra)
            try:
                done = subprocess.run([sys.executable, "-c", ARM, str(out / "ids.npz"), model,
                                       os.environ.get("ATTENTION", "varlen,flashinfer"),
                                       "profile" if round_ == 0 else "no", f"{arm}/{round_}"],
                                      env=env, cwd=root, capture_output=True, text=True, timeout=150)
            except subprocess.TimeoutExpired as expired:
                print(arm, round_, "timed out:", (expired.stdout or b"")[-3000:], flush=True)
                continue
            lines = done.stdout.splitlines()
            print("\n".join(l for l in lines if not l.startswith("RESULT")), flush=True)
            if done.returncode:
                print(arm, "failed:", done.stderr[-2000:], flush=True)
            results[f"{arm}/{round_}"] = next((json.loads(l[7:]) for l in lines if l.startswith("RESULT")), None)
            (out / "results.json").write_text(json.dumps(results, indent=1))


main()
