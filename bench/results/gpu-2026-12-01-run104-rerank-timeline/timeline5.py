"""run104: where a 5-pair rerank spends its time on unseen documents with the first pair tokenized here
and the other four by 8 workers (one pair each): p50 of that (hybrid), of the same but holding every pair
for one step (one_step), and in process, alternating two rounds; then traced calls of each: the hand-overs,
the groups' arrival in pair_scores, each step's host call and its end on the device."""
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
repeats = 3 if smoke else 60
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **shape)
engine = Engine.load(str(path), EngineConfig(warmup=not smoke, attention="varlen" if not smoke else "auto"))
runner = engine.runner
new_tokenizer = partial(TextTokenizer, engine.files.tokenizer_file, engine.max_length)
documents = long_documents(Path(sys.argv[2]), new_tokenizer())
log, t0 = [], [0.0]
now = lambda: round((time.perf_counter() - t0[0]) * 1e3, 3)
orig_step, orig_groups = engine.step, score._tokenized_groups

def traced_step(batch):
    s = now(); lazy = orig_step(batch); e = now()
    ev = None
    if not smoke:
        ev = torch.cuda.Event(enable_timing=True); ev.record(runner.lanes[runner.last_used].stream)
    log.append(["step", s, e, batch.num_seqs, ev])
    return lazy

def one_step_groups(*args):  # every group but the last says the next is at hand: one step at the end
    for encoded, next_ready in orig_groups(*args):
        yield encoded, (None if next_ready is None else True)

def traced(groups):
    def wrapped(*args):
        for i, item in enumerate(groups(*args)):
            log.append(["got", now(), i, len(item[0].ids), item[1]])
            yield item
    return wrapped

pairs = 5
queries = [QUERY] * pairs
encoded = new_tokenizer().encode_pairs(queries, documents[:pairs])
results = {"rounds": [], "timelines": {}}
with UnseenDocuments(documents, pairs, new_tokenizer, 8) as unseen, UnseenDocuments(documents, pairs, new_tokenizer) as here:
    call = lambda: score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=unseen.workers)
    for _ in range(2):
        res = {}
        score._tokenized_groups = orig_groups
        res["hybrid"] = percentiles(call, repeats, before=unseen.advance)
        score._tokenized_groups = one_step_groups
        res["one_step"] = percentiles(call, repeats, before=unseen.advance)
        score._tokenized_groups = orig_groups
        res["in_process"] = percentiles(lambda: score.pair_scores(engine, here.tokenizer, queries, here.texts), repeats, before=here.advance)
        res["model_only"] = percentiles(lambda: engine.embed(encoded.ids, encoded.type_ids), repeats)
        res = {k: {"p50_ms": round(v["p50_ms"], 3), "p99_ms": round(v["p99_ms"], 3)} for k, v in res.items()}
        results["rounds"].append(res)
        print(json.dumps(res), flush=True)
    engine.step = traced_step
    for name, groups in (("hybrid", orig_groups), ("one_step", one_step_groups)):
        score._tokenized_groups = traced(groups)
        timelines = []
        for _ in range(6):
            unseen.advance()
            pool = unseen.workers
            orig_submit = pool.submit_pairs
            def submit_pairs(a, b, orig_submit=orig_submit):
                log.append(["submit", now(), len(a)])
                return orig_submit(a, b)
            pool.submit_pairs = submit_pairs
            log.clear()
            if not smoke:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True); start.record(runner.lanes[0].stream)
            t0[0] = time.perf_counter()
            score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=pool)
            total = now()
            if not smoke:
                torch.cuda.synchronize()
            del pool.submit_pairs
            events = [row[:-1] + [round(start.elapsed_time(row[-1]), 3) if row[-1] is not None else None]
                      if row[0] == "step" else row for row in sorted(log, key=lambda row: row[1])]
            timelines.append({"total_ms": total, "events": events})
        results["timelines"][name] = timelines
        for timeline in timelines[2:5]:
            print(name, "total", timeline["total_ms"], flush=True)
            for event in timeline["events"]:
                print("   ", event, flush=True)
    engine.step, score._tokenized_groups = orig_step, orig_groups
results["graph_stats"] = vars(engine.stats)
(out / "timelines.json").write_text(json.dumps(results, indent=1))
