"""The low-latency ranking suite: a cross-encoder scoring 5, 25 and 50 (query, document) pairs of 512 tokens.

Ours: pipelines.score.pair_scores, the path `embedctl score --reranker` runs (pairs tokenized in
small groups while the device runs the groups before, from 16 pairs on by the tokenizer's worker
processes side by side; CUDA graphs, pinned readback), on documents its tokenizer has not seen
(UnseenDocuments: the tokenizer caches the ids of each stretch of text between spaces, so the same
documents again would flatter it). Beside it: the same with every pair tokenized in this process
(ours_in_process; "ours" up to run80), and its two parts alone: that tokenizer in the same groups,
and the model on the pairs tokenized beforehand. The graphs are captured at load
(EngineConfig.warmup, as `embedctl serve` does): steps gather as many pairs as the device's pace
lets through, so their sizes vary from call to call, and without it a call now and then would
capture a new size's graph while timed. Peer: sentence-transformers' CrossEncoder.predict on the
same checkpoint and GPU, in fp16 and fp32 (its default). Both include tokenization and the copy of
the scores to the host. The model is BERT-base shaped with random weights (timings do not depend on
the weights; no cross-encoder weights ship offline). `--arms` measures only some of them, and
`--pairs` only some sizes (an A/B of the host code). Writes results.json and report.md under --out.
`--smoke` runs tiny sizes on any device to check the script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
import torch

from bench.common import percentiles
from engine import Engine, EngineConfig
from pipelines.score import PAIR_GROUP, default_pair_processes, pair_groups, pair_scores
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool
from tests.models import BERT_BASE, SMALL_BERT, save_random_model

PAIRS = (5, 25, 50)
ARMS = ("ours", "ours_in_process", "ours_tokenize_only", "ours_model_only", "sentence_transformers_fp16",
        "sentence_transformers_fp32")
QUERY = "how do I stream record batches from a parquet file into a vector database"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench-out/rerank"))
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--processes", type=int, help="tokenizer worker processes (default: as `embedctl score`)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    parser.add_argument("--pairs", default=",".join(map(str, PAIRS)), help="comma-separated pair counts")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    arms = args.arms.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SMALL_BERT if args.smoke else BERT_BASE
    repeats = 3 if args.smoke else args.repeats
    path = save_random_model(Path(tempfile.mkdtemp(prefix="embedctl-rerank-")) / "cross-encoder",
                             "BertForSequenceClassification", num_labels=1, **shape)
    engine = Engine.load(str(path), EngineConfig(attention=args.attention, warmup=not args.smoke))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    documents = long_documents(args.corpus, tokenizer)
    sizes = [int(pairs) for pairs in args.pairs.split(",")]
    docs = documents[:max(sizes)]
    processes = default_pair_processes(engine.device.type == "cuda") if args.processes is None else args.processes
    new_tokenizer = partial(TextTokenizer, engine.files.tokenizer_file, engine.max_length)
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
               "attention": engine.attention_label, "dtype": str(engine.dtype), "pair_tokens": engine.max_length,
               "tokenizer_processes": processes, "points": {}}
    # fp16 is how the peer figures in ../shared/gpu/README.md were taken; fp32 is CrossEncoder's default.
    peers = {name: cross_encoder(path, dtype, engine.max_length) for name, dtype in
             (("sentence_transformers_fp16", torch.float16), ("sentence_transformers_fp32", torch.float32)) if name in arms}
    for pairs in sizes:
        queries, texts = [QUERY] * pairs, docs[:pairs]
        encoded = tokenizer.encode_pairs(queries, texts)
        with UnseenDocuments(documents, pairs, new_tokenizer, processes) as unseen, \
                UnseenDocuments(documents, pairs, new_tokenizer) as here:
            ours = {"ours": lambda: percentiles(lambda: pair_scores(engine, unseen.tokenizer, queries, unseen.texts,
                                                                    pool=unseen.workers), repeats, before=unseen.advance),
                    "ours_in_process": lambda: percentiles(lambda: pair_scores(engine, here.tokenizer, queries, here.texts),
                                                           repeats, before=here.advance),
                    # where the time goes in this process: the tokenizer alone, in pair_scores' groups;
                    # the model alone on pairs tokenized beforehand, packed at the token budget
                    "ours_tokenize_only": lambda: percentiles(lambda: tokenize_in_groups(here.tokenizer, queries, here.texts),
                                                              repeats, before=here.advance),
                    "ours_model_only": lambda: percentiles(lambda: engine.embed(encoded.ids, encoded.type_ids), repeats)}
            point = {name: measure() for name, measure in ours.items() if name in arms}
        for name, peer in peers.items():
            point[name] = percentiles(lambda: peer.predict(list(zip(queries, texts)), batch_size=pairs), repeats)
        results["points"][pairs] = point
        print(f"{pairs} pairs: {json.dumps(point)}", flush=True)
    results["graph_stats"] = vars(engine.stats)
    report = render(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "report.md").write_text(report)
    print(report)


def tokenize_in_groups(tokenizer: TextTokenizer, queries: list[str], texts: list[str]) -> None:
    """The tokenizer's share of pair_scores: the same groups."""
    for start, end in pair_groups(len(queries)):
        tokenizer.encode_pairs(queries[start:end], texts[start:end])


def long_documents(corpus: Path, tokenizer: TextTokenizer, count: int | None = None) -> list[str]:
    """Documents that fill a max-length pair with the query: corpus texts joined until long enough;
    `count` of them, or as many as the corpus makes."""
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    docs, current = [], ""
    for text in texts:
        current = f"{current} {text or ''}".strip()
        if len(tokenizer.encode([current]).ids[0]) >= tokenizer.max_length:
            docs.append(current)
            current = ""
            if len(docs) == count:
                break
    encoded = tokenizer.encode_pairs([QUERY] * len(docs), docs)
    assert len(docs) == (count or len(docs)) > 0 and all(len(ids) == tokenizer.max_length for ids in encoded.ids)
    return docs


class UnseenDocuments:
    """Documents for timed calls that the tokenizer has not seen, as a server meets new ones, with a
    cache warmed as a server's would be: a tokenizer that has tokenized every other document takes
    the rest in turn, `pairs` a call; when they run out, a new tokenizer is warmed the same way.
    With processes, the tokenizer has that many worker processes (`workers`, for pair_scores), and
    each worker's cache is warmed by its share of the documents, in the small groups pair_scores
    hands out (and this process's by all of them, for the calls it tokenizes itself). advance() does
    this work before each call, untimed."""

    def __init__(self, documents: list[str], pairs: int, new_tokenizer: Callable[[], TextTokenizer],
                 processes: int = 0) -> None:
        self.seen, self.unseen, self.pairs = documents[0::2], documents[1::2], pairs
        self.new_tokenizer, self.processes = new_tokenizer, processes
        assert len(self.unseen) >= pairs, "the corpus makes too few documents"
        self.tokenizer: TextTokenizer | None = None  # made by the first advance()
        self.workers: TokenizerPool | None = None
        self.texts, self.next = [], len(self.unseen)

    def advance(self) -> None:
        if self.next + self.pairs > len(self.unseen):
            self._renew()
            self.next = 0
        self.texts = self.unseen[self.next:self.next + self.pairs]
        self.next += self.pairs

    def _renew(self) -> None:
        self.close()
        self.tokenizer = self.new_tokenizer()
        # This process's cache too: it tokenizes the first pair of calls of fewer than POOL_MIN_PAIRS pairs.
        self.tokenizer.encode_pairs([QUERY] * len(self.seen), self.seen)
        if not self.processes:
            return
        self.workers = TokenizerPool(self.tokenizer, self.processes, pulled=True)  # as embedctl score makes it
        self.workers.wait_for_workers()
        groups = [self.workers.submit_pairs([QUERY] * PAIR_GROUP, self.seen[start:start + PAIR_GROUP])
                  for start in range(0, len(self.seen) - PAIR_GROUP + 1, PAIR_GROUP)]
        for group in groups:
            group.result()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def __enter__(self) -> UnseenDocuments:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def cross_encoder(path: Path, dtype: torch.dtype, max_length: int):  # noqa: ANN201 - a bench-only import
    from sentence_transformers import CrossEncoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return CrossEncoder(str(path), device=device, max_length=max_length, model_kwargs={"dtype": dtype})


def render(results: dict) -> str:
    names = list(next(iter(results["points"].values())))
    lines = [f"# Cross-encoder latency, BERT-base shape, pairs of {results['pair_tokens']} tokens",
             f"{results['device']}, torch {results['torch']}, ours {results['dtype']} attention {results['attention']}; "
             "tokenization and readback included; p50 / p99 ms", "",
             "| pairs | " + " | ".join(names) + " | ours vs ST fp16 (p50) |", "|---" * (len(names) + 2) + "|"]
    for pairs, point in results["points"].items():
        cells = [f"{point[n]['p50_ms']:.2f} / {point[n]['p99_ms']:.2f}" for n in names]
        speedup = (f"{point['sentence_transformers_fp16']['p50_ms'] / point['ours']['p50_ms']:.1f}x"
                   if {"ours", "sentence_transformers_fp16"} <= point.keys() else "")
        lines.append(f"| {pairs} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
