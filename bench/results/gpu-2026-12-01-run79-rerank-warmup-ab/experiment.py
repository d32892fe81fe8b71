"""Experiment (not committed): pair_scores on an engine warmed up at load against one capturing lazily."""
import json, sys, tempfile, time
from pathlib import Path
from bench.common import percentiles
from bench.gpu_rerank import long_documents, PAIRS, QUERY
from engine import Engine, EngineConfig
from pipelines import score
from pipelines.score import pair_scores
from pipelines.tokenize import TextTokenizer
from tests.models import BERT_BASE, save_random_model

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
path = save_random_model(Path(tempfile.mkdtemp()) / "ce", "BertForSequenceClassification", num_labels=1, **BERT_BASE)
started = time.perf_counter()
engines = {"warm": Engine.load(str(path), EngineConfig(warmup=True))}
print("warm load s", round(time.perf_counter() - started, 1), flush=True)
engines["lazy"] = Engine.load(str(path), EngineConfig())
tok = TextTokenizer(engines["warm"].files.tokenizer_file, engines["warm"].max_length)
words = tok._words
docs = long_documents(Path(".bench-data/docstrings.parquet"), tok, 50)
configs = {"words (default)": (True, score.PAIR_GROUP, score.EVEN_PAIR_GROUPS, score.QUEUED_STEPS),
           "library g16x4 flush-each (before)": (False, 16, 4, 10**9)}
results = []
for rnd in range(3):
    for name, engine in engines.items():
        for config, (use_words, group, even, queued) in configs.items():
            tok._words = words if use_words else None
            score.PAIR_GROUP, score.EVEN_PAIR_GROUPS, score.QUEUED_STEPS = group, even, queued
            row = {n: round(percentiles(lambda: pair_scores(engine, tok, [QUERY] * n, docs[:n]), 40)["p50_ms"], 2) for n in PAIRS}
            results.append({"round": rnd, "engine": name, "config": config, "p50_ms": row})
            print(rnd, name, config, row, flush=True)
print({name: vars(engine.stats) for name, engine in engines.items()})
(out / "results.json").write_text(json.dumps(results, indent=1))
