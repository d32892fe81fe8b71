"""run108: a 5-pair rerank on unseen documents, alternating: the tree (first pair here, the other four's
documents in pieces over the workers), the last session's hybrid (first pair here, one pair per worker),
all five in pieces (one step), all in process, and the model alone; then timelines of the tree and the
hybrid: hand-overs, groups' arrival in pair_scores, each step's host call and its end on the device."""
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
processes = 2 if smoke else 8
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **shape)
engine = Engine.load(str(path), EngineConfig(warmup=not smoke))
runner = engine.runner
new_tokenizer = partial(TextTokenizer, engine.files.tokenizer_file, engine.max_length)
documents = long_documents(Path(sys.argv[2]), new_tokenizer())
log, t0 = [], [0.0]
now = lambda: round((time.perf_counter() - t0[0]) * 1e3, 3)
orig_step, tree_groups = engine.step, score._tokenized_groups


def hybrid_groups(tokenizer, pool, firsts, seconds):  # 8c0bb2c's: one pair per worker
    futures = [pool.submit_pairs(firsts[i:i + 1], seconds[i:i + 1]) for i in range(1, len(firsts))]
    yield tokenizer.encode_pairs(firsts[:1], seconds[:1]), futures[0].done()
    for index, future in enumerate(futures):
        yield future.result(), futures[index + 1].done() if index + 1 < len(futures) else None


def all_pieces_groups(tokenizer, pool, firsts, seconds):  # every pair in pieces, one step
    planned = tokenizer.pair_pieces(firsts, seconds, parts=pool.processes)
    pieces = [pool.submit_pieces([piece]) for piece in planned.pieces]
    whole = pool.submit_pairs([firsts[i] for i in planned.whole], [seconds[i] for i in planned.whole]) if planned.whole else None
    yield tokenizer.assemble_pairs(planned, [future.result().ids[0] for future in pieces],
                                   whole.result() if whole else None), None


def traced_step(batch):
    s = now(); lazy = orig_step(batch); e = now()
    ev = None
    if not smoke:
        ev = torch.cuda.Event(enable_timing=True); ev.record(runner.lanes[runner.last_used].stream)
    log.append(["step", s, e, batch.num_seqs, ev])
    return lazy


def traced(groups):
    def wrapped(*args):
        for i, item in enumerate(groups(*args)):
            log.append(["got", now(), i, len(item[0].ids), item[1]])
            yield item
    return wrapped


pairs = 5
queries = [QUERY] * pairs
encoded = new_tokenizer().encode_pairs(queries, documents[:pairs])
arms = {"tree": tree_groups, "hybrid": hybrid_groups, "all_pieces": all_pieces_groups}
results = {"rounds": [], "timelines": {}, "processes": processes}
with UnseenDocuments(documents, pairs, new_tokenizer, processes) as unseen, \
        UnseenDocuments(documents, pairs, new_tokenizer) as here:
    call = lambda: score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=unseen.workers)
    unseen.advance()
    planned = unseen.tokenizer.pair_pieces(queries[1:], unseen.texts[1:], parts=processes)
    results["pieces_chars"] = [len(piece) for piece in planned.pieces]
    print("pieces", results["pieces_chars"], "whole", planned.whole, flush=True)
    for _ in range(2):
        res = {}
        for name, groups in arms.items():
            score._tokenized_groups = groups if name == "tree" else (lambda g: lambda t, p, f, s: g(t, p, f, s))(groups)
            res[name] = percentiles(call, repeats, before=unseen.advance)
        score._tokenized_groups = tree_groups
        res["in_process"] = percentiles(lambda: score.pair_scores(engine, here.tokenizer, queries, here.texts), repeats, before=here.advance)
        res["model_only"] = percentiles(lambda: engine.embed(encoded.ids, encoded.type_ids), repeats)
        res = {k: {"p50_ms": round(v["p50_ms"], 3), "p99_ms": round(v["p99_ms"], 3)} for k, v in res.items()}
        results["rounds"].append(res)
        print(json.dumps(res), flush=True)
    engine.step = traced_step
    for name in ("tree", "hybrid"):
        score._tokenized_groups = traced(arms[name])
        timelines = []
        for _ in range(8):
            unseen.advance()
            pool = unseen.workers
            for kind in ("submit_pairs", "submit_pieces"):
                orig = getattr(pool, kind)
                def submit(*a, orig=orig, kind=kind):
                    log.append(["submit", now(), kind, len(a[0])])
                    return orig(*a)
                setattr(pool, kind, submit)
            log.clear()
            if not smoke:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True); start.record(runner.lanes[0].stream)
            t0[0] = time.perf_counter()
            score.pair_scores(engine, unseen.tokenizer, queries, unseen.texts, pool=pool)
            total = now()
            if not smoke:
                torch.cuda.synchronize()
            del pool.submit_pairs, pool.submit_pieces
            events = [row[:-1] + [round(start.elapsed_time(row[-1]), 3) if row[-1] is not None else None]
                      if row[0] == "step" else row for row in sorted(log, key=lambda row: row[1])]
            timelines.append({"total_ms": total, "events": events})
        results["timelines"][name] = timelines
        for timeline in timelines[3:6]:
            print(name, "total", timeline["total_ms"], flush=True)
            for event in timeline["events"]:
                print("   ", event, flush=True)
    engine.step, score._tokenized_groups = orig_step, tree_groups
results["graph_stats"] = vars(engine.stats)
(out / "timelines.json").write_text(json.dumps(results, indent=1))
