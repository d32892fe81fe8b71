"""The experiment of run33, as it ran (from the repo root, as bench/_exp_tokprocs.py): tokenization in-process threads vs worker processes."""
import json, os, resource, subprocess, sys, time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
import multiprocessing as mp
import numpy as np, pyarrow.parquet as pq
from pipelines.tokenize import TextTokenizer
TOK, CORPUS = sys.argv[1], sys.argv[2]
_tok = None
def init(threads):
    global _tok
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    _tok = TextTokenizer(TOK, 512)
def work(texts):
    e = _tok.encode(texts)
    lengths = np.fromiter((len(i) for i in e.ids), np.int32, len(e.ids))
    return np.concatenate(e.ids), lengths, e.truncated
def one(mode, procs, threads):
    texts = pq.read_table(CORPUS, columns=["text"]).column("text").to_pylist()
    texts = [t or "" for t in texts]
    chunks = [texts[i:i+1024] for i in range(0, len(texts), 1024)]
    n = 0
    if mode == "threads":
        init(threads); _tok.encode(chunks[0])
        cpu0 = time.process_time(); t = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            for e in pool.map(_tok.encode, chunks): n += sum(len(i) for i in e.ids)
    else:
        with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"), initializer=init, initargs=(threads,)) as pool:
            list(pool.map(work, [chunks[0]] * procs))
            cpu0 = time.process_time(); t = time.perf_counter()
            pending = deque()
            it = iter(chunks)
            def drain():
                nonlocal n
                flat, lengths, _ = pending.popleft().result()
                views = np.split(flat, np.cumsum(lengths)[:-1]); n += len(flat)
            for c in it:
                pending.append(pool.submit(work, c))
                if len(pending) >= 2 * procs: drain()
            while pending: drain()
    dt = time.perf_counter() - t
    return {"mode": mode, "procs": procs, "threads": threads, "tokens": n, "seconds": round(dt, 3),
            "tok_per_s": round(n / dt), "main_cpu_s": round(time.process_time() - cpu0, 3)}
if __name__ == "__main__":
    if len(sys.argv) > 3:
        print(json.dumps(one(sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))); sys.exit()
    cores = os.cpu_count()
    configs = [("threads", 1, cores), ("threads", 1, cores), ("procs", 2, cores // 2), ("procs", 4, cores // 4),
               ("procs", 8, max(1, cores // 8)), ("procs", cores, 1), ("procs", 4, cores // 2), ("procs", 8, max(1, cores // 4)),
               ("procs", 6, 2), ("procs", 12, 1)]
    for mode, p, t in configs:
        out = subprocess.run([sys.executable, "-m", "bench._exp_tokprocs", TOK, CORPUS, mode, str(p), str(t)],
                             capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-500:], flush=True)
