"""run107: the tokenizer pool's round trip taken apart, in one process: each stage's Python for a tiny pair
and for one pair of 512 tokens, against the round trip through a worker (busy between calls)."""
import json, pickle, sys, time
from pathlib import Path
import numpy as np
from bench.gpu_rerank import QUERY, long_documents
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool, _encode, _frame, _Pulled, _unpack

tok = TextTokenizer(Path(sys.argv[1]) / "tokenizer.json", 512)
docs = long_documents(Path(sys.argv[2]), tok)
tok.encode_pairs([QUERY] * len(docs), docs)  # every document seen: the tokenizing itself is not what is timed
res = {}

def timed(name, fn, n=2000):
    t = []
    for _ in range(n):
        s = time.perf_counter(); fn(); t.append((time.perf_counter() - s) * 1e6)
    res[name] = round(float(np.percentile(t, 50)), 2)
    print(f"{name}: {res[name]} us", flush=True)

with TokenizerPool(tok, 8, pulled=True) as pool:
    pool.wait_for_workers()
    worker = pool._workers[0]
    for label, chunk in (("tiny", (["a"], ["b"])), ("pair", ([QUERY], [docs[0]]))):
        frame = pickle.dumps(chunk, pickle.HIGHEST_PROTOCOL)
        answer = pickle.dumps(_encode(tok, chunk), pickle.HIGHEST_PROTOCOL)
        timed(f"{label} main: in_workers + choose worker", lambda: min(pool._workers, key=lambda w: len(w.pending)) if pool.in_workers else None)
        timed(f"{label} main: future + pickle + frame", lambda: (_Pulled(worker), memoryview(_frame(pickle.dumps(chunk, pickle.HIGHEST_PROTOCOL)))))
        timed(f"{label} worker: unpickle", lambda: pickle.loads(frame))
        timed(f"{label} worker: _encode", lambda: _encode(tok, chunk), 500)
        timed(f"{label} worker: pickle answer", lambda: pickle.dumps(_encode.__wrapped__ if False else answer and pickle.loads(answer), pickle.HIGHEST_PROTOCOL))
        timed(f"{label} main: unpickle + _unpack", lambda: _unpack(*pickle.loads(answer)))
        def round_trip():
            pool.submit_pairs(*chunk).result()
            until = time.perf_counter() + 0.001
            while time.perf_counter() < until:
                pass
        timed(f"{label} round trip (+1 ms busy)", round_trip, 500)
        res[f"{label} round trip (+1 ms busy)"] = round(res[f"{label} round trip (+1 ms busy)"] - 1000, 2)
        def back_to_back():
            pool.submit_pairs(*chunk).result()
        timed(f"{label} round trip back to back", back_to_back, 500)
Path(sys.argv[3]).write_text(json.dumps(res, indent=1))
