"""run88: where a 25 / 50-pair rerank through 8 tokenizer workers spends its time on unseen documents,
under CPython's 5 ms GIL switch interval and under 0.2 ms: p50 of the pool path and of the
in-process path, then traced calls: each group's hand-over, its answer (the reader thread's callback),
its use by pair_scores, and each step's host call and device end."""
import json, sys, tempfile, time
from functools import partial
from pathlib import Path
import torch
import pipelines.score as score
from bench.common import percentiles
from bench.gpu_rerank import QUERY, UnseenDocuments, long_documents
from engine import Engine, EngineConfig
from pipelines.tokenize import TextTokenizer
from tests.models import BERT_BASE, SMALL_BERT, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
smoke = not torch.cuda.is_available()
shape = SMALL_BERT if smoke else BERT_BASE
repeats = 3 if smoke else 40
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **shape)
engine = Engine.load(str(path), EngineConfig(warmup=not smoke))
runner = engine.runner
file = engine.files.tokenizer_file
new_tokenizer = partial(TextTokenizer, file, engine.max_length)
documents = long_documents(Path(sys.argv[2]), new_tokenizer())
log, t0 = [], [0.0]
now = lambda: round((time.perf_counter() - t0[0]) * 1e3, 3)
orig_step = engine.step

def step(batch):
    s = now(); lazy = orig_step(batch); e = now()
    if torch.cuda.is_available():
        ev = torch.cuda.Event(enable_timing=True); ev.record(runner.lanes[runner.last_used].stream)
    else:
        ev = None
    log.append(["step", s, e, batch.num_seqs, ev])
    return lazy

orig_groups = score._tokenized_groups

def groups(*args):
    for i, item in enumerate(orig_groups(*args)):
        log.append(["got", now(), i, len(item[0].ids), item[1]])
        yield item

results = {}
for interval in (0.005, 0.0002):
    sys.setswitchinterval(interval)
    for pairs in (25, 50):
        queries = [QUERY] * pairs
        with UnseenDocuments(documents, pairs, new_tokenizer, 8) as unseen, \
                UnseenDocuments(documents, pairs, new_tokenizer) as here:
            res = {"pool": percentiles(lambda: score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=unseen.workers), repeats, before=unseen.advance),
                   "in_process": percentiles(lambda: score.pair_scores(engine, here.tokenizer, queries, here.texts), repeats, before=here.advance)}
            timelines = []
            engine.step, score._tokenized_groups = step, groups
            for _ in range(4):
                unseen.advance()
                pool = unseen.workers
                orig_submit = pool.submit_pairs
                def submit_pairs(a, b, orig_submit=orig_submit):
                    index = sum(1 for row in log if row[0] == "submit")
                    log.append(["submit", now(), index, len(a)])
                    future = orig_submit(a, b)
                    future.add_done_callback(lambda _, index=index: log.append(["answered", now(), index]))
                    return future
                pool.submit_pairs = submit_pairs
                log.clear()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    start = torch.cuda.Event(enable_timing=True); start.record(runner.lanes[0].stream)
                t0[0] = time.perf_counter()
                score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=pool)
                total = now()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                del pool.submit_pairs
                events = [row[:-1] + [round(start.elapsed_time(row[-1]), 3) if row[-1] is not None else None]
                          if row[0] == "step" else row for row in sorted(log, key=lambda row: row[1])]
                timelines.append({"total_ms": total, "events": events})
            engine.step, score._tokenized_groups = orig_step, orig_groups
        res["timelines"] = timelines
        results[f"{interval}/{pairs}"] = res
        print(interval, pairs, json.dumps({k: v for k, v in res.items() if k != "timelines"}), flush=True)
        for timeline in timelines[1:3]:
            print("  total", timeline["total_ms"], flush=True)
            for event in timeline["events"]:
                print("   ", event, flush=True)
(out / "timelines.json").write_text(json.dumps(results, indent=1))
