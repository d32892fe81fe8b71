"""run81: where a 5 / 25 / 50-pair rerank spends its time on unseen documents; words against library,
QUEUED_STEPS 1 against 2; a timeline of host tokenize / step calls and each step's device end."""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
import pipelines.score as score
from bench.common import percentiles
from bench.gpu_rerank import QUERY, UnseenDocuments, long_documents
from engine import Engine, EngineConfig
from pipelines.tokenize import TextTokenizer
from tests.models import BERT_BASE, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **BERT_BASE)
engine = Engine.load(str(path), EngineConfig(warmup=True))
runner = engine.runner
file = engine.files.tokenizer_file
pool = long_documents(Path(".bench-data/docstrings.parquet"), TextTokenizer(file, engine.max_length))
print("budget", engine.max_batch_tokens, "lanes", len(runner.lanes), "docs", len(pool), flush=True)
log = []
t0 = [0.0]
start_ev = [None]
orig_step = engine.step

def step(batch):
    s = time.perf_counter(); st = vars(runner.stats).copy()
    lazy = orig_step(batch)
    e = time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True); ev.record(runner.lanes[runner.last_used].stream)
    d = {k: v - st[k] for k, v in vars(runner.stats).items() if k != "capture_seconds"}
    log.append(["step", round((s - t0[0]) * 1e3, 3), round((e - t0[0]) * 1e3, 3), batch.num_seqs, runner.last_used, d, ev])
    return lazy
engine.step = step

def traced(tok):
    orig = tok.encode_pairs
    def encode_pairs(a, b):
        s = time.perf_counter(); r = orig(a, b); e = time.perf_counter()
        log.append(["tok", round((s - t0[0]) * 1e3, 3), round((e - t0[0]) * 1e3, 3), len(a)])
        return r
    return encode_pairs

results = {}
for name, words, queued in (("words_q1", True, 1), ("library_q1", False, 1), ("words_q2", True, 2)):
    score.QUEUED_STEPS = queued
    for pairs in (5, 25, 50):
        queries = [QUERY] * pairs
        unseen = UnseenDocuments(pool, pairs, lambda: TextTokenizer(file, engine.max_length, by_words=words))
        stats0 = vars(runner.stats).copy()
        res = percentiles(lambda: score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts), 40, before=unseen.advance)
        res["graph_delta"] = {k: v - stats0[k] for k, v in vars(runner.stats).items()}
        timelines = []
        for _ in range(3):
            unseen.advance()
            tok = unseen.tokenizer
            tok.encode_pairs = traced(tok)
            log.clear()
            torch.cuda.synchronize()
            se = torch.cuda.Event(enable_timing=True); se.record(runner.lanes[0].stream)
            t0[0] = time.perf_counter()
            score.pair_scores(engine, tok, queries, unseen.texts)
            total = (time.perf_counter() - t0[0]) * 1e3
            torch.cuda.synchronize()
            del tok.encode_pairs
            rows = []
            for row in log:
                if row[0] == "step":
                    row = row[:-1] + [round(se.elapsed_time(row[-1]), 3)]
                rows.append(row)
            timelines.append({"total_ms": round(total, 3), "events": rows})
        res["timelines"] = timelines
        results[f"{name}/{pairs}"] = res
        print(name, pairs, json.dumps({k: v for k, v in res.items() if k != "timelines"}), flush=True)
        for tl in timelines[:2]:
            print("  ", tl["total_ms"], tl["events"], flush=True)
(out / "profile.json").write_text(json.dumps(results, indent=1))
