"""`embedctl index`: a corpus of shards in, a vector table kept up to date, every stage beside the engine.

    reader thread -> select thread + TokenizerPool -> packer + Engine.step (this thread)
        -> results thread (waits on each LazyTensor, builds record batches) -> writer thread

Every row gets a content key: a hash of its text, the prompt and the settings that decide its vector
(weights, pooling, normalisation, max length, dim), and one of its kept columns. Rows whose id the output
already holds under the same key are unchanged: they are counted and never tokenized or embedded. Rows
whose kept columns alone changed keep their stored vectors and get the new values at finish (a cron job
whose metadata moves does not re-embed its corpus). The rest are embedded and committed by the store in groups (pipelines/writers.py), so a run that fails or is killed
keeps its committed groups and the same command resumes after them. At the end, ids whose text the
source now holds empty are deleted (their vectors were made from a text that is gone), and with prune
ids that left the source. Bounded queues join the stages, so memory stays flat (but for the ids
and keys of the output and of the source) and the engine always has the next batch queued: while the
device computes batch N+1, the results thread waits on batch N's LazyTensor. The writer's queue holds
the chunks of a commit group (at most WRITER_QUEUE_CHUNKS): a commit, or a Parquet row group, takes
tenths of a second to write, and behind a queue of a few batches the engine loop stalled that long,
each time (BERT-base on the H200 indexed at 83% of its model-only rate on the same corpus before,
90-91% after: bench/results/gpu-2026-11-30-run49-index-host, run51, run54). A run that fails or is
killed loses the rows embedded since its last commit, queued ones included. Rows are written in the
order they came.

The model comes as an IndexModel: its spec (what a vector is) at once, its tokenizer and engines only
when the first row needs embedding, so an up-to-date output costs no model load, no GPU start and
no torch import. With several engines (one per GPU) batches go to them in turn, and their results are
read back in the same order, so rows are still written in the order they came. It does not guard against a second run on the same output: the caller holds
lock_output(options).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from engine import ModelSpec, Packer
from engine.errors import UserError
from engine.spec import LATER_SETTINGS
from pipelines.lock import hold_lock
from pipelines.progress import Progress, plural
from pipelines.readers import Chunk, CorpusReader
from pipelines.tokenize import Encoded, TextTokenizer, resolve_prompt
from pipelines.tokenize_pool import TokenizerPool, check_processes, default_processes
from pipelines.writers import (CONTENT_KEY, VectorStore, check_commit_rows, check_output, lance_table, lock_file,
                               open_store, output_schema, stored_kept)

if TYPE_CHECKING:
    from engine import Engine

QUEUE_DEPTH = 4
# Chunks of rows the writer's queue may hold at most (16,384 rows in the reader's chunks of 1,024).
WRITER_QUEUE_CHUNKS = 16


@dataclass(frozen=True)
class IndexOptions:
    source: str | tuple[str, ...]  # one SOURCE, or several read as one corpus (CorpusReader)
    out: str
    table: str | None = None
    text_col: str = "text"
    id_col: str = "id"
    keep: tuple[str, ...] = ()
    prompt: str | None = None  # put in front of every text; None: the model's document prompt, if any
    prompt_name: str | None = None  # a prompt of the model's sentence-transformers config
    rebuild: bool = False  # re-embed everything and replace the output at the end
    prune: bool = False  # delete rows whose ids are no longer in the source
    commit_rows: int = 10_000  # embedded rows per commit: what a kill can lose
    optimize: bool = True  # tidy a LanceDB table or a Parquet directory at the end (the stores' _tidy)
    on_long: str = "truncate"  # truncate | error
    on_empty: str = "skip"  # skip | error
    on_duplicate: str = "error"  # error | skip
    chunk_rows: int = 1024
    tokenizer_processes: int | None = None  # worker processes that tokenize; None: default_processes

    def __post_init__(self) -> None:
        if self.table is not None and self.out.rstrip("/").endswith(".parquet"):
            raise UserError(f"--table {self.table} names a table of a LanceDB database, and {self.out} is a Parquet "
                            "output; drop --table, or give --out a LanceDB directory or URI")
        lance_table(self.out, self.table)  # a name LanceDB refuses, refused now rather than at the first commit
        check_commit_rows(self.commit_rows)  # before open_corpus, which reads chunks of at most this many rows
        check_processes(self.tokenizer_processes)


@dataclass
class IndexReport:
    output: str
    model: str
    device: str | None = None  # None: nothing needed embedding, so no engine was loaded
    rows_read: int = 0
    rows_written: int = 0  # embedded: added + updated - kept_only
    rows_committed: int = 0  # in the output (a rebuild: in its stage); of a stopped run, what the next run keeps
    added: int = 0
    updated: int = 0
    kept_only: int = 0  # of updated: rows whose kept columns alone changed, their stored vectors kept
    unchanged: int = 0
    deleted: int = 0
    tokens: int = 0
    truncated: int = 0
    skipped_empty: int = 0
    skipped_duplicate: int = 0
    numbered_files: int = 0  # files without the id column, whose rows got FILE:ROW ids
    json_left_out: list[str] = field(default_factory=list)  # .json files a folder's walk found and did not read
    seconds: float = 0.0  # the run, less load_seconds
    load_seconds: float = 0.0  # loading the model, when a row needed it
    graphs: dict = field(default_factory=dict)
    not_written: str | None = None  # why the run left the output alone, when it could not write it
    dropped_indexes: list[str] = field(default_factory=list)  # a LanceDB table's indexes that a rebuild replaced
    optimized: str | None = None  # what tidying the output at the end of the run did, if anything
    optimize_error: str | None = None  # why tidying it failed, if it did (the run's rows are committed)

    @property
    def skipped(self) -> int:
        return self.skipped_empty + self.skipped_duplicate

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        embedded = (f"{plural(self.tokens, 'token')} in {self.seconds:.1f} s "
                    f"({self.tokens_per_second:,.0f} tokens/s{self._load()})"
                    if self.tokens else f"nothing to embed ({self.seconds:.1f} s)")
        written = f"{self.output} not written: {self.not_written}" if self.not_written else self.output
        numbered = (f"; the rows of {plural(self.numbered_files, 'file')} numbered FILE:ROW for want of an id column"
                    if self.numbered_files else "")
        more = ", ..." if len(self.json_left_out) > 1 else ""
        left_out = (f"; {plural(len(self.json_left_out), '.json file')} left out ({self.json_left_out[0]}{more}): "
                    "name JSON lines in a glob (DIR/*.json) to read them" if self.json_left_out else "")
        dropped = (f"; the rebuilt table has none of the old one's indexes ({', '.join(self.dropped_indexes)}): "
                   "create them again" if self.dropped_indexes else "")
        kept_only = f" ({self.kept_only:,} in kept columns only)" if self.kept_only else ""
        optimized = f"; table optimized: {self.optimized}" if self.optimized else ""
        if self.optimize_error:
            optimized = (f"; table not optimized ({self.optimize_error}): its rows are committed, and the next run "
                         "tries again")
        rows = self.rows_written + self.kept_only + self.unchanged
        return (f"{plural(rows, 'row')}: {self.added:,} added, {self.updated:,} updated{kept_only}, "
                f"{self.unchanged:,} unchanged, {self.deleted:,} deleted; {embedded}; {self.truncated:,} truncated, "
                f"{self.skipped:,} skipped{numbered}{left_out} -> {written}{optimized}{dropped}")

    def _load(self) -> str:
        return f", after {self.load_seconds:.1f} s loading the model" if self.load_seconds else ""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "skipped": self.skipped,
                           "tokens_per_second": round(self.tokens_per_second, 1)}, indent=2)


@dataclass(frozen=True)
class _Selection:
    """A chunk's rows to embed (positions in the chunk) and their content keys."""

    chunk: Chunk
    rows: list[int]
    keys: list[str]


@dataclass
class _Tokenized:
    """A chunk's rows that go to the engine, with what the output needs to know about them."""

    chunk: Chunk
    rows: list[int]  # positions in the chunk of the rows kept
    ids: list[np.ndarray]
    truncated: list[bool]
    keys: list[str]
    vectors: np.ndarray | None = None
    filled: int = 0

    def place(self, row: int, vector: np.ndarray) -> bool:
        """Store one row's vector; True once every row of the chunk has one."""
        if self.vectors is None:
            self.vectors = np.empty((len(self.rows), len(vector)), dtype=np.float32)
        self.vectors[row] = vector
        self.filled += 1
        return self.filled == len(self.rows)


class IndexModel:
    """What run_index embeds with: the model's spec now, its tokenizer and engines when a row first needs them."""

    def __init__(self, spec: ModelSpec, load_engines: Callable[[ModelSpec], list[Engine]],
                 on_gpu: Callable[[], bool]) -> None:
        """load_engines: the model on each device it runs on (one engine, or one per GPU); on_gpu: whether
        they will be on GPUs (asked before they load)."""
        self.spec = spec
        self._load_engines = load_engines
        self._ask_gpu = on_gpu
        self._gpu: bool | None = None
        self.engines: list[Engine] = []
        self.load_seconds = 0.0  # finding the devices and loading the engines

    @classmethod
    def loaded(cls, *engines: Engine) -> IndexModel:
        """Engines the caller loaded already (tests and benchmarks reuse them across runs)."""
        model = cls(engines[0].spec, lambda spec: list(engines), lambda: engines[0].device.type == "cuda")
        model.engines = list(engines)
        return model

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        """For the pool's threads in this process (worker processes load their own, by words)."""
        return TextTokenizer(self.spec.files.tokenizer_file, self.spec.max_length, by_words=False)

    def on_gpu(self) -> bool:
        """Whether the engine runs on a GPU, known before it loads. Finding out imports torch (a second
        or more), which is part of loading the model, not of embedding."""
        if self._gpu is None:
            started = time.perf_counter()
            self._gpu = self._ask_gpu()
            self.load_seconds += time.perf_counter() - started
        return self._gpu

    def load(self) -> list[Engine]:
        if not self.engines:
            started = time.perf_counter()
            self.engines = self._load_engines(self.spec)
            self.load_seconds += time.perf_counter() - started
        return self.engines


def open_corpus(options: IndexOptions) -> CorpusReader:
    """The corpus with its files found and their schemas checked: cheap, so do it before loading a model.

    Chunks are no larger than a commit group: a chunk reaches the writer only once all its rows are embedded,
    so with chunks of 1,024 rows a --commit-rows of 100 committed nothing until 1,024 rows were done."""
    return CorpusReader(options.source, options.text_col, options.id_col, options.keep,
                        min(options.chunk_rows, options.commit_rows))


def lock_output(options: IndexOptions) -> AbstractContextManager[None]:
    """Hold options.out against other runs for the block; raises pipelines.lock.OutputLocked if one holds it.
    An output of no known kind is refused first, before the lock makes its folder."""
    check_output(options.out, options.table)
    return hold_lock(lock_file(options.out, options.table), options.out)


def run_index(model: IndexModel, options: IndexOptions, progress: Progress | None = None,
              corpus: CorpusReader | None = None, report: IndexReport | None = None) -> IndexReport:
    """Bring options.out up to date with every row of options.source; returns the run's report: `report`
    when given, filled as the run goes, so that a caller can tell how far a run that raised got.

    corpus is open_corpus(options) when the caller has opened it already. On any failure, including
    KeyboardInterrupt, every pipeline thread has stopped; the output holds what it held before plus
    the groups committed so far, which a run with the same options does not embed again. With keep, a
    JSONL source without rows leaves the output alone (report.not_written says so): no row tells the
    types of the kept columns.
    """
    reader = corpus or open_corpus(options)
    spec = model.spec
    if spec.num_labels:
        raise UserError(f"{spec.files.name} is a cross-encoder: it scores query-document pairs and has no vectors "
                        "to index; index with a bi-encoder, and rerank with this one through `embedctl score --reranker`")
    options = replace(options, prompt=resolve_prompt(spec.files, "document", options.prompt, options.prompt_name),
                      prompt_name=None)
    report = report if report is not None else IndexReport(output=options.out, model=spec.files.name)
    loaded_before = bool(model.engines)
    started = time.perf_counter()
    flow = _Flow()
    store: VectorStore | None = None
    try:
        if options.keep and not options.rebuild and (kept := stored_kept(options.out, options.table)) is not None \
                and set(kept.names) == set(reader.keep):
            reader.follow(kept, f"the existing output {options.out}")
        chunks = flow.stage(iter(reader))
        first = next(chunks, None)
        if options.keep and reader.kept_schema is None:
            # JSONL without a row gives the kept keys no type; an output made without their columns
            # would refuse every later run that has rows.
            flow.finish()
            if options.prune or options.rebuild:  # asked to empty the output: most likely an export that failed
                flag = "--rebuild" if options.rebuild else "--prune"
                raise UserError(f"the source holds no rows, so {flag} has nothing to leave in {options.out} (and no "
                                "rows to tell the types of the --keep columns); check the source (an empty export?)")
            report.not_written = "the source has no rows to tell the types of the --keep columns"
            return report
        settings = {**spec.settings(), "prompt": options.prompt}
        schema = _schema(spec, settings, reader.kept_schema)
        store = open_store(options.out, schema, options.table, options.rebuild, options.commit_rows, options.optimize)
        source: dict[str, str] = {}  # id -> content key of every row a fresh build would write
        emptied: set[str] = set()  # ids of the output that the source lists with an empty text
        restamps: list[pa.Table] = []  # stored rows whose kept columns alone changed: their new values
        selections = _select(_chain(first, chunks), options, report, _ContentKeys(settings), store, source, emptied,
                             restamps)
        tokenized = flow.stage(_tokenize(selections, model, options, reader.total_rows))
        if progress is not None:
            progress(0, 0, reader.total_rows)
        vector_type = schema.field("vector").type.value_type
        records = flow.stage(_assemble(flow.stage_from_queue(), report, progress, reader.total_rows, vector_type),
                             depth=_writer_depth(options.commit_rows, reader.chunk_rows))
        flow.consume(records, store)
        _embed(model, tokenized, flow)
        flow.finish()
        if not source and store.replaced:
            raise UserError(f"the source holds no rows with text, so --rebuild would replace the "
                            f"{plural(len(store.replaced), 'row')} stored in {options.out} with none; check the "
                            "source (an empty export?), or remove the output to start it empty")
        if not source and (options.prune or emptied) and store.existing:
            doomed = len(store.existing) if options.prune else len(emptied)
            cause = "--prune" if options.prune else "their empty texts"
            raise UserError(f"the source holds no rows with text, so {cause} would delete {doomed:,} of the "
                            f"{len(store.existing):,} stored in {options.out}; check the source (an empty export?), "
                            "or remove the output to start it empty")
        report.deleted = store.finish(source, options.prune, emptied, restamps)
        report.dropped_indexes, report.optimized, report.optimize_error = (list(store.dropped_indexes), store.optimized,
                                                                           store.optimize_error)
    except BaseException:
        flow.cancel()
        if store is not None:
            store.abort()
            report.rows_committed = store.committed_rows
        raise
    report.rows_committed = store.committed_rows
    report.numbered_files = len(reader.numbered)
    report.json_left_out = reader.json_left_out
    if progress is not None:
        progress(report.rows_written + report.kept_only + report.unchanged + report.skipped, report.tokens,
                 reader.total_rows)
    report.load_seconds = model.load_seconds if model.engines and not loaded_before else 0.0
    report.seconds = time.perf_counter() - started - report.load_seconds
    if model.engines:
        report.device = ",".join(str(engine.device) for engine in model.engines)
        report.graphs = {name: sum(getattr(engine.stats, name) for engine in model.engines)
                         for name in asdict(model.engines[0].stats)}
    return report


def _writer_depth(commit_rows: int, chunk_rows: int) -> int:
    """The writer's queue, in chunks: a commit group's worth (see the module docstring), within bounds."""
    return min(max(QUEUE_DEPTH, -(-commit_rows // chunk_rows)), WRITER_QUEUE_CHUNKS)


def _embed(model: IndexModel, items: Iterator[_Tokenized], flow: _Flow) -> None:
    """Pack rows first come, first served and send each batch's LazyTensor on to the results thread,
    the batches going to the engines in turn.

    The engines load when the first rows to embed arrive, while the tokenizer pool works ahead."""
    first = next(items, None)
    if first is None:
        return
    engines = model.load()
    turns = itertools.cycle(engines)
    packer = Packer(engines[0].max_batch_tokens, engines[0].config.max_seqs)
    for item in _chain(first, items):
        for row, ids in enumerate(item.ids):
            if (batch := packer.add(ids, (item, row))) is not None:
                flow.send((next(turns).step(batch), batch.tags))
    if (batch := packer.flush()) is not None:
        flow.send((next(turns).step(batch), batch.tags))


class _ContentKeys:
    """A row's content key: 32 hex digits of a sha256 of what decides its vector (the settings, prompt
    included, and its text), and with kept columns a '+' and 16 of a sha256 of those, so that a change
    to them alone shows as such. Outputs written before keys had two parts hold 32 digits of one hash of
    both (legacy), which still names a row that has not changed."""

    def __init__(self, settings: dict[str, str]) -> None:
        # The model is named by its hashes; LATER_SETTINGS are checked per table, not per row.
        identity = {key: value for key, value in settings.items() if key != "model" and key not in LATER_SETTINGS}
        self._base = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())

    def of(self, text: str, kept: dict | None) -> str:
        vector_key = self._vector_hash(text).hexdigest()[:32]
        if kept is None:
            return vector_key
        return f"{vector_key}+{hashlib.sha256(_kept_json(kept)).hexdigest()[:16]}"

    def legacy(self, text: str, kept: dict) -> str:
        key = self._vector_hash(text)
        key.update(b"\0" + _kept_json(kept))
        return key.hexdigest()[:32]

    @staticmethod
    def same_vector(stored: str, key: str) -> bool:
        """Whether a stored row's key and a row's key name the same vector (their kept columns may differ)."""
        return "+" in stored and stored.partition("+")[0] == key.partition("+")[0]

    def _vector_hash(self, text: str) -> hashlib._Hash:
        key = self._base.copy()
        key.update(text.encode("utf-8", "surrogatepass"))
        return key


def _kept_json(kept: dict) -> bytes:
    return json.dumps(kept, sort_keys=True, default=str).encode()


def _select(chunks: Iterator[Chunk], options: IndexOptions, report: IndexReport, keys: _ContentKeys,
            store: VectorStore, source: dict[str, str], emptied: set[str],
            restamps: list[pa.Table]) -> Iterator[_Selection]:
    """The rows of each chunk the output lacks or holds under another key; note every wanted row in source,
    in emptied the existing ids whose text is empty, and in restamps (id, content_key and kept columns) the
    stored rows whose kept columns alone changed. A row that takes the place of one in the output counts as
    updated, also when a rebuild replaces the output."""
    existing = store.existing
    blank: set[str] = set()  # the ids whose first row has an empty text
    for chunk in chunks:
        report.rows_read += len(chunk.ids)
        kept = _kept_rows(chunk.kept) if chunk.kept is not None else None
        rows, row_keys, restamped, restamped_keys = [], [], [], []
        for row in range(len(chunk.ids)):
            row_id = chunk.ids[row]
            if not _wanted(chunk, row, options, report, source, blank):
                if row_id in blank and row_id in existing:
                    emptied.add(row_id)
                continue
            text, kept_row = chunk.texts[row], kept[row] if kept is not None else None
            key = keys.of(text, kept_row)
            stored = existing.get(row_id)
            if stored is not None and kept_row is not None and stored != key and stored == keys.legacy(text, kept_row):
                key = stored
            source[row_id] = key
            if stored == key:
                report.unchanged += 1
                continue
            replaces = row_id in store.replaced if options.rebuild else stored is not None
            report.updated += replaces
            report.added += not replaces
            if stored is not None and keys.same_vector(stored, key):
                report.kept_only += 1
                restamped.append(row)
                restamped_keys.append(key)
                continue
            rows.append(row)
            row_keys.append(key)
        if restamped:
            restamps.append(_restamp(chunk, restamped, restamped_keys))
        if rows:
            yield _Selection(chunk, rows, row_keys)


def _restamp(chunk: Chunk, rows: list[int], keys: list[str]) -> pa.Table:
    """The id, new content key and kept columns of a chunk's rows whose kept columns alone changed."""
    new = chunk.kept.take(rows)
    return new.add_column(0, "id", pa.array([chunk.ids[row] for row in rows], pa.string())) \
        .add_column(1, CONTENT_KEY, pa.array(keys, pa.string()))


def _kept_rows(kept: pa.Table) -> list[dict]:
    """The kept columns row by row, for the content keys: as Python values, or as text a value that has no
    Python form (a nanosecond timestamp past its microseconds, as pandas writes them). Value by value, so
    that a row's key does not depend on the other rows of its chunk."""
    columns = {}
    for name, column in zip(kept.column_names, kept.columns):
        try:
            columns[name] = column.to_pylist()
        except (pa.ArrowInvalid, ValueError):
            columns[name] = [_python_or_text(value) for value in column]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def _python_or_text(value: pa.Scalar) -> object:
    try:
        return value.as_py()
    except (pa.ArrowInvalid, ValueError):
        return value.cast(pa.string()).as_py()


def _tokenize(selections: Iterator[_Selection], model: IndexModel, options: IndexOptions,
              total_rows: int | None) -> Iterator[_Tokenized]:
    """Each selection's rows tokenized, in order, with the pool's depth of chunks submitted ahead."""
    selections = iter(selections)
    first = next(selections, None)
    if first is None:
        return
    tokenizer = model.tokenizer  # loaded here, at the first row to embed
    table = model.spec.vocab_size if model.spec.ids_past_table else None
    processes = options.tokenizer_processes
    if processes is None:
        processes = default_processes(model.on_gpu(), total_rows)
    with TokenizerPool(tokenizer, processes) as pool:
        pending: deque[tuple[_Selection, Future[Encoded]]] = deque()
        rest = _chain(first, selections)
        while True:
            try:
                selection = next(rest)
            except StopIteration:
                break
            except Exception:
                for earlier in pending:
                    _collected(*earlier, tokenizer.max_length, table, options)  # a failure in rows before is the one to report
                raise
            pending.append((selection, pool.submit([options.prompt + selection.chunk.texts[row] for row in selection.rows])))
            while len(pending) >= pool.depth:
                yield _collected(*pending.popleft(), tokenizer.max_length, table, options)
        while pending:
            yield _collected(*pending.popleft(), tokenizer.max_length, table, options)


def _collected(selection: _Selection, future: Future[Encoded], max_length: int, table: int | None,
               options: IndexOptions) -> _Tokenized:
    """A selection's tokens once the pool has them; UserError for an over-long text when on_long is error,
    and for a text holding a token past the embedding table's `table` rows (None: the tokenizer gives none)."""
    chunk, rows, encoded = selection.chunk, selection.rows, future.result()
    if options.on_long == "error" and any(encoded.truncated):
        row = rows[encoded.truncated.index(True)]
        raise UserError(f"{chunk.where(row)}: text is longer than the model's {max_length} "
                        "tokens; shorten it or pass --on-long truncate")
    if table is not None and (why := encoded.past_table(table, lambda i: f"{chunk.where(rows[i])}: the text (id "
                                                                      f"{chunk.ids[rows[i]]!r})")):
        raise UserError(why)
    return _Tokenized(chunk, rows, encoded.ids, encoded.truncated, selection.keys)


def _wanted(chunk: Chunk, row: int, options: IndexOptions, report: IndexReport, seen: dict[str, str],
            blank: set[str]) -> bool:
    """Whether a row belongs in the output (seen: the ids that do so far; blank: those whose first row has an
    empty text): False (counted) for a repeated id when skipping, the first row of an id deciding even when
    its text is empty, and for an empty text, whose id then joins blank."""
    row_id, text = chunk.ids[row], chunk.texts[row]
    if row_id in seen or row_id in blank:
        if options.on_duplicate == "error":
            raise UserError(f"{chunk.where(row)}: duplicate id {row_id!r}; "
                            "make ids unique or pass --on-duplicate skip to keep the first")
        report.skipped_duplicate += 1
        return False
    if _empty(text):
        if options.on_empty == "error":
            raise UserError(f"{chunk.where(row)}: empty text (id {row_id!r}); remove the row or pass --on-empty skip")
        report.skipped_empty += 1
        blank.add(row_id)
        return False
    return True


def _empty(text: str | None) -> bool:
    return not text or text.isspace()  # no stripped copy of every text for this


def _assemble(results: Iterable[tuple], report: IndexReport, progress: Progress | None,
              total_rows: int | None, vector_type: pa.DataType) -> Iterator[pa.RecordBatch]:
    """Wait on each batch's vectors in order; yield each chunk as a record batch once it is whole."""
    embedded = 0
    for lazy, tags in results:
        for (item, row), vector in zip(tags, lazy.result()):
            report.tokens += len(item.ids[row])
            if item.place(row, vector):
                report.rows_written += len(item.rows)
                report.truncated += sum(item.truncated)
                yield _record_batch(item, vector_type)
        embedded += len(tags)
        if progress is not None:
            progress(embedded + report.kept_only + report.unchanged + report.skipped, report.tokens, total_rows)


def _record_batch(item: _Tokenized, vector_type: pa.DataType) -> pa.RecordBatch:
    chunk, rows = item.chunk, item.rows
    dim = item.vectors.shape[1]
    columns = {
        "id": pa.array([chunk.ids[r] for r in rows], pa.string()),
        # An int8 model's float32 results are whole numbers: the cast to the schema's int8 is exact.
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(item.vectors.reshape(-1)).cast(vector_type), dim),
        "n_tokens": pa.array([len(ids) for ids in item.ids], pa.int32()),
        "truncated": pa.array(item.truncated, pa.bool_()),
        CONTENT_KEY: pa.array(item.keys, pa.string()),
    }
    if chunk.kept is not None:
        kept = chunk.kept.take(rows)
        for name in kept.column_names:
            columns[name] = kept.column(name).combine_chunks()
    return pa.RecordBatch.from_pydict(columns)


def _schema(spec: ModelSpec, settings: dict[str, str], kept: pa.Schema | None) -> pa.Schema:
    return output_schema(spec.dim, kept, {f"embedctl.{key}": value for key, value in settings.items()},
                         pa.from_numpy_dtype(np.dtype(spec.vector_dtype)))


def _chain(first: object | None, rest: Iterator) -> Iterator:
    if first is not None:
        yield first
        yield from rest


class _Flow:
    """Threads joined by bounded queues, with one place that remembers the first failure.

    stage(it) runs an iterator in its own thread and returns an iterator over its items; send()
    and stage_from_queue() are the queue from the engine loop to the thread that waits on results,
    and consume() writes what a stage yields to the store in a thread of its own. finish() ends the
    queue and waits for every thread; cancel() stops them all and waits for them too, so that
    nothing still writes when the caller aborts the store.
    """

    _END = object()

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.results: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self.threads: list[threading.Thread] = []

    def stage(self, items: Iterator, depth: int = QUEUE_DEPTH) -> Iterator:
        out: queue.Queue = queue.Queue(depth)

        def produce() -> None:
            try:
                try:
                    for item in items:
                        self._put(out, item)
                finally:
                    if isinstance(items, Generator):
                        items.close()  # a generator left on a yield lets go of what it holds (threads) now
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                self._fail(error)
            finally:  # after _fail: whoever meets the end must also see the failure
                self._put(out, self._END, final=True)

        self._start(produce)
        return self._drain(out)

    def stage_from_queue(self) -> Iterator:
        return self._drain(self.results)

    def consume(self, records: Iterator[pa.RecordBatch], store: VectorStore) -> None:
        def write() -> None:
            try:
                for record in records:
                    store.write(record)
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                self._fail(error)

        self._start(write)

    def send(self, item: object) -> None:
        self._put(self.results, item)
        self.raise_failure()

    def finish(self) -> None:
        self._put(self.results, self._END, final=True)
        self._join()
        self.raise_failure()

    def cancel(self) -> None:
        self.stopped.set()
        self._join()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
        self.stopped.set()

    def _start(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _drain(self, source: queue.Queue) -> Iterator:
        while not self.stopped.is_set():
            try:
                item = source.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is self._END:
                break
            yield item
        self.raise_failure()

    def _put(self, target: queue.Queue, item: object, final: bool = False) -> None:
        while not self.stopped.is_set() or final:
            try:
                target.put(item, timeout=0.1)
                return
            except queue.Full:
                if final and self.stopped.is_set():
                    return
        self.raise_failure()
        raise _Cancelled


class _Cancelled(Exception):
    """Raised in a stage thread when the run was stopped elsewhere."""
