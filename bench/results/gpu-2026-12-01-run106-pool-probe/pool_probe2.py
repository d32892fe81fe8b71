"""run106 probe (run105's, with this process busy between calls instead of asleep, and a raw pipe ping-pong): how long a tokenizer worker takes to answer one pair of 512 tokens, against this
process tokenizing one. Round trips (submit -> result) of: a tiny pair (the pipe and pickling alone),
one unseen pair to one worker, four unseen pairs to four workers at once (the hybrid's hand-over),
and this process's encode_pairs of one unseen pair; 8 workers as score makes them."""
import json, sys, time
from pathlib import Path
import numpy as np

def busy(seconds):
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass
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
            busy(0.002)
        return times
    def tiny():
        times = []
        for _ in range(150):
            t = time.perf_counter(); pool.submit_pairs(["a"], ["b"]).result(); times.append((time.perf_counter() - t) * 1e3)
            busy(0.002)
        return times
    def here():
        times = []
        for _ in range(150):
            d = next(it); t = time.perf_counter(); tok.encode_pairs([QUERY], [d]); times.append((time.perf_counter() - t) * 1e3)
            busy(0.002)
        return times
    for rnd in range(2):
        for name, fn in (("tiny_pair_round_trip", tiny), ("one_pair_one_worker", lambda: rt(1)),
                         ("four_pairs_four_workers", lambda: rt(4)), ("one_pair_here", here)):
            t = np.array(fn())
            res[f"{name}_{rnd}"] = {"p50_ms": round(float(np.percentile(t, 50)), 3), "p90_ms": round(float(np.percentile(t, 90)), 3)}
            print(name, rnd, res[f"{name}_{rnd}"], flush=True)
# The floor: two processes handing 100 bytes back and forth through pipes, each polling as the pool does.
import os, select, subprocess
child = """
import os, select, sys
r, w = int(sys.argv[1]), int(sys.argv[2])
p = select.poll(); p.register(r, select.POLLIN)
while True:
    while not p.poll(0): pass
    d = os.read(r, 65536)
    if not d: break
    os.write(w, d)
"""
a_r, a_w = os.pipe(); b_r, b_w = os.pipe()
proc = subprocess.Popen([sys.executable, "-c", child, str(a_r), str(b_w)], pass_fds=(a_r, b_w))
os.close(a_r); os.close(b_w)
p = select.poll(); p.register(b_r, select.POLLIN)
t = []
for i in range(2000):
    s = time.perf_counter(); os.write(a_w, b"x" * 100)
    while not p.poll(0): pass
    os.read(b_r, 65536); t.append((time.perf_counter() - s) * 1e3)
    busy(0.0005)
os.close(a_w); proc.wait()
res["raw_ping_pong"] = {"p50_ms": round(float(np.percentile(t, 50)), 4), "p90_ms": round(float(np.percentile(t, 90)), 4)}
print("raw ping-pong", res["raw_ping_pong"], flush=True)
out.write_text(json.dumps(res, indent=1))
