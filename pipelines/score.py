"""`embedctl score`: rank documents for queries by the cosine of their bi-encoder vectors.

    queries (read whole, embedded once) -> document chunks (CorpusReader) -> engine -> running top-k -> run file

Queries are held in memory; documents are not. Each chunk of documents is embedded, scored against
every query in one matrix product on the engine's device, and merged into a running top-k per query
(RunningTopK), so a corpus of any size needs memory for one chunk and k hits per query. The top-k is
exact, and equal scores rank in document order. The run is written at the end, to stdout or to a
temporary file renamed onto --out, so no half-written run file is ever left.

It is not a cross-encoder reranker, does not read documents from a table built by `embedctl index`,
and computes no retrieval metrics.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import Engine
from engine.errors import UserError, short_reason
from pipelines.readers import Chunk, CorpusReader
from pipelines.tokenize import TextTokenizer

FORMATS = ("jsonl", "trec")
TREC_RUN_TAG = "embedctl"
# Rows of queries scored in one matrix product: bounds the score matrix for large query sets.
QUERY_BLOCK = 4096
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class ScoreOptions:
    queries: str
    docs: str
    out: str | None = None  # None writes the run to stdout
    top_k: int = 10
    format: str = "jsonl"  # jsonl | trec
    overwrite: bool = False
    text_col: str = "text"
    id_col: str = "id"
    query_prompt: str = ""  # prepended to every query text as it is
    doc_prompt: str = ""  # prepended to every document text as it is
    chunk_rows: int = 1024


@dataclass(frozen=True)
class Queries:
    ids: list[str]
    texts: list[str]


@dataclass
class Ranking:
    """Each query's hits, best first: doc_ids[q][r] scored scores[q, r]."""

    query_ids: list[str]
    doc_ids: list[list[str]]
    scores: np.ndarray  # float32 [queries, min(top_k, documents)]
    documents: int = 0
    skipped_empty: int = 0
    seconds: float = 0.0

    def summary(self, out: str | None) -> str:
        return (f"{len(self.query_ids):,} queries x {self.documents:,} documents, top {self.scores.shape[1]} "
                f"in {self.seconds:.1f} s; {self.skipped_empty:,} empty documents skipped -> {out or 'stdout'}")


class RunningTopK:
    """The exact top-k documents per query, over document vectors that arrive in chunks.

    Scores are dot products (cosines for L2-normalised vectors). Documents are numbered in the
    order they arrive; among equal scores the earlier document ranks first, whatever the chunking.
    """

    def __init__(self, queries: torch.Tensor, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.queries, self.k = queries, k
        self.scores = queries.new_empty((len(queries), 0))
        self.indices = torch.empty((len(queries), 0), dtype=torch.long, device=queries.device)
        self.seen = 0

    def add(self, docs: torch.Tensor) -> None:
        """Merge a chunk of document vectors [n, dim] (the next n documents) into the running top-k."""
        numbers = torch.arange(self.seen, self.seen + len(docs), device=docs.device)
        scores, indices = [], []
        for start in range(0, len(self.queries), QUERY_BLOCK):
            block = slice(start, start + QUERY_BLOCK)
            merged = torch.cat([self.scores[block], self.queries[block] @ docs.T], dim=1)
            candidates = torch.cat([self.indices[block], numbers.expand(len(merged), -1)], dim=1)
            # A stable sort rather than topk, whose choice and order among equal scores is unspecified:
            # the running best come first and are already in document order among ties, so ties stay so.
            order = torch.sort(merged, dim=1, descending=True, stable=True).indices[:, : self.k]
            scores.append(merged.gather(1, order))
            indices.append(candidates.gather(1, order))
        if scores:
            self.scores, self.indices = torch.cat(scores), torch.cat(indices)
        self.seen += len(docs)


def open_inputs(options: ScoreOptions) -> tuple[Queries, CorpusReader]:
    """Check the options, read the queries and open the documents: cheap, so do it before loading a model."""
    if options.top_k < 1:
        raise UserError(f"--top-k {options.top_k}: ask for at least 1 document per query")
    if options.format not in FORMATS:
        raise UserError(f"unknown --format {options.format!r}; use one of {', '.join(FORMATS)}")
    if options.out is not None:
        _check_out(Path(options.out), options.overwrite)
    queries = _read_queries(options)
    docs = CorpusReader(options.docs, options.text_col, options.id_col, chunk_rows=options.chunk_rows)
    return queries, docs


def rank(engine: Engine, tokenizer: TextTokenizer, queries: Queries, docs: Iterable[Chunk],
         options: ScoreOptions) -> Ranking:
    """The top options.top_k documents of docs for every query, by cosine."""
    started = time.perf_counter()
    top = RunningTopK(_vectors(engine, tokenizer, queries.texts, options.query_prompt), options.top_k)
    doc_ids: list[str] = []
    seen: set[str] = set()
    skipped = 0
    for chunk in docs:
        rows = []
        for row, (doc_id, text) in enumerate(zip(chunk.ids, chunk.texts)):
            if not text or text.isspace():
                skipped += 1
                continue
            if doc_id in seen:
                raise UserError(f"{chunk.where(row)}: duplicate document id {doc_id!r}; make document ids unique")
            _check_id(chunk, row, options.format)
            seen.add(doc_id)
            doc_ids.append(doc_id)
            rows.append(row)
        if rows:
            top.add(_vectors(engine, tokenizer, [chunk.texts[row] for row in rows], options.doc_prompt))
    if not doc_ids:
        raise UserError(f"{options.docs} holds no documents with text; give a corpus with at least one non-empty text")
    indices = top.indices.cpu().numpy()
    return Ranking(query_ids=queries.ids, doc_ids=[[doc_ids[i] for i in row] for row in indices],
                   scores=top.scores.cpu().numpy(), documents=len(doc_ids), skipped_empty=skipped,
                   seconds=time.perf_counter() - started)


def write_run(ranking: Ranking, options: ScoreOptions) -> None:
    """The run as JSONL rows or TREC lines, to stdout or, all at once, to options.out."""
    lines = _trec_lines(ranking) if options.format == "trec" else _jsonl_lines(ranking)
    if options.out is None:
        sys.stdout.writelines(lines)
        sys.stdout.flush()
        return
    out = Path(options.out)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.writelines(lines)
        os.replace(tmp, out)
    except OSError as error:
        raise UserError(f"cannot write {out} ({short_reason(error)}); check free space and permissions") from None
    finally:
        tmp.unlink(missing_ok=True)


def _hits(ranking: Ranking) -> Iterator[tuple[str, str, int, float]]:
    for query_id, doc_ids, scores in zip(ranking.query_ids, ranking.doc_ids, ranking.scores):
        for rank_, (doc_id, score) in enumerate(zip(doc_ids, scores.tolist()), start=1):
            yield query_id, doc_id, rank_, score


def _jsonl_lines(ranking: Ranking) -> Iterator[str]:
    for query_id, doc_id, rank_, score in _hits(ranking):
        yield json.dumps({"query_id": query_id, "doc_id": doc_id, "rank": rank_, "score": round(score, 6)}) + "\n"


def _trec_lines(ranking: Ranking) -> Iterator[str]:
    for query_id, doc_id, rank_, score in _hits(ranking):
        yield f"{query_id} Q0 {doc_id} {rank_} {score:.6f} {TREC_RUN_TAG}\n"


def _vectors(engine: Engine, tokenizer: TextTokenizer, texts: list[str], prompt: str) -> torch.Tensor:
    """L2-normalised vectors on the engine's device, so that dot products are cosines."""
    vectors = torch.from_numpy(engine.embed(tokenizer.encode([prompt + text for text in texts]).ids))
    vectors = vectors.to(engine.device)
    return vectors if engine.normalize else torch.nn.functional.normalize(vectors, dim=1)


def _read_queries(options: ScoreOptions) -> Queries:
    reader = CorpusReader(options.queries, options.text_col, options.id_col, chunk_rows=options.chunk_rows)
    ids: list[str] = []
    texts: list[str] = []
    seen: set[str] = set()
    for chunk in reader:
        for row, (query_id, text) in enumerate(zip(chunk.ids, chunk.texts)):
            if not text or text.isspace():
                raise UserError(f"{chunk.where(row)}: empty query text (id {query_id!r}); "
                                "give the query a text or remove it")
            if query_id in seen:
                raise UserError(f"{chunk.where(row)}: duplicate query id {query_id!r}; make query ids unique")
            _check_id(chunk, row, options.format)
            seen.add(query_id)
            ids.append(query_id)
            texts.append(text)
    if not ids:
        raise UserError(f"{options.queries} holds no queries; give a file with at least one query")
    return Queries(ids, texts)


def _check_id(chunk: Chunk, row: int, run_format: str) -> None:
    if run_format == "trec" and _WHITESPACE.search(chunk.ids[row]):
        raise UserError(f"{chunk.where(row)}: id {chunk.ids[row]!r} holds whitespace, which a TREC run cannot; "
                        "use --format jsonl or ids without whitespace")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name for the run")
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or pick another --out")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the directory {out.parent} does not exist; create it or pick another path")
