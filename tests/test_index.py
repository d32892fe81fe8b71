"""run_index in-process: the properties that need many small runs or a look inside the pipeline.

Vectors are checked against embedctl.load().embed() (the engine packed differently), order across
many chunks and engine batches, and what a failure leaves behind: before the first commit no output,
or an existing output byte for byte as it was; after it the committed groups, which a re-run does
not embed again; and never a pipeline thread still running. Kills and re-runs of the command line
are in test_incremental.py.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import fsspec.implementations.local
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lancedb.index import BTree

import embedctl
from engine import Engine, EngineConfig, UserError
from pipelines import index as index_module
from pipelines import writers
from pipelines.index import IndexModel, IndexOptions, IndexReport, lock_output, open_corpus, run_index
from pipelines.progress import plural
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool
from tests.files import child_processes, snapshot, write_jsonl
from tests.models import add_token_past_the_table, save_random_model

LONG = "A sentence that repeats until the text is longer than the model allows. " * 40
OUTPUTS = ["x.lance", "x.parquet", "dir/"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> None:
    # On a loaded two-core machine two-thread CPU kernels wait on each other; one thread is faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(None, EngineConfig(max_batch_tokens=300))  # several engine batches per chunk


@pytest.fixture(scope="module")
def reference() -> embedctl.Embedder:
    """The library API with its default batch budget: the same rows, packed differently."""
    return embedctl.load()


def index(engine: Engine, source: Path, out: str, **options: object) -> IndexReport:
    return run_index(IndexModel.loaded(engine), IndexOptions(source=str(source), out=out, chunk_rows=7, **options))


def read_output(out: str) -> pa.Table:
    if out.endswith(".lance"):
        path = Path(out)
        return lancedb.connect(path.parent).open_table(path.stem).to_arrow()
    return pq.read_table(out)


def mixed_rows(n: int, prefix: str) -> list[dict]:
    """Short, long, non-ASCII and (every fifth row) blank texts, each with a `tag` to keep."""
    texts = ["Short text {}.", "Ünïcödé and 漢字 text {}.", LONG + "{}",
             "A middling sentence, number {}, about tables."]
    return [{"id": f"{prefix}{i}", "tag": f"t{prefix}{i}", "text": "  " if i % 5 == 4 else texts[i % 4].format(i)}
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A Parquet shard and a JSONL shard, and every row in the order a reader meets them."""
    root = tmp_path_factory.mktemp("corpus")
    first, second = mixed_rows(33, "p"), mixed_rows(30, "j")
    pq.write_table(pa.Table.from_pylist(first), root / "a.parquet")
    write_jsonl(root / "b.jsonl", second)
    return root, first + second


@pytest.mark.parametrize("out", OUTPUTS)
def test_vectors_ids_and_kept_columns_match_the_api_in_input_order(
        tmp_path: Path, engine: Engine, reference: embedctl.Embedder,
        corpus: tuple[Path, list[dict]], out: str) -> None:
    source, rows = corpus
    report = index(engine, source, f"{tmp_path}/{out}", keep=("tag",))
    kept = [row for row in rows if row["text"].strip()]
    table = read_output(f"{tmp_path}/{out}")
    assert table.column("id").to_pylist() == [row["id"] for row in kept]
    assert table.column("tag").to_pylist() == [row["tag"] for row in kept]
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(vectors, reference.embed([row["text"] for row in kept]), atol=1e-5)
    assert report.rows_read == len(rows)
    assert report.skipped_empty == len(rows) - len(kept)
    assert report.rows_written == len(kept)
    assert report.tokens == sum(table.column("n_tokens").to_pylist()) > 10 * engine.max_batch_tokens
    assert report.truncated == sum(table.column("truncated").to_pylist()) == sum(LONG in r["text"] for r in kept)


def test_batches_go_to_the_engines_in_turn_and_rows_keep_their_order(
        tmp_path: Path, engine: Engine, reference: embedctl.Embedder, corpus: tuple[Path, list[dict]]) -> None:
    """`--device cuda:0,cuda:1`'s path, on two CPU engines: each gets every other batch, and the rows are
    written in input order with their own vectors."""
    source, rows = corpus
    other = Engine.load(None, EngineConfig(max_batch_tokens=300))
    steps: dict[str, int] = {"first": 0, "second": 0}

    def counted(name: str, step: Callable) -> Callable:
        def count_then_step(batch: object) -> object:
            steps[name] += 1
            return step(batch)
        return count_then_step

    engine.step, other.step = counted("first", engine.step), counted("second", other.step)
    try:
        report = run_index(IndexModel.loaded(engine, other),
                           IndexOptions(source=str(source), out=f"{tmp_path}/x.parquet", chunk_rows=7))
    finally:
        del engine.step  # the module's engine steps as before for the other tests
    kept = [row for row in rows if row["text"].strip()]
    table = read_output(f"{tmp_path}/x.parquet")
    assert table.column("id").to_pylist() == [row["id"] for row in kept]
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(vectors, reference.embed([row["text"] for row in kept]), atol=1e-5)
    assert steps["first"] - steps["second"] in (0, 1) and steps["second"] >= 5
    assert report.device == "cpu,cpu" and report.rows_written == len(kept)


class StartedPool(TokenizerPool):
    """A pool that waits for its workers, so that every chunk of a small run goes to them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.wait_for_workers()


@pytest.fixture
def started_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipelines.index.TokenizerPool", StartedPool)


def test_worker_processes_write_what_the_main_process_writes(
        tmp_path: Path, engine: Engine, corpus: tuple[Path, list[dict]], started_workers: None) -> None:
    source, _ = corpus
    before = child_processes()
    in_main = index(engine, source, f"{tmp_path}/main.parquet", keep=("tag",), tokenizer_processes=0)
    in_workers = index(engine, source, f"{tmp_path}/workers.parquet", keep=("tag",), tokenizer_processes=2)
    main_table, workers_table = read_output(f"{tmp_path}/main.parquet"), read_output(f"{tmp_path}/workers.parquet")
    assert workers_table.drop_columns("vector").equals(main_table.drop_columns("vector"))
    np.testing.assert_allclose(np.stack(workers_table.column("vector").to_numpy(zero_copy_only=False)),
                               np.stack(main_table.column("vector").to_numpy(zero_copy_only=False)), atol=1e-6)
    assert (in_workers.tokens, in_workers.truncated) == (in_main.tokens, in_main.truncated) and in_main.truncated
    assert child_processes() == before


def test_duplicates_skipped_on_request_keep_the_first(tmp_path: Path, engine: Engine,
                                                     reference: embedctl.Embedder) -> None:
    rows = [{"id": "a", "text": "first"}, {"id": "b", "text": "second"}, {"id": "a", "text": "again"}]
    report = index(engine, write_jsonl(tmp_path / "d.jsonl", rows), f"{tmp_path}/x.parquet",
                   on_duplicate="skip")
    table = read_output(f"{tmp_path}/x.parquet")
    assert table.column("id").to_pylist() == ["a", "b"]
    np.testing.assert_allclose(table.column("vector")[0].values.to_numpy(), reference.embed(["first"])[0],
                               atol=1e-5)
    assert report.skipped_duplicate == 1


@pytest.mark.parametrize("first_blank", [True, False])
def test_an_id_repeated_with_a_blank_text_is_a_duplicate_and_its_first_row_decides(
        tmp_path: Path, engine: Engine, reference: embedctl.Embedder, first_blank: bool) -> None:
    out = f"{tmp_path}/x.parquet"
    index(engine, write_jsonl(tmp_path / "old.jsonl", [{"id": "a", "text": "stored"}, {"id": "b", "text": "kept"}]),
          out)
    copies = [{"id": "a", "text": "  "}, {"id": "a", "text": "again"}]
    rows = [{"id": "b", "text": "kept"}, *(copies if first_blank else copies[::-1])]
    source = write_jsonl(tmp_path / "new.jsonl", rows)
    with pytest.raises(UserError, match="new.jsonl line 3: duplicate id 'a'; .* --on-duplicate skip"):
        index(engine, source, out)
    report = index(engine, source, out, on_duplicate="skip")
    assert (report.skipped_empty, report.skipped_duplicate) == ((1, 1) if first_blank else (0, 1))
    table = read_output(out)
    if first_blank:  # the id's text is gone, so is the vector an earlier run stored for it
        assert table.column("id").to_pylist() == ["b"] and report.deleted == 1
    else:
        assert table.column("id").to_pylist() == ["a", "b"] and report.updated == 1
        np.testing.assert_allclose(table.column("vector")[0].values.to_numpy(), reference.embed(["again"])[0],
                                   atol=1e-5)


def test_the_summary_of_one_row_says_row(tmp_path: Path, engine: Engine) -> None:
    report = index(engine, write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "one"}]), f"{tmp_path}/x.parquet")
    assert report.tokens > 1
    assert report.summary().startswith(f"1 row: 1 added, 0 updated, 0 unchanged, 0 deleted; {report.tokens} tokens in ")
    assert report.summary().endswith(f"; 0 truncated, 0 skipped -> {tmp_path}/x.parquet")


@pytest.mark.parametrize(("count", "rows", "queries"), [(0, "0 rows", "0 queries"), (1, "1 row", "1 query"),
                                                        (2, "2 rows", "2 queries"), (12_345, "12,345 rows", "12,345 queries")])
def test_plural_agrees_with_the_count(count: int, rows: str, queries: str) -> None:
    assert plural(count, "row") == rows
    assert plural(count, "query", "queries") == queries


def test_finding_the_device_counts_as_loading_not_embedding(tmp_path: Path, engine: Engine,
                                                           corpus: tuple[Path, list[dict]]) -> None:
    # The CLI's probe imports torch, a second or more, before the engine loads: that is loading time.
    source, _ = corpus

    def slow_probe() -> bool:
        time.sleep(0.5)
        return False

    model = IndexModel(engine.spec, lambda spec: [engine], slow_probe)
    report = run_index(model, IndexOptions(source=str(source / "a.parquet"), out=f"{tmp_path}/x.parquet"))
    assert report.rows_written > 0 and report.load_seconds >= 0.5


def test_progress_counts_up_to_the_known_total(tmp_path: Path, engine: Engine,
                                               corpus: tuple[Path, list[dict]]) -> None:
    source, _ = corpus
    calls = []
    run_index(IndexModel.loaded(engine), IndexOptions(source=str(source / "a.parquet"), out=f"{tmp_path}/x.parquet",
                                              chunk_rows=7), lambda *args: calls.append(args))
    assert calls[0] == (0, 0, 33)
    rows = [rows for rows, _, _ in calls]
    assert rows == sorted(rows) and rows[-1] == 33 and len(calls) > 3


# Failures: a bad line far into the input, an interrupt in the engine loop, an error in the results or
# the writer thread.

GOOD = [{"id": f"g{i}", "text": f"Good line number {i}."} for i in range(300)]


@pytest.fixture
def bad_source(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "bad.jsonl", [*GOOD, '{"id": "x", "text": '])


def existing_output(engine: Engine, work: Path, out: str) -> str:
    small = write_jsonl(work / "small.jsonl", [{"id": "old", "text": "An old row."}])
    index(engine, small, f"{work}/{out}")
    return f"{work}/{out}"


class Watch:
    """A progress callback that remembers how many rows had been embedded."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, rows: int, tokens: int, total_rows: int | None) -> None:
        self.rows = rows


def assert_failure_changes_nothing(work: Path, run: Callable[[], object], error: type[BaseException],
                                  match: str | None) -> None:
    """run() raises `error`; every file under work is as before and no pipeline thread is left."""
    before, threads = snapshot(work), threading.active_count()
    with pytest.raises(error, match=match):
        run()
    assert snapshot(work) == before
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]


@pytest.mark.parametrize("out", OUTPUTS)
def test_bad_line_far_in_leaves_no_output(tmp_path: Path, engine: Engine,
                                          bad_source: Path, out: str) -> None:
    existing_output(engine, tmp_path / "warm", out)  # LanceDB's own thread starts once, before the count
    watch = Watch()
    options = IndexOptions(source=str(bad_source), out=f"{tmp_path}/{out}", chunk_rows=7)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options, watch),
                                   UserError, "bad.jsonl line 301: invalid JSON")
    assert watch.rows >= 7  # the failure came after rows had been embedded
    assert not (tmp_path / out).exists()


def test_a_failure_leaves_no_folder_made_for_a_new_output(tmp_path: Path, engine: Engine, bad_source: Path) -> None:
    options = IndexOptions(source=str(bad_source), out=f"{tmp_path}/new/deeper/x.lance", chunk_rows=7)
    with pytest.raises(UserError, match="bad.jsonl line 301"):
        with lock_output(options):
            run_index(IndexModel.loaded(engine), options)
    assert not (tmp_path / "new").exists()


def test_a_lock_whose_holder_record_cannot_be_written_still_guards_the_run(tmp_path: Path, monkeypatch) -> None:
    """On a full disk the lock file's note of who holds it cannot be written; the flock holds all the same, and a
    run with nothing to write goes on (it failed with a traceback)."""
    import errno

    from pipelines import lock

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "write", full)
    path = str(tmp_path / ".x.lance.lock")
    with lock.hold_lock(path, "x.lance"):
        with pytest.raises(lock.OutputLocked, match="x.lance is being written by another embedctl run"):
            with lock.hold_lock(path, "x.lance"):
                pass
    assert not (tmp_path / ".x.lance.lock").exists()


def test_a_failure_with_worker_processes_leaves_no_output_and_no_process(
        tmp_path: Path, engine: Engine, bad_source: Path, started_workers: None) -> None:
    options = IndexOptions(source=str(bad_source), out=f"{tmp_path}/x.parquet", chunk_rows=7, tokenizer_processes=2)
    before = child_processes()
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options),
                                   UserError, "bad.jsonl line 301")
    assert child_processes() == before


@pytest.mark.parametrize("out", OUTPUTS)
@pytest.mark.parametrize("rebuild", [False, True])
def test_bad_line_before_the_first_commit_leaves_an_existing_output_untouched(
        tmp_path: Path, engine: Engine, bad_source: Path, out: str, rebuild: bool) -> None:
    existing = existing_output(engine, tmp_path, out)
    options = IndexOptions(source=str(bad_source), out=existing, rebuild=rebuild, chunk_rows=7)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options),
                                   UserError, "bad.jsonl line 301")
    assert read_output(existing).column("id").to_pylist() == ["old"]


@pytest.mark.parametrize("out", OUTPUTS)
def test_interrupt_in_the_engine_loop_leaves_nothing(tmp_path: Path, engine: Engine,
                                                     monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    existing = existing_output(engine, tmp_path, out)
    source = write_jsonl(tmp_path / "good.jsonl", GOOD)
    step, calls = engine.step, []

    def interrupted_step(batch: object) -> object:
        calls.append(batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(batch)

    monkeypatch.setattr(engine, "step", interrupted_step)
    options = IndexOptions(source=str(source), out=existing, rebuild=True, chunk_rows=7)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options), KeyboardInterrupt, None)


@pytest.mark.parametrize("processes", [0, 2])
def test_the_first_bad_row_is_the_one_reported_while_chunks_tokenize_ahead(
        tmp_path: Path, engine: Engine, processes: int, started_workers: None) -> None:
    """A too-long text in the first chunk is found while the next chunk is selected (where an empty
    text fails): the error reported is the first row's, as a run one row at a time would report."""
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": LONG}, {"id": "b", "text": "fine"},
                                                   {"id": "c", "text": "   "}, {"id": "d", "text": "ok"}])
    options = IndexOptions(source=str(source), out=f"{tmp_path}/x.parquet", chunk_rows=2, on_long="error",
                           on_empty="error", tokenizer_processes=processes)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options),
                                   UserError, "line 1: text is longer")


def test_error_in_the_results_thread_reaches_the_caller(tmp_path: Path, engine: Engine) -> None:
    existing_output(engine, tmp_path / "warm", "x.lance")
    source = write_jsonl(tmp_path / "good.jsonl", GOOD)

    def broken_progress(rows: int, tokens: int, total_rows: int | None) -> None:
        if rows > 30:
            raise RuntimeError("progress display failed")

    options = IndexOptions(source=str(source), out=f"{tmp_path}/x.lance", chunk_rows=7)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options, broken_progress),
                                   RuntimeError, "progress display failed")


@pytest.mark.parametrize("out", OUTPUTS)
def test_a_store_that_fails_mid_run_stops_every_thread_and_keeps_the_old_output(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    """A write that fails (a full disk, say) while the results thread keeps queueing rows for it."""
    existing = existing_output(engine, tmp_path, out)
    source = write_jsonl(tmp_path / "good.jsonl", GOOD)
    store_class = {"x.lance": writers._LanceStore, "x.parquet": writers._ParquetFileStore,
                   "dir/": writers._ParquetDirStore}[out]
    write, calls = store_class.write, []

    def failing_write(self: object, batch: pa.RecordBatch) -> None:
        calls.append(batch)
        if len(calls) == 3:
            raise UserError(f"{out}: no space left on the device")
        write(self, batch)

    monkeypatch.setattr(store_class, "write", failing_write)
    options = IndexOptions(source=str(source), out=existing, rebuild=True, chunk_rows=7, commit_rows=1000)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options),
                                   UserError, "no space left")
    assert read_output(existing).column("id").to_pylist() == ["old"]


@pytest.mark.parametrize("out", OUTPUTS)
@pytest.mark.parametrize(("rows", "flag", "phrase"), [
    ([{"id": "blank", "text": "  "}], "prune", "--prune would delete 1 of the 1 stored in"),
    ([{"id": "old", "text": None}], None, "their empty texts would delete 1 of the 1 stored in"),
    ([], "rebuild", "--rebuild would replace the 1 row stored in"),
], ids=["prune", "emptied", "rebuild"])
def test_a_source_without_text_that_would_delete_rows_is_refused(tmp_path: Path, engine: Engine, out: str,
                                                                 rows: list[dict], flag: str | None, phrase: str) -> None:
    """An upstream export that failed and left empty files or null texts must not wipe the index in a cron job."""
    existing = existing_output(engine, tmp_path, out)
    empty = write_jsonl(tmp_path / "empty.jsonl", rows)
    options = IndexOptions(source=str(empty), out=existing, prune=flag == "prune", rebuild=flag == "rebuild")
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options), UserError,
                                   f"the source holds no rows with text, so {phrase}")
    assert read_output(existing).column("id").to_pylist() == ["old"]


@pytest.mark.parametrize("out", OUTPUTS)
def test_a_rebuild_counts_the_rows_of_the_old_output_it_drops_as_deleted(tmp_path: Path, engine: Engine, out: str) -> None:
    old = write_jsonl(tmp_path / "old.jsonl", [{"id": "old", "text": "An old row."}, {"id": "kept", "text": "A kept row."}])
    index(engine, old, f"{tmp_path}/{out}")
    fresh = write_jsonl(tmp_path / "fresh.jsonl", [{"id": "kept", "text": "A kept row."}, {"id": "new", "text": "A new row."}])
    report = run_index(IndexModel.loaded(engine), IndexOptions(source=str(fresh), out=f"{tmp_path}/{out}", rebuild=True))
    # counted against the output it replaces, as a monitor reads the counts: "kept" replaced, "new" added, "old" gone
    assert (report.added, report.updated, report.unchanged, report.deleted) == (1, 1, 0, 1)
    assert sorted(read_output(f"{tmp_path}/{out}").column("id").to_pylist()) == ["kept", "new"]


@pytest.mark.parametrize(("commit_rows", "chunk_rows"), [(100, 100), (5000, IndexOptions.chunk_rows)])
def test_chunks_are_no_larger_than_a_commit_group(tmp_path: Path, commit_rows: int, chunk_rows: int) -> None:
    # A chunk reaches the writer once all its rows are embedded: chunks larger than --commit-rows would
    # commit nothing until a whole chunk was done, and a kill before then would lose more than a group.
    source = write_jsonl(tmp_path / "good.jsonl", GOOD)
    assert open_corpus(IndexOptions(source=str(source), out=f"{tmp_path}/x.lance", commit_rows=commit_rows)).chunk_rows == chunk_rows


@pytest.mark.parametrize("out", ["x.lance", "dir/"])
def test_a_failure_keeps_the_committed_groups_and_a_rerun_resumes_after_them(
        tmp_path: Path, engine: Engine, bad_source: Path, out: str) -> None:
    options = IndexOptions(source=str(bad_source), out=f"{tmp_path}/{out}", chunk_rows=7, commit_rows=50)
    with pytest.raises(UserError, match="bad.jsonl line 301"):
        run_index(IndexModel.loaded(engine), options)
    committed = read_output(f"{tmp_path}/{out}").column("id").to_pylist()
    assert committed == [row["id"] for row in GOOD[:len(committed)]] and len(committed) % 50 == 0 and committed

    write_jsonl(bad_source, GOOD)  # the user fixes the line and runs the same command again
    report = run_index(IndexModel.loaded(engine), options)
    assert (report.unchanged, report.added) == (len(committed), len(GOOD) - len(committed))
    assert sorted(read_output(f"{tmp_path}/{out}").column("id").to_pylist()) == sorted(row["id"] for row in GOOD)


@pytest.mark.parametrize("out", ["x.lance", "dir/"])
def test_a_resumed_rebuild_counts_against_the_output_it_replaces(tmp_path: Path, engine: Engine, bad_source: Path,
                                                                out: str) -> None:
    """A row the stopped run staged and this one embeds again (its text changed meanwhile) is added, not updated,
    when the output being replaced never held its id."""
    existing_output(engine, tmp_path, out)
    options = IndexOptions(source=str(bad_source), out=f"{tmp_path}/{out}", chunk_rows=7, commit_rows=50,
                           rebuild=True)
    with pytest.raises(UserError, match="bad.jsonl line 301"):
        run_index(IndexModel.loaded(engine), options)
    write_jsonl(bad_source, [{"id": "g0", "text": "Edited."}, *GOOD[1:]])
    report = run_index(IndexModel.loaded(engine), options)
    assert (report.updated, report.added + report.unchanged, report.deleted) == (0, len(GOOD), 1)
    assert sorted(read_output(f"{tmp_path}/{out}").column("id").to_pylist()) == sorted(row["id"] for row in GOOD)


def test_other_settings_are_refused(tmp_path: Path, engine: Engine) -> None:
    existing = existing_output(engine, tmp_path, "x.lance")
    other = Engine.load(None, EngineConfig(normalize=False))
    options = IndexOptions(source=str(tmp_path / "small.jsonl"), out=existing)
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(other), options), UserError,
                                   "normalize true and this run's normalize is false; pass --rebuild")


def test_the_prompt_goes_before_every_text_and_is_part_of_the_settings(
        tmp_path: Path, engine: Engine, reference: embedctl.Embedder) -> None:
    rows = [{"id": "a", "text": "first"}, {"id": "b", "text": "second"}]
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    index(engine, source, f"{tmp_path}/x.lance", prompt="passage: ")
    table = read_output(f"{tmp_path}/x.lance")
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(vectors, reference.embed(["passage: first", "passage: second"]), atol=1e-5)
    options = IndexOptions(source=str(source), out=f"{tmp_path}/x.lance", prompt="query: ")
    assert_failure_changes_nothing(tmp_path, lambda: run_index(IndexModel.loaded(engine), options), UserError,
                                   "prompt 'passage: ' and this run's prompt is 'query: '")


def test_int8_model_writes_int8_vectors_equal_to_the_engine(tmp_path: Path) -> None:
    from tests.test_qwen3 import save_random_qwen3

    path = save_random_qwen3(tmp_path / "model", causal=False, pooling="mean", quantize=True)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    rows = [{"id": f"d{i}", "text": f"document number {i} about vectors"} for i in range(5)]
    write_jsonl(tmp_path / "docs.jsonl", rows)
    run_index(IndexModel.loaded(engine), IndexOptions(source=str(tmp_path / "docs.jsonl"), out=str(tmp_path / "out.parquet")))
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("vector").type == pa.list_(pa.int8(), engine.dim)
    assert table.schema.metadata[b"embedctl.quantization"] == b"int8"
    stored = np.array(table.column("vector").to_pylist(), dtype=np.int8)
    np.testing.assert_array_equal(stored, engine.embed(tokenizer.encode([r["text"] for r in rows]).ids))


@pytest.mark.parametrize("out", OUTPUTS)
def test_a_kept_column_the_source_declares_not_null_is_written(tmp_path: Path, engine: Engine, out: str) -> None:
    not_null = pa.schema([pa.field(name, pa.string(), nullable=False) for name in ("id", "text", "title")])
    pq.write_table(pa.table({"id": ["a"], "text": ["A text."], "title": ["A title"]}, schema=not_null),
                   tmp_path / "nn.parquet")
    assert index(engine, tmp_path / "nn.parquet", f"{tmp_path}/{out}", keep=("title",)).added == 1
    assert read_output(f"{tmp_path}/{out}").select(["id", "title"]).to_pylist() == [{"id": "a", "title": "A title"}]
    assert index(engine, tmp_path / "nn.parquet", f"{tmp_path}/{out}", keep=("title",)).unchanged == 1


@pytest.mark.parametrize("out", OUTPUTS)
def test_a_kept_nanosecond_timestamp_is_written_as_it_is_and_a_rerun_changes_nothing(tmp_path: Path, engine: Engine,
                                                                                       out: str) -> None:
    """pandas writes timestamps in nanoseconds, which Python's datetime cannot hold past the microsecond."""
    stamps = pa.array([1_700_000_000_123_456_789, 1_700_000_000_000_000_000, None], pa.timestamp("ns"))
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["One.", "Two.", "Three."], "at": stamps}),
                   tmp_path / "ts.parquet")
    assert index(engine, tmp_path / "ts.parquet", f"{tmp_path}/{out}", keep=("at",)).added == 3
    assert read_output(f"{tmp_path}/{out}").column("at").cast(pa.int64()).to_pylist() == stamps.cast(pa.int64()).to_pylist()
    assert index(engine, tmp_path / "ts.parquet", f"{tmp_path}/{out}", keep=("at",)).unchanged == 3


def sorted_rows(out: str) -> list[dict]:
    return sorted(read_output(out).to_pylist(), key=lambda row: row["id"])


@pytest.mark.parametrize("out", OUTPUTS)
def test_rows_whose_kept_columns_alone_changed_keep_their_vectors_and_take_the_new_values(
        tmp_path: Path, engine: Engine, out: str) -> None:
    """A cron job over a corpus whose metadata moves: those rows are not embedded again."""
    rows = [{"id": f"d{i}", "text": f"Document number {i}.", "tag": f"t{i}", "n": i} for i in range(30)]
    write_jsonl(tmp_path / "docs.jsonl", rows)
    target, keep = f"{tmp_path}/{out}", ("tag", "n")
    assert index(engine, tmp_path / "docs.jsonl", target, keep=keep).added == 30
    before = {row["id"]: row for row in sorted_rows(target)}
    for row in rows[:10]:
        row["tag"] += "-new"  # kept columns only
    for row in rows[10:16]:
        row["text"] += " Edited."  # the text (row 15: both)
    rows[15]["n"] = -1
    write_jsonl(tmp_path / "docs.jsonl", rows)
    report = index(engine, tmp_path / "docs.jsonl", target, keep=keep)
    assert (report.updated, report.kept_only, report.rows_written, report.unchanged) == (16, 10, 6, 14)
    assert report.summary().startswith("30 rows: 0 added, 16 updated (10 in kept columns only), 14 unchanged")
    assert report.rows_committed == 6  # the rows embedded, as in every kind of output; not the restamped ones
    after = sorted_rows(target)
    write_jsonl(tmp_path / "fresh.jsonl", rows)
    fresh = index(engine, tmp_path / "fresh.jsonl", f"{tmp_path}/fresh.parquet", keep=keep)
    assert fresh.added == 30
    for row, expected in zip(after, sorted_rows(f"{tmp_path}/fresh.parquet"), strict=True):
        assert {k: v for k, v in row.items() if k != "vector"} == {k: v for k, v in expected.items() if k != "vector"}
        np.testing.assert_allclose(row["vector"], expected["vector"], atol=1e-6)
        if int(row["id"][1:]) < 10:
            assert row["vector"] == before[row["id"]]["vector"]  # the stored vector, not a new one
    report = index(engine, tmp_path / "docs.jsonl", target, keep=keep)
    assert (report.unchanged, report.updated) == (30, 0)


def test_rows_whose_kept_columns_alone_changed_stay_in_the_lance_tables_indexes(tmp_path: Path,
                                                                               engine: Engine) -> None:
    """Only those rows leave the index on id (as re-embedded rows do), not every fragment they sit in."""
    rows = [{"id": f"d{i}", "text": f"Document number {i}.", "tag": f"t{i}"} for i in range(40)]
    write_jsonl(tmp_path / "docs.jsonl", rows)
    assert index(engine, tmp_path / "docs.jsonl", f"{tmp_path}/x.lance", keep=("tag",)).added == 40
    lancedb.connect(tmp_path).open_table("x").create_index("id", config=BTree())
    rows[3]["tag"] = "new"
    write_jsonl(tmp_path / "docs.jsonl", rows)
    assert index(engine, tmp_path / "docs.jsonl", f"{tmp_path}/x.lance", keep=("tag",)).kept_only == 1
    table = lancedb.connect(tmp_path).open_table("x")
    stats = table.index_stats("id_idx")
    assert (stats.num_indexed_rows, stats.num_unindexed_rows) == (39, 1)
    assert table.search().where("id = 'd3'").to_arrow().column("tag").to_pylist() == ["new"]


def test_an_output_keyed_before_keys_had_two_parts_is_not_embedded_again(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its keys hash the text and the kept columns together: an unchanged row stays unchanged, a changed one
    (whose change the key cannot tell apart) is embedded again and gets a key of two parts."""
    rows = [{"id": f"d{i}", "text": f"Document number {i}.", "tag": f"t{i}"} for i in range(5)]
    write_jsonl(tmp_path / "docs.jsonl", rows)
    target = f"{tmp_path}/x.lance"
    with monkeypatch.context() as patch:
        patch.setattr(index_module._ContentKeys, "of", lambda self, text, kept: self.legacy(text, kept))
        assert index(engine, tmp_path / "docs.jsonl", target, keep=("tag",)).added == 5
    assert all(len(row["content_key"]) == 32 for row in sorted_rows(target))
    assert index(engine, tmp_path / "docs.jsonl", target, keep=("tag",)).unchanged == 5
    rows[0]["tag"] = "new"
    write_jsonl(tmp_path / "docs.jsonl", rows)
    report = index(engine, tmp_path / "docs.jsonl", target, keep=("tag",))
    assert (report.updated, report.kept_only, report.rows_written, report.unchanged) == (1, 0, 1, 4)
    assert [len(row["content_key"]) for row in sorted_rows(target)] == [49, 32, 32, 32, 32]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_partition_key_keeps_the_type_the_output_gave_it_when_its_folders_change(tmp_path: Path, engine: Engine,
                                                                                  suffix: str) -> None:
    """year=unknown made the key text; once that folder is gone the whole numbers left must not retype it."""
    def shard(year: str, doc: str) -> None:
        path = tmp_path / "c" / f"year={year}" / f"part-0{suffix}"
        path.parent.mkdir(parents=True)
        if suffix == ".parquet":
            pq.write_table(pa.table({"id": [doc], "text": [f"Text {doc}."]}), path)
        else:
            write_jsonl(path, [{"id": doc, "text": f"Text {doc}."}])

    shard("2024", "a")
    shard("unknown", "b")
    out = f"{tmp_path}/x.lance"
    assert index(engine, tmp_path / "c", out, keep=("year",)).added == 2
    shutil.rmtree(tmp_path / "c" / "year=unknown")
    shard("2025", "c")
    report = index(engine, tmp_path / "c", out, keep=("year",))
    assert (report.added, report.unchanged) == (1, 1)
    assert sorted(read_output(out).select(["id", "year"]).to_pylist(), key=lambda row: row["id"]) == [
        {"id": "a", "year": "2024"}, {"id": "b", "year": "unknown"}, {"id": "c", "year": "2025"}]


@pytest.mark.parametrize("out", OUTPUTS)
def test_the_same_weights_with_another_config_or_tokenizer_are_refused(tmp_path: Path, out: str) -> None:
    """Vectors depend on config.json (the activation) and tokenizer.json as much as on the weights."""
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "One text."}, {"id": "b", "text": "Two."}])
    model = save_random_model(tmp_path / "model", pooling="mean")
    assert run_index(IndexModel.loaded(Engine.load(str(model))), IndexOptions(str(source), f"{tmp_path}/{out}")).added == 2
    for changed in ("config.json", "tokenizer.json"):
        other = tmp_path / f"other-{changed}"
        shutil.copytree(model, other)
        edited = json.loads((other / changed).read_text())
        if changed == "config.json":
            edited["hidden_act"] = "relu"
        else:
            edited["normalizer"] = None  # cased now: another text, other ids
        (other / changed).write_text(json.dumps(edited))
        with pytest.raises(UserError, match="model's config, tokenizer or module files differ from this run's"):
            run_index(IndexModel.loaded(Engine.load(str(other))), IndexOptions(str(source), f"{tmp_path}/{out}"))


def test_a_table_written_before_the_files_were_recorded_updates_without_re_embedding(tmp_path: Path,
                                                                                     engine: Engine) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "One text."}, {"id": "b", "text": "Two."}])
    assert index(engine, source, f"{tmp_path}/x.parquet").added == 2
    table = pq.read_table(tmp_path / "x.parquet")
    older = {k: v for k, v in table.schema.metadata.items() if k != b"embedctl.files_sha256"}
    pq.write_table(table.replace_schema_metadata(older), tmp_path / "x.parquet")
    assert index(engine, source, f"{tmp_path}/x.parquet").unchanged == 2


def test_a_cross_encoder_is_refused_having_no_vectors_to_index(tmp_path: Path) -> None:
    reranker = save_random_model(tmp_path / "reranker", "BertForSequenceClassification", num_labels=1)
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "One text."}])
    with pytest.raises(UserError, match="is a cross-encoder: it scores query-document pairs and has no vectors"):
        run_index(IndexModel.loaded(Engine.load(str(reranker))), IndexOptions(str(source), f"{tmp_path}/x.parquet"))
    assert not (tmp_path / "x.parquet").exists()


def test_a_text_holding_a_token_past_the_embedding_table_is_named_by_its_row(tmp_path: Path, random_bert: Path) -> None:
    """Qwen3-Embedding-4B's <think>: the line and id to fix, rather than a failed batch of rows."""
    add_token_past_the_table(random_bert)
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu"))
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A cat."}, {"id": "b", "text": "<think> a dog"}])
    with pytest.raises(UserError, match=r"docs.jsonl line 2: the text \(id 'b'\) holds token id 30522, which the "
                                        "tokenizer adds but the model's embedding table lacks"):
        index(engine, source, f"{tmp_path}/x.parquet")
    write_jsonl(source, [{"id": "a", "text": "A cat."}, {"id": "b", "text": "a dog"}])
    assert index(engine, source, f"{tmp_path}/x.parquet").added == 2


@pytest.mark.parametrize("out", OUTPUTS)
def test_kept_map_columns_at_any_depth_are_updated_and_rebuilt(tmp_path: Path, engine: Engine, out: str) -> None:
    """Parquet's reader names a map's entries after its column; Lance refused to update a table made so."""
    tags_type = pa.map_(pa.string(), pa.string())
    nested_type = pa.struct([pa.field("labels", pa.list_(tags_type))])

    def export(texts: dict[str, str], lang: dict[str, str]) -> Path:
        ids = sorted(texts)
        tags = pa.array([[("lang", lang[i])] for i in ids], tags_type)
        nested = pa.array([{"labels": [[("lang", lang[i])]]} for i in ids], nested_type)
        pq.write_table(pa.table({"id": ids, "text": [texts[i] for i in ids], "tags": tags, "nested": nested}),
                       tmp_path / "m.parquet")
        return tmp_path / "m.parquet"

    def stored() -> dict[str, tuple]:
        rows = read_output(f"{tmp_path}/{out}").to_pylist()
        return {row["id"]: (row["tags"], row["nested"]) for row in rows}

    keep = ("tags", "nested")
    first = export({"a": "One.", "b": "Two."}, {"a": "en", "b": "de"})
    assert index(engine, first, f"{tmp_path}/{out}", keep=keep).added == 2
    report = index(engine, export({"a": "One!", "b": "Two.", "c": "Three."}, {"a": "fr", "b": "de", "c": "it"}),
                   f"{tmp_path}/{out}", keep=keep)
    assert (report.added, report.updated, report.unchanged) == (1, 1, 1)
    assert stored() == {i: ([("lang", lang)], {"labels": [[("lang", lang)]]}) for i, lang in
                        [("a", "fr"), ("b", "de"), ("c", "it")]}
    rebuilt = index(engine, export({"a": "One!"}, {"a": "es"}), f"{tmp_path}/{out}", keep=keep, rebuild=True)
    assert (rebuilt.added, rebuilt.updated, rebuilt.deleted) == (0, 1, 2)
    assert stored() == {"a": ([("lang", "es")], {"labels": [[("lang", "es")]]})}


@pytest.mark.parametrize("out", OUTPUTS)
def test_an_empty_first_export_with_kept_columns_does_not_block_the_next_runs(tmp_path: Path, engine: Engine,
                                                                              out: str) -> None:
    empty = pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string()),
                      "title": pa.array([], pa.string())})
    pq.write_table(empty, tmp_path / "empty.parquet")
    write_jsonl(tmp_path / "empty.jsonl", [])
    full = write_jsonl(tmp_path / "full.jsonl", [{"id": "a", "text": "A text.", "title": "A title"}])

    from_jsonl = index(engine, tmp_path / "empty.jsonl", f"{tmp_path}/j{out}", keep=("title",))
    assert from_jsonl.not_written == "the source has no rows to tell the types of the --keep columns"
    assert from_jsonl.summary().endswith(f"-> {tmp_path}/j{out} not written: {from_jsonl.not_written}")
    assert not (tmp_path / f"j{out}").exists()
    assert index(engine, full, f"{tmp_path}/j{out}", keep=("title",)).added == 1

    # an empty export is refused as it is without --keep, not "not written" (updating, the kept types are the output's)
    refusals = {"prune": "the source holds no rows with text, so --prune would delete 1 of the 1 stored in",
                "rebuild": "the source holds no rows, so --rebuild has nothing to leave in"}
    for flag, refusal in refusals.items():
        with pytest.raises(UserError, match=refusal):
            index(engine, tmp_path / "empty.jsonl", f"{tmp_path}/j{out}", keep=("title",), **{flag: True})
    assert read_output(f"{tmp_path}/j{out}").column("id").to_pylist() == ["a"]
    assert index(engine, tmp_path / "empty.parquet", f"{tmp_path}/p{out}", keep=("title",)).not_written is None
    assert index(engine, full, f"{tmp_path}/p{out}", keep=("title",)).added == 1
    assert read_output(f"{tmp_path}/p{out}").select(["id", "title"]).to_pylist() == [{"id": "a", "title": "A title"}]


def fragments(folder: Path, name: str) -> list[int]:
    """The rows of each fragment of LanceDB table `name` in folder."""
    return [fragment.count_rows() for fragment in lancedb.connect(folder).open_table(name).to_lance().get_fragments()]


def test_a_lance_tables_small_fragments_are_compacted_once_enough_have_gathered(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each commit adds a fragment, and a cron job's commits are small: once COMPACT_SMALL_FRAGMENTS (10; 3 here)
    are under COMPACT_TARGET_ROWS (10,000; 4 here), the run ends by compacting them, and says so. Fragments of
    that size, as a build's commits give them, stay (a flat search scans them in parallel). A table left alone
    (--no-optimize) holds the same rows, and the next run that may tidy it does, though it changed nothing."""
    monkeypatch.setattr(writers, "COMPACT_TARGET_ROWS", 4)
    monkeypatch.setattr(writers, "COMPACT_SMALL_FRAGMENTS", 3)

    def texts(n: int) -> Path:
        return write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(n)])

    out, left = f"{tmp_path}/x.lance", f"{tmp_path}/left.lance"
    for count, commit_rows in ((8, 4), (10, 1)):
        assert index(engine, texts(count), out, commit_rows=commit_rows).optimized is None
        assert index(engine, texts(count), left, commit_rows=commit_rows, optimize=False).optimized is None
    assert fragments(tmp_path, "x") == [4, 4, 1, 1]  # two small ones: not yet
    report = index(engine, texts(11), out, commit_rows=1)
    assert report.optimized == "3 fragments rewritten as 1"
    assert report.summary().endswith(f" -> {out}; table optimized: 3 fragments rewritten as 1")
    assert fragments(tmp_path, "x") == [4, 4, 3]
    assert index(engine, texts(11), out, commit_rows=1).optimized is None  # one small fragment: nothing to do
    assert index(engine, texts(11), left, commit_rows=1, optimize=False).optimized is None
    assert fragments(tmp_path, "left") == [4, 4, 1, 1, 1]
    rows, expected = sorted_rows(out), sorted_rows(left)
    assert [row["id"] for row in rows] == [row["id"] for row in expected] == sorted(f"d{i}" for i in range(11))
    np.testing.assert_allclose([row["vector"] for row in rows], [row["vector"] for row in expected], atol=1e-6)
    unchanged = index(engine, texts(11), left)
    assert (unchanged.unchanged, unchanged.optimized) == (11, "3 fragments rewritten as 1")


def test_a_parquet_directorys_small_parts_are_merged_once_enough_have_gathered(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each commit adds a part, as to a Lance table a fragment, and by the same rule: once COMPACT_SMALL_FRAGMENTS
    (10; 3 here) parts under COMPACT_TARGET_ROWS rows (10,000; 4 here) would merge, the run ends by merging them,
    each group of up to that many rows into one part, and says so. A directory left alone (--no-optimize) holds
    the same rows, and the next run that may tidy it does, though it changed nothing."""
    monkeypatch.setattr(writers, "COMPACT_TARGET_ROWS", 4)
    monkeypatch.setattr(writers, "COMPACT_SMALL_FRAGMENTS", 3)

    def texts(n: int) -> Path:
        return write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(n)])

    def part_rows(out: str) -> list[int]:
        return [pq.read_metadata(part).num_rows for part in sorted(Path(out).glob("*.parquet"))]

    out, left = f"{tmp_path}/x/", f"{tmp_path}/left/"
    for count, commit_rows in ((8, 4), (10, 1)):
        assert index(engine, texts(count), out, commit_rows=commit_rows).optimized is None
        assert index(engine, texts(count), left, commit_rows=commit_rows, optimize=False).optimized is None
    assert part_rows(out) == [4, 4, 1, 1]  # two small ones: not yet
    report = index(engine, texts(13), out, commit_rows=1)
    assert report.optimized == "4 parts merged into 1"
    assert report.summary().endswith(f" -> {out}; table optimized: 4 parts merged into 1")
    assert part_rows(out) == [4, 4, 4, 1]
    assert index(engine, texts(13), out, commit_rows=1).optimized is None
    assert index(engine, texts(13), left, commit_rows=1, optimize=False).optimized is None
    assert part_rows(left) == [4, 4, 1, 1, 1, 1, 1]
    rows, expected = sorted_rows(out), sorted_rows(left)
    assert [row["id"] for row in rows] == [row["id"] for row in expected] == sorted(f"d{i}" for i in range(13))
    np.testing.assert_allclose([row["vector"] for row in rows], [row["vector"] for row in expected], atol=1e-6)
    unchanged = index(engine, texts(13), left)
    assert (unchanged.unchanged, unchanged.optimized) == (13, "4 parts merged into 1")
    assert part_rows(left) == [4, 4, 4, 1]


def rebuild_killed_in_its_swap(engine: Engine, source: Path, out: str, monkeypatch: pytest.MonkeyPatch,
                               **options: object) -> None:
    """A --rebuild of the Parquet directory out killed as its swap moves the first staged part in."""
    move = fsspec.implementations.local.LocalFileSystem.mv

    def killed_at_the_swap(fs: object, source_path: str, target: str, *args: object, **kwargs: object) -> None:
        if "/.rebuild/part-" in source_path and "/.rebuild/" not in target:
            raise KeyboardInterrupt
        move(fs, source_path, target, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(fsspec.implementations.local.LocalFileSystem, "mv", killed_at_the_swap)
        with pytest.raises(KeyboardInterrupt):
            index(engine, source, out, rebuild=True, **options)


def test_a_run_after_a_rebuild_killed_in_its_swap_reads_the_output_as_the_rebuild_left_it(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild gave a kept column another type; the plain run after it types its kept values by the rebuild's
    parts, not the old ones that the swap had yet to remove, and finishes the swap."""
    out = f"{tmp_path}/parts/"
    rows = [{"id": "a", "text": "Alpha.", "rating": 3}, {"id": "b", "text": "Beta.", "rating": 4}]
    index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out, keep=("rating",))
    rows[0]["rating"] = 3.5
    source = write_jsonl(tmp_path / "docs.jsonl", rows)
    with pytest.raises(UserError, match="does not fit the type int64"):
        index(engine, source, out, keep=("rating",))
    rebuild_killed_in_its_swap(engine, source, out, monkeypatch, keep=("rating",))
    report = index(engine, source, out, keep=("rating",))
    assert (report.added, report.updated, report.unchanged) == (0, 0, 2)
    assert [(row["id"], row["rating"]) for row in sorted_rows(out)] == [("a", 3.5), ("b", 4.0)]
    assert not (tmp_path / "parts" / ".rebuild").exists()


def test_a_rebuild_run_again_after_it_was_killed_in_its_swap_does_not_embed_again(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a rebuild killed earlier goes on from its stage, one killed in its swap goes on from what the swap
    brought in: the same command embeds nothing again, and still drops ids that left the source."""
    out = f"{tmp_path}/parts/"
    rows = [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(5)]
    index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out)
    source = write_jsonl(tmp_path / "docs.jsonl", rows)
    rebuild_killed_in_its_swap(engine, source, out, monkeypatch, prompt="passage: ")
    again = index(engine, write_jsonl(tmp_path / "docs.jsonl", rows[1:]), out, prompt="passage: ", rebuild=True)
    assert (again.added, again.updated, again.unchanged, again.deleted, again.tokens) == (0, 0, 4, 1, 0)
    assert [row["id"] for row in sorted_rows(out)] == ["d1", "d2", "d3", "d4"]
    assert read_output(out).schema.metadata[b"embedctl.prompt"] == b"passage: "
    assert not (tmp_path / "parts" / ".rebuild").exists()


def test_a_rebuilt_lance_table_has_the_fragments_of_a_build(tmp_path: Path, engine: Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """LanceDB's overwrite writes one fragment per million rows, which its flat search scans several times slower
    than ten of 100,000: the rebuilt table is written in fragments of COMPACT_TARGET_ROWS (10,000; 4 here). Its
    upkeep removes the versions replaced over VERSIONS_KEPT ago (7 days; none here), the old table's whole copy
    among them, as after any run."""
    monkeypatch.setattr(writers, "COMPACT_TARGET_ROWS", 4)
    monkeypatch.setattr(writers, "VERSIONS_KEPT", timedelta(0))
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(11)])
    index(engine, source, f"{tmp_path}/x.lance", commit_rows=11)
    assert fragments(tmp_path, "x") == [11]
    rebuilt = index(engine, source, f"{tmp_path}/x.lance", rebuild=True)
    assert rebuilt.updated == 11 and re.fullmatch(r"1 old version removed \(\d+\.\d MiB\)", rebuilt.optimized)
    assert fragments(tmp_path, "x") == [4, 4, 3]
    assert len(lancedb.connect(tmp_path).open_table("x").list_versions()) == 1
    assert sorted(row["id"] for row in sorted_rows(f"{tmp_path}/x.lance")) == sorted(f"d{i}" for i in range(11))


def test_a_lance_tables_indexes_get_the_rows_they_lack_once_enough_have_gathered(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows outside an index are scanned one by one by every query: from INDEX_UNINDEXED_ROWS (100,000; 5 here)
    the run ends by adding them to it."""
    monkeypatch.setattr(writers, "INDEX_UNINDEXED_ROWS", 5)
    monkeypatch.setattr(writers, "COMPACT_TARGET_ROWS", 1)  # no compaction: this is about the index alone
    rows = [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(10)]
    out = f"{tmp_path}/x.lance"
    index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out)
    lancedb.connect(tmp_path).open_table("x").create_index("id", config=BTree())
    rows += [{"id": f"n{i}", "text": f"New text {i}."} for i in range(4)]
    assert index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out).optimized is None  # 4 outside the index
    assert lancedb.connect(tmp_path).open_table("x").index_stats("id_idx").num_unindexed_rows == 4
    rows += [{"id": "n4", "text": "New text 4."}]
    report = index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out)
    assert report.optimized == "its indexes given the 5 rows they lacked"
    stats = lancedb.connect(tmp_path).open_table("x").index_stats("id_idx")
    assert (stats.num_indexed_rows, stats.num_unindexed_rows) == (15, 0)


def test_a_lance_tables_old_versions_are_removed_at_the_end_of_the_run_that_changed_it(
        tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every commit keeps the files of what it replaced: those of versions older than VERSIONS_KEPT (7 days; none
    here) are removed, and the table reads the same."""
    monkeypatch.setattr(writers, "VERSIONS_KEPT", timedelta(0))
    out = f"{tmp_path}/x.lance"
    rows = [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(6)]
    index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out, commit_rows=2, optimize=False)
    assert len(lancedb.connect(tmp_path).open_table("x").list_versions()) == 3
    rows[0]["text"] = "Another text."
    report = index(engine, write_jsonl(tmp_path / "docs.jsonl", rows), out)
    assert re.fullmatch(r"\d+ old versions removed \(\d+\.\d MiB\)", report.optimized)
    table = lancedb.connect(tmp_path).open_table("x")
    assert len(table.list_versions()) == 1 and table.count_rows() == 6
    assert table.search().where("id = 'd0'").to_arrow().column("n_tokens").to_pylist() == [5]  # another text .


def test_only_neighbouring_small_fragments_count_toward_a_compaction() -> None:
    """Lance merges neighbours only: a small fragment between full ones never merges, so it must not count."""
    assert writers.mergeable_small([10, 5, 10, 5, 5, 3], 10) == 3
    assert writers.mergeable_small([5, 10, 5], 10) == 0
    assert writers.mergeable_small([5, 5], 10) == 2
    assert writers.mergeable_small([], 10) == 0


def test_only_versions_replaced_before_the_cutoff_are_old() -> None:
    """A version made long ago that was current until an hour ago may have a reader on it: it stays."""
    now = datetime(2026, 12, 7, 12, 0)
    versions = [{"version": n, "timestamp": now - age} for n, age in
                ((1, timedelta(days=10)), (2, timedelta(days=9)), (3, timedelta(hours=1)), (4, timedelta(0)))]
    assert writers._superseded_before(versions, now - timedelta(days=7)) == [1]
    assert writers._superseded_before(versions, now + timedelta(seconds=1)) == [1, 2, 3]
    assert writers._superseded_before(versions[:1], now) == []


def test_a_failed_upkeep_leaves_the_run_done_and_says_so(tmp_path: Path, engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's rows are committed before the upkeep: a failure there (a full disk) is told, not a failed run."""
    def full_disk(versions: list, cutoff: datetime) -> list:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers, "_superseded_before", full_disk)
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A text."}])
    report = index(engine, source, f"{tmp_path}/x.lance")
    assert (report.added, report.optimized) == (1, None)
    assert report.optimize_error == "[Errno 28] No space left on device"
    assert report.summary().endswith("; table not optimized ([Errno 28] No space left on device): its rows are "
                                     "committed, and the next run tries again")
    assert [row["id"] for row in sorted_rows(f"{tmp_path}/x.lance")] == ["a"]


def test_a_rebuild_names_the_indexes_the_table_it_replaces_had(tmp_path: Path, engine: Engine) -> None:
    """LanceDB's overwrite leaves none of a table's indexes, and an ANN index's training options are not kept
    to build it again by: the summary says so, rather than queries turning slow without a word."""
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(5)])
    out = f"{tmp_path}/x.lance"
    assert index(engine, source, out).dropped_indexes == []
    lancedb.connect(tmp_path).open_table("x").create_index("id", config=BTree())
    rebuilt = index(engine, source, out, rebuild=True)
    assert rebuilt.dropped_indexes == ["id_idx: BTree on id"]
    assert rebuilt.summary().endswith("; the rebuilt table has none of the old one's indexes (id_idx: BTree on id): "
                                      "create them again")
    assert lancedb.connect(tmp_path).open_table("x").list_indices() == []
    assert index(engine, source, out, rebuild=True).dropped_indexes == []
    assert index(engine, source, f"{tmp_path}/x.parquet", rebuild=True).dropped_indexes == []


def test_a_database_folder_with_a_trailing_slash_takes_a_table(tmp_path: Path, engine: Engine) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A text."}])
    options = IndexOptions(source=str(source), out=f"{tmp_path}/db/", table="docs")
    with lock_output(options):
        assert run_index(IndexModel.loaded(engine), options).added == 1
    assert lancedb.connect(tmp_path / "db").open_table("docs").to_arrow().column("id").to_pylist() == ["a"]


@pytest.mark.parametrize("commit_rows", [0, -5])
def test_commit_rows_that_are_not_positive_are_refused_before_the_source_is_read(tmp_path: Path,
                                                                                 commit_rows: int) -> None:
    with pytest.raises(UserError, match=f"^--commit-rows {commit_rows}: give a positive number of rows$"):
        open_corpus(IndexOptions(source=str(tmp_path / "absent.jsonl"), out=f"{tmp_path}/x.lance",
                                 commit_rows=commit_rows))
