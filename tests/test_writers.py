"""Vector writers: round trips, refusal of existing outputs, atomic commit and abort, appends, search."""

import os
import subprocess
import sys
import textwrap

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.errors import UserError
from pipelines import writers
from pipelines.writers import open_writer, output_schema

DIM = 4
META = {"embedctl.model": "test/model", "embedctl.weights_sha256": "abc", "embedctl.dim": str(DIM)}
KEPT = pa.schema([("lang", pa.string())])


def schema(meta=META, dim=DIM, kept=KEPT):
    return output_schema(dim, kept, dict(meta))


def batch(ids, vectors=None, sch=None):
    sch = sch or schema()
    dim = sch.field("vector").type.list_size
    if vectors is None:
        vectors = np.random.default_rng(len(ids)).random((len(ids), dim), dtype=np.float32)
    vectors = np.asarray(vectors, dtype=np.float32)
    return pa.record_batch(
        [
            pa.array(ids, pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim),
            pa.array([3] * len(ids), pa.int32()),
            pa.array([False] * len(ids)),
            pa.array(["en"] * len(ids)),
        ],
        schema=sch.remove_metadata(),
    )


# Each output kind: how to name it, how to read it back, how to list its table's ids.
OUTPUTS = ["file.parquet", "dir/", "vectors.lance", "db+table"]


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


def write(tmp_path, kind, ids, mode="create", sch=None):
    writer = open_writer(**spec(tmp_path, kind), schema=sch or schema(), mode=mode)
    writer.write(batch(ids, sch=sch))
    return writer.commit()


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
    assert sch.names == ["id", "vector", "n_tokens", "truncated", "lang"]
    assert sch.field("vector").type == pa.list_(pa.float32(), DIM)
    assert sch.field("n_tokens").type == pa.int32() and sch.field("truncated").type == pa.bool_()
    assert {k.decode(): v.decode() for k, v in sch.metadata.items()} == META
    assert output_schema(8, None, {}).names == ["id", "vector", "n_tokens", "truncated"]
    with pytest.raises(UserError, match="--keep id: the output already has an? 'id' column"):
        output_schema(DIM, pa.schema([("id", pa.string())]), {})


@pytest.mark.parametrize("kind", OUTPUTS)
def test_round_trip_keeps_rows_vectors_and_metadata(tmp_path, kind):
    vectors = np.arange(12, dtype=np.float32).reshape(3, DIM)
    writer = open_writer(**spec(tmp_path, kind), schema=schema())
    writer.write(batch(["a", "b"], vectors[:2]))
    writer.write(batch(["c"], vectors[2:]))
    assert writer.commit() == 3
    table = read_back(tmp_path, kind)
    assert table.column("id").to_pylist() == ["a", "b", "c"]
    assert np.array_equal(np.stack(table.column("vector").to_numpy(zero_copy_only=False)), vectors)
    assert table.column("lang").to_pylist() == ["en"] * 3
    assert table.schema.field("vector").type == pa.list_(pa.float32(), DIM)
    assert {k: table.schema.metadata[k.encode()].decode() for k in META} == META


def test_lance_path_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writer = open_writer("vectors.lance", schema())
    writer.write(batch(["a", "b"]))
    writer.commit()
    assert os.path.isdir("vectors.lance")
    assert lancedb.connect(".").open_table("vectors").count_rows() == 2


def test_lancedb_search_finds_the_nearest_vector(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    vectors = np.eye(DIM, dtype=np.float32)
    writer = open_writer("vectors.lance", schema())
    writer.write(batch(["x", "y", "z", "w"], vectors))
    writer.commit()
    hits = lancedb.connect(".").open_table("vectors").search(np.array([0.1, 0.9, 0.2, 0.0])).limit(3).to_list()
    assert len(hits) == 3
    assert hits[0]["id"] == "y"
    assert hits[0]["lang"] == "en"


@pytest.mark.parametrize("kind", OUTPUTS)
def test_existing_output_is_refused_and_left_byte_identical(tmp_path, kind):
    write(tmp_path, kind, ["a"])
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as info:
        open_writer(**spec(tmp_path, kind), schema=schema())
    assert str(info.value).endswith("already exists; pass --overwrite to replace it or --append to add to it")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", OUTPUTS)
def test_abort_leaves_no_output(tmp_path, kind):
    writer = open_writer(**spec(tmp_path, kind), schema=schema())
    writer.write(batch(["a", "b"]))
    writer.abort()
    assert snapshot(tmp_path) == {}
    leftovers = sorted(os.listdir(tmp_path))
    if kind == "db+table":
        assert leftovers in ([], ["db"]) and lancedb.connect(str(tmp_path / "db")).list_tables().tables == []
    else:
        assert leftovers == []


@pytest.mark.parametrize("kind", OUTPUTS)
def test_overwrite_replaces_only_at_commit_and_abort_keeps_the_old_output(tmp_path, kind):
    write(tmp_path, kind, ["old1", "old2"])
    before = snapshot(tmp_path)

    writer = open_writer(**spec(tmp_path, kind), schema=schema(), mode="overwrite")
    writer.write(batch(["new1"]))
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["old1", "old2"]
    writer.abort()
    assert snapshot(tmp_path) == before
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["old1", "old2"]

    writer = open_writer(**spec(tmp_path, kind), schema=schema(), mode="overwrite")
    writer.write(batch(["new1"]))
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["old1", "old2"]
    writer.commit()
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["new1"]


@pytest.mark.parametrize("kind", ["vectors.lance", "db+table"])
def test_lance_failure_in_the_writer_thread_reaches_the_caller_and_commits_nothing(tmp_path, kind):
    bad = batch(["nan"], [[np.nan] * DIM])  # Lance refuses NaN vectors by default

    writer = open_writer(**spec(tmp_path, kind), schema=schema())
    writer.write(batch(["a"]))
    with pytest.raises(Exception, match="(?i)nan"):
        writer.write(bad)
        writer.commit()
    writer.abort()
    db = lancedb.connect(str(tmp_path / "db") if kind == "db+table" else str(tmp_path))
    assert db.list_tables().tables == []
    assert not (tmp_path / "vectors.lance").exists() and not (tmp_path / "db" / "vectors.lance").exists()

    write(tmp_path, kind, ["old"])
    writer = open_writer(**spec(tmp_path, kind), schema=schema(), mode="overwrite")
    writer.write(batch(["b"]))
    with pytest.raises(Exception, match="(?i)nan"):
        writer.write(bad)
        writer.commit()
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["old"]


def test_lance_abort_mid_stream_with_many_batches(tmp_path):
    writer = open_writer(str(tmp_path / "vectors.lance"), schema())
    for n in range(50):  # more batches than the queue holds, so the writer thread is busy
        writer.write(batch([f"{n}-{i}" for i in range(100)]))
    writer.abort()
    assert not (tmp_path / "vectors.lance").exists()


@pytest.mark.parametrize("kind", ["dir/", "vectors.lance", "db+table"])
def test_append_adds_rows(tmp_path, kind):
    write(tmp_path, kind, ["a", "b"])
    # run-specific, not compared: the time, and the model's spelling (same weights, other name)
    created = META | {"embedctl.created": "another day", "embedctl.model": "/models/the-same-files"}
    assert write(tmp_path, kind, ["c"], mode="append", sch=schema(created)) == 1
    assert sorted(read_back(tmp_path, kind).column("id").to_pylist()) == ["a", "b", "c"]


@pytest.mark.parametrize("kind", ["dir/", "vectors.lance", "db+table"])
def test_append_to_nothing_creates(tmp_path, kind):
    write(tmp_path, kind, ["a"], mode="append")
    assert read_back(tmp_path, kind).column("id").to_pylist() == ["a"]


@pytest.mark.parametrize("kind", ["dir/", "vectors.lance", "db+table"])
def test_append_refuses_other_weights_dim_or_columns(tmp_path, kind):
    write(tmp_path, kind, ["a"])
    before = snapshot(tmp_path)
    other_weights = META | {"embedctl.weights_sha256": "def"}
    with pytest.raises(UserError, match="its embedctl.weights_sha256 is 'abc' but this run's is 'def'"):
        open_writer(**spec(tmp_path, kind), schema=schema(other_weights), mode="append")
    with pytest.raises(UserError, match="its embedctl.pooling is None but this run's is 'cls'"):
        open_writer(**spec(tmp_path, kind), schema=schema(META | {"embedctl.pooling": "cls"}), mode="append")
    with pytest.raises(UserError, match="its vectors have 4 dimensions and this run's have 8"):
        open_writer(**spec(tmp_path, kind), schema=schema(META | {"embedctl.dim": "8"}, dim=8), mode="append")
    with pytest.raises(UserError, match="its columns are"):
        open_writer(**spec(tmp_path, kind), schema=schema(kept=None), mode="append")
    assert snapshot(tmp_path) == before


def test_append_to_a_single_parquet_file_is_refused(tmp_path):
    write(tmp_path, "file.parquet", ["a"])
    with pytest.raises(UserError, match="cannot append to the single Parquet file .*directory"):
        open_writer(str(tmp_path / "file.parquet"), schema(), mode="append")


def test_unknown_output_name(tmp_path):
    with pytest.raises(UserError, match=r"cannot tell what kind of output .*vectors\.csv.*\.lance.*\.parquet"):
        open_writer(str(tmp_path / "vectors.csv"), schema())


def test_parquet_directory_rolls_parts_and_hides_them_until_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(writers, "_PART_BYTES", 1)  # one part per batch
    monkeypatch.setattr(writers, "_ROW_GROUP_BYTES", 1)
    write(tmp_path, "dir/", ["old"])
    (tmp_path / "dir" / "_notes.txt").write_text("not part of the table")

    writer = open_writer(str(tmp_path / "dir"), schema(), mode="overwrite")  # an existing directory, no slash
    for n in range(3):
        writer.write(batch([f"n{n}"]))
    assert pq.read_table(tmp_path / "dir").column("id").to_pylist() == ["old"]
    writer.commit()
    parts = ["part-00001.parquet", "part-00002.parquet", "part-00003.parquet"]
    assert sorted(os.listdir(tmp_path / "dir")) == ["_notes.txt", *parts]
    assert pq.read_table(tmp_path / "dir").column("id").to_pylist() == ["n0", "n1", "n2"]


def test_parquet_row_groups_gather_small_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(writers, "_ROW_GROUP_BYTES", 3 * batch(["a"]).nbytes)
    writer = open_writer(str(tmp_path / "file.parquet"), schema())
    for n in range(7):
        writer.write(batch([f"r{n}"]))
    assert os.listdir(tmp_path) != ["file.parquet"]  # still under a temporary name
    writer.commit()
    assert os.listdir(tmp_path) == ["file.parquet"]
    meta = pq.ParquetFile(tmp_path / "file.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 3, 1]


def test_writers_take_no_batches_after_commit(tmp_path):
    for kind in OUTPUTS:
        writer = open_writer(**spec(tmp_path, kind), schema=schema())
        writer.commit()
        assert read_back(tmp_path, kind).num_rows == 0
        with pytest.raises(RuntimeError, match="already committed or aborted"):
            writer.write(batch(["late"]))
        writer.abort()  # after a commit, abort changes nothing
        assert read_back(tmp_path, kind).num_rows == 0


def test_a_crash_mid_write_leaves_old_outputs_intact_and_no_new_ones(tmp_path):
    for kind in OUTPUTS:
        write(tmp_path / "old", kind, ["old"])
    script = textwrap.dedent(f"""
        import os, pathlib, sys
        sys.path[:0] = [{os.getcwd()!r}, {os.path.dirname(__file__)!r}]
        from test_writers import OUTPUTS, batch, open_writer, schema, spec
        tmp = pathlib.Path({str(tmp_path)!r})
        started = [open_writer(**spec(tmp / "new", kind), schema=schema()) for kind in OUTPUTS]
        started += [open_writer(**spec(tmp / "old", kind), schema=schema(), mode="overwrite") for kind in OUTPUTS]
        for n in range(30):
            for writer in started:
                writer.write(batch([f"{{n}}-{{i}}" for i in range(100)]))
        os._exit(1)  # no commit, no abort, no cleanup
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 1
    for kind in OUTPUTS:
        assert read_back(tmp_path / "old", kind).column("id").to_pylist() == ["old"]
    new = tmp_path / "new"
    assert not (new / "file.parquet").exists()
    assert [p for p in os.listdir(new / "dir") if p.endswith(".parquet")] == []
    for db in (new, new / "db"):
        with pytest.raises(ValueError, match="not found"):
            lancedb.connect(str(db)).open_table("vectors")
    for kind in OUTPUTS:  # what a crash leaves behind does not block the next run
        write(new, kind, ["a"])
        assert read_back(new, kind).column("id").to_pylist() == ["a"]
