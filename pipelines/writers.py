"""Vector table writers: a LanceDB table, one Parquet file or a directory of Parquet part files.

open_writer picks the format from the output name, refuses an existing output or checks that an append
matches it, and returns a VectorWriter. write() takes batches; nothing is visible until commit(), which
shows them all at once; abort() drops them and leaves any previous output exactly as it was.

It is not a reader of vector tables and builds no vector index. The schema, including the embedctl.*
metadata that identifies the model, comes from the caller through output_schema().
"""

from __future__ import annotations

import posixpath
import queue
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import UserError, short_reason

Mode = Literal["create", "overwrite", "append"]

# Metadata that may differ between runs appending to one table: the model's spelling (a hub id
# or a path to the same files; the weights' hash is what must match) and the creation time.
_RUN_SPECIFIC = frozenset({"embedctl.created", "embedctl.model"})
_ROW_GROUP_BYTES = 64 << 20
_PART_BYTES = 512 << 20
_QUEUE_BATCHES = 8
_PART_NAME = re.compile(r"part-(\d+)\.parquet$")


def output_schema(dim: int, kept: pa.Schema | None, metadata: dict[str, str]) -> pa.Schema:
    """id, vector (float32 x dim), n_tokens, truncated, then the kept columns; metadata on the schema."""
    fields = [
        pa.field("id", pa.string()),
        pa.field("vector", pa.list_(pa.float32(), dim)),
        pa.field("n_tokens", pa.int32()),
        pa.field("truncated", pa.bool_()),
    ]
    for field in kept or []:
        if field.name in {f.name for f in fields}:
            raise UserError(f"--keep {field.name}: the output already has a '{field.name}' column; drop it from --keep")
    return pa.schema([*fields, *(kept or [])], metadata=metadata)


class VectorWriter(Protocol):
    def write(self, batch: pa.RecordBatch) -> None: ...

    def commit(self) -> int: ...

    def abort(self) -> None: ...


def open_writer(out: str, schema: pa.Schema, mode: Mode = "create", table: str | None = None) -> VectorWriter:
    """A writer for out; raises UserError, before writing anything, if out cannot take this schema."""
    if mode not in ("create", "overwrite", "append"):
        raise ValueError(f"unknown mode {mode!r}")
    if table is not None:
        return _LanceWriter(f"table '{table}' in {out}", out, table, schema, mode)
    if out.rstrip("/").endswith(".lance"):
        db, _, name = out.rstrip("/").rpartition("/")
        return _LanceWriter(out, db or ".", name.removesuffix(".lance"), schema, mode)
    try:
        fs, path = fsspec.core.url_to_fs(out)
        is_dir = out.endswith("/") or fs.isdir(path)
    except (ValueError, ImportError, OSError) as e:
        raise UserError(f"cannot open {out} ({short_reason(e)}); give a local path or an fsspec URL") from None
    if is_dir:
        return _ParquetDirWriter(out, fs, path.rstrip("/"), schema, mode)
    if out.endswith(".parquet"):
        return _ParquetFileWriter(out, fs, path, schema, mode)
    raise UserError(
        f"cannot tell what kind of output {out} is; name it *.lance for a LanceDB table, *.parquet for one "
        "Parquet file, or end it with / for a directory of Parquet files (or pass --table for a LanceDB database)"
    )


class _Abort(Exception):
    """Raised inside Lance's read of the batch stream so that Lance commits nothing."""


_END = object()


class _LanceWriter:
    """Streams every batch into one Lance commit, made by a thread that reads a bounded queue."""

    def __init__(self, shown: str, db_uri: str, name: str, schema: pa.Schema, mode: Mode) -> None:
        import lancedb  # here, not at the top: Parquet output works where lancedb is not installed

        self._shown, self._name, self._schema = shown, name, schema
        try:
            self._db = lancedb.connect(db_uri)
        except ValueError as e:
            raise UserError(f"cannot open LanceDB database {db_uri} ({short_reason(e)}); check the path or URI") from None
        existing = self._open_existing()
        if existing is not None and mode == "create":
            raise UserError(_exists(shown))
        if existing is not None and mode == "append":
            _check_append(shown, existing.schema, schema)
        self._existed = existing is not None
        self._rows = 0
        self._closed = False
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_BATCHES)
        append = existing is not None and mode == "append"
        self._thread = threading.Thread(target=self._run, args=(append,), name=f"lance-writer-{name}", daemon=True)
        self._thread.start()

    def _open_existing(self) -> object | None:
        try:
            return self._db.open_table(self._name)
        except ValueError:  # Lance's "table not found"; a directory left by a crashed run counts as absent
            return None

    def _batches(self) -> Iterator[pa.RecordBatch]:
        while (item := self._queue.get()) is not _END:
            if isinstance(item, _Abort):
                raise item
            yield item

    def _run(self, append: bool) -> None:
        stream = pa.RecordBatchReader.from_batches(self._schema, self._batches())
        try:
            if append:
                self._db.open_table(self._name).add(stream)
            else:
                mode = "overwrite" if self._existed else "create"
                self._db.create_table(self._name, data=stream, schema=self._schema, mode=mode)
        except BaseException as e:
            self._error = e
            if not self._existed:
                # A failed create leaves an empty table directory that list_tables() would still show.
                self._db.drop_table(self._name, ignore_missing=True)

    def write(self, batch: pa.RecordBatch) -> None:
        self._check_open()
        _check_batch(batch, self._schema)
        self._put(batch)
        self._rows += batch.num_rows

    def commit(self) -> int:
        self._check_open()
        self._put(_END)
        self._thread.join()
        self._closed = True
        self._raise_failure()
        return self._rows

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        while True:  # make room for the abort signal; the writer thread is the only other user
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():
            self._queue.put(_Abort())
            self._thread.join()

    def _put(self, item: object) -> None:
        while True:  # a writer thread that has failed no longer drains the queue
            self._raise_failure()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _raise_failure(self) -> None:
        if isinstance(self._error, OSError):
            raise UserError(f"cannot write {self._shown} ({short_reason(self._error)}); check free space and permissions")
        if self._error is not None:
            raise self._error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the writer for {self._shown} is already committed or aborted")


class _ParquetFileWriter:
    """Writes a temporary file beside the output and renames it onto the output at commit."""

    def __init__(self, shown: str, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema, mode: Mode) -> None:
        if mode == "append":
            raise UserError(
                f"cannot append to the single Parquet file {shown}; write to a directory of Parquet files "
                "(an output ending in /) to append"
            )
        self._shown, self._fs, self._path, self._schema = shown, fs, path, schema
        parent, base = posixpath.split(path)
        self._tmp = posixpath.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
        self._rows = 0
        self._closed = False
        with _io_errors(shown):
            if mode == "create" and fs.exists(path):
                raise UserError(_exists(shown))
            if parent:
                fs.makedirs(parent, exist_ok=True)
            self._sink = _RowGroups(fs, self._tmp, schema)

    def write(self, batch: pa.RecordBatch) -> None:
        self._check_open()
        _check_batch(batch, self._schema)
        with _io_errors(self._shown):
            self._sink.write(batch)
        self._rows += batch.num_rows

    def commit(self) -> int:
        self._check_open()
        with _io_errors(self._shown):
            self._sink.close()
            self._fs.mv(self._tmp, self._path)
        self._closed = True
        return self._rows

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sink.discard()
        _remove_quietly(self._fs, self._tmp, recursive=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the writer for {self._shown} is already committed or aborted")


class _ParquetDirWriter:
    """Writes part files into a hidden subdirectory and moves them into the output directory at commit.

    The table is the set of *.parquet files directly in the directory; other files are left alone.
    """

    def __init__(self, shown: str, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema, mode: Mode) -> None:
        self._shown, self._fs, self._path, self._schema = shown, fs, path, schema
        with _io_errors(shown):
            self._created = not fs.exists(path)
            self._old = [] if self._created else sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
        if self._old and mode == "create":
            raise UserError(_exists(shown))
        if self._old and mode == "append":
            _check_append(shown, _read_schema(fs, self._old[0], shown), schema)
        self._replace = mode == "overwrite"
        # New parts number on from the old ones so that they never take an old part's name.
        numbers = [int(m.group(1)) for p in self._old if (m := _PART_NAME.search(p))]
        self._next_part = max(numbers, default=-1) + 1
        self._tmp_dir = posixpath.join(path, f".tmp-{uuid.uuid4().hex[:12]}")
        self._parts: list[str] = []
        self._sink: _RowGroups | None = None
        self._rows = 0
        self._closed = False
        with _io_errors(shown):
            fs.makedirs(self._tmp_dir, exist_ok=True)

    def write(self, batch: pa.RecordBatch) -> None:
        self._check_open()
        _check_batch(batch, self._schema)
        with _io_errors(self._shown):
            if self._sink is None:
                name = f"part-{self._next_part + len(self._parts):05d}.parquet"
                self._parts.append(name)
                self._sink = _RowGroups(self._fs, posixpath.join(self._tmp_dir, name), self._schema)
            self._sink.write(batch)
            if self._sink.nbytes >= _PART_BYTES:
                self._sink.close()
                self._sink = None
        self._rows += batch.num_rows

    def commit(self) -> int:
        self._check_open()
        with _io_errors(self._shown):
            if self._sink is not None:
                self._sink.close()
                self._sink = None
            moved = []
            try:
                for name in self._parts:
                    self._fs.mv(posixpath.join(self._tmp_dir, name), posixpath.join(self._path, name))
                    moved.append(name)
            except BaseException:
                # Leave the directory as it was: take back the parts that already moved in.
                for name in moved:
                    _remove_quietly(self._fs, posixpath.join(self._path, name), recursive=False)
                raise
            if self._replace and self._old:
                self._fs.rm(self._old)
            self._fs.rm(self._tmp_dir, recursive=True)
        self._closed = True
        return self._rows

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sink is not None:
            self._sink.discard()
        _remove_quietly(self._fs, self._tmp_dir, recursive=True)
        if self._created:
            _remove_quietly(self._fs, self._path, recursive=False)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the writer for {self._shown} is already committed or aborted")


class _RowGroups:
    """A Parquet file that gathers small batches into row groups of about _ROW_GROUP_BYTES."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema) -> None:
        self._writer = pq.ParquetWriter(path, schema, filesystem=fs)
        self._schema = schema
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self.nbytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        self.nbytes += batch.nbytes
        if self._pending_bytes >= _ROW_GROUP_BYTES:
            self._flush()

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def discard(self) -> None:
        self._pending = []
        try:
            self._writer.close()
        except OSError:
            pass  # the file is removed next; a failure to finish it no longer matters

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.Table.from_batches(self._pending, schema=self._schema))
            self._pending, self._pending_bytes = [], 0


def _check_append(shown: str, old: pa.Schema, new: pa.Schema) -> None:
    if "vector" not in old.names or not pa.types.is_fixed_size_list(old.field("vector").type):
        raise UserError(f"cannot append to {shown}: it has no vector column; write to a new output")
    old_dim, new_dim = old.field("vector").type.list_size, new.field("vector").type.list_size
    if old_dim != new_dim:
        raise UserError(
            f"cannot append to {shown}: its vectors have {old_dim} dimensions and this run's have {new_dim}; "
            "pass --overwrite to replace it or write to a new output"
        )
    old_meta, new_meta = _embedctl_metadata(old), _embedctl_metadata(new)
    for key in sorted(old_meta.keys() | new_meta.keys()):
        if old_meta.get(key) != new_meta.get(key):
            raise UserError(
                f"cannot append to {shown}: its {key} is {old_meta.get(key)!r} but this run's is "
                f"{new_meta.get(key)!r}; pass --overwrite to replace it or write to a new output"
            )
    if not old.remove_metadata().equals(new.remove_metadata()):
        raise UserError(
            f"cannot append to {shown}: its columns are ({_columns(old)}) but this run writes ({_columns(new)}); "
            "use the same --keep columns or write to a new output"
        )


def _embedctl_metadata(schema: pa.Schema) -> dict[str, str]:
    items = (schema.metadata or {}).items()
    return {
        k.decode(): v.decode()
        for k, v in items
        if k.decode().startswith("embedctl.") and k.decode() not in _RUN_SPECIFIC
    }


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _check_batch(batch: pa.RecordBatch, schema: pa.Schema) -> None:
    if not batch.schema.equals(schema, check_metadata=False):
        raise ValueError(f"batch schema ({_columns(batch.schema)}) is not the output schema ({_columns(schema)})")


def _read_schema(fs: fsspec.AbstractFileSystem, path: str, shown: str) -> pa.Schema:
    try:
        return pq.read_schema(path, filesystem=fs)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"cannot append to {shown}: {posixpath.basename(path)} is not a readable Parquet file ({short_reason(e)}); "
            "repair or remove it, or pass --overwrite"
        ) from None


def _exists(shown: str) -> str:
    return f"{shown} already exists; pass --overwrite to replace it or --append to add to it"


@contextmanager
def _io_errors(shown: str) -> Iterator[None]:
    """Turns an OSError while writing into a UserError that names the output."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {shown} ({short_reason(e)}); check free space and permissions") from None


def _remove_quietly(fs: fsspec.AbstractFileSystem, path: str, recursive: bool = False) -> None:
    try:
        if recursive:
            fs.rm(path, recursive=True)
        else:
            fs.rmdir(path)
    except OSError:
        pass  # abort is best effort: it runs while another error is already on its way to the user
