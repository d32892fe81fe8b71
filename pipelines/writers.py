"""Vector stores: a LanceDB table, one Parquet file or a directory of Parquet part files, kept up to date.

open_store picks the format from the output name and checks that an existing output was made by embedctl
with this run's settings and columns; with rebuild it builds a replacement beside it instead. `existing`
maps the ids the store holds to their content keys. write() takes record batches and commits them in
groups of commit_rows rows, each group atomically: a Lance version (merge_insert by id when the group
holds ids the table already has), or a Parquet part written under a temporary name and renamed into
place. finish() commits the rest, gives stored rows whose kept columns alone changed their new kept values and
content keys (restamps: their vectors stay), removes rows that the run superseded, emptied or pruned, for a
rebuild swaps the replacement in, and tidies the output: a LanceDB table's small fragments compacted, rows added
to its indexes and old versions' files removed, a Parquet directory's small parts merged. abort() drops what is
not committed. Committed groups stay through a failure or a kill: that partial output is what lets the next run
resume, and it is the one state in which an output holds part of a run.

A single Parquet file cannot grow in place: it is rewritten whole (new rows, then the old rows that
stay) under a temporary name and renamed at finish, so it commits once and a killed run starts over.

It is not a reader of vector tables for search, builds no vector index, does not decide which rows to
embed (pipelines/index.py does) and takes no lock (pipelines/lock.py; lock_file() names the file).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Protocol

import fsspec
import fsspec.implementations.local
import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import UserError, short_reason
from engine.spec import LATER_SETTINGS
from pipelines.progress import plural

CONTENT_KEY = "content_key"
# The model's spelling may differ between runs on one output (a hub id or a path to the same files);
# the weights' hash is what must match.
_RUN_SPECIFIC = frozenset({"embedctl.model"})
# Row groups of 32 MiB: the last one is written after the last batch, so its size is the run's tail.
_ROW_GROUP_BYTES = 32 << 20
_PART_NAME = re.compile(r"part-(\d+)\.parquet$")
_TMP = ".tmp-"  # prefix of a Parquet part not yet committed; hidden from readers
_REBUILD = ".rebuild"  # where a directory rebuild stages its parts; a Lance rebuild's table is .NAME.rebuild
_SWAP = ".swap.json"  # in a directory rebuild's stage: the old parts its swap removes, for a run after a crash
_UPDATE = ".update"  # where a run into a directory that holds parts stages its parts until they are moved in at finish
_DELETE_IDS = 1000  # ids per Lance delete predicate
# A Lance table's upkeep at the end of a run (_LanceStore._tidy), and a Parquet directory's (_ParquetDirStore._tidy,
# by the same sizes: readers open each part, and finish rewrites a whole part for any of its rows that changed).
# Compaction merges neighbouring fragments under COMPACT_TARGET_ROWS rows (each commit adds one; a cron job's are
# small) into ones of about that size, the size a build's default commits give them, and rewrites those with a tenth
# of their rows deleted. Not LanceDB's 1M: its flat search scans fragments in parallel, and 100,000 rows in one
# fragment took 300 ms a query against 124 in 10 and 73 in 100, while 200 fragments of 100 rows cost 48 ms against
# 25 compacted and id lookups 30 against 7 (bench/results/cpu-2026-12-07-lance-fragments).
COMPACT_TARGET_ROWS = 10_000
# Compaction waits for this many neighbouring fragments under COMPACT_TARGET_ROWS: run after each small commit, it
# would rewrite the growing last fragment every time. A daily cron job changing 50 of 100,000 rows had 98 times the rows it
# changed rewritten over 200 days that way, 11 times with this wait (bench.lance_fragments).
COMPACT_SMALL_FRAGMENTS = 10
# Rows an index lacks, which every query scans one by one, are added to it from this many: LanceDB's advice
# (Table.optimize's notes), since each addition rewrites part of the index.
INDEX_UNINDEXED_ROWS = 100_000
# The files of versions replaced longer ago than this are removed (LanceDB's optimize() keeps 7 days too): a reader
# may still be on a recently replaced one, and every commit keeps the files of what it replaced until then.
VERSIONS_KEPT = timedelta(days=7)
_LANCE_IO = "LanceError(IO)"  # how Lance's RuntimeError tells an I/O failure (a read-only folder, a full disk)
_LANCE_PREFIX = re.compile(r"^lance error: LanceError\(\w+\): ")
_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # the table names LanceDB accepts
# What a Lance table's folder holds; a create that was killed leaves some of them and no readable version
_LANCE_ENTRIES = frozenset({"_versions", "data", "_transactions", "_indices", "_deletions", "_refs", "tree",
                            "_latest.manifest"})


def output_schema(dim: int, kept: pa.Schema | None, metadata: dict[str, str],
                  vector_type: pa.DataType | None = None) -> pa.Schema:
    """id, vector (vector_type, float32 by default, x dim), n_tokens, truncated, content_key, then the
    kept columns, nullable whatever the source declares (a later source may hold nulls where this one's
    schema forbids them, and the rows come in batches that do not carry "not null"); metadata on the schema."""
    fields = [
        pa.field("id", pa.string()),
        pa.field("vector", pa.list_(vector_type or pa.float32(), dim)),
        pa.field("n_tokens", pa.int32()),
        pa.field("truncated", pa.bool_()),
        pa.field(CONTENT_KEY, pa.string()),
    ]
    _refuse_empty_objects(kept or [])
    for field in kept or []:
        if field.name in {f.name for f in fields}:
            raise UserError(f"--keep {field.name}: the output already has a '{field.name}' column; drop it from --keep")
    return pa.schema([*fields, *(field.with_nullable(True) for field in kept or [])], metadata=metadata)


def stored_kept(out: str, table: str | None = None) -> pa.Schema | None:
    """The kept columns of the output at out as it stands (those output_schema adds to its own), read from its
    newest part for a Parquet directory (one a rebuild left staged, where a crash cut its swap short: open_store
    finishes that swap); None where there is no output yet, or one that open_store will refuse (it says why)."""
    try:
        if (lance := lance_table(out, table)) is not None:
            import lancedb

            schema = lancedb.connect(lance[0]).open_table(lance[1]).schema
        else:
            fs, path, is_dir = _locate(out)
            if is_dir:
                root = path.rstrip("/")
                files = table_parts(fs, root) + _staged_for_swap(fs, root) if fs.isdir(root) else []
            else:
                files = [path] if fs.isfile(path) else []
            if not files:
                return None
            schema = _read_schema(fs, files[-1], out)
    except (UserError, ValueError, RuntimeError, OSError, ImportError):
        return None
    if CONTENT_KEY not in schema.names:  # not embedctl's
        return None
    ours = set(output_schema(1, None, {}).names)
    return pa.schema([field for field in schema if field.name not in ours])


def _refuse_empty_objects(kept: Iterable[pa.Field]) -> None:
    """A JSONL --keep key whose values are or hold {} becomes a struct without fields, which Parquet cannot
    store, nor Lance inside a list."""
    for field in kept:
        if _holds_empty_struct(field.type):
            raise UserError(f"--keep {field.name}: its values hold empty objects ({{}}), which a Parquet file cannot "
                            "store, nor LanceDB inside a list; drop it from --keep, or give those objects a key")


def _holds_empty_struct(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        return kind.num_fields == 0 or any(_holds_empty_struct(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _holds_empty_struct(kind.key_type) or _holds_empty_struct(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _holds_empty_struct(kind.value_type)
    return False


class VectorStore(Protocol):
    existing: dict[str, str]  # id -> content_key of every row committed before this run
    replaced: set[str]  # with rebuild, the ids of the output the replacement takes the place of; else empty
    committed_rows: int  # rows this run committed, which a run stopped before finish keeps (a rebuild: staged)
    dropped_indexes: Sequence[str]  # after finish: the indexes of a LanceDB table that a rebuild replaced
    optimized: str | None  # after finish: what a LanceDB table's upkeep did, if anything
    optimize_error: str | None  # after finish: why a LanceDB table's upkeep failed, if it did

    def write(self, batch: pa.RecordBatch) -> None: ...

    def finish(self, source: dict[str, str], prune: bool, emptied: AbstractSet[str] = frozenset(),
               restamps: Sequence[pa.Table] = ()) -> int: ...

    def abort(self) -> None: ...


class Restamps:
    """Stored rows to give new kept columns and content keys, their vectors kept: tables of id, content_key and
    the kept columns, by id."""

    def __init__(self, tables: Sequence[pa.Table]) -> None:
        # One chunk per column: a dictionary column's chunks are unified once here, not again for every part
        self.table = pa.concat_tables(tables).combine_chunks() if tables else None
        ids = self.table.column("id").to_pylist() if self.table is not None else []
        self._rows = {row_id: row for row, row_id in enumerate(ids)}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def ids(self) -> list[str]:
        return list(self._rows)

    def keys(self, ids: list[str], keys: list[str]) -> list[str]:
        """Stored rows' content keys as they will be."""
        column = self.table.column(CONTENT_KEY) if self.table is not None else None
        return [key if (row := self._rows.get(row_id)) is None else column[row].as_py() for row_id, key in zip(ids, keys)]

    def apply(self, stored: pa.Table) -> pa.Table:
        """stored (rows of the output, every column) with the restamped rows' new values, in its order."""
        places = [self._rows.get(row_id) for row_id in stored.column("id").to_pylist()]
        restamped = [row for row, place in enumerate(places) if place is not None]
        if not restamped:
            return stored
        fresh = self.table.take([places[row] for row in restamped])
        # Each changed column: the stored values followed by these rows' new ones, then one take puts each in place.
        picks = list(range(stored.num_rows))
        for order, row in enumerate(restamped):
            picks[row] = stored.num_rows + order
        columns = []
        for field in stored.schema:
            column = stored.column(field.name)
            if field.name != "id" and field.name in fresh.column_names:
                new = _as_stored(fresh.column(field.name), field.type)
                column = pa.chunked_array(column.chunks + new.chunks, field.type).take(picks)
            columns.append(column)
        return pa.Table.from_arrays(columns, schema=stored.schema)


def _as_stored(values: pa.ChunkedArray, stored_type: pa.DataType) -> pa.ChunkedArray:
    """values in the type the output stores: a map's entries as the file names them, and a dictionary over these
    values alone (a take keeps the whole run's dictionary, which each rewritten part would then carry)."""
    if pa.types.is_dictionary(stored_type):
        return values.cast(stored_type.value_type).dictionary_encode().cast(stored_type)
    return values.cast(stored_type)


def open_store(out: str, schema: pa.Schema, table: str | None = None, rebuild: bool = False,
               commit_rows: int = 10_000, optimize: bool = True) -> VectorStore:
    """A store for out; raises UserError, before changing anything, if out cannot take this schema. With
    optimize, the output gets its upkeep at finish: a LanceDB table's small fragments compacted, rows added to its
    indexes, old versions' files removed (_LanceStore._tidy); a Parquet directory's small parts merged
    (_ParquetDirStore._tidy).

    finish(source, prune, emptied, restamps) takes the id -> content_key of every row of the run's source, the
    ids the source lists with an empty text and the Restamps tables, and returns how many ids it deleted: those
    of emptied, and with prune all that are not in source.
    """
    check_commit_rows(commit_rows)
    if (lance := lance_table(out, table)) is not None:
        shown = out if table is None else f"table '{table}' in {out}"
        return _LanceStore(shown, *lance, schema, rebuild, commit_rows, optimize)
    fs, path, is_dir = _locate(out)
    if is_dir:
        return _ParquetDirStore(out, fs, path.rstrip("/"), schema, rebuild, commit_rows, optimize)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        path = _followed(path)  # a symbolic link (a "current" link) keeps pointing at the file it names
    return _ParquetFileStore(out, fs, path, schema, rebuild)


def check_commit_rows(commit_rows: int) -> None:
    if commit_rows < 1:
        raise UserError(f"--commit-rows {commit_rows}: give a positive number of rows")


def lance_table(out: str, table: str | None = None) -> tuple[str, str] | None:
    """The database and the table name of a LanceDB output (NAME.lance, or a database with table); None for
    a Parquet output. UserError for a name LanceDB refuses, which LanceDB itself does only at the first commit."""
    _check_named(out)
    if table is not None:
        if out.rstrip("/").endswith(".lance"):  # a table's folder; a table inside it would be lost to LanceDB
            raise UserError(f"--out {out} names a LanceDB table, and --table {table or repr(table)} a table of a "
                            "database; give --out the database folder that holds the tables, or drop --table")
        if _parts_in(out):
            raise UserError(f"--out {out} is a folder of Parquet parts written by embedctl, not a LanceDB database; "
                            "give the database another folder")
        db, name, option = out, table, f"--table {table}"
        if name.endswith(".lance"):  # LanceDB adds the suffix to the folder itself: t.lance.lance beside t.lance
            raise UserError(f"--table {table}: LanceDB names a table's folder after it with .lance added, so this "
                            f"would be a new table beside {table}; pass --table {table.removesuffix('.lance')}")
    elif out.rstrip("/").endswith(".lance"):
        db, _, base = out.rstrip("/").rpartition("/")
        db, name, option = db or ".", base.removesuffix(".lance"), f"--out {out}"
    else:
        return None
    if not _TABLE_NAME.fullmatch(name):
        raise UserError(f"{option}: LanceDB takes only ASCII letters, digits, underscores, hyphens and periods in a "
                        f"table name, not '{name}'; rename it")
    if not name.strip("."):  # LanceDB reads . and .. as path segments, and refuses them only at the first commit
        raise UserError(f"{option}: '{name}' is a path segment, not a table name; rename it")
    return db, name


def commits_in_groups(out: str, table: str | None = None) -> bool:
    """True for a store that commits group by group, whose committed groups a failed or killed run keeps
    (a LanceDB table, a directory of parts); False for one Parquet file, written whole at finish.
    UserError as check_output."""
    return lance_table(out, table) is not None or _locate(out)[2]


def output_exists(out: str) -> bool:
    """Whether a Parquet output (one file, or a directory of parts) is there already. UserError as check_output."""
    fs, path, _ = _locate(out)
    return fs.exists(path)


def lock_file(out: str, table: str | None = None) -> str | None:
    """The local file that guards out against a second run (beside it, hidden), or None for a remote out."""
    if "://" in out and not out.startswith("file://"):
        return None
    path = _followed(out.removeprefix("file://").rstrip("/") or ".")  # one lock, whichever link leads to it
    if table is not None:
        return posixpath.join(path, f".{table}.lance.lock")
    parent, base = posixpath.split(path)
    return posixpath.join(parent, f".{base}.lock")


def _followed(path: str) -> str:
    """A local path, or the file a symbolic link at it names."""
    return os.path.realpath(path) if os.path.islink(path) else path


def check_output(out: str, table: str | None = None) -> None:
    """UserError for an out that names no kind of output this module writes."""
    if lance_table(out, table) is None:
        _locate(out)


def _check_named(out: str) -> None:
    if not out.strip("/").strip():
        raise UserError(f"--out {out!r} names no output of its own; give vectors.lance, out.parquet, a folder/ "
                        "for the parts or a database folder with --table")


def _locate(out: str) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    _check_named(out)
    try:
        fs, path = fsspec.core.url_to_fs(out)
        is_dir = out.endswith("/") or fs.isdir(path)
    except (ValueError, ImportError, OSError) as e:
        raise UserError(f"cannot open {out} ({short_reason(e)}); give a local path or an fsspec URL") from None
    if out.endswith("/") and fs.isfile(path.rstrip("/")):
        raise UserError(f"--out {out} names a folder for Parquet parts, but {out.rstrip('/')} is a file; "
                        "pick another --out")
    if not is_dir and not out.endswith(".parquet"):
        raise UserError(
            f"cannot tell what kind of output {out} is; name it *.lance for a LanceDB table, *.parquet for one "
            "Parquet file, or end it with / for a directory of Parquet files (or pass --table for a LanceDB database)"
        )
    if is_dir and (tables := database_tables(out)):
        raise UserError(f"{out} is a LanceDB database (tables: {', '.join(tables)}), not a folder for Parquet parts; "
                        "pass --table NAME to write a table in it, or give another folder")
    names = _parquet_names(fs, path) if is_dir else []
    others = [name for name in names if not _PART_NAME.fullmatch(name)]
    if others and len(others) < len(names):  # a folder of someone else's files alone: _refuse_foreign says so
        # Its parts are all its *.parquet files to a reader (pyarrow, this store): another would be read with
        # them, and replaced or deleted as one of them.
        raise UserError(f"{out} holds Parquet files that are not embedctl's parts ({', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''}); move them out, or give another folder")
    if not is_dir and _parts_in(posixpath.dirname(out) or "."):
        raise UserError(f"--out {out} would lie among the Parquet parts of the embedctl output "
                        f"{posixpath.dirname(out) or '.'}/, and be read as one of them; pick another folder")
    return fs, path, is_dir


def _parquet_names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The names of the *.parquet files in a folder, but those not yet committed; none where it is no folder."""
    try:
        names = [posixpath.basename(p) for p in fs.ls(path.rstrip("/"), detail=False)] if fs.isdir(path) else []
    except OSError:
        return []
    return sorted(name for name in names if name.endswith(".parquet") and not name.startswith(_TMP))


def _staged_for_swap(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The parts a directory rebuild's stage still holds, where a crash cut its swap short; none otherwise."""
    stage = posixpath.join(root, _REBUILD)
    return table_parts(fs, stage) if fs.exists(posixpath.join(stage, _SWAP)) else []


def _parts_in(folder: str) -> bool:
    """Whether a folder (local path or fsspec URL) holds Parquet parts written by embedctl."""
    try:
        fs, path = fsspec.core.url_to_fs(folder)
    except (ValueError, ImportError):
        return False
    return any(_PART_NAME.fullmatch(name) for name in _parquet_names(fs, path))


def table_parts(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The files of a directory of Parquet parts written by embedctl, in the order they were committed:
    its *.parquet files but those not yet committed; other files in it are not the table's."""
    files = [p for p in fs.ls(path, detail=False) if p.endswith(".parquet") and not posixpath.basename(p).startswith(_TMP)]
    return sorted(files, key=lambda p: (_part_number(p), p))


def database_tables(folder: str) -> list[str]:
    """The LanceDB tables in folder, a local path or fsspec URL (its NAME.lance folders), sorted; none where
    it holds none, is no folder or cannot be listed."""
    try:
        fs, path = fsspec.core.url_to_fs(folder)
        found = fs.glob(posixpath.join(path.rstrip("/"), "*.lance"))
    except (ValueError, ImportError, OSError):
        return []
    return sorted(posixpath.basename(p).removesuffix(".lance") for p in found if fs.isdir(p))


class _Groups:
    """Batches gathered, and split where needed, into groups of commit_rows rows."""

    def __init__(self, schema: pa.Schema, commit_rows: int) -> None:
        self._schema, self._commit_rows = schema, commit_rows
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0

    def add(self, batch: pa.RecordBatch) -> Iterator[pa.Table]:
        """Keep batch; yield each group it completes."""
        _check_batch(batch, self._schema)
        while self._rows + batch.num_rows >= self._commit_rows:
            room = self._commit_rows - self._rows
            self._batches.append(batch.slice(0, room))
            batch = batch.slice(room)
            self._rows = self._commit_rows
            yield self.take()
        if batch.num_rows:
            self._batches.append(batch)
            self._rows += batch.num_rows

    def take(self) -> pa.Table | None:
        """The rows kept so far, as a table with the output schema, or None if there are none."""
        if not self._batches:
            return None
        group = pa.Table.from_batches(self._batches, schema=self._schema)
        self._batches, self._rows = [], 0
        return group


class _Survivors:
    """Which stored rows stay at finish, asked newest copy first: one row per id, and for an id of the
    source only the source's version of it; ids that left the source stay unless pruned, and ids the
    source lists with an empty text go (their vectors were made from a text that is gone)."""

    def __init__(self, source: dict[str, str], prune: bool, emptied: AbstractSet[str]) -> None:
        self._source, self._prune, self._emptied = source, prune, emptied
        self._kept: set[str] = set()
        self.deleted: set[str] = set()

    def mask(self, ids: list[str], keys: list[str]) -> list[bool]:
        stays = []
        for row_id, key in zip(ids, keys):
            wanted = self._source.get(row_id)
            if row_id in self._kept:
                keep = False
            elif wanted is None:
                keep = not self._prune and row_id not in self._emptied
                if not keep:
                    self.deleted.add(row_id)
            else:
                keep = key == wanted
            if keep:
                self._kept.add(row_id)
            stays.append(keep)
        return stays


class _LanceStore:
    """A LanceDB table, created by its first group; a rebuild fills the table .NAME.rebuild and copies it
    over NAME in one commit at finish."""

    def __init__(self, shown: str, db_uri: str, name: str, schema: pa.Schema, rebuild: bool, commit_rows: int,
                 optimize: bool = True) -> None:
        import lancedb  # here, not at the top: Parquet output works where lancedb is not installed

        self._shown, self._name, self._db_uri = shown, name, db_uri
        # Lance keeps the entries' name of the map that created a table and refuses another on update,
        # and Parquet's reader names a map's entries after its column: so every group is cast to maps
        # with entries named "entries", as Arrow names them.
        self._holds_map = _holds_map(schema)
        if self._holds_map:
            schema = pa.schema([_with_standard_maps(field) for field in schema], metadata=schema.metadata)
        self._schema = schema
        try:
            self._db = lancedb.connect(db_uri)
        except (ValueError, RuntimeError, OSError) as e:  # lance raises RuntimeError for a store it cannot reach
            raise UserError(f"cannot open LanceDB database {db_uri} ({_lance_reason(e)}); check the path or URI, and "
                            "the credentials and network for a remote one") from None
        self._table = self._open(name)
        self._target = name
        if self._table is not None:
            _refuse_foreign(shown, self._table.schema)
        self.replaced: set[str] = set()
        if rebuild:  # staged even with no table yet, so that a killed first build resumes from its stage
            if self._table is not None:
                self.replaced = set(self._table.to_lance().to_table(columns=["id"]).column("id").to_pylist())
            self._target = f".{name}{_REBUILD}"
            self._table = self._open(self._target)
            if self._table is not None and _incompatibility(self._table.schema, schema) is not None:
                self._db.drop_table(self._target)  # a rebuild for other settings, left by a killed run
                self._table = None
        elif self._table is not None:
            _check_compatible(shown, self._table.schema, schema)
        self._groups = _Groups(schema, commit_rows)
        self.committed_rows = 0
        self.dropped_indexes: list[str] = []
        self._may_optimize = optimize
        self.optimized: str | None = None
        self.optimize_error: str | None = None
        self.existing: dict[str, str] = {}
        if self._table is not None:
            stored = self._table.to_lance().to_table(columns=["id", CONTENT_KEY])
            self.existing = dict(zip(stored.column("id").to_pylist(), stored.column(CONTENT_KEY).to_pylist()))

    def _open(self, name: str) -> object | None:
        try:
            return self._db.open_table(name)
        except ValueError:  # Lance's "table not found"; a directory left by a killed create counts as absent
            self._refuse_other_files(name)
            return None
        except RuntimeError as error:  # something else is there: a plain file, a folder Lance cannot read
            raise UserError(f"cannot open {self._shown} as a LanceDB table ({_lance_reason(error)}); remove what is "
                            "there or pick another --out") from None

    def _refuse_other_files(self, name: str) -> None:
        """UserError for a local folder NAME.lance that holds files Lance does not write: someone else's folder
        under the output's name, which a table created in it would be mixed into."""
        if "://" in self._db_uri and not self._db_uri.startswith("file://"):
            return
        try:
            others = sorted(set(os.listdir(os.path.join(self._db_uri.removeprefix("file://"), f"{name}.lance")))
                            - _LANCE_ENTRIES)
        except OSError:  # none there (a plain file is refused by create_table)
            return
        if others:
            raise UserError(f"{self._shown} is a folder of other files than a LanceDB table's ({others[0]}"
                            f"{', ...' if len(others) > 1 else ''}); embedctl will not write into it: pick another "
                            "--out")

    def write(self, batch: pa.RecordBatch) -> None:
        for group in self._groups.add(batch):
            self._commit(group)

    def _commit(self, group: pa.Table) -> None:
        if self._holds_map:
            group = group.cast(self._schema)
        with _io_errors(self._shown):
            if self._table is None:
                self._table = self._db.create_table(self._target, data=group, schema=self._schema)
            elif any(row_id in self.existing for row_id in group.column("id").to_pylist()):
                self._table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(group)
            else:  # only new ids: a plain append, with no join against the whole table
                self._table.add(group)
        self.committed_rows += group.num_rows

    def finish(self, source: dict[str, str], prune: bool, emptied: AbstractSet[str] = frozenset(),
               restamps: Sequence[pa.Table] = ()) -> int:
        replace = self._target != self._name
        self._restamp(Restamps(restamps))
        if (group := self._groups.take()) is not None:
            self._commit(group)
        elif self._table is None:  # an empty source still makes an (empty) table
            self._commit(self._schema.empty_table())
        doomed = self.existing.keys() if prune or replace else self.existing.keys() & emptied
        gone = sorted(doomed - source.keys())
        with _io_errors(self._shown):
            for start in range(0, len(gone), _DELETE_IDS):
                self._table.delete(_id_in(gone[start:start + _DELETE_IDS]))
            if replace:
                # Overwritten, the table loses the indexes built on it (LanceDB keeps no recipe to rebuild an ANN
                # index by): named in the summary, rather than left for slow queries to reveal.
                old = self._open(self._name)
                self.dropped_indexes = [f"{index.name}: {index.index_type} on {', '.join(index.columns)}"
                                        for index in (old.list_indices() if old is not None else [])]
                self._replace(create=old is None)
        if self._may_optimize:
            self._tidy()
        return len(self.replaced - source.keys()) if replace else len(gone)

    def _replace(self, create: bool) -> None:
        """The table NAME replaced by the staged one in one commit (with create, made from it: an overwrite of no
        table logs a warning of Lance's own on stderr), in fragments of COMPACT_TARGET_ROWS rows as a build's
        commits make them (LanceDB's overwrite writes one per million rows, which its flat search scans several
        times slower), and the stage dropped."""
        import lance

        stage = self._table.to_lance()
        uri = posixpath.join(posixpath.dirname(stage.uri.rstrip("/")), f"{self._name}.lance")  # beside the stage
        lance.write_dataset(stage.scanner().to_reader(), uri, schema=self._schema,
                            mode="create" if create else "overwrite", max_rows_per_file=COMPACT_TARGET_ROWS)
        self._db.drop_table(self._target)
        self._table = self._open(self._name)

    def _tidy(self) -> None:
        """The upkeep a table needs, each part only where it has work: runs of neighbouring small fragments
        compacted once COMPACT_SMALL_FRAGMENTS of them are under COMPACT_TARGET_ROWS, the rows its indexes lack
        added once there are INDEX_UNINDEXED_ROWS, the files of versions replaced over VERSIONS_KEPT ago removed.
        It runs whether or not the run changed the table, so that an upkeep cut short is done by the next run.
        Sets `optimized` to what it did, if anything, or `optimize_error` to why it failed: the run's rows are
        committed by then, so a failure does not fail it."""
        try:
            dataset, done = self._table.to_lance(), []
            sizes = [fragment.metadata.physical_rows for fragment in dataset.get_fragments()]
            if mergeable_small(sizes, COMPACT_TARGET_ROWS) >= COMPACT_SMALL_FRAGMENTS:
                compaction = dataset.optimize.compact_files(target_rows_per_fragment=COMPACT_TARGET_ROWS)
                if compaction.fragments_removed:
                    done.append(f"{plural(compaction.fragments_removed, 'fragment')} rewritten as "
                                f"{compaction.fragments_added:,}")
                self._table.checkout_latest()
            unindexed = max((stats.num_unindexed_rows for index in self._table.list_indices()
                             if (stats := self._table.index_stats(index.name)) is not None), default=0)
            if unindexed >= INDEX_UNINDEXED_ROWS:
                dataset.optimize.optimize_indices()
                done.append(f"its indexes given the {plural(unindexed, 'row')} they lacked")
            if old := _superseded_before(dataset.versions(), datetime.now() - VERSIONS_KEPT):
                cleanup = dataset.cleanup_old_versions(versions=old, error_if_tagged_old_versions=False)
                if cleanup.old_versions:
                    done.append(f"{plural(cleanup.old_versions, 'old version')} removed "
                                f"({cleanup.bytes_removed / 2**20:,.1f} MiB)")
            self._table.checkout_latest()
        except (OSError, RuntimeError, ValueError) as error:
            self.optimize_error = _lance_reason(error) if isinstance(error, RuntimeError) else short_reason(error)
            return
        self.optimized = ", ".join(done) or None

    def _restamp(self, restamps: Restamps) -> None:
        """Whole rows, their stored vectors in them, written as re-embedded rows are (upserted in the run's
        groups): a merge of the changed columns alone rewrites them in place, which takes every fragment it
        touches out of the table's indexes."""
        ids = restamps.ids()
        for start in range(0, len(ids), _DELETE_IDS):
            with _io_errors(self._shown):
                stored = self._table.to_lance().to_table(filter=_id_in(ids[start:start + _DELETE_IDS]))
            for batch in restamps.apply(stored.cast(self._schema)).to_batches():
                self.write(batch)
                # committed_rows counts embedded rows, as the Parquet stores' do: these were embedded by an earlier run
                self.committed_rows -= batch.num_rows

    def abort(self) -> None:
        self._groups.take()


def mergeable_small(sizes: list[int], target: int) -> int:
    """How many of the fragments with these row counts, in table order, compaction can merge: those under target
    beside another such. Lance merges only neighbours, so one stranded between full fragments never is, and
    counting it would start a compaction after every small commit once ten were stranded."""
    small = [size < target for size in sizes]
    return sum(is_small and (before or after)
               for before, is_small, after in zip([False, *small], small, [*small[1:], False]))


def small_part_groups(rows: list[int], target: int) -> list[list[int]]:
    """The indexes of the parts with these row counts that a merge joins, in groups of two or more in part order:
    parts under target, each group as many as stay within target rows."""
    groups: list[list[int]] = [[]]
    total = 0
    for index, count in enumerate(rows):
        if count >= target:
            continue
        if total + count > target:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += count
    return [group for group in groups if len(group) > 1]


def _superseded_before(versions: list[dict], cutoff: datetime) -> list[int]:
    """The numbers of the table versions that a later version replaced before cutoff: no reader has been on them
    since. (Lance's own older_than goes by when a version was made, which would take the version a table was on
    until this run if that was made long ago.) Lance gives each version's timestamp in local time, as cutoff."""
    return [version["version"] for version, successor in zip(versions, versions[1:]) if successor["timestamp"] < cutoff]


def _id_in(ids: Sequence[str]) -> str:
    """A Lance predicate for rows with these ids."""
    quoted = ", ".join("'" + row_id.replace("'", "''") + "'" for row_id in ids)
    return f"id IN ({quoted})"


class _ParquetDirStore:
    """A directory whose *.parquet files are the table (other files are left alone); each group is a new
    part. A first build commits its parts in place. A run into a directory that holds parts stages them in
    DIR/.update, hidden from readers, and moves them in at finish before it rewrites the old parts without the
    copies they replace: readers see a changed row twice only while finish rewrites (committed beside its old
    copy, it was twice for the whole run, and after a kill until the next run). Plain files cannot change
    together; a LanceDB table's commits can. A killed update's stage is the next run's committed work, moved in at
    its finish; a rebuild's swap removes it. A rebuild stages
    its parts in DIR/.rebuild and moves them in at finish, after the old parts; a rebuild run again with the same
    settings after a crash mid-swap goes on from what that swap brought in (as one cut short earlier goes on from
    its stage)."""

    dropped_indexes: Sequence[str] = ()  # Parquet holds no indexes

    def __init__(self, shown: str, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema,
                 rebuild: bool, commit_rows: int, optimize: bool = True) -> None:
        self._shown, self._fs, self._root, self._schema = shown, fs, path, schema
        self._path = path
        self._may_optimize = optimize
        self.optimized: str | None = None
        self.optimize_error: str | None = None
        with _io_errors(shown):
            swapped = self._finish_swap()  # a rebuild's, cut short by a crash: before anything reads the parts
            old_parts = self._parts(path)
            schemas = [_read_schema(fs, part, shown) for part in old_parts]
            for old in schemas:
                _refuse_foreign(shown, old)
            self.replaced: set[str] = set()
            self._rebuilt_in_place = rebuild and swapped and not any(_incompatibility(old, schema) for old in schemas)
            update_stage = posixpath.join(path, _UPDATE)
            self._updating = not rebuild and bool(old_parts or self._parts(update_stage))
            if rebuild and not self._rebuilt_in_place:  # staged even with no old parts: a killed first build resumes
                self.replaced = {row_id for part in old_parts for row_id in _ids(fs, part)}
                self._path = posixpath.join(path, _REBUILD)
                if any(_incompatibility(_read_schema(fs, p, shown), schema) for p in self._parts(self._path)):
                    fs.rm(self._path, recursive=True)  # a rebuild for other settings, left by a killed run
            else:
                staged = [_read_schema(fs, part, shown, stage=update_stage) for part in self._parts(update_stage)]
                for old in schemas + staged:
                    _check_compatible(shown, old, schema)
                if self._updating:
                    self._path = update_stage
            for leftover in {*self._listing(path), *self._listing(self._path)}:  # parts a killed run did not commit
                if posixpath.basename(leftover).startswith(_TMP):
                    fs.rm(leftover, recursive=True)
            # A stage's parts are newer than the directory's, whatever their numbers after a kill mid-move.
            parts = (old_parts if self._updating else []) + self._parts(self._path)
            self._next = max(map(_part_number, parts), default=-1) + 1
            self.existing = {}
            for part in reversed(parts):  # newest first: after a kill mid-finish, the newest copy is the run's
                stored = pq.read_table(part, columns=["id", CONTENT_KEY], filesystem=fs)
                for row_id, key in zip(stored.column("id").to_pylist(), stored.column(CONTENT_KEY).to_pylist()):
                    self.existing.setdefault(row_id, key)
            if self._rebuilt_in_place:  # its rows are the old output for this run, which keeps only the source's
                self.replaced = set(self.existing)
        self._groups = _Groups(schema, commit_rows)
        self.committed_rows = 0

    def _listing(self, path: str) -> list[str]:
        return self._fs.ls(path, detail=False) if self._fs.isdir(path) else []

    def _parts(self, path: str) -> list[str]:
        return table_parts(self._fs, path) if self._fs.isdir(path) else []

    def write(self, batch: pa.RecordBatch) -> None:
        for group in self._groups.add(batch):
            self._commit(group)

    def _commit(self, group: pa.Table) -> None:
        name = f"part-{self._next:05d}.parquet"
        with _io_errors(self._shown):
            self._fs.makedirs(self._path, exist_ok=True)
            _replace(self._fs, posixpath.join(self._path, name), group)
        self._next += 1
        self.committed_rows += group.num_rows

    def finish(self, source: dict[str, str], prune: bool, emptied: AbstractSet[str] = frozenset(),
               restamps: Sequence[pa.Table] = ()) -> int:
        if (group := self._groups.take()) is not None:
            self._commit(group)
        if self._updating:
            self._end_update_stage()
        replace = self._path != self._root
        survivors = _Survivors(source, prune or replace or self._rebuilt_in_place, emptied)
        restamped = Restamps(restamps)
        with _io_errors(self._shown):
            self._fs.makedirs(self._path, exist_ok=True)
            for part in reversed(self._parts(self._path)):
                stored = pq.read_table(part, columns=["id", CONTENT_KEY], filesystem=self._fs)
                ids = stored.column("id").to_pylist()
                keys = restamped.keys(ids, stored.column(CONTENT_KEY).to_pylist())
                stays = survivors.mask(ids, keys)
                if not any(stays):
                    self._fs.rm(part)
                elif not all(stays) or keys != stored.column(CONTENT_KEY).to_pylist():
                    whole = restamped.apply(pq.read_table(part, filesystem=self._fs))
                    _replace(self._fs, part, whole.filter(pa.array(stays)))
            if replace:
                self._swap_in()
        if self._may_optimize:
            self._tidy()
        return len(self.replaced - source.keys()) if replace else len(survivors.deleted)

    def _end_update_stage(self) -> None:
        """An update's staged parts moved in, numbered after the old ones, so that the copies of their ids in the
        old parts are the older ones, which finish then removes: until it has, readers see both (rather than
        neither, as removing first would show them), and after a kill until the next run, which reads the newer
        ones as its own and removes the others."""
        with _io_errors(self._shown):
            if self._fs.isdir(self._path):
                self._move_in(self._path)
                self._fs.rm(self._path, recursive=True)
        self._path, self._updating = self._root, False

    def _swap_in(self) -> None:
        """Move the staged parts into the directory, numbered after the old ones, then remove the old ones.

        Not atomic across files, so the old parts' names are written into the stage first: a crash in between
        leaves old and new parts side by side for readers until the next run, whatever its options, finishes
        the swap (_finish_swap) before it reads the parts."""
        old = [posixpath.basename(part) for part in self._parts(self._root)]
        self._fs.pipe_file(posixpath.join(self._path, _TMP + _SWAP), json.dumps(old).encode())
        self._fs.mv(posixpath.join(self._path, _TMP + _SWAP), posixpath.join(self._path, _SWAP))
        self._finish_swap()

    def _finish_swap(self) -> bool:
        """The swap a stage's list of old parts asks for: the staged parts moved in, numbered after every part
        there, the listed old parts removed, the stage removed. Whether there was one to finish."""
        stage = posixpath.join(self._root, _REBUILD)
        if not self._fs.exists(listing := posixpath.join(stage, _SWAP)):
            return False
        try:
            old = json.loads(self._fs.cat_file(listing))
        except ValueError:  # cut short by a power loss
            old = None
        if not isinstance(old, list) or not all(isinstance(name, str) for name in old):
            raise UserError(f"cannot read {listing}, the list of the old parts that a --rebuild was replacing when it "
                            f"was cut short; remove the folder {stage} and run with --rebuild")
        self._move_in(stage)
        if doomed := [path for name in old if self._fs.exists(path := posixpath.join(self._root, name))]:
            self._fs.rm(doomed)
        if self._fs.isdir(update_stage := posixpath.join(self._root, _UPDATE)):  # a killed update's, now replaced
            self._fs.rm(update_stage, recursive=True)
        self._fs.rm(stage, recursive=True)
        return True

    def _move_in(self, stage: str) -> None:
        """A stage's parts moved into the directory in their order, numbered after every part there."""
        present = self._parts(self._root)
        number = _part_number(present[-1]) + 1 if present else 0
        for offset, part in enumerate(self._parts(stage)):
            self._fs.mv(part, posixpath.join(self._root, f"part-{number + offset:05d}.parquet"))

    def _tidy(self) -> None:
        """Small parts merged, in part order, into parts of up to COMPACT_TARGET_ROWS rows, once
        COMPACT_SMALL_FRAGMENTS of them would be: a Lance table's sizes, counted among all small parts (any two
        parts may merge, where Lance merges only neighbouring fragments). Each merged part is written over the
        newest of its parts, then the others are removed: a crash in between leaves their rows twice, equal copies
        that readers see until the next run's finish removes them, as it removes those of a crash mid-finish. A year
        of a cron job's daily parts cost an unchanged run 0.83 s on the output against 0.13 merged, one with 50
        changed rows 0.96-1.20 s against 0.24-0.50 (merged parts rewrite more rows, but parts cost more than rows),
        and pyarrow's scan 225 ms against 134 (bench/results/cpu-2026-12-07-parquet-parts). Sets `optimized` to what it
        did, if anything, and `optimize_error` to why it failed, as a Lance table's upkeep does."""
        merged = into = 0
        try:
            parts = self._parts(self._root)
            groups = small_part_groups([pq.read_metadata(part, filesystem=self._fs).num_rows for part in parts],
                                       COMPACT_TARGET_ROWS)
            if sum(map(len, groups)) < COMPACT_SMALL_FRAGMENTS:
                return
            for group in groups:
                tables = [pq.read_table(parts[i], filesystem=self._fs) for i in group]
                whole = pa.concat_tables(tables).replace_schema_metadata(tables[-1].schema.metadata)
                _replace(self._fs, parts[group[-1]], whole)
                self._fs.rm([parts[i] for i in group[:-1]])
                merged, into = merged + len(group), into + 1
        except (OSError, pa.ArrowException) as error:
            self.optimize_error = short_reason(error)
        finally:
            self.optimized = f"{plural(merged, 'part')} merged into {into:,}" if merged else None

    def abort(self) -> None:
        self._groups.take()


class _ParquetFileStore:
    """One Parquet file, rewritten whole beside the output and renamed onto it at finish."""

    dropped_indexes: Sequence[str] = ()  # Parquet holds no indexes
    optimized = optimize_error = None  # rewritten whole every run, it needs no upkeep

    def __init__(self, shown: str, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema, rebuild: bool) -> None:
        self._shown, self._fs, self._path, self._schema = shown, fs, path, schema
        parent, base = posixpath.split(path)
        self._tmp = posixpath.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
        self._closed = False
        self.committed_rows = 0  # the file is written whole at finish
        self.existing: dict[str, str] = {}
        with _io_errors(shown):
            exists = fs.exists(path)
            old_schema = _read_schema(fs, path, shown) if exists else None
            if old_schema is not None:
                _refuse_foreign(shown, old_schema)
            self._old = exists and not rebuild
            self._replacing = exists and rebuild
            self.replaced: set[str] = set(_ids(fs, path)) if self._replacing else set()
            self._stored: tuple[list[str], list[str]] = ([], [])  # id and content_key of the old rows, in order
            if self._old:
                _check_compatible(shown, old_schema, schema)
                stored = pq.read_table(path, columns=["id", CONTENT_KEY], filesystem=fs)
                self._stored = stored.column("id").to_pylist(), stored.column(CONTENT_KEY).to_pylist()
                self.existing = dict(zip(*self._stored))
            if parent:
                fs.makedirs(parent, exist_ok=True)
            # From a killed run on this output: exactly .BASE.<12 hex digits>.tmp, not the temporary file of
            # another output whose name starts with BASE. (x.parquet.old.parquet's run holds another lock.)
            leftovers = re.compile(re.escape(f".{base}.") + "[0-9a-f]{12}" + re.escape(".tmp"))
            for leftover in fs.glob(posixpath.join(parent, f".{base}.*.tmp")):
                if leftovers.fullmatch(posixpath.basename(leftover)):
                    fs.rm(leftover)
            self._sink = _RowGroups(fs, self._tmp, schema)
        self._written: list[pa.RecordBatch] = []  # id and content_key of the new rows

    def write(self, batch: pa.RecordBatch) -> None:
        _check_batch(batch, self._schema)
        with _io_errors(self._shown):
            self._sink.write(batch)
        self._written.append(batch.select(["id", CONTENT_KEY]))

    def finish(self, source: dict[str, str], prune: bool, emptied: AbstractSet[str] = frozenset(),
               restamps: Sequence[pa.Table] = ()) -> int:
        survivors = _Survivors(source, prune, emptied)
        restamped = Restamps(restamps)
        if self._stored[0]:  # old rows to sort out; the new rows come first and stay
            for batch in self._written:
                survivors.mask(batch.column("id").to_pylist(), batch.column(CONTENT_KEY).to_pylist())
        stays = survivors.mask(self._stored[0], restamped.keys(*self._stored))
        if self._old and not self._written and not restamped and all(stays):  # nothing to change: leave the file
            self.abort()
            return 0
        with _io_errors(self._shown):
            if self._old:
                with self._fs.open(self._path, "rb") as handle:
                    start = 0
                    for batch in pq.ParquetFile(handle).iter_batches():
                        whole = restamped.apply(pa.Table.from_batches([batch]))
                        for part in whole.filter(pa.array(stays[start:start + batch.num_rows])).to_batches():
                            self._sink.write(part)
                        start += batch.num_rows
            self._sink.close()
            self._fs.mv(self._tmp, self._path)
        self._closed = True
        self.committed_rows = sum(batch.num_rows for batch in self._written)
        return len(self.replaced - source.keys()) if self._replacing else len(survivors.deleted)

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sink.discard()
        try:
            self._fs.rm(self._tmp)
        except OSError:
            pass  # abort is best effort: it runs while another error is already on its way to the user


class _RowGroups:
    """A Parquet file that gathers small batches into row groups of about _ROW_GROUP_BYTES."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema) -> None:
        self._writer = pq.ParquetWriter(path, schema, filesystem=fs, **_parquet_options(schema))
        self._schema = schema
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
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


def _replace(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table) -> None:
    """Write table to path atomically: under a hidden temporary name, then renamed onto path."""
    parent, base = posixpath.split(path)
    tmp = posixpath.join(parent, f"{_TMP}{base}")
    pq.write_table(table, tmp, filesystem=fs, **_parquet_options(table.schema))
    fs.mv(tmp, path)


def _parquet_options(schema: pa.Schema) -> dict[str, list[str]]:
    """Dictionary pages and min/max statistics for every column but the vectors: a dictionary of float
    vectors never pays and is dropped after a page, and no reader prunes on a vector's smallest element.
    With these options and 32 MiB row groups, MiniLM's index of 60,000 documents on the H200 ran 4.50M and
    4.52M tok/s against 4.28M and 4.23M before, alternating on one host (bench/results/gpu-2026-11-30-run55-writer-ab).
    pyarrow matches these lists against Parquet's leaf paths ("vector.list.element", "tags.list.element"),
    so they name the leaves of every column but the vector column's."""
    vector_leaves = set(_leaf_paths(pa.schema([schema.field("vector")])))
    others = [path for path in _leaf_paths(schema) if path not in vector_leaves]
    return {"use_dictionary": others, "write_statistics": others}


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """The Parquet leaf column paths a table of this schema is written with."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    parquet_schema = pq.read_metadata(pa.BufferReader(sink.getvalue())).schema
    return [parquet_schema.column(i).path for i in range(len(parquet_schema))]


def _part_number(path: str) -> int:
    match = _PART_NAME.search(path)
    return int(match.group(1)) if match else -1


def _incompatibility(old: pa.Schema, new: pa.Schema) -> str | None:
    """Why rows with schema new cannot join a table with schema old, or None when they can."""
    if (why := _settings_incompatibility(old, new)) is not None:
        return why
    if not old.remove_metadata().equals(new.remove_metadata()):
        return f"its columns are ({_columns(old)}) but this run writes ({_columns(new)})"
    return None


def _settings_incompatibility(old: pa.Schema, new: pa.Schema) -> str | None:
    """Why the vectors of a table with schema old are not what this run's settings (schema new) make, or None."""
    if CONTENT_KEY not in old.names:
        return f"it has no {CONTENT_KEY} column (it was not made by this version of embedctl)"
    old_meta, new_meta = _embedctl_metadata(old), _embedctl_metadata(new)
    # The weights first, then the model's other files, where both record them: another model differs in
    # both, and in dim or pooling too.
    first = [key for key in ("embedctl.weights_sha256", "embedctl.files_sha256") if key in old_meta and key in new_meta]
    rank = {key: place for place, key in enumerate(first)}
    for key in sorted(old_meta.keys() | new_meta.keys(), key=lambda key: (rank.get(key, len(first)), key)):
        if key not in old_meta and key.removeprefix("embedctl.") in LATER_SETTINGS:
            continue
        if old_meta.get(key) != new_meta.get(key):
            if key == "embedctl.weights_sha256":  # name the models: two hashes alone tell a user nothing
                models = [(schema.metadata or {}).get(b"embedctl.model", b"?").decode() for schema in (old, new)]
                return (f"it was embedded with the model {models[0]} (weights sha256 {old_meta.get(key, '?')[:12]}...) "
                        f"and this run's is {models[1]} (weights sha256 {new_meta.get(key, '?')[:12]}...)")
            if key == "embedctl.files_sha256":
                return (f"its model's config, tokenizer or module files differ from this run's (sha256 "
                        f"{old_meta[key][:12]}... against {new_meta.get(key, '?')[:12]}...), though its weights are the same")
            name = setting_name(key)
            return (f"it was embedded with {name} {setting_value(old_meta.get(key))} and this run's {name} is "
                    f"{setting_value(new_meta.get(key))}")
    return None


def _with_standard_maps(field: pa.Field) -> pa.Field:
    """field with the entries of each map in it, at any depth, named "entries"."""
    kind = field.type
    if pa.types.is_map(kind):
        kind = pa.map_(_with_standard_maps(kind.key_field), _with_standard_maps(kind.item_field), kind.keys_sorted)
    elif pa.types.is_struct(kind):
        kind = pa.struct([_with_standard_maps(kind.field(i)) for i in range(kind.num_fields)])
    elif pa.types.is_fixed_size_list(kind):
        kind = pa.list_(_with_standard_maps(kind.value_field), kind.list_size)
    elif pa.types.is_large_list(kind):
        kind = pa.large_list(_with_standard_maps(kind.value_field))
    elif pa.types.is_list(kind):
        kind = pa.list_(_with_standard_maps(kind.value_field))
    return field.with_type(kind)


def _holds_map(schema: pa.Schema) -> bool:
    """Whether a column holds a map at any depth."""
    def holds(kind: pa.DataType) -> bool:
        return pa.types.is_map(kind) or any(holds(kind.field(i).type) for i in range(kind.num_fields))

    return any(holds(field.type) for field in schema)


def _ids(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The ids of a Parquet file of the table, which a rebuild replaces."""
    return pq.read_table(path, columns=["id"], filesystem=fs).column("id").to_pylist()


def _refuse_foreign(shown: str, old: pa.Schema) -> None:
    """UserError for an existing output that embedctl did not write: neither an update nor --rebuild
    may overwrite or delete data of someone else's."""
    if not _embedctl_metadata(old):
        raise UserError(f"{shown} holds data that embedctl did not write (no embedctl settings in its schema); "
                        "embedctl will not change or replace it: pick another --out")


def _check_compatible(shown: str, old: pa.Schema, new: pa.Schema) -> None:
    if (why := _incompatibility(old, new)) is None:
        return
    # Kept columns that differ by name, under the same settings: most often a cron line that lacks the --keep of the
    # command that built the output, whose fix is that flag rather than a rebuild.
    stored_only = [name for name in old.names if name not in new.names]
    run_only = [name for name in new.names if name not in old.names]
    if (stored_only or run_only) and _settings_incompatibility(old, new) is None:
        flags = [f"{verb} {' '.join(f'--keep {name}' for name in names)}"
                 for verb, names in (("add", stored_only), ("drop", run_only)) if names]
        fixes = [f"{' and '.join(flags)} to match it", "pass --rebuild to re-embed it all with this run's columns",
                 "write to a new output"]
        held = (f"it keeps the column{'s' * (len(stored_only) > 1)} {', '.join(stored_only)}, which this run does not"
                if stored_only else "")
        lacked = f"this run keeps {', '.join(run_only)}, which it lacks" if run_only else ""
        raise UserError(f"cannot update {shown}: {'; '.join(filter(None, (held, lacked)))}; {', or '.join(fixes)}")
    raise UserError(f"cannot update {shown}: {why}; pass --rebuild to re-embed it all, or write to a new output")


def _embedctl_metadata(schema: pa.Schema) -> dict[str, str]:
    items = (schema.metadata or {}).items()
    return {
        k.decode(): v.decode()
        for k, v in items
        if k.decode().startswith("embedctl.") and k.decode() not in _RUN_SPECIFIC
    }


def setting_name(key: str) -> str:
    """A recorded setting's name as a message shows it: "max length" for embedctl.max_length."""
    return key.removeprefix("embedctl.").replace("_", " ")


def setting_value(value: str | None) -> str:
    """A recorded setting's value as a message shows it: numbers and words as they are, other text (a prompt) quoted."""
    if value is None:
        return "none"
    return value if re.fullmatch(r"[\w.-]+", value) else repr(value)


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _check_batch(batch: pa.RecordBatch, schema: pa.Schema) -> None:
    if not batch.schema.equals(schema, check_metadata=False):
        raise ValueError(f"batch schema ({_columns(batch.schema)}) is not the output schema ({_columns(schema)})")


def _read_schema(fs: fsspec.AbstractFileSystem, path: str, shown: str, stage: str | None = None) -> pa.Schema:
    """A part's schema. One that cannot be read is refused: in the directory as not embedctl's, in the `stage`
    of a cut-off update as rows to embed again."""
    try:
        return pq.read_schema(path, filesystem=fs)
    except (pa.ArrowException, OSError) as e:
        if stage is not None:
            raise UserError(f"cannot update {shown}: {path} is not a readable Parquet file ({short_reason(e)}); it "
                            f"holds rows a cut-off run embedded: remove the folder {stage} and run again to embed "
                            "them again") from None
        # embedctl writes a file whole under another name and renames it: one it cannot read is not its own.
        raise UserError(
            f"cannot update {shown}: {posixpath.basename(path)} is not a readable Parquet file ({short_reason(e)}), "
            "so not one embedctl wrote, and it will not replace it, --rebuild or not; repair or remove it, or pick "
            "another --out"
        ) from None


def _lance_reason(error: RuntimeError) -> str:
    """Lance's message without its error-kind prefix and the Rust source file's path it appends."""
    return _LANCE_PREFIX.sub("", short_reason(error).split(", /")[0])


@contextmanager
def _io_errors(shown: str) -> Iterator[None]:
    """Turns an OSError while writing, or Lance's RuntimeError for one, into a UserError that names the output."""
    try:
        yield
    except OSError as e:
        raise _cannot_write(shown, short_reason(e)) from None
    except RuntimeError as e:
        if _LANCE_IO not in str(e):  # a Lance bug, not the user's disk: keep its traceback
            raise
        raise _cannot_write(shown, _lance_reason(e)) from None


def _cannot_write(shown: str, reason: str) -> UserError:
    return UserError(f"cannot write {shown} ({reason}); check free space and permissions")
