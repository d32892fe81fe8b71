"""`embedctl score`: rank documents for queries by bi-encoder similarity, optionally rerank with a cross-encoder.

    queries (read whole, embedded once) -> documents: embedded chunk by chunk from files, or read from a
    table built by `embedctl index` (--index) -> running top-k -> [cross-encoder rescoring] -> run file

Queries are held in memory; documents are not. Each chunk of document vectors is scored against every
query in one matrix product on the engine's device and merged into a running top-k per query
(RunningTopK), so a corpus of any size needs memory for one chunk and k hits per query. The top-k is
exact, and equal scores rank in document order. The similarity is the model's, as sentence-transformers'
similarity_fn_name names it (pipelines.similarity). With ignore_identical_ids a query's hits leave out the
document of its own id, as BEIR's searches do (where queries are also documents, as in ArguAna and Quora, a
query finds itself first): the top-k is taken one deeper and the document dropped, so k hits remain, and the
reranker, the run file and the metrics all go without it. A reranker (a cross-encoder engine) then rescores each
query's top hits as packed (query, document) pairs. The run is written at the end, to stdout or to a
temporary file renamed onto --out, so no half-written run file is ever left; metrics against qrels come
from pipelines.qrels.

It builds no vector index (the scan is exact) and does not overlap reading with the engine.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import torch

from engine import Engine, EngineConfig, LazyTensor, ModelSpec
from engine.batch import PackedBatch, Packer
from engine.errors import UserError, short_reason
from engine.spec import LATER_SETTINGS
from pipelines.progress import Progress, plural
from pipelines.qrels import CUTOFF, Metrics, Qrels, evaluate, read_qrels, trec_order
from pipelines.readers import Chunk, CorpusReader
from pipelines.similarity import pair_scores_of, similarity_of, unit
from pipelines.tokenize import Encoded, TextTokenizer, resolve_prompt
from pipelines.tokenize_pool import TokenizerPool, check_processes, default_processes
from pipelines.writers import database_tables, setting_name, setting_value, table_parts

FORMATS = ("jsonl", "trec")
QUERY_FLAGS = ("--query-text-col", "--query-id-col")  # the options that name the queries' columns, for the errors
TREC_RUN_TAG = "embedctl"
# Names of an open file descriptor, which --out writes into rather than replaces (see _written_in_place).
_DESCRIPTOR_PATH = re.compile(r"/dev/(?:stdin|stdout|stderr|fd/\d+)|/proc/(?:self|thread-self|\d+)/fd/\d+")
# Rows of queries scored in one matrix product: bounds the score matrix for large query sets.
QUERY_BLOCK = 4096
# Queries whose (query, document) pairs are tokenized and reranked together: bounds the pairs in memory.
RERANK_QUERY_BLOCK = 256
# Pairs tokenized together when reranking (see pair_groups): PAIR_GROUP in each of the first
# EVEN_PAIR_GROUPS groups; each later group is twice the one before.
PAIR_GROUP = 2
EVEN_PAIR_GROUPS = 4
# From this many pairs on, a pool's workers take every pair, in pair_groups' groups. Fewer go to them a
# pair each but the first, which is tokenized here meanwhile, so that the device starts on it while
# they answer (0.7-1.2 ms after the hand-over on the H200 host, where one pair took 0.3-0.4 here:
# bench/results/gpu-2026-12-01-run104-rerank-timeline): 5 pairs reranked in 2.49 and 2.63 ms that
# way, against 3.03 and 3.05 with all five in the workers in groups of two, and 3.35-3.82 all tokenized
# here (run103-rerank-hybrid, alternating; a slow host, the model alone 1.44-1.69). Before the workers
# stayed awake, a group came back from them 1-3 ms after it was handed over, so fewer than this were
# all tokenized here (run82, run91).
POOL_MIN_PAIRS = 16
# Cores per tokenizer worker process for a reranker's pairs (default_pair_processes): the words are
# split in Python, one core per process. On the 16-core H200 host 8 workers reranked 50 pairs in
# 12.5-13.2 ms against 13.7-14.1 for 4, and 25 pairs in 7.8-8.1 against 7.8-9.2
# (bench/results/gpu-2026-12-01-run82-rerank-pool, run83).
PAIR_CORES_PER_PROCESS = 2
# The largest group of pairs a tokenizer worker process takes at once, about 6 ms of its time for pairs
# of 512 tokens: large enough that handing it over costs little, small enough that the workers' last
# groups end close together.
POOL_LARGEST_GROUP = 32
# Steps a reranker's device may have queued before the pairs tokenized since are held back for a
# larger step (see pair_scores): with none, BERT-base on the H200 reranked 5 / 25 / 50 pairs in
# 1.95-1.99 / 6.86-7.08 / 12.37-13.32 ms, with one in 2.20-2.21 / 7.39-7.50 / 12.76-13.02
# (bench/results/gpu-2026-12-01-run76-rerank-schedules).
QUEUED_STEPS = 1
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class ScoreOptions:
    queries: str
    docs: str | None = None  # documents to embed; with --index only their texts are read, for a reranker
    index: str | None = None  # a table written by `embedctl index` whose vectors stand for the documents
    table: str | None = None  # the table's name when index is a LanceDB database (as `embedctl index --table`)
    reranker: str | None = None  # a cross-encoder model that rescores each query's top hits
    rerank_depth: int | None = None  # hits per query the reranker rescores (default: top_k)
    qrels: str | None = None
    out: str | None = None  # None writes the run to stdout
    top_k: int = 10
    format: str = "jsonl"  # jsonl | trec
    overwrite: bool = False
    text_col: str = "text"
    id_col: str = "id"
    query_text_col: str | None = None  # the queries' own columns, where they differ from the documents'; None: the same
    query_id_col: str | None = None
    query_prompt: str | None = None  # put in front of every query; None: see resolve_prompt
    doc_prompt: str | None = None  # put in front of every document; None: see resolve_prompt
    query_prompt_name: str | None = None  # a prompt of the model's sentence-transformers config
    doc_prompt_name: str | None = None
    chunk_rows: int = 1024
    ignore_identical_ids: bool = False  # leave out of a query's hits the document of the query's own id
    tokenizer_processes: int | None = None  # worker processes that tokenize the reranker's pairs; None: default_pair_processes

    def __post_init__(self) -> None:
        check_processes(self.tokenizer_processes)


@dataclass(frozen=True)
class Queries:
    ids: list[str]
    texts: list[str]


@dataclass(frozen=True)
class Inputs:
    """What open_inputs() read or opened: enough to fail on bad input before any model loads."""

    queries: Queries
    docs: CorpusReader | None
    table: StoredVectors | None
    qrels: Qrels | None


@dataclass
class Ranking:
    """Each query's hits, best first: doc_ids[q][r] scored scores[q, r]. A query may hold one hit fewer than
    the others (its own document dropped from a corpus no larger than the top-k): its row of scores then
    ends in -inf past its hits."""

    query_ids: list[str]
    doc_ids: list[list[str]]
    scores: np.ndarray  # float32 [queries, min(top_k, documents)]
    corpus_ids: list[str]  # every document ranked, in order: what qrels may judge
    skipped_empty: int = 0
    truncated: int = 0  # queries and documents this run embedded that were cut at the max length
    seconds: float = 0.0
    reranked: int = 0  # (query, document) pairs the reranker scored
    own_ids_dropped: int = 0  # queries whose own document ranked and was left out (ignore_identical_ids)
    similarity: str = "cosine"  # what the bi-encoder's scores are (see similarity_of)

    @property
    def documents(self) -> int:
        return len(self.corpus_ids)

    def top(self, k: int) -> Ranking:
        """The same ranking cut to each query's first k hits."""
        return replace(self, doc_ids=[hits[:k] for hits in self.doc_ids], scores=self.scores[:, :k])

    def to_dict(self) -> dict[str, int | float | str]:
        return {"queries": len(self.query_ids), "documents": self.documents, "top_k": int(self.scores.shape[1]),
                "skipped_empty": self.skipped_empty, "truncated": self.truncated, "reranked_pairs": self.reranked, "similarity": self.similarity,
                "own_ids_dropped": self.own_ids_dropped, "seconds": round(self.seconds, 3)}

    def summary(self, out: str | None) -> str:
        reranked = f", {plural(self.reranked, 'pair')} reranked" if self.reranked else ""
        dropped = f", {plural(self.own_ids_dropped, 'own-id hit')} dropped" if self.own_ids_dropped else ""
        return (f"{plural(len(self.query_ids), 'query', 'queries')} x {plural(self.documents, 'document')}, top "
                f"{self.scores.shape[1]}{reranked} in {self.seconds:.1f} s; {plural(self.skipped_empty, 'empty document')} "
                f"skipped, {self.truncated:,} truncated{dropped} -> {out or 'stdout'}")


class RunningTopK:
    """The exact top-k documents per query, over document vectors that arrive in chunks.

    Scores are pipelines.similarity's by the named similarity: dot products by default (cosines for
    L2-normalised vectors). Documents are numbered in the order they arrive; among equal scores the
    earlier document ranks first, whatever the chunking.
    """

    def __init__(self, queries: torch.Tensor, k: int, similarity: str = "dot") -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.queries, self.k, self.similarity = queries, k, similarity
        self.scores = queries.new_empty((len(queries), 0))
        self.indices = torch.empty((len(queries), 0), dtype=torch.long, device=queries.device)
        self.seen = 0

    def add(self, docs: torch.Tensor) -> None:
        """Merge a chunk of document vectors [n, dim] (the next n documents) into the running top-k."""
        numbers = torch.arange(self.seen, self.seen + len(docs), device=docs.device)
        scores, indices = [], []
        for start in range(0, len(self.queries), QUERY_BLOCK):
            block = slice(start, start + QUERY_BLOCK)
            merged = torch.cat([self.scores[block], pair_scores_of(self.similarity, self.queries[block], docs)], dim=1)
            candidates = torch.cat([self.indices[block], numbers.expand(len(merged), -1)], dim=1)
            # A stable sort rather than topk, whose choice and order among equal scores is unspecified:
            # the running best come first and are already in document order among ties, so ties stay so.
            order = torch.sort(merged, dim=1, descending=True, stable=True).indices[:, : self.k]
            scores.append(merged.gather(1, order))
            indices.append(candidates.gather(1, order))
        if scores:
            self.scores, self.indices = torch.cat(scores), torch.cat(indices)
        self.seen += len(docs)


class StoredVectors:
    """The vectors of a table written by `embedctl index`: a .lance table, a table of a LanceDB database
    named by `table`, a Parquet file or directory."""

    def __init__(self, path: str, text_col: str, table: str | None = None) -> None:
        self.path, self.text_col = path, text_col
        self._table = self._dataset = None
        lance = path.rstrip("/").endswith(".lance")
        shown = f"table '{table}' of --index {path}" if table is not None else f"--index {path}"
        if table is not None and path.rstrip("/").endswith(".parquet"):
            raise UserError(f"--table {table} names a table of a LanceDB database, and {path} is a Parquet table; "
                            "drop --table, or give --index the LanceDB directory or URI")
        if table is not None and lance:  # as index's --out and --table refuse it
            raise UserError(f"--index {path} names a LanceDB table, and --table {table} a table of a database; drop "
                            "--table, or give --index the database folder that holds the tables")
        if "://" not in path and not os.path.exists(path):
            wanted = (f"the LanceDB database that holds table '{table}'" if table is not None else
                      "a table written by `embedctl index` (x.lance, x.parquet, a directory of parts, or a database "
                      "with --table)")
            raise UserError(f"--index {path} does not exist; give {wanted}")
        if table is None and not lance and (tables := database_tables(path)):
            raise UserError(f"--index {path} is a LanceDB database (tables: {', '.join(tables)}); pass --table NAME")
        try:
            if table is not None or lance:
                import lancedb  # here, not at the top: Parquet tables work where lancedb is not installed

                db, _, name = path.rstrip("/").rpartition("/")
                if table is not None:
                    db, name = path, table
                    if "://" not in db and not os.path.isdir(db):  # lancedb.connect would make the folder
                        raise UserError(f"--index {path} is not a folder; give the LanceDB database that holds "
                                        f"table '{table}'")
                self._table = lancedb.connect(db or ".").open_table(name.removesuffix(".lance"))
                schema, self.total_rows = self._table.schema, self._table.count_rows()
            else:
                import pyarrow.dataset

                try:
                    fs, root = fsspec.core.url_to_fs(path)
                except ImportError:  # a store fsspec has no driver for here (s3fs not installed): pyarrow's own
                    fs, root = None, path
                # A directory's parts only: other files beside them (a README) are not the table's, as for the writer.
                parts = table_parts(fs, root) if fs is not None and fs.isdir(root) else root
                self._dataset = pyarrow.dataset.dataset(parts, format="parquet", filesystem=fs)
                schema, self.total_rows = self._dataset.schema, self._dataset.count_rows()
        except (ValueError, OSError, RuntimeError) as error:  # lance raises RuntimeError for a store it cannot reach
            raise UserError(f"cannot open {shown} ({short_reason(error)}); give a table written by "
                            "`embedctl index` (x.lance, x.parquet, a directory of parts, or a database with --table)") \
                from None
        if not {"id", "vector"} <= set(schema.names):
            raise UserError(f"{shown} has no id and vector columns; give a table written by `embedctl index`")
        metadata = {key.decode(): value.decode() for key, value in (schema.metadata or {}).items()}
        self.settings = {key.removeprefix("embedctl."): value for key, value in metadata.items()
                         if key.startswith("embedctl.")}
        if "weights_sha256" not in self.settings:  # nothing says which model made its vectors
            raise UserError(f"{shown} records no embedctl settings (the model and weights its vectors come from); "
                            "give a table written by `embedctl index`")
        self.has_texts = text_col in schema.names

    def query_config(self, spec: ModelSpec, config: EngineConfig) -> EngineConfig:
        """config with the dim, max length and normalisation the table's vectors were made with where
        config leaves them unset, so that queries are embedded as its documents were without the user
        repeating `index`'s flags (one given otherwise meets check_model's error).

        spec is the query model's under config; it must be the model the table was built with (its
        weights' sha256), or the table's dim and max length may mean nothing for it.
        """
        built = self.settings["weights_sha256"]
        if built != spec.weights_sha256:
            raise UserError(f"--index {self.path} was built with the model {self.settings.get('model')!r} (weights "
                            f"sha256 {built[:12]}), not {spec.files.name}; pass the --model it was built with")
        recorded = {"dim": int, "max_length": int, "normalize": lambda value: value == "true"}
        return replace(config, **{key: parse(self.settings[key]) for key, parse in recorded.items()
                                   if key in self.settings and getattr(config, key) is None})

    def check_model(self, engine: Engine) -> None:
        """Refuse to score a table's vectors against queries embedded with other model settings."""
        for key, value in engine.settings().items():
            if key == "model" or (key in LATER_SETTINGS and key not in self.settings):
                continue
            if self.settings.get(key) != value:
                fix = ("score with the model and settings it was built with (without --dim and --max-length the "
                       "table's are taken)")
                if key == "files_sha256":  # two hashes alone tell a user nothing
                    raise UserError(f"--index {self.path} was built with the same weights but other config, tokenizer "
                                    f"or module files than {engine.files.name}'s (the table names the model "
                                    f"{self.settings.get('model')!r}); {fix}")
                raise UserError(f"--index {self.path} was built with {setting_name(key)} "
                                f"{setting_value(self.settings.get(key))} but the query model has {setting_value(value)}; "
                                f"{fix}")

    def chunks(self, rows: int) -> Iterator[tuple[list[str], np.ndarray]]:
        for batch in self._batches(["id", "vector"], rows):
            if batch.num_rows:
                # flatten(), not .values: a batch may be a slice of a larger list array (Parquet's row groups)
                vectors = batch.column("vector").flatten().to_numpy(zero_copy_only=False)
                yield batch.column("id").to_pylist(), vectors.reshape(batch.num_rows, -1)

    def _batches(self, columns: list[str], rows: int) -> Iterator[pa.RecordBatch]:
        if self._table is not None:
            return iter(self._table.search().select(columns).limit(None).to_batches(rows))
        return iter(self._dataset.to_batches(columns=columns, batch_size=rows))

    def texts(self, wanted: set[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for batch in self._batches(["id", self.text_col], 4096):
            for doc_id, text in zip(batch.column("id").to_pylist(), batch.column(self.text_col).to_pylist()):
                if doc_id in wanted:
                    if not isinstance(text, str):  # a null, or a kept column of numbers
                        raise UserError(f"--index {self.path}: document {doc_id!r} has {text!r} in its text column "
                                        f"'{self.text_col}', not a text, so the reranker cannot read it; give "
                                        "--text-col a column of texts (index --keep text)")
                    found[doc_id] = text
        return found


def open_inputs(options: ScoreOptions) -> Inputs:
    """Check the options, read the queries and qrels, open the documents: cheap, so before loading a model."""
    if options.top_k < 1:
        raise UserError(f"--top-k {options.top_k}: ask for at least 1 document per query")
    if options.format not in FORMATS:
        raise UserError(f"unknown --format {options.format!r}; use one of {', '.join(FORMATS)}")
    if options.table is not None and options.index is None:
        raise UserError(f"--table {options.table} names a table of --index, and there is no --index; give --index "
                        "the LanceDB database that holds it")
    if options.docs is None and options.index is None:
        raise UserError("no documents: give DOCS (a file or directory) or --index with a table built by `embedctl index`")
    # Options that would do nothing are refused rather than ignored: a user who gave one expects it to count.
    if options.rerank_depth is not None and options.reranker is None:
        raise UserError(f"--rerank-depth {options.rerank_depth} sets how many hits --reranker rescores, and there is "
                        "no --reranker; name the cross-encoder or drop --rerank-depth")
    if options.tokenizer_processes is not None and options.reranker is None:
        raise UserError(f"--tokenizer-processes {options.tokenizer_processes} sets the processes that tokenize "
                        "--reranker's pairs, and there is no --reranker; name the cross-encoder or drop the option")
    if options.overwrite and options.out is None:
        raise UserError("--overwrite lets --out replace an existing file, and there is no --out (the run goes to "
                        "standard output); give --out FILE or drop --overwrite")
    if options.rerank_depth is not None and options.rerank_depth < options.top_k:
        raise UserError(f"--rerank-depth {options.rerank_depth} is below --top-k {options.top_k}; "
                        "rerank at least as many documents as you keep")
    if options.index is not None and options.docs is not None and options.reranker is None:
        raise UserError(f"with --index the vectors come from {options.index}, and DOCS is read only for --reranker's "
                        "texts; drop DOCS, or drop --index to embed DOCS")
    if options.index is not None and (options.doc_prompt is not None or options.doc_prompt_name is not None):
        flag = "--doc-prompt" if options.doc_prompt is not None else "--doc-prompt-name"
        raise UserError(f"{flag} puts a prompt before documents this run embeds, and with --index it embeds none (the "
                        f"table's vectors carry the prompt they were indexed with); drop {flag}")
    if options.reranker is not None and not options.reranker.strip():
        raise UserError(f"--reranker {options.reranker!r} names no model; give the cross-encoder's directory or hub id, "
                        "or drop --reranker")
    if options.out is not None and not options.out.strip():
        raise UserError(f"--out {options.out!r} names no file; give a file path, or - (or no --out) for standard output")
    if options.out is not None:
        _check_out(Path(options.out), options.overwrite)
    queries = _read_queries(options)
    docs = CorpusReader(options.docs, options.text_col, options.id_col, chunk_rows=options.chunk_rows) \
        if options.docs is not None else None
    table = StoredVectors(options.index, options.text_col, options.table) if options.index is not None else None
    if options.reranker is not None and docs is None and not table.has_texts:
        raise UserError(f"--reranker needs the documents' texts and --index {options.index} has no "
                        f"'{options.text_col}' column; pass DOCS too, or index with --keep {options.text_col}")
    qrels = read_qrels(options.qrels, queries.ids) if options.qrels is not None else None
    return Inputs(queries, docs, table, qrels)


def rank(engine: Engine, tokenizer: TextTokenizer, queries: Queries, docs: Iterable[Chunk] | StoredVectors,
         options: ScoreOptions, top_k: int | None = None, progress: Progress | None = None) -> Ranking:
    """The top documents (options.top_k unless top_k is given) for every query, by the model's similarity;
    progress counts documents."""
    started = time.perf_counter()
    similarity = similarity_of(engine.files)
    cosine = similarity == "cosine"  # vectors normalised once, as they come, and scored by their products
    query_prompt = resolve_prompt(engine.files, "query", options.query_prompt, options.query_prompt_name)
    # A table's vectors carry the prompt they were indexed with; only documents this run embeds take one.
    doc_prompt = "" if isinstance(docs, StoredVectors) else resolve_prompt(engine.files, "document", options.doc_prompt,
                                                                           options.doc_prompt_name)
    query_vectors, _, truncated = _vectors(engine, tokenizer, queries.texts, query_prompt,
                                           lambda i: f"query {queries.ids[i]!r}", cosine)
    depth = top_k or options.top_k
    # A query's own document is at most one of its hits (document ids are unique): one more keeps depth without it.
    top = RunningTopK(query_vectors, depth + 1 if options.ignore_identical_ids else depth, "dot" if cosine else similarity)
    doc_ids: list[str] = []
    seen: set[str] = set()
    skipped = tokens = 0
    total = docs.total_rows if isinstance(docs, (StoredVectors, CorpusReader)) else None
    if progress is not None:
        progress(0, 0, total)
    if isinstance(docs, StoredVectors):
        docs.check_model(engine)
        for ids, vectors in docs.chunks(options.chunk_rows):
            for doc_id in ids:  # embedctl writes unique ids; a table appended to by other means may not hold them
                if doc_id in seen:
                    # A directory of parts holds both copies of an updated row while its run's finish rewrites
                    # the old parts, and after a kill there until the next run.
                    raise UserError(f"--index {docs.path}: duplicate document id {doc_id!r}; if an `embedctl index` "
                                    "run into it is ending, score once it has ended; if one was cut off, run it again "
                                    "to finish it; else rebuild the table with `embedctl index --rebuild` from "
                                    "documents with unique ids")
                if options.format == "trec" and _WHITESPACE.search(doc_id):
                    raise UserError(f"--index {docs.path}: document id {doc_id!r} holds whitespace, which a TREC run "
                                    "cannot; use --format jsonl or ids without whitespace")
                seen.add(doc_id)
            doc_ids.extend(ids)
            stored = torch.tensor(vectors, device=engine.device)
            top.add(unit(stored) if cosine else stored.float())
            if progress is not None:
                progress(len(doc_ids), 0, total)
    else:
        for chunk in docs:
            rows = []
            for row, (doc_id, text) in enumerate(zip(chunk.ids, chunk.texts)):
                if doc_id in seen:  # blank rows' ids included: which of two rows is meant is unclear either way
                    raise UserError(f"{chunk.where(row)}: duplicate document id {doc_id!r}; make document ids unique")
                seen.add(doc_id)
                if _blank(text):
                    skipped += 1
                    continue
                _check_id(chunk, row, options.format, "--id-col")
                doc_ids.append(doc_id)
                rows.append(row)
            if rows:
                vectors, chunk_tokens, chunk_truncated = _vectors(
                    engine, tokenizer, [chunk.texts[row] for row in rows], doc_prompt,
                    lambda i: f"{chunk.where(rows[i])}: document {chunk.ids[rows[i]]!r}", cosine)
                top.add(vectors)
                tokens += chunk_tokens
                truncated += chunk_truncated
            if progress is not None:
                progress(len(doc_ids) + skipped, tokens, total)
    if not doc_ids:
        source = options.docs if options.index is None else options.index
        raise UserError(f"{source} holds no documents with text; give a corpus with at least one non-empty text")
    hits = [[doc_ids[i] for i in row] for row in top.indices.cpu().numpy()]
    scores, dropped = top.scores.cpu().numpy(), 0
    if options.ignore_identical_ids:
        hits, scores, dropped = _without_own_ids(queries.ids, hits, scores, depth)
    return Ranking(query_ids=queries.ids, doc_ids=hits, scores=scores, corpus_ids=doc_ids, skipped_empty=skipped,
                   truncated=truncated, seconds=time.perf_counter() - started, own_ids_dropped=dropped,
                   similarity=similarity)


def _without_own_ids(query_ids: list[str], hits: list[list[str]], scores: np.ndarray,
                     depth: int) -> tuple[list[list[str]], np.ndarray, int]:
    """Each query's hits and scores less the document of the query's own id, cut to depth, and how many
    queries had it among their hits."""
    kept = [[r for r, doc_id in enumerate(row) if doc_id != query_id][:depth] for query_id, row in zip(query_ids, hits)]
    dropped = sum(query_id in row for query_id, row in zip(query_ids, hits))
    return ([[row[r] for r in rows] for row, rows in zip(hits, kept)],
            _padded([row[rows] for row, rows in zip(scores, kept)]), dropped)


def _padded(rows: list[np.ndarray]) -> np.ndarray:
    """Queries' scores as one matrix, a shorter row padded with -inf (see Ranking)."""
    padded = np.full((len(rows), max(map(len, rows), default=0)), -np.inf, dtype=np.float32)
    for row, scores in zip(padded, rows):
        row[: len(scores)] = scores
    return padded


def rerank(reranker: Engine, tokenizer: TextTokenizer, queries: Queries, ranking: Ranking, texts: dict[str, str],
           top_k: int, progress: Progress | None = None, pool: TokenizerPool | None = None) -> Ranking:
    """Rescore every query's hits with a cross-encoder, best first (ties keep the first ranking's order);
    progress counts queries, each once its last pair is scored. pool: see pair_scores."""
    started = time.perf_counter()
    doc_ids: list[list[str]] = []
    scores: list[np.ndarray] = []
    pairs = 0
    total = len(queries.ids)
    if progress is not None:
        progress(0, 0, total)
    for start in range(0, total, RERANK_QUERY_BLOCK):
        block = range(start, min(start + RERANK_QUERY_BLOCK, total))
        firsts = [queries.texts[q] for q in block for _ in ranking.doc_ids[q]]
        seconds = [texts[doc_id] for q in block for doc_id in ranking.doc_ids[q]]
        scored = (_queries_scored(progress, start, [len(ranking.doc_ids[q]) for q in block], total)
                  if progress is not None else None)
        block_scores = pair_scores(reranker, tokenizer, firsts, seconds, scored, pool)
        if scored is not None:
            scored(len(firsts))  # a block of queries without hits has no pairs to report it
        pairs += len(firsts)
        offset = 0
        for q in block:
            hits = ranking.doc_ids[q]
            mine = block_scores[offset: offset + len(hits)]
            offset += len(hits)
            order = np.argsort(-mine, kind="stable")[:top_k]
            doc_ids.append([hits[i] for i in order])
            scores.append(mine[order])
    return replace(ranking, doc_ids=doc_ids, scores=_padded(scores),
                   seconds=ranking.seconds + time.perf_counter() - started, reranked=pairs)


def pair_scores(reranker: Engine, tokenizer: TextTokenizer, firsts: list[str], seconds: list[str],
                scored: Callable[[int], None] | None = None, pool: TokenizerPool | None = None) -> np.ndarray:
    """A cross-encoder's score for each (first, second) pair, float32 [pairs].

    For a handful of long pairs, tokenizing costs about as much as the model. So the pairs are
    tokenized in small groups (pair_groups), and the device is given the pairs tokenized so far
    once it has fewer than QUEUED_STEPS steps left to run and the next group is not tokenized yet:
    the first step starts after the first group, and while the device is busy the next groups
    gather into one larger step, which the device runs faster per pair (each BERT-base step costs
    the H200 about 0.45 ms besides its pairs). A step also leaves when it fills the token budget,
    and the last group's pairs leave at once. On the CPU a step is done before step() returns, so
    each group is a step.

    With a pool whose worker processes have started, every group is handed to the workers at once and
    they tokenize side by side, each group as its worker gets to it; below POOL_MIN_PAIRS pairs, the
    groups are single pairs and the first is tokenized here meanwhile. Without one, the groups are
    tokenized here, one after the other, between steps. On the H200 host one process tokenized
    unseen pairs of 512 tokens about as fast as the device scored them (0.2 ms a pair), so the
    scores waited on it (bench/results/gpu-2026-12-01-run81-rerank-timeline).

    scored, when given, hears how many pairs (from the first) have their scores, each time that grows.
    For it, the results already ready are taken between steps, in order and without waiting on any, so
    the next step is never held back for them; without it, results are taken only at the end.
    """
    packer = Packer(reranker.max_batch_tokens, reranker.config.max_seqs)
    pending: deque[LazyTensor] = deque()
    scores: list[np.ndarray] = []
    done = 0

    def take(wait: bool) -> None:
        nonlocal done
        while pending and (wait or (scored is not None and pending[0].ready())):
            scores.append(reranker.activate(pending.popleft().result()[:, 0]))
            done += len(scores[-1])
            if scored is not None:
                scored(done)

    def enqueue(batch: PackedBatch | None) -> None:
        if batch is not None:
            pending.append(reranker.step(batch))
            take(wait=False)

    for encoded, next_ready in _tokenized_groups(tokenizer, pool, firsts, seconds):
        for ids, types in zip(encoded.ids, encoded.type_ids):
            enqueue(packer.add(ids, None, types))
        if next_ready is None or (not next_ready and sum(not lazy.ready() for lazy in pending) < QUEUED_STEPS):
            enqueue(packer.flush())
    take(wait=True)
    return np.concatenate(scores) if scores else np.zeros(0, dtype=np.float32)


def _tokenized_groups(tokenizer: TextTokenizer, pool: TokenizerPool | None, firsts: list[str],
                      seconds: list[str]) -> Iterator[tuple[Encoded, bool | None]]:
    """Each group's pairs tokenized, in order, with whether the next group's are at hand already (None
    after the last group). With the pool's workers running: at least POOL_MIN_PAIRS pairs all go to
    them; fewer are a pair per group, the first tokenized here while the workers take the others.
    Else all are tokenized here."""
    if pool is None or not pool.in_workers or len(firsts) <= 1:
        groups = list(pair_groups(len(firsts)))
        for index, (start, end) in enumerate(groups):
            yield tokenizer.encode_pairs(firsts[start:end], seconds[start:end]), False if index + 1 < len(groups) else None
        return
    if len(firsts) < POOL_MIN_PAIRS:
        futures = [pool.submit_pairs(firsts[i:i + 1], seconds[i:i + 1]) for i in range(1, len(firsts))]
        yield tokenizer.encode_pairs(firsts[:1], seconds[:1]), futures[0].done()
    else:
        futures = [pool.submit_pairs(firsts[start:end], seconds[start:end]) for start, end
                   in pair_groups(len(firsts), even_groups=2 * pool.processes, largest=POOL_LARGEST_GROUP)]
    for index, future in enumerate(futures):
        yield future.result(), futures[index + 1].done() if index + 1 < len(futures) else None


def _queries_scored(progress: Progress, first: int, hits: list[int], total: int) -> Callable[[int], None]:
    """A pair_scores callback for the queries from first on, with hits[i] pairs each in order: it tells
    progress of each query whose pairs have all been scored."""
    ends = np.cumsum(hits)
    reported = first

    def scored(pairs: int) -> None:
        nonlocal reported
        done = first + int(np.searchsorted(ends, pairs, side="right"))
        if done > reported:
            reported = done
            progress(done, 0, total)

    return scored


def pair_groups(pairs: int, even_groups: int | None = None, largest: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, end) of each group of pairs tokenized together: even_groups (None: EVEN_PAIR_GROUPS)
    groups of PAIR_GROUP pairs, then groups that double up to `largest` pairs (None: without limit),
    the last what is left.

    Small first groups start the device early (see pair_scores); the many queries of a block then
    rerank in groups that grow, so that the tokenizer's calls stay few and, on the CPU, where each
    group is a step, steps fill the token budget.
    """
    start, group, groups = 0, PAIR_GROUP, 0
    while start < pairs:
        yield start, min(start + group, pairs)
        start, groups = start + group, groups + 1
        if groups >= (EVEN_PAIR_GROUPS if even_groups is None else even_groups):
            group = group * 2 if largest is None else min(group * 2, largest)


def document_texts(inputs: Inputs, wanted: set[str]) -> dict[str, str]:
    """The texts of the wanted documents: a second pass over DOCS, or the --index table's text column."""
    if inputs.docs is None:
        return inputs.table.texts(wanted)
    texts = {}
    for chunk in inputs.docs:
        # With --index, rank() read the table and not DOCS, whose ids it never checked: a blank row that shares
        # a ranked document's id must not replace its text.
        texts.update((doc_id, text) for doc_id, text in zip(chunk.ids, chunk.texts)
                     if doc_id in wanted and not _blank(text))
    missing = wanted - texts.keys()
    if missing and inputs.table is None:
        raise UserError(f"{plural(len(missing), 'ranked document')} {'is' if len(missing) == 1 else 'are'} no longer "
                        f"in {inputs.docs.files[0]}{' and the other files' if len(inputs.docs.files) > 1 else ''} "
                        f"(first: {min(missing)!r}): DOCS changed while the run read it; run score again once "
                        "the documents are written")
    if missing:
        raise UserError(f"{plural(len(missing), 'document')} of --index {inputs.table.path} "
                        f"{'is' if len(missing) == 1 else 'are'} not in {inputs.docs.files[0]}"
                        f"{' and the other files' if len(inputs.docs.files) > 1 else ''} (first: {min(missing)!r}); "
                        "pass the DOCS the table was built from")
    return texts


def run_score(engine: Engine, tokenizer: TextTokenizer, inputs: Inputs, options: ScoreOptions,
              reranker: tuple[Engine, TextTokenizer] | None = None,
              bars: Callable[[str, str], Progress] | None = None) -> tuple[Ranking, Metrics | None]:
    """The whole command after loading: rank, rerank when asked, evaluate against qrels when given.
    bars(label, unit), when given, makes the progress callback of each phase. The reranker's worker
    processes (options.tokenizer_processes) start first, so that they are ready when ranking ends."""
    if engine.num_labels:
        raise UserError(f"{engine.files.name} is a cross-encoder; pass it with --reranker and a bi-encoder with --model")
    if reranker is not None and reranker[0].num_labels != 1:
        labels = reranker[0].num_labels
        raise UserError(f"--reranker {reranker[0].files.name} is not a cross-encoder with one relevance score "
                        f"({'an embedding model' if not labels else f'{labels} labels'}); pass a sequence classifier "
                        "with one label, such as an ms-marco cross-encoder")
    reranked = (options.rerank_depth or options.top_k) if reranker is not None else 0
    # nDCG@10 and MRR@10 need ten hits per query, whatever --top-k the run file keeps: with --qrels the
    # first stage goes ten deep, and what the reranker rescores and the run file hold stay as asked.
    depth = max(options.top_k, reranked, CUTOFF if inputs.qrels else 0)
    with _pair_pool(reranker, options.tokenizer_processes) if reranker is not None else nullcontext() as pool:
        first = rank(engine, tokenizer, inputs.queries, inputs.table or inputs.docs, options, top_k=depth,
                     progress=bars("ranking", "documents") if bars else None)
        ranking = first
        if reranker is not None:
            shortlist = first.top(reranked)
            wanted = {doc_id for hits in shortlist.doc_ids for doc_id in hits}
            ranking = rerank(*reranker, inputs.queries, shortlist, document_texts(inputs, wanted), reranked,
                             progress=bars("reranking", "queries") if bars else None, pool=pool)
    if not inputs.qrels:
        return ranking.top(options.top_k), None
    judged = [trec_order(hits, scores) for hits, scores in zip(ranking.doc_ids, ranking.scores)]
    if reranker is not None:  # the reranked hits, then the first stage's next ones
        judged = [hits + trec_order(deeper[reranked:], scores[reranked:])
                  for hits, deeper, scores in zip(judged, first.doc_ids, first.scores)]
    metrics = evaluate(ranking.query_ids, judged, inputs.qrels, options.top_k, ranking.corpus_ids,
                       written=ranking.top(options.top_k).doc_ids)
    return ranking.top(options.top_k), metrics


def _pair_pool(reranker: tuple[Engine, TextTokenizer], processes: int | None) -> TokenizerPool:
    """The pool that tokenizes the reranker's pairs: `processes` workers, by default
    default_pair_processes, whatever the number of pairs (they start while the first stage ranks);
    pulled, so that pair_scores reads each answer when it wants it (see TokenizerPool)."""
    engine, tokenizer = reranker
    processes = default_pair_processes(engine.device.type == "cuda") if processes is None else processes
    return TokenizerPool(tokenizer, processes, pulled=True)


def default_pair_processes(on_gpu: bool) -> int:
    """Tokenizer worker processes for a reranker's pairs when the user does not say: one per
    PAIR_CORES_PER_PROCESS cores beside a GPU, as default_processes decides otherwise."""
    return default_processes(on_gpu, cores_per_process=PAIR_CORES_PER_PROCESS)


def write_run(ranking: Ranking, options: ScoreOptions) -> None:
    """The run as JSONL rows or TREC lines, to stdout or, all at once, to options.out."""
    lines = _trec_lines(ranking) if options.format == "trec" else _jsonl_lines(ranking)
    if options.out is None:
        try:
            sys.stdout.writelines(lines)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left (`| head`): the rest of the run is not wanted
            _quiet_stdout()
        except OSError as error:  # a full disk behind a redirect
            _quiet_stdout()
            raise UserError(f"cannot write the run to standard output ({short_reason(error)}); check free space, "
                            "or give --out FILE") from None
        return
    in_place = _written_in_place(options.out)
    out = Path(options.out if in_place else os.path.realpath(options.out))  # a link stays; what it names is replaced
    target = out if in_place else out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        # Appended to in place: /dev/stdout redirected to a file opens that file, which "w" would empty of what
        # the shell and this process's stderr wrote there before.
        with target.open("a" if in_place else "w", encoding="utf-8") as handle:
            handle.writelines(lines)
        if not in_place:
            os.replace(target, out)
    except BrokenPipeError:
        if not in_place:
            raise
        # /dev/stdout into a pipe whose reader left (`| head`), as with --out -
    except OSError as error:
        raise UserError(f"cannot write {options.out} ({short_reason(error)}); check free space and permissions") from None
    finally:
        if not in_place:
            target.unlink(missing_ok=True)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null after a write to it failed, so that the interpreter's flush at exit, which
    would try the unwritten rest again, neither fails nor prints."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _written_in_place(out: str) -> bool:
    """Whether --out is written into rather than replaced: a FIFO, a device, or a name of an open file
    descriptor (/dev/stdout is a pipe, a terminal, or the file a shell redirected it to). A file under
    /dev/shm is a file like any other."""
    if _DESCRIPTOR_PATH.fullmatch(os.path.abspath(out)):
        return True
    try:
        return not stat.S_ISREG(os.stat(out).st_mode)  # follows links; a folder was refused up front
    except OSError:
        return False  # not there yet (or a dangling link): a new file


def _hits(ranking: Ranking) -> Iterator[tuple[str, str, int, float]]:
    for query_id, doc_ids, scores in zip(ranking.query_ids, ranking.doc_ids, ranking.scores):
        for rank_, (doc_id, score) in enumerate(zip(doc_ids, scores.tolist()), start=1):
            yield query_id, doc_id, rank_, score


# Scores are written with nine significant digits, which tell any two float32 scores apart: six merged some into
# ties, which trec_eval orders by document id rather than by the run's rank.
def _jsonl_lines(ranking: Ranking) -> Iterator[str]:
    for query_id, doc_id, rank_, score in _hits(ranking):
        yield json.dumps({"query_id": query_id, "doc_id": doc_id, "rank": rank_, "score": float(f"{score:.9g}")}) + "\n"


def _trec_lines(ranking: Ranking) -> Iterator[str]:
    for query_id, doc_id, rank_, score in _hits(ranking):
        yield f"{query_id} Q0 {doc_id} {rank_} {score:.9g} {TREC_RUN_TAG}\n"


def _vectors(engine: Engine, tokenizer: TextTokenizer, texts: list[str], prompt: str,
             where: Callable[[int], str], normalize: bool) -> tuple[torch.Tensor, int, int]:
    """The texts' vectors on the engine's device, L2-normalised if normalize (dot products are then cosines),
    their tokens, and how many were cut at the max length. where(i) names text i in an error."""
    encoded = tokenizer.encode([prompt + text for text in texts])
    if engine.ids_past_table and (why := encoded.past_table(engine.vocab_size, where)):
        raise UserError(why)
    vectors = torch.from_numpy(engine.embed(encoded.ids)).to(engine.device)
    vectors = unit(vectors) if normalize and not engine.normalize else vectors.float()
    return vectors, sum(len(row) for row in encoded.ids), sum(encoded.truncated)


def _read_queries(options: ScoreOptions) -> Queries:
    reader = CorpusReader(options.queries, options.query_text_col or options.text_col,
                          options.query_id_col or options.id_col, chunk_rows=options.chunk_rows, flags=QUERY_FLAGS)
    ids: list[str] = []
    texts: list[str] = []
    seen: set[str] = set()
    for chunk in reader:
        for row, (query_id, text) in enumerate(zip(chunk.ids, chunk.texts)):
            if _blank(text):
                raise UserError(f"{chunk.where(row)}: empty query text (id {query_id!r}); "
                                "give the query a text or remove it")
            if query_id in seen:
                raise UserError(f"{chunk.where(row)}: duplicate query id {query_id!r}; make query ids unique")
            _check_id(chunk, row, options.format, QUERY_FLAGS[1])
            seen.add(query_id)
            ids.append(query_id)
            texts.append(text)
    if not ids:
        raise UserError(f"{options.queries} holds no queries; give a file with at least one query")
    return Queries(ids, texts)


def _blank(text: str | None) -> bool:
    return not text or text.isspace()


def _check_id(chunk: Chunk, row: int, run_format: str, id_flag: str) -> None:
    if run_format == "trec" and _WHITESPACE.search(chunk.ids[row]):
        fix = "use --format jsonl or ids without whitespace"
        made, _, number = chunk.ids[row].rpartition(":")
        if number == str(chunk.lines[row]) and chunk.source.endswith(made):  # FILE:ROW, for want of an id column
            fix = (f"the id was made from the file's name, as the file has no id column: pass {id_flag} with its column "
                   "of ids, rename the file, or use --format jsonl")
        raise UserError(f"{chunk.where(row)}: id {chunk.ids[row]!r} holds whitespace, which a TREC run cannot; {fix}")


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before any ranking, a --out that the run could not be written to at the end."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name for the run")
    if _written_in_place(str(out)):  # a FIFO or a device such as /dev/stdout: written to, not replaced
        return
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or pick another --out")
    folder = Path(os.path.realpath(out)).parent
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {out}: {folder} is a file, not a directory; pick another path")
    if not folder.is_dir():
        raise UserError(f"--out {out}: the directory {folder} does not exist; create it or pick another path")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--out {out}: the directory {folder} is read-only; pick a writable place for the run")
