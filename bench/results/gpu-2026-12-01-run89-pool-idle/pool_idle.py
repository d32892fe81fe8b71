"""run89: why a tokenizer worker answers a 2-pair group in 1.3-1.8 ms when this process tokenizes one
in 0.3-0.4: the same groups of unseen pairs timed in this process and through one worker, each
after 10 ms idle and back to back."""
import json, statistics, sys, time
from functools import partial
from pathlib import Path
from bench.gpu_rerank import QUERY, long_documents
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool
from tests.models import minilm_path

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
file = minilm_path() / "tokenizer.json"
new = partial(TextTokenizer, file, 512)
documents = long_documents(Path(sys.argv[2]), new())
seen, unseen = documents[0::2], documents[1::2]
groups = [unseen[i:i + 2] for i in range(0, len(unseen) - 1, 2)]
print("documents", len(documents), "groups", len(groups), flush=True)
here = new(); here.encode_pairs([QUERY] * len(seen), seen)
results = {}

def timed(run, idle):
    times = []
    for group in groups[:60]:
        if idle:
            time.sleep(idle)
        start = time.perf_counter(); run(group); times.append((time.perf_counter() - start) * 1e3)
    return {"p50": round(statistics.median(times), 3), "p10": round(sorted(times)[len(times) // 10], 3), "max": round(max(times), 3)}

results["in_process_hot"] = timed(lambda g: here.encode_pairs([QUERY] * 2, g), 0)
here = new(); here.encode_pairs([QUERY] * len(seen), seen)
results["in_process_after_10ms_idle"] = timed(lambda g: here.encode_pairs([QUERY] * 2, g), 0.01)
for processes in (1, 8):
    for idle in (0, 0.01):
        with TokenizerPool(new(), processes) as pool:
            pool.wait_for_workers()
            for future in [pool.submit_pairs([QUERY] * 2, seen[i:i + 2]) for i in range(0, len(seen) - 1, 2)]:
                future.result()
            results[f"{processes}_workers_idle_{idle}"] = timed(lambda g: pool.submit_pairs([QUERY] * 2, g).result(), idle)
    print(json.dumps(results), flush=True)
# a worker kept busy: a second chunk in its queue while the first is timed
with TokenizerPool(new(), 1) as pool:
    pool.wait_for_workers()
    for future in [pool.submit_pairs([QUERY] * 2, seen[i:i + 2]) for i in range(0, len(seen) - 1, 2)]:
        future.result()
    times = []
    for a, b in zip(groups[:60:2], groups[1:60:2]):
        time.sleep(0.01)
        start = time.perf_counter(); first = pool.submit_pairs([QUERY] * 2, a); second = pool.submit_pairs([QUERY] * 2, b)
        first.result(); t1 = time.perf_counter(); second.result(); t2 = time.perf_counter()
        times.append(((t1 - start) * 1e3, (t2 - t1) * 1e3))
    results["1_worker_two_queued_after_idle"] = {"first_p50": round(statistics.median(t for t, _ in times), 3),
                                                 "second_after_first_p50": round(statistics.median(t for _, t in times), 3)}
print(json.dumps(results, indent=1), flush=True)
(out / "results.json").write_text(json.dumps(results, indent=1))
