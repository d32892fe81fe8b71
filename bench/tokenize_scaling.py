"""How tokenization scales with CPU threads on this host: the ceiling of every end-to-end figure.

  texts   TextTokenizer.encode over corpus documents in chunks of 1,024 (what `embedctl index` does),
          with the Rust thread pool limited to 1, 2, 4, ... cores: tokens/s
  pairs   TextTokenizer.encode_pairs for 5, 25 and 50 (query, document) pairs of 512 tokens (the
          cross-encoder suite's inputs), the same documents every call and documents not seen before
          (bench.gpu_rerank.UnseenDocuments), against the tokenizer's own encode_batch_fast on the whole
          pairs, both with their ids turned into int32 arrays, with every core: p50 ms (runs 14 and
          17 left the arrays out of the second figure: about 2 ms for 50 pairs on a 2-core dev box)
Each thread count runs in a fresh subprocess, as RAYON_NUM_THREADS is read once per process.

    python -m bench.tokenize_scaling --tokenizer .bundle/tok --corpus .bench-data/docstrings.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench.common import percentiles
from pipelines.tokenize import TextTokenizer

MAX_LENGTH, CHUNK, PAIRS = 512, 1024, (5, 25, 50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer.json")
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--docs", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tokenize_scaling"))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # run one measurement, print JSON
    args = parser.parse_args()
    tokenizer = TextTokenizer(args.tokenizer / "tokenizer.json", MAX_LENGTH)
    if args.measure == "texts":
        print(json.dumps(texts_rate(tokenizer, args.corpus, args.docs)))
        return
    if args.measure == "pairs":
        print(json.dumps(pairs_latency(tokenizer, args.corpus)))
        return
    cores = os.cpu_count() or 1
    threads = sorted({1, 2, 4, 8, 16, cores} & set(range(1, cores + 1)))
    results: dict = {"cores": cores, "texts_tokens_per_s": {}, "pairs_p50_ms": None}
    for count in threads:
        results["texts_tokens_per_s"][count] = measure(args, "texts", count)
        print(f"{count} threads: {results['texts_tokens_per_s'][count]}", flush=True)
    results["pairs_p50_ms"] = measure(args, "pairs", cores)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"# Tokenization on {cores} cores (MiniLM's tokenizer, max length {MAX_LENGTH})", "",
             "| threads | tokens/s | speedup |", "|---|---|---|"]
    base = results["texts_tokens_per_s"][1]["tokens_per_s"]
    for count, point in results["texts_tokens_per_s"].items():
        lines.append(f"| {count} | {point['tokens_per_s']:,.0f} | {point['tokens_per_s'] / base:.1f}x |")
    lines += ["", "| pairs | encode_pairs p50 ms, same documents | unseen documents "
              "| whole pairs (encode_batch_fast) p50 ms |", "|---|---|---|---|"]
    for pairs, point in results["pairs_p50_ms"].items():
        lines.append(f"| {pairs} | {point['ours']:.2f} | {point['ours_unseen']:.2f} | {point['whole']:.2f} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def measure(args: argparse.Namespace, what: str, threads: int) -> dict:
    command = [sys.executable, "-m", "bench.tokenize_scaling", "--tokenizer", str(args.tokenizer), "--corpus",
               str(args.corpus), "--docs", str(args.docs), "--measure", what]
    done = subprocess.run(command, env={**os.environ, "RAYON_NUM_THREADS": str(threads)}, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def texts_rate(tokenizer: TextTokenizer, corpus: Path, docs: int) -> dict:
    texts = [t or "" for t in pq.read_table(corpus, columns=["text"]).column("text").to_pylist()[:docs]]
    tokenizer.encode(texts[:CHUNK])  # starts the thread pool
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(texts), CHUNK):
        tokens += sum(len(ids) for ids in tokenizer.encode(texts[start: start + CHUNK]).ids)
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def pairs_latency(tokenizer: TextTokenizer, corpus: Path) -> dict:
    from bench.gpu_rerank import QUERY, UnseenDocuments, long_documents

    documents = long_documents(corpus, tokenizer)
    result = {}
    for pairs in PAIRS:
        queries, texts = [QUERY] * pairs, documents[:pairs]
        unseen = UnseenDocuments(documents, pairs, lambda: TextTokenizer(tokenizer.file, tokenizer.max_length))
        result[pairs] = {"ours": p50(lambda: tokenizer.encode_pairs(queries, texts)),
                         "ours_unseen": p50(lambda: unseen.tokenizer.encode_pairs(queries, unseen.texts),
                                            before=unseen.advance),
                         "whole": p50(lambda: as_arrays(tokenizer.tokenizer.encode_batch_fast(list(zip(queries, texts)))))}
    return result


def p50(call: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    return percentiles(call, 50, warmup=1, before=before)["p50_ms"]


def as_arrays(encodings: list) -> list:
    """What encode_pairs hands on besides the tokens: the same int32 arrays, for a like-for-like time."""
    return [(np.asarray(e.ids, dtype=np.int32), np.asarray(e.type_ids, dtype=np.int32), bool(e.overflowing))
            for e in encodings]


if __name__ == "__main__":
    main()
