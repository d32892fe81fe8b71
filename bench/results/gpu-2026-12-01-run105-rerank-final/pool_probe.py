"""run105 probe: how long a tokenizer worker takes to answer one pair of 512 tokens, against this
process tokenizing one. Round trips (submit -> result) of: a tiny pair (the pipe and pickling alone),
one unseen pair to one worker, four unseen pairs to four workers at once (the hybrid's hand-over),
and this process's encode_pairs of one unseen pair; 8 workers as score makes them."""
import json, sys, time
from pathlib import Path
import numpy as np
from bench.gpu_rerank import QUERY, long_documents
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool

tok_file = Path(sys.argv[1]) / "tokenizer.json"
out = Path(sys.argv[3])
new = lambda: TextTokenizer(tok_file, 512)
docs = long_documents(Path(sys.argv[2]), new())
seen, unseen = docs[0::2], docs[1::2]
tok = new()
tok.encode_pairs([QUERY] * len(seen), seen)
res = {}
with TokenizerPool(tok, 8, pulled=True) as pool:
    pool.wait_for_workers()
    for f in [pool.submit_pairs([QUERY] * 2, seen[i:i + 2]) for i in range(0, len(seen) - 1, 2)]:
        f.result()
    it = iter(unseen * 4)
    def rt(n):
        times = []
        for _ in range(150):
            batch = [next(it) for _ in range(n)]
            t = time.perf_counter()
            fs = [pool.submit_pairs([QUERY], [d]) for d in batch]
            for f in fs:
                f.result()
            times.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.002)
        return times
    def tiny():
        times = []
        for _ in range(150):
            t = time.perf_counter(); pool.submit_pairs(["a"], ["b"]).result(); times.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.002)
        return times
    def here():
        times = []
        for _ in range(150):
            d = next(it); t = time.perf_counter(); tok.encode_pairs([QUERY], [d]); times.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.002)
        return times
    for rnd in range(2):
        for name, fn in (("tiny_pair_round_trip", tiny), ("one_pair_one_worker", lambda: rt(1)),
                         ("four_pairs_four_workers", lambda: rt(4)), ("one_pair_here", here)):
            t = np.array(fn())
            res[f"{name}_{rnd}"] = {"p50_ms": round(float(np.percentile(t, 50)), 3), "p90_ms": round(float(np.percentile(t, 90)), 3)}
            print(name, rnd, res[f"{name}_{rnd}"], flush=True)
# A fresh process like a worker (its cache warmed by an eighth of the seen documents), timing its own
# encode_pairs of one unseen pair: the worker's tokenizing without the pipe.
import subprocess
code = f"""
import time, numpy as np
from pathlib import Path
from bench.gpu_rerank import QUERY, long_documents
from pipelines.tokenize import TextTokenizer
tok = TextTokenizer(Path({str(tok_file)!r}), 512)
docs = long_documents(Path({sys.argv[2]!r}), tok)
seen, unseen = docs[0::2], docs[1::2]
tok.encode_pairs([QUERY] * len(seen[::8]), seen[::8])
for rnd in range(2):
    t = []
    for d in unseen[rnd * 150:(rnd + 1) * 150]:
        s = time.perf_counter(); tok.encode_pairs([QUERY], [d]); t.append((time.perf_counter() - s) * 1e3); time.sleep(0.002)
    print(rnd, round(float(np.percentile(t, 50)), 3), round(float(np.percentile(t, 90)), 3))
"""
fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print("fresh process, an eighth warm:", fresh.stdout, fresh.stderr[-500:], flush=True)
res["fresh_process_eighth_warm"] = fresh.stdout
out.write_text(json.dumps(res, indent=1))
