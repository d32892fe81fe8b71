"""Vector stores: round trips, refusal of incompatible outputs, group commits, upserts and prunes,
rebuilds swapped in at finish, what aborts and crashes leave, search, and where the lock file goes."""

import os
import shutil
import subprocess
import sys
import textwrap

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq
import pytest

from engine.errors import UserError
from pipelines import writers
from pipelines.writers import lock_file, open_store, output_schema

DIM = 4
META = {"embedctl.model": "test/model", "embedctl.weights_sha256": "abc", "embedctl.dim": str(DIM)}
KEPT = pa.schema([("lang", pa.string())])


def schema(meta=META, dim=DIM, kept=KEPT):
    return output_schema(dim, kept, dict(meta))


def batch(ids, vectors=None, sch=None, keys=None):
    sch = sch or schema()
    dim = sch.field("vector").type.list_size
    if vectors is None:
        vectors = np.random.default_rng(len(ids)).random((len(ids), dim), dtype=np.float32)
    vectors = np.asarray(vectors, dtype=np.float32)
    columns = [
        pa.array(ids, pa.string()),
        pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim),
        pa.array([3] * len(ids), pa.int32()),
        pa.array([False] * len(ids)),
        pa.array(keys or [f"k-{i}" for i in ids], pa.string()),
    ]
    if "lang" in sch.names:
        columns.append(pa.array(["en"] * len(ids)))
    return pa.record_batch(columns, schema=sch.remove_metadata())


# Each output kind: how to name it, how to read it back.
OUTPUTS = ["file.parquet", "dir/", "vectors.lance", "db+table"]
GROUPED = ["dir/", "vectors.lance", "db+table"]  # the kinds that commit in groups


def spec(tmp_path, kind):
    if kind == "db+table":
        return {"out": str(tmp_path / "db"), "table": "vectors"}
    return {"out": str(tmp_path / kind) + ("/" if kind.endswith("/") else "")}


def read_back(tmp_path, kind) -> pa.Table:
    if kind == "file.parquet":
        return pq.read_table(tmp_path / "file.parquet")
    if kind == "dir/":
        return pq.read_table(tmp_path / "dir")
    if kind == "vectors.lance":
        return lancedb.connect(str(tmp_path)).open_table("vectors").to_arrow()
    return lancedb.connect(str(tmp_path / "db")).open_table("vectors").to_arrow()


def ids_of(tmp_path, kind) -> list[str]:
    return sorted(read_back(tmp_path, kind).column("id").to_pylist())


def write(tmp_path, kind, ids, sch=None, **options):
    store = open_store(**spec(tmp_path, kind), schema=sch or schema(), **options)
    store.write(batch(ids, sch=sch))
    return store.finish({i: f"k-{i}" for i in ids}, prune=False)


def snapshot(root):
    """Every file under root with its bytes."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def test_output_schema():
    sch = schema()
    assert sch.names == ["id", "vector", "n_tokens", "truncated", "content_key", "lang"]
    assert sch.field("vector").type == pa.list_(pa.float32(), DIM)
    assert sch.field("n_tokens").type == pa.int32() and sch.field("truncated").type == pa.bool_()
    assert {k.decode(): v.decode() for k, v in sch.metadata.items()} == META
    assert output_schema(8, None, {}).names == ["id", "vector", "n_tokens", "truncated", "content_key"]
    with pytest.raises(UserError, match="--keep id: the output already has an? 'id' column"):
        output_schema(DIM, pa.schema([("id", pa.string())]), {})


@pytest.mark.parametrize("kind", OUTPUTS)
def test_round_trip_keeps_rows_vectors_and_metadata(tmp_path, kind):
    vectors = np.arange(12, dtype=np.float32).reshape(3, DIM)
    store = open_store(**spec(tmp_path, kind), schema=schema())
    assert store.existing == {}
    store.write(batch(["a", "b"], vectors[:2]))
    store.write(batch(["c"], vectors[2:]))
    assert store.finish({"a": "k-a", "b": "k-b", "c": "k-c"}, prune=False) == 0
    table = read_back(tmp_path, kind)
    assert table.column("id").to_pylist() == ["a", "b", "c"]
    assert np.array_equal(np.stack(table.column("vector").to_numpy(zero_copy_only=False)), vectors)
    assert table.column("lang").to_pylist() == ["en"] * 3
    assert table.column("content_key").to_pylist() == ["k-a", "k-b", "k-c"]
    assert table.schema.field("vector").type == pa.list_(pa.float32(), DIM)
    assert {k: table.schema.metadata[k.encode()].decode() for k in META} == META
    assert open_store(**spec(tmp_path, kind), schema=schema()).existing == {"a": "k-a", "b": "k-b", "c": "k-c"}


def test_lance_path_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "vectors.lance", ["a", "b"])
    assert os.path.isdir("vectors.lance")
    assert lancedb.connect(".").open_table("vectors").count_rows() == 2


def test_lancedb_search_finds_the_nearest_vector(tmp_path):
    store = open_store(str(tmp_path / "vectors.lance"), schema())
    store.write(batch(["x", "y", "z", "w"], np.eye(DIM, dtype=np.float32)))
    store.finish({}, prune=False)
    hits = lancedb.connect(str(tmp_path)).open_table("vectors").search(np.array([0.1, 0.9, 0.2, 0.0])).limit(3).to_list()
    assert len(hits) == 3
    assert hits[0]["id"] == "y"
    assert hits[0]["lang"] == "en"


@pytest.mark.parametrize("kind", OUTPUTS)
def test_other_settings_or_columns_are_refused_and_leave_the_output_byte_identical(tmp_path, kind):
    write(tmp_path, kind, ["a"])
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"cannot update .*: it was embedded with the model test/model \(weights sha256 "
                                        r"abc\.\.\.\) and this run's is other/model \(weights sha256 def\.\.\.\); "
                                        "pass --rebuild to re-embed it all"):
        open_store(**spec(tmp_path, kind), schema=schema(META | {"embedctl.weights_sha256": "def", "embedctl.dim": "8",
                                                                 "embedctl.files_sha256": "fed",
                                                                 "embedctl.model": "other/model"}))
    with pytest.raises(UserError, match="pooling none and this run's pooling is cls"):
        open_store(**spec(tmp_path, kind), schema=schema(META | {"embedctl.pooling": "cls"}))
    with pytest.raises(UserError, match="dim 4 and this run's dim is 8"):
        open_store(**spec(tmp_path, kind), schema=schema(META | {"embedctl.dim": "8"}, dim=8))
    # kept columns by name: the --keep flags that match the output (a cron line that lacks the build's --keep)
    with pytest.raises(UserError, match=r"it keeps the column lang, which this run does not; add --keep lang to match "
                                        r"it, or pass --rebuild to re-embed it all with this run's columns"):
        open_store(**spec(tmp_path, kind), schema=schema(kept=None))
    with pytest.raises(UserError, match=r"it keeps the column lang, which this run does not; this run keeps tag, which "
                                        r"it lacks; add --keep lang and drop --keep tag to match it"):
        open_store(**spec(tmp_path, kind), schema=schema(kept=pa.schema([("tag", pa.string())])))
    # the same names in other types: the columns as they are and as this run writes them
    with pytest.raises(UserError, match="its columns are .* but this run writes"):
        open_store(**spec(tmp_path, kind), schema=schema(kept=pa.schema([("lang", pa.int64())])))
    # the model's spelling is not compared: the same weights under another name
    open_store(**spec(tmp_path, kind), schema=schema(META | {"embedctl.model": "/models/the-same-files"})).abort()
    assert snapshot(tmp_path) == before


def test_an_output_without_content_keys_is_refused(tmp_path):
    sch = schema().remove(schema().get_field_index("content_key"))
    lancedb.connect(str(tmp_path)).create_table("vectors", schema=sch)
    with pytest.raises(UserError, match="it has no content_key column .*; pass --rebuild"):
        open_store(str(tmp_path / "vectors.lance"), schema())


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_lance_table_that_embedctl_did_not_write_is_never_changed(tmp_path, rebuild):
    lancedb.connect(str(tmp_path)).create_table("vectors", data=pa.table({"theirs": [1, 2, 3]}))
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"vectors.lance holds data that embedctl did not write \(.*pick another --out"):
        open_store(str(tmp_path / "vectors.lance"), schema(), rebuild=rebuild)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", OUTPUTS)
def test_abort_before_the_first_commit_leaves_no_output(tmp_path, kind):
    store = open_store(**spec(tmp_path, kind), schema=schema())
    store.write(batch(["a", "b"]))
    store.abort()
    assert snapshot(tmp_path) == {}
    leftovers = sorted(os.listdir(tmp_path))
    if kind == "db+table":
        assert leftovers in ([], ["db"]) and lancedb.connect(str(tmp_path / "db")).list_tables().tables == []
    else:
        assert leftovers == []


@pytest.mark.parametrize("kind", GROUPED)
def test_groups_commit_as_they_fill_and_stay_through_an_abort(tmp_path, kind):
    store = open_store(**spec(tmp_path, kind), schema=schema(), commit_rows=2)
    store.write(batch(["a"]))
    store.write(batch(["b", "c", "d", "e"]))  # split across groups: a+b, c+d, and e waiting
    assert ids_of(tmp_path, kind) == ["a", "b", "c", "d"] and store.committed_rows == 4
    store.abort()
    assert ids_of(tmp_path, kind) == ["a", "b", "c", "d"] and store.committed_rows == 4
    assert open_store(**spec(tmp_path, kind), schema=schema()).existing == {i: f"k-{i}" for i in "abcd"}


@pytest.mark.parametrize("kind", OUTPUTS)
@pytest.mark.parametrize("prune", [False, True])
def test_changed_ids_are_updated_new_ones_added_and_pruned_ones_deleted(tmp_path, kind, prune):
    write(tmp_path, kind, ["a", "b", "c"])
    store = open_store(**spec(tmp_path, kind), schema=schema(), commit_rows=1)
    store.write(batch(["b", "d"], np.full((2, DIM), 7, np.float32), keys=["k-b2", "k-d"]))
    assert store.finish({"a": "k-a", "b": "k-b2", "d": "k-d"}, prune) == (1 if prune else 0)
    table = read_back(tmp_path, kind).sort_by("id")
    assert table.column("id").to_pylist() == (["a", "b", "d"] if prune else ["a", "b", "c", "d"])
    rows = {row["id"]: row for row in table.to_pylist()}
    assert rows["b"]["content_key"] == "k-b2" and rows["b"]["vector"] == [7.0] * DIM
    assert rows["a"]["content_key"] == "k-a"


def keys_of(tmp_path) -> list[tuple[str, str]]:
    table = read_back(tmp_path, "dir/")
    return sorted(zip(table.column("id").to_pylist(), table.column("content_key").to_pylist()))


def test_an_update_of_a_parquet_dir_shows_readers_one_copy_per_id_until_finish_and_after_a_kill(tmp_path):
    """An update's groups wait in a stage hidden from readers: a changed row's new part beside its old one
    would show both copies (a kill left them so until the next run, which refused the output as an index)."""
    write(tmp_path, "dir/", ["a", "b"])  # part-00000: a and b, both with their old keys
    store = open_store(str(tmp_path / "dir"), schema(), commit_rows=1)
    store.write(batch(["b", "c"], keys=["k-b2", "k-c"]))  # two groups commit; the kill comes before finish
    store.abort()
    assert keys_of(tmp_path) == [("a", "k-a"), ("b", "k-b")] and parts(tmp_path) == ["part-00000.parquet"]
    assert pyarrow.dataset.dataset(tmp_path / "dir").to_table().num_rows == 2  # pyarrow leaves the stage out too
    store = open_store(str(tmp_path / "dir"), schema())
    assert store.existing == {"a": "k-a", "b": "k-b2", "c": "k-c"}  # the stage is this run's committed work
    store.finish({"a": "k-a", "b": "k-b2", "c": "k-c"}, prune=False)
    assert keys_of(tmp_path) == [("a", "k-a"), ("b", "k-b2"), ("c", "k-c")]
    assert sorted(os.listdir(tmp_path / "dir")) == parts(tmp_path)  # no stage left


def test_an_update_killed_while_moving_its_parts_in_is_finished_by_the_next_run(tmp_path, monkeypatch):
    write(tmp_path, "dir/", ["a", "b"])
    store = open_store(str(tmp_path / "dir"), schema(), commit_rows=1)
    store.write(batch(["a", "b"], keys=["k-a2", "k-b2"]))
    moves = 0
    move = store._fs.mv

    def kill_at_the_second_move(*args, **kwargs):
        nonlocal moves
        moves += 1
        if moves == 2:
            raise KeyboardInterrupt
        return move(*args, **kwargs)

    monkeypatch.setattr(store._fs, "mv", kill_at_the_second_move)
    with pytest.raises(KeyboardInterrupt):
        store.finish({"a": "k-a2", "b": "k-b2"}, prune=False)
    monkeypatch.undo()
    assert keys_of(tmp_path) == [("a", "k-a"), ("a", "k-a2"), ("b", "k-b")]  # what readers see until the next run
    store = open_store(str(tmp_path / "dir"), schema(), commit_rows=1)
    assert store.existing == {"a": "k-a2", "b": "k-b2"}
    store.write(batch(["c"], keys=["k-c"]))
    store.finish({"a": "k-a2", "b": "k-b2", "c": "k-c"}, prune=False)
    assert keys_of(tmp_path) == [("a", "k-a2"), ("b", "k-b2"), ("c", "k-c")]


def test_a_killed_updates_stage_stays_through_a_rebuild_cut_short_and_goes_when_one_replaces_the_output(tmp_path):
    write(tmp_path, "dir/", ["a"])
    store = open_store(str(tmp_path / "dir"), schema(), commit_rows=1)
    store.write(batch(["a"], keys=["k-a2"]))
    store.abort()
    other = schema(META | {"embedctl.weights_sha256": "new"})
    open_store(str(tmp_path / "dir"), other, rebuild=True).abort()  # refused, or killed, before it replaced anything
    assert open_store(str(tmp_path / "dir"), schema()).existing == {"a": "k-a2"}  # the update's work is kept
    store = open_store(str(tmp_path / "dir"), other, rebuild=True)
    assert store.existing == {}
    store.write(batch(["a"], keys=["k-a3"], sch=other))
    store.finish({"a": "k-a3"}, prune=False)
    assert keys_of(tmp_path) == [("a", "k-a3")] and not (tmp_path / "dir" / ".update").exists()


def test_a_broken_staged_part_is_named_where_it_is_with_the_way_out(tmp_path):
    write(tmp_path, "dir/", ["a"])
    (tmp_path / "dir" / ".update").mkdir()
    (tmp_path / "dir" / ".update" / "part-00001.parquet").write_bytes(b"")
    with pytest.raises(UserError, match=r"dir/\.update/part-00001\.parquet is not a readable Parquet file .*remove "
                                        r"the folder .*dir/\.update and run again"):
        open_store(str(tmp_path / "dir"), schema())
    shutil.rmtree(tmp_path / "dir" / ".update")
    assert open_store(str(tmp_path / "dir"), schema()).existing == {"a": "k-a"}


def parts(tmp_path) -> list[str]:
    return sorted(name for name in os.listdir(tmp_path / "dir") if name.endswith(".parquet"))


def test_small_parts_merge_in_part_order_in_groups_that_stay_within_the_target():
    assert writers.small_part_groups([100, 100, 100, 20_000, 5_000, 6_000, 3_000], 10_000) == [[0, 1, 2, 4], [5, 6]]
    assert writers.small_part_groups([6_000, 6_000, 10_000], 10_000) == []  # no two fit in one
    assert writers.small_part_groups([5_000, 5_000], 10_000) == [[0, 1]]
    assert writers.small_part_groups([], 10_000) == []


def test_a_merge_of_parts_cut_short_leaves_equal_copies_that_the_next_run_removes(tmp_path, monkeypatch):
    """The merged part is written over the newest of its parts before the others go: a failure in between (a
    full disk) leaves rows twice, equal copies, which is told as the upkeep's error; the next run keeps one."""
    ids = [f"r{i}" for i in range(12)]
    store = open_store(f"{tmp_path}/dir/", schema(), commit_rows=1, optimize=False)
    store.write(batch(ids))
    store.finish({i: f"k-{i}" for i in ids}, prune=False)
    assert len(parts(tmp_path)) == 12
    before = read_back(tmp_path, "dir/").sort_by("id")

    store = open_store(f"{tmp_path}/dir/", schema())
    fs = store._fs

    def full_disk(paths, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "rm", full_disk)
    assert store.finish({i: f"k-{i}" for i in ids}, prune=False) == 0
    assert (store.optimized, store.optimize_error) == (None, "[Errno 28] No space left on device")
    assert len(parts(tmp_path)) == 12 and read_back(tmp_path, "dir/").num_rows == 23  # part-00011 now holds all 12
    monkeypatch.undo()

    store = open_store(f"{tmp_path}/dir/", schema())
    assert store.existing == {i: f"k-{i}" for i in ids}
    store.finish({i: f"k-{i}" for i in ids}, prune=False)
    assert parts(tmp_path) == ["part-00011.parquet"] and store.optimized is None
    assert read_back(tmp_path, "dir/").sort_by("id").equals(before)


def test_a_rebuilds_swap_cut_short_is_finished_by_the_next_run(tmp_path, monkeypatch):
    """The swap moves the staged parts in, then removes the old ones, having listed them in the stage first: after
    a crash between the moves, the next run, a plain one too, finishes it before it reads the parts."""
    old_store = open_store(f"{tmp_path}/dir/", schema(), commit_rows=1)
    old_store.write(batch(["old1", "old2"]))
    old_store.finish({"old1": "k-old1", "old2": "k-old2"}, prune=False)
    other = schema(META | {"embedctl.weights_sha256": "new"})
    store = open_store(f"{tmp_path}/dir/", other, rebuild=True, commit_rows=1)
    store.write(batch(["new1", "new2", "new3"], sch=other))
    moved = []
    move = store._fs.mv

    def crash_after_two_moves(source, target, *args, **kwargs):  # the list of old parts, then one staged part
        if len(moved) == 2:
            raise KeyboardInterrupt  # a kill: nothing of the run's own handling runs
        moved.append(target)
        return move(source, target, *args, **kwargs)

    monkeypatch.setattr(store._fs, "mv", crash_after_two_moves)
    with pytest.raises(KeyboardInterrupt):
        store.finish({"new1": "k-new1", "new2": "k-new2", "new3": "k-new3"}, prune=False)
    monkeypatch.undo()
    assert ids_of(tmp_path, "dir/") == ["new1", "old1", "old2"]  # what readers see until the next run
    assert parts(tmp_path) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]

    after = open_store(f"{tmp_path}/dir/", other)  # no --rebuild: the swap is finished all the same
    assert after.existing == {i: f"k-{i}" for i in ("new1", "new2", "new3")}
    assert parts(tmp_path) == ["part-00002.parquet", "part-00003.parquet", "part-00004.parquet"]
    assert ids_of(tmp_path, "dir/") == ["new1", "new2", "new3"]
    assert read_back(tmp_path, "dir/").schema.metadata[b"embedctl.weights_sha256"] == b"new"
    assert sorted(os.listdir(tmp_path / "dir")) == parts(tmp_path)  # no stage left


def test_a_swap_list_cut_short_is_one_error_that_says_how_to_mend_the_output(tmp_path):
    """A power loss can leave the list of old parts empty: the output cannot be told apart, so the run says so,
    and the way out it names works."""
    store = open_store(f"{tmp_path}/dir/", schema())
    store.write(batch(["a"]))
    store.finish({"a": "k-a"}, prune=False)
    (tmp_path / "dir" / ".rebuild").mkdir()
    (tmp_path / "dir" / ".rebuild" / ".swap.json").write_text("")
    for rebuild in (False, True):
        with pytest.raises(UserError, match=r"^cannot read .*/dir/\.rebuild/\.swap\.json, the list of the old parts "
                                            r"that a --rebuild was replacing when it was cut short; remove the "
                                            r"folder .*/dir/\.rebuild and run with --rebuild$"):
            open_store(f"{tmp_path}/dir/", schema(), rebuild=rebuild)
    shutil.rmtree(tmp_path / "dir" / ".rebuild")
    assert write(tmp_path, "dir/", ["b"], rebuild=True) == 1  # a, replaced
    assert ids_of(tmp_path, "dir/") == ["b"]


def test_a_merge_that_fails_partway_says_what_it_merged_and_why_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(writers, "COMPACT_TARGET_ROWS", 2)
    monkeypatch.setattr(writers, "COMPACT_SMALL_FRAGMENTS", 2)
    ids = ["a", "b", "c", "d"]
    store = open_store(f"{tmp_path}/dir/", schema(), commit_rows=1)
    store.write(batch(ids))
    removals = []
    remove = store._fs.rm

    def full_disk_at_the_second(paths, *args, **kwargs):
        removals.append(paths)
        if len(removals) == 2:
            raise OSError(28, "No space left on device")
        return remove(paths, *args, **kwargs)

    monkeypatch.setattr(store._fs, "rm", full_disk_at_the_second)
    store.finish({i: f"k-{i}" for i in ids}, prune=False)
    assert (store.optimized, store.optimize_error) == ("2 parts merged into 1", "[Errno 28] No space left on device")
    monkeypatch.undo()
    assert parts(tmp_path) == ["part-00001.parquet", "part-00002.parquet", "part-00003.parquet"]


@pytest.mark.parametrize("kind", GROUPED)
def test_a_first_rebuild_cut_short_resumes_from_its_stage(tmp_path, kind):
    """With no output yet, --rebuild still stages its groups, so the same command run again goes on from them."""
    store = open_store(**spec(tmp_path, kind), schema=schema(), rebuild=True, commit_rows=2)
    store.write(batch(["a", "b", "c"]))  # a and b commit to the stage; c waits
    store.abort()  # the kill
    again = open_store(**spec(tmp_path, kind), schema=schema(), rebuild=True, commit_rows=2)
    assert again.existing == {"a": "k-a", "b": "k-b"}
    again.write(batch(["c"]))
    assert again.finish({i: f"k-{i}" for i in "abc"}, prune=False) == 0
    assert ids_of(tmp_path, kind) == ["a", "b", "c"]


@pytest.mark.parametrize("kind", OUTPUTS)
def test_rebuild_replaces_only_at_finish_and_resumes_after_an_abort(tmp_path, kind):
    write(tmp_path, kind, ["old1", "old2"])
    before = snapshot(tmp_path)
    other = schema(META | {"embedctl.weights_sha256": "new"})

    store = open_store(**spec(tmp_path, kind), schema=other, rebuild=True, commit_rows=1)
    assert store.existing == {}
    store.write(batch(["new1"], sch=other))
    assert ids_of(tmp_path, kind) == ["old1", "old2"]
    store.abort()
    assert ids_of(tmp_path, kind) == ["old1", "old2"]
    if kind == "file.parquet":
        assert snapshot(tmp_path) == before
    else:  # the staged group waits for the next rebuild
        assert open_store(**spec(tmp_path, kind), schema=other, rebuild=True).existing == {"new1": "k-new1"}

    store = open_store(**spec(tmp_path, kind), schema=other, rebuild=True)
    store.write(batch([i for i in ("new1", "new2") if i not in store.existing], sch=other))  # as index does
    store.finish({"new1": "k-new1", "new2": "k-new2"}, prune=False)
    table = read_back(tmp_path, kind)
    assert sorted(table.column("id").to_pylist()) == ["new1", "new2"]
    assert table.schema.metadata[b"embedctl.weights_sha256"] == b"new"
    hidden = [name for name in os.listdir(tmp_path / ("db" if kind == "db+table" else "")) if name.startswith(".")]
    assert hidden == [] and not (tmp_path / "dir" / ".rebuild").exists()


def test_a_failed_lance_commit_reaches_the_caller_and_changes_nothing(tmp_path):
    write(tmp_path, "vectors.lance", ["old"])
    store = open_store(str(tmp_path / "vectors.lance"), schema(), commit_rows=1)
    with pytest.raises(ValueError, match="(?i)nan"):  # Lance refuses NaN vectors
        store.write(batch(["nan"], [[np.nan] * DIM]))
    store.abort()
    assert ids_of(tmp_path, "vectors.lance") == ["old"]


def test_a_lance_io_failure_is_one_user_error_and_changes_nothing(tmp_path):
    write(tmp_path, "vectors.lance", ["old"])
    store = open_store(str(tmp_path / "vectors.lance"), schema(), commit_rows=1)
    data = tmp_path / "vectors.lance" / "data"
    data.rename(tmp_path / "data.aside")
    data.write_text("a file where Lance writes its data files")  # an I/O error that root meets too
    with pytest.raises(UserError) as error:
        store.write(batch(["new"]))
    store.abort()
    data.unlink()
    (tmp_path / "data.aside").rename(data)
    assert str(error.value).startswith(f"cannot write {tmp_path}/vectors.lance (")
    assert str(error.value).endswith("; check free space and permissions") and "LanceError" not in str(error.value)
    assert ids_of(tmp_path, "vectors.lance") == ["old"]


def test_unknown_output_name(tmp_path):
    with pytest.raises(UserError, match=r"cannot tell what kind of output .*vectors\.csv.*\.lance.*\.parquet"):
        open_store(str(tmp_path / "vectors.csv"), schema())


@pytest.mark.parametrize("out", ["db", "db/"])
def test_a_lancedb_database_is_not_taken_for_a_folder_of_parquet_parts(tmp_path, out):
    store = open_store(str(tmp_path / "db"), schema(), table="docs")
    store.write(batch(["a"]))
    store.finish({"a": "k-a"}, prune=False)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for refused in (lambda: writers.check_output(f"{tmp_path}/{out}"), lambda: open_store(f"{tmp_path}/{out}", schema())):
        with pytest.raises(UserError, match=r"db/? is a LanceDB database \(tables: docs\), not a folder for Parquet parts; "
                                            "pass --table NAME"):
            refused()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_commit_rows_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="--commit-rows 0: give a positive number"):
        open_store(str(tmp_path / "vectors.lance"), schema(), commit_rows=0)


def test_an_unchanged_parquet_file_is_not_rewritten(tmp_path):
    write(tmp_path, "file.parquet", ["a"])
    before = snapshot(tmp_path)
    assert open_store(str(tmp_path / "file.parquet"), schema()).finish({"a": "k-a"}, prune=True) == 0
    assert snapshot(tmp_path) == before


def test_parquet_row_groups_gather_small_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(writers, "_ROW_GROUP_BYTES", 3 * batch(["a"]).nbytes)
    store = open_store(str(tmp_path / "file.parquet"), schema())
    for n in range(7):
        store.write(batch([f"r{n}"]))
    assert os.listdir(tmp_path) != ["file.parquet"]  # still under a temporary name
    store.finish({}, prune=False)
    assert os.listdir(tmp_path) == ["file.parquet"]
    meta = pq.ParquetFile(tmp_path / "file.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 3, 1]


@pytest.mark.parametrize("kind", ["file.parquet", "dir/"])
def test_parquet_vectors_have_no_dictionary_or_statistics_and_every_other_column_keeps_them(tmp_path, kind):
    kept = pa.schema([("lang", pa.string()), ("tags", pa.list_(pa.string())), ("meta", pa.struct([("year", pa.int64())]))])
    sch = schema(kept=kept)
    rows = batch(["a", "b"], sch=schema(kept=None))
    extra = [pa.array(["en", "en"]), pa.array([["x"], ["x", "y"]]), pa.array([{"year": 2020}, {"year": 2021}])]
    store = open_store(spec(tmp_path, kind)["out"], sch)
    store.write(pa.record_batch([*rows.columns, *extra], schema=sch.remove_metadata()))
    store.finish({"a": "k-a", "b": "k-b"}, prune=False)
    path = tmp_path / "file.parquet" if kind == "file.parquet" else next((tmp_path / "dir").glob("*.parquet"))
    group = pq.ParquetFile(path).metadata.row_group(0)
    columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    assert set(columns) == {"id", "vector.list.element", "n_tokens", "truncated", "content_key", "lang",
                            "tags.list.element", "meta.year"}
    assert [path for path, column in columns.items() if not column.is_stats_set] == ["vector.list.element"]
    # Booleans never get a dictionary page.
    assert [path for path, column in columns.items() if not column.has_dictionary_page] == [
        "vector.list.element", "truncated"]


@pytest.mark.parametrize("kind", ["file.parquet", "dir/"])
@pytest.mark.parametrize("rebuild", [False, True])
def test_a_parquet_output_no_one_can_read_is_not_replaced_rebuild_or_not(tmp_path, kind, rebuild):
    """embedctl writes whole files under other names and renames them: a file it cannot read is someone else's."""
    broken = tmp_path / ("file.parquet" if kind == "file.parquet" else "dir/part-00000.parquet")
    broken.parent.mkdir(exist_ok=True)
    broken.write_text("not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file .*, so not one embedctl wrote, and it will not "
                                        "replace it, --rebuild or not"):
        open_store(**spec(tmp_path, kind), schema=schema(), rebuild=rebuild)
    assert broken.read_text() == "not parquet"


def test_a_parquet_output_behind_a_symbolic_link_is_updated_where_the_link_points(tmp_path):
    write(tmp_path, "file.parquet", ["a"])
    (tmp_path / "current.parquet").symlink_to("file.parquet")
    store = open_store(str(tmp_path / "current.parquet"), schema())
    store.write(batch(["b"]))
    store.finish({"a": "k-a", "b": "k-b"}, prune=False)
    assert (tmp_path / "current.parquet").is_symlink()
    assert sorted(pq.read_table(tmp_path / "file.parquet").column("id").to_pylist()) == ["a", "b"]
    # A run through the link and a run through the file take one lock.
    assert lock_file(str(tmp_path / "current.parquet")) == lock_file(str(tmp_path / "file.parquet"))


def test_lock_file_sits_hidden_beside_the_output():
    assert lock_file("out/vectors.lance") == "out/.vectors.lance.lock"
    assert lock_file("vectors.lance") == ".vectors.lance.lock"
    assert lock_file("db", table="vectors") == "db/.vectors.lance.lock"
    assert lock_file("parts/") == ".parts.lock"
    assert lock_file("file:///data/x.parquet") == "/data/.x.parquet.lock"
    assert lock_file("s3://bucket/x.lance") is None


def test_a_crash_mid_write_leaves_old_outputs_intact_and_no_new_ones(tmp_path):
    for kind in OUTPUTS:
        write(tmp_path / "old", kind, ["old"])
    script = textwrap.dedent(f"""
        import os, pathlib, sys
        sys.path[:0] = [{os.getcwd()!r}, {os.path.dirname(__file__)!r}]
        from test_writers import OUTPUTS, batch, open_store, schema, spec
        tmp = pathlib.Path({str(tmp_path)!r})
        other = schema({{**{META!r}, "embedctl.weights_sha256": "new"}})
        started = [open_store(**spec(tmp / "new", kind), schema=schema()) for kind in OUTPUTS]
        started += [open_store(**spec(tmp / "old", kind), schema=other, rebuild=True) for kind in OUTPUTS]
        for n in range(30):
            for store, sch in zip(started, [schema()] * len(OUTPUTS) + [other] * len(OUTPUTS)):
                store.write(batch([f"{{n}}-{{i}}" for i in range(100)], sch=sch))
        os._exit(1)  # no finish, no abort, no cleanup
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 1
    for kind in OUTPUTS:
        assert read_back(tmp_path / "old", kind).column("id").to_pylist() == ["old"]
    new = tmp_path / "new"
    assert not (new / "file.parquet").exists()
    assert not (new / "dir").exists()
    for db in (new, new / "db"):
        with pytest.raises(ValueError, match="not found"):
            lancedb.connect(str(db)).open_table("vectors")
    for kind in OUTPUTS:  # what a crash leaves behind does not block the next run
        write(new, kind, ["a"])
        assert read_back(new, kind).column("id").to_pylist() == ["a"]


def test_a_parquet_file_clears_its_own_killed_temporary_files_not_another_outputs(tmp_path):
    """x.parquet's run and x.parquet.old.parquet's run hold different locks and may run at once."""
    own, other = tmp_path / ".x.parquet.0123456789ab.tmp", tmp_path / ".x.parquet.old.parquet.0123456789ab.tmp"
    own.write_text("left by a killed run")
    other.write_text("being written by another run")
    store = open_store(str(tmp_path / "x.parquet"), schema())
    store.write(batch(["a"]))
    store.finish({"a": "k-a"}, prune=False)
    assert not own.exists() and other.read_text() == "being written by another run"


@pytest.mark.parametrize("kept", [pa.struct([]), pa.list_(pa.struct([])), pa.struct([("a", pa.struct([]))])],
                         ids=["{}", "[{}]", "{a: {}}"])
def test_kept_empty_objects_are_refused_before_any_output_is_touched(kept):
    """JSONL's {} values give a --keep key a struct without fields, which Parquet's writer cannot store, nor
    Lance's inside a list."""
    with pytest.raises(UserError, match=r"^--keep v: its values hold empty objects \(\{\}\), which a Parquet file "
                                        r"cannot store, nor LanceDB inside a list; drop it from --keep, or give those "
                                        r"objects a key$"):
        schema(kept=pa.schema([("v", kept)]))


def test_restamped_dictionary_values_reach_only_the_parts_that_hold_their_rows():
    """A rewritten part's dictionary holds its own values, not every restamped row's of the run."""
    tag = pa.dictionary(pa.int32(), pa.string())
    restamps = writers.Restamps([pa.table({"id": [f"r{i}" for i in range(start, start + 50)],
                                           "content_key": ["new"] * 50,
                                           "tag": pa.array([f"t{i}" for i in range(start, start + 50)], tag)})
                                 for start in (0, 50)])
    part = pa.table({"id": ["r7", "s1", "r99"], "content_key": ["old"] * 3, "tag": pa.array(["a", "b", "c"], tag)})
    restamped = restamps.apply(part)
    assert restamped.schema == part.schema
    assert restamped.to_pydict() == {"id": ["r7", "s1", "r99"], "content_key": ["new", "old", "new"],
                                     "tag": ["t7", "b", "t99"]}
    assert set(restamped.column("tag").combine_chunks().dictionary.to_pylist()) <= {"a", "b", "c", "t7", "t99"}
