"""Experiment (not committed): pair_scores under several pair schedules, one process, 5/25/50 pairs."""
import json, os, sys, tempfile, time
from pathlib import Path
import torch
from bench.common import percentiles
from bench.gpu_rerank import long_documents, PAIRS, QUERY
from engine import Engine, EngineConfig
from pipelines import score
from pipelines.score import pair_scores
from pipelines.tokenize import TextTokenizer
from tests.models import BERT_BASE, SMALL_BERT, save_random_model
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:
    PAIRS = (5,)

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **(SMALL_BERT if SMOKE else BERT_BASE))
engine = Engine.load(str(path), EngineConfig())
tok = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
words = tok._words
docs = long_documents(Path(".bench-data/docstrings.parquet"), tok, 50)
ALWAYS = 10**9
variants = {  # name: (words, PAIR_GROUP, EVEN_PAIR_GROUPS, QUEUED_STEPS)
    "library g16x4 flush-each (before)": (False, 16, 4, ALWAYS),
    "words g2x4 queued<2": (True, 2, 4, 2),
    "words g2x4 queued<1 (default)": (True, 2, 4, 1),
    "words g2x16 queued<1": (True, 2, 16, 1),
    "words g1x32 queued<1": (True, 1, 32, 1),
    "words g4x8 queued<1": (True, 4, 8, 1),
}
results = {}
for rnd in range(3):
    for name, (use_words, group, even, queued) in variants.items():
        tok._words = words if use_words else None
        score.PAIR_GROUP, score.EVEN_PAIR_GROUPS, score.QUEUED_STEPS = group, even, queued
        row = {}
        for n in PAIRS:
            q, t = [QUERY] * n, docs[:n]
            row[n] = round(percentiles(lambda: pair_scores(engine, tok, q, t), 2 if SMOKE else 40)["p50_ms"], 2)
        results.setdefault(name, []).append(row)
        print(rnd, name, row, flush=True)
print(json.dumps(vars(engine.stats)))
(out / "results.json").write_text(json.dumps(results, indent=1))
