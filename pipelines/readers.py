"""Streaming corpus reader: Parquet and JSONL shards in, chunks of (id, text) rows out.

A CorpusReader resolves a file, directory or glob (local or any fsspec URL), or several read as one
corpus, to .parquet, .jsonl and .ndjson files, the JSON lines plain or compressed (.gz, .zst as Dolma
and FineWeb ship them, .bz2, .xz; suffixes in any case; .json files too where a path or a glob names
them, as Spark and C4 name JSON lines), checks every Parquet schema and that every JSONL file has the --keep keys up front, then
yields Chunks of at most chunk_rows rows, one at a time, never a whole file. Every problem with the user's files becomes a one-line UserError that names
the file (and the line for JSONL).

It is not a tokenizer (texts come out as they are, None for null) and it does not deduplicate ids.
"""

from __future__ import annotations

import codecs
import contextlib
import fnmatch
import io
import json
import lzma
import math
import os
import posixpath
import re
import sys
import urllib.parse
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import IO

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from engine.errors import UserError, short_reason
from pipelines.progress import plural

_PARQUET = ".parquet"
# How JSON lines may be compressed: read by their suffix, .zst with Arrow's codec, the others with fsspec's.
_COMPRESSIONS = ("", ".gz", ".zst", ".bz2", ".xz")
# The suffixes of corpus files, compared in lower case
_SUFFIXES = (_PARQUET, *(kind + compression for kind in (".jsonl", ".ndjson") for compression in _COMPRESSIONS))
_SUFFIX_LIST = ".parquet, .jsonl or .ndjson (plain or compressed as .gz, .zst, .bz2 or .xz)"
# JSON lines under a .json name (Spark's df.write.json, C4): read where the user names them, by path or by a glob
# whose last part spells .json, not found by a folder's walk or DIR/*, where .json files are as often side files
# (dataset_info.json).
_JSON_SUFFIXES = tuple(".json" + compression for compression in _COMPRESSIONS)
_GLOB = re.compile(r"[*?\[]")
_BARE_PROTOCOL = re.compile(r"[a-z][a-z0-9+.-]*")  # a part of a chained URL that names a protocol and no path
# A corpus file under a compression it is not read in (a .jsonl.gz is read): refused by name rather than left
# out like a side file.
_OTHER_COMPRESSION = re.compile(r"\.(?:jsonl|ndjson|parquet)\.(zstd?|bz2|xz|lzma|lz4|zip|br|snappy|7z|gz|gzip|z)$",
                                re.IGNORECASE)
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # the folder Hive and Spark write a partition's null value as
_WHOLE = re.compile(r"-?(0|[1-9][0-9]{0,17})")  # a partition value read as an int64: no leading zeros (id=007 stays text)


@dataclass
class Chunk:
    source: str  # the file as the user would recognise it (path/URL)
    ids: list[str]
    texts: list[str | None]
    lines: list[int]  # 1-based line (JSONL) or row (Parquet) in source, for error messages
    kept: pa.Table | None  # the --keep columns; the same schema in every chunk of a reader

    def where(self, row: int) -> str:
        """Where a row came from, for an error message: the file and its line (JSONL) or row (Parquet)."""
        unit = "row" if _is_parquet(self.source) else "line"
        return f"{self.source} {unit} {self.lines[row]}"


@dataclass
class _File:
    fs: fsspec.AbstractFileSystem
    path: str  # fsspec path, protocol stripped
    shown: str  # the user's spelling of it
    rel: str  # name relative to the given directory: the prefix of generated ids
    has_id: bool = False  # Parquet only; in JSONL the first line decides
    rows: int = 0  # Parquet only, from the footer
    partitions: dict[str, str | None] = field(default_factory=dict)  # its key=value folders (_partitions)
    folder_keys: list[str] = field(default_factory=list)  # the --keep keys whose values it takes from its folders
    schema: pa.Schema | None = None  # Parquet only: its footer's, as checked when the reader was made


class CorpusReader:
    """Iterate a corpus as Chunks; construction resolves and validates the files."""

    def __init__(
        self,
        path: str | Sequence[str],
        text_col: str = "text",
        id_col: str = "id",
        keep: Sequence[str] = (),
        chunk_rows: int = 1024,
        flags: tuple[str, str] = ("--text-col", "--id-col"),
    ) -> None:
        """path: one SOURCE, or several (see _resolve_sources). flags: the options that set text_col and id_col, as
        the errors name them."""
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.text_col, self.id_col, self.chunk_rows = text_col, id_col, chunk_rows
        self.text_flag, self.id_flag = flags
        self.keep = list(dict.fromkeys(keep))
        self.sources = [path] if isinstance(path, str) else list(path)
        if not self.sources:
            raise ValueError("no SOURCE: give at least one path")
        self._files, self.json_left_out = _resolve_sources(self.sources)
        self.files: list[str] = [f.shown for f in self._files]
        # Every chunk's kept table gets one schema so the writer can fix its schema from the first.
        self._kept_schema: pa.Schema | None = None
        self._kept_origins: dict[str, str] = {}  # kept column -> the Parquet file (or output) that gave it its type
        self._typed_by = "earlier lines"  # with JSONL alone: the file and lines whose values gave the kept types
        self._followed: str | None = None  # the output whose kept types this run follows (follow)
        # Files read so far whose rows are numbered FILE:ROW for want of an id column (a Parquet file's as it is
        # checked, below; a JSONL file's on its first line): an --id-col misspelt would number every row.
        self.numbered: list[str] = []
        parquet = [f for f in self._files if _is_parquet(f.path)]
        own_schemas = {f.path: self._check_parquet(f) for f in parquet}  # the kept columns each file holds itself
        text_keys = {field.name for schema in own_schemas.values() for field in schema if _is_text(field.type)}
        if self.keep:
            for f in self._files:
                if not _is_parquet(f.path):
                    text_keys |= self._check_jsonl_keep(f)
        self._partition_types = _partitioned(self._files, self.keep, text_keys)
        if self.keep:
            for f in parquet:
                own = own_schemas[f.path]
                kept = pa.schema([own.field(c) if c in own.names else pa.field(c, self._partition_types[c])
                                  for c in self.keep])
                unified = _unify(f, self._kept_schema, kept)
                for field in unified:
                    if self._kept_schema is None or self._kept_schema.field(field.name).type != field.type:
                        self._kept_origins[field.name] = f.shown
                self._kept_schema = unified
            if self._kept_schema is not None:  # a key only null folders give: text, as JSONL's null keys become
                self._kept_schema = pa.schema([field.with_type(pa.string()) if pa.types.is_null(field.type) else field
                                               for field in self._kept_schema])
        self._own_columns = {name for schema in own_schemas.values() for name in schema.names}
        self.total_rows: int | None = None
        if len(parquet) == len(self._files):
            self.total_rows = sum(f.rows for f in parquet)

    def follow(self, stored: pa.Schema, origin: str) -> None:
        """Keep the columns of an output this run updates (stored, holding the same names as keep) in its order,
        and in its types where no Parquet file's own column gives one (a JSONL corpus, a key only folders give)
        or where the files' type is of the same kind (_same_kind: a re-export writing large_string for string,
        or int32 for int64): --keep b --keep a then matches a table made with --keep a --keep b, a key null
        throughout the first chunk keeps the type stored rather than becoming text, year=2024 stays text in an
        output that stored year=unknown, and a Parquet export moved from pandas to Polars updates its output
        rather than asking for a --rebuild. origin names the output in the message for a value that does not fit."""
        self.keep, self._followed = stored.names, origin
        if self._kept_schema is not None:  # typed by the Parquet files' own schemas, but for keys only folders give
            own = {name for name in stored.names if name in self._own_columns
                   and not _same_kind(self._kept_schema.field(name).type, stored.field(name).type)}
            self._kept_schema = pa.schema([self._kept_schema.field(name) if name in own else stored.field(name)
                                           for name in stored.names])
            self._kept_origins |= {name: origin for name in stored.names if name not in own}
        else:
            self._kept_schema, self._typed_by = stored, origin

    @property
    def _jsonl_id_fix(self) -> str:
        return f"give every line an id, or pass {self.id_flag} naming a key the file lacks to number lines instead"

    @property
    def kept_schema(self) -> pa.Schema | None:
        """The schema of every chunk's kept table: known from the Parquet footers once constructed; for JSONL
        only, set by the first chunk (so None for a JSONL corpus without rows). None without keep."""
        return self._kept_schema

    def __iter__(self) -> Iterator[Chunk]:
        for f in self._files:
            if _is_parquet(f.path):
                yield from self._read_parquet(f)
            else:
                yield from self._read_jsonl(f)

    # Parquet

    def _open_parquet(self, f: _File) -> tuple[IO[bytes], pq.ParquetFile]:
        try:
            handle = f.fs.open(f.path, "rb")
        except OSError as e:
            raise UserError(f"cannot open {f.shown} ({short_reason(e)}); check the path and its permissions") from None
        try:
            return handle, pq.ParquetFile(handle)
        except (pa.ArrowException, OSError) as e:
            handle.close()
            raise _unreadable_parquet(f, e) from None

    def _check_parquet(self, f: _File) -> pa.Schema:
        handle, pfile = self._open_parquet(f)
        with handle:
            schema, f.rows = pfile.schema_arrow, pfile.metadata.num_rows
        f.schema = schema
        names = ", ".join(schema.names)
        for col in dict.fromkeys([self.text_col, self.id_col, *self.keep]):
            if schema.names.count(col) > 1:
                raise UserError(f"{f.shown} has {schema.names.count(col)} columns named '{col}', which no reader can "
                                "tell apart; rename all but one")
        if self.text_col not in schema.names:
            raise UserError(
                f"{f.shown} has no column '{self.text_col}' (its columns: {names}); "
                f"pass {self.text_flag} with the column that holds the text"
            )
        text_type = schema.field(self.text_col).type
        if not (_is_text(text_type) or pa.types.is_null(text_type)):  # null: pandas' type for a column of None
            raise UserError(
                f"{f.shown}: column '{self.text_col}' is {text_type}, not a string; "
                f"pass {self.text_flag} with a string column"
            )
        for col in self.keep:
            if col not in schema.names and col not in f.partitions:
                raise UserError(
                    f"{f.shown} has no column '{col}' for --keep (its columns: {names}), nor a folder {col}=VALUE; "
                    f"check its spelling or drop it from --keep{self._source_folder_hint(col)}"
                )
        f.folder_keys = [col for col in self.keep if col not in schema.names]
        f.has_id = self.id_col in schema.names
        if not f.has_id:
            self.numbered.append(f.shown)
        else:
            id_type = schema.field(self.id_col).type
            try:
                pa.array([], type=id_type).cast(pa.string())
            except pa.ArrowException:
                raise UserError(
                    f"{f.shown}: column '{self.id_col}' is {id_type}, which cannot serve as an id; "
                    f"pass {self.id_flag} with a string or number column"
                ) from None
        return pa.schema([_without_view(schema.field(c)) for c in self.keep if c in schema.names])

    def _read_parquet(self, f: _File) -> Iterator[Chunk]:
        handle, pfile = self._open_parquet(f)
        if not pfile.schema_arrow.equals(f.schema):  # rewritten since the checks, which a long run's files can be
            handle.close()
            raise UserError(f"{f.shown} changed while this run read the corpus (its columns are not those it had when "
                            "the run started); run again once the corpus is written")
        names = pfile.schema_arrow.names
        kept = [name for name in self.keep if name in names]  # the others come from the file's folders
        columns = list(dict.fromkeys([self.text_col, *([self.id_col] if f.has_id else []), *kept]))
        with handle:
            batches = pfile.iter_batches(batch_size=self.chunk_rows, columns=columns)
            row = 1
            while True:
                try:
                    batch = next(batches, None)
                except (pa.ArrowException, OSError) as e:
                    raise _unreadable_parquet(f, e) from None
                if batch is None:
                    return
                yield self._parquet_chunk(f, batch, row)
                row += batch.num_rows

    def _parquet_chunk(self, f: _File, batch: pa.RecordBatch, first_row: int) -> Chunk:
        lines = list(range(first_row, first_row + batch.num_rows))
        _check_utf8(f, batch, lines)
        if f.has_id:
            id_array = batch.column(self.id_col)
            if id_array.null_count:
                bad = lines[pc.index(pc.is_null(id_array), True).as_py()]
                raise UserError(
                    f"{f.shown} row {bad}: {self.id_col} is null; give every row an id, "
                    f"or pass {self.id_flag} naming a column the file lacks to number rows instead"
                )
            try:
                ids = _parquet_ids(id_array)
            except pa.ArrowInvalid as error:
                raise UserError(f"{f.shown}: {self.id_col} does not read as text ({short_reason(error)}); "
                                "store ids as UTF-8 strings or numbers") from None
            except BadId as bad:
                raise UserError(f"{f.shown} row {lines[bad.index]}: {self.id_col} is {bad}, which names no row; "
                                f"store ids as strings or finite numbers, or pass {self.id_flag} naming the id column") \
                    from None
            if "" in ids:
                raise UserError(f"{f.shown} row {lines[ids.index('')]}: {self.id_col} is empty; give every row an id, "
                                f"or pass {self.id_flag} naming a column the file lacks to number rows instead")
        else:
            ids = [f"{f.rel}:{n}" for n in lines]
        kept = None
        if self.keep:
            kept = pa.Table.from_batches([batch.select([name for name in self.keep if name not in f.folder_keys])])
            for name in f.folder_keys:
                kept = kept.append_column(name, self._folder_column(f, name, batch.num_rows,
                                                                    self._kept_schema.field(name).type))
            kept = kept.select(self.keep)
            if not kept.schema.equals(self._kept_schema):
                kept = self._cast_kept(f, lines, kept)
        return Chunk(f.shown, ids, batch.column(self.text_col).to_pylist(), lines, kept)

    def _cast_kept(self, f: _File, lines: list[int], kept: pa.Table) -> pa.Table:
        """A Parquet chunk's --keep columns in the type every file's columns were unified to; UserError naming the
        column whose values that type cannot hold (2**53 + 1 in a float64, a decimal too wide for it)."""
        columns = []
        for field in self._kept_schema:
            column = kept.column(field.name)
            try:
                columns.append(column.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise _unfit(f, lines, field.name, field.type, short_reason(error), self._kept_origins.get(field.name),
                             kind="column") from None
        return pa.Table.from_arrays(columns, schema=self._kept_schema)

    # JSONL

    def _read_jsonl(self, f: _File) -> Iterator[Chunk]:
        ids: list[str] = []
        texts: list[str | None] = []
        lines: list[int] = []
        kept_rows: list[dict] = []
        first: tuple[int, bool] | None = None  # the first line's number and whether it has an id
        for number, row in self._jsonl_rows(f):
            if first is None:
                first = (number, self.id_col in row)
                if not first[1]:
                    self.numbered.append(f.shown)
            ids.append(self._line_id(f, number, row, first))
            texts.append(row[self.text_col])
            lines.append(number)
            if self.keep:
                self._check_folder_keys(f, number, row, first[0])
                kept_rows.append(row)
            if len(lines) == self.chunk_rows:
                yield Chunk(f.shown, ids, texts, lines, self._jsonl_kept(f, kept_rows, lines))
                ids, texts, lines, kept_rows = [], [], [], []
        if lines:
            yield Chunk(f.shown, ids, texts, lines, self._jsonl_kept(f, kept_rows, lines))

    def _check_jsonl_keep(self, f: _File) -> set[str]:
        """Refuse a --keep key that no line of the file has, as Parquet refuses a missing column: read on,
        it would become a column of nulls. Set the keys the file takes from its folders: those its first line
        lacks (the first line decides, as for ids). Return the keys whose first line holds text, which then
        stays text in every file. Reading stops once every key has been seen, mostly on line 1."""
        missing = [name for name in self.keep if name not in f.partitions]
        keys: dict[str, None] = {}  # every key seen, in order
        text_keys: set[str] = set()
        for number, row in self._jsonl_rows(f):
            if not keys:
                f.folder_keys = [name for name in self.keep if name in f.partitions and name not in row]
                text_keys = {name for name in self.keep if isinstance(row.get(name), str)}
            missing = [name for name in missing if name not in row]
            if not missing:
                return text_keys
            keys.update(dict.fromkeys(row))
        if keys:  # a file without rows gives no column at all
            raise UserError(
                f"{f.shown}: no line has the --keep key '{missing[0]}' (its keys: {', '.join(keys)}), nor a folder "
                f"{missing[0]}=VALUE; check its spelling or drop it from --keep{self._source_folder_hint(missing[0])}"
            )
        return text_keys

    def _check_folder_keys(self, f: _File, number: int, row: dict, first_line: int) -> None:
        """Refuse a line whose own value of a key contradicts the folder that gives the file's values of it."""
        for name in f.folder_keys:
            if name in row and _as_text(row[name]) != f.partitions[name]:
                raise UserError(f"{f.shown} line {number}: '{name}' is {json.dumps(row[name])}, but line {first_line} "
                                f"has no '{name}', so the folder {name}={f.partitions[name]} gives every line its value; "
                                "give the key in every line of the file, or in none")

    def _source_folder_hint(self, key: str) -> str:
        """For a key no file has: where SOURCE itself names a folder key=VALUE, that only folders below SOURCE count,
        and the glob that reads the same files with that folder below its base (a bracket is a wildcard; a SOURCE
        read as spelled has its own wildcard characters escaped in it, so that the glob reads the same files).
        Several SOURCEs count the folders below the one common to them (_resolve_sources)."""
        spelling = rf"(^|/){re.escape(key)}="
        if len(self.sources) > 1:
            named = any(re.search(spelling, source) for source in self.sources)
            return f" (a folder {key}=VALUE counts only below the folder common to the SOURCEs)" if named else ""
        source = self.sources[0]
        if (spelled := re.search(spelling, source)) is None:
            return ""
        before, after = source[:spelled.start()], source[spelled.end():]
        if not is_glob(source):
            before, after = _GLOB.sub(r"[\g<0>]", before), _GLOB.sub(r"[\g<0>]", after)
        glob = f"{before}{spelled.group(1)}[{key[0]}]{key[1:]}={after}"
        return f" (a folder {key}=VALUE counts only below SOURCE: give a glob that spells it, '{glob}')"

    def _folder_column(self, f: _File, name: str, rows: int, kind: pa.DataType) -> pa.Array:
        """The value of a key that f takes from its folder, `rows` times, as kind; UserError where kind cannot hold
        it (year=unknown where an output stored whole numbers)."""
        value = f.partitions[name]
        column = pa.repeat(pa.scalar(value, pa.string()), rows)
        if value is None or not pa.types.is_integer(kind) or _WHOLE.fullmatch(value):  # Arrow casts "007" to 7
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return column.cast(kind)
        origin = self._kept_origins.get(name, self._typed_by)
        fix = ("pass --rebuild to store the column anew" if origin == self._followed
               else "give the folders and files one type of value")
        raise UserError(f"{f.shown}: its folder {name}={value} does not fit the type {kind} that '{name}' has in "
                        f"{origin}; {fix}, or leave '{name}' out of --keep")

    def _jsonl_rows(self, f: _File) -> Iterator[tuple[int, dict]]:
        """Each non-blank line's number and its object, checked by _parse_line."""
        with self._open_jsonl(f) as handle:
            for number, raw in _numbered_lines(f, handle):
                if raw.strip():
                    yield number, self._parse_line(f, number, raw)

    def _open_jsonl(self, f: _File) -> IO[bytes]:
        try:
            if f.path.lower().endswith(".zst"):
                # Arrow's, not fsspec's (zstandard's stream reader), which ends a file cut short without a word
                compressed = pa.PythonFile(f.fs.open(f.path, "rb"), mode="r")
                return io.BufferedReader(pa.CompressedInputStream(compressed, "zstd"))
            return f.fs.open(f.path, "rb", compression="infer")
        except OSError as e:
            raise UserError(f"cannot open {f.shown} ({short_reason(e)}); check the path and its permissions") from None

    def _parse_line(self, f: _File, number: int, raw: bytes) -> dict:
        where = f"{f.shown} line {number}"
        if raw.startswith(codecs.BOM_UTF8):  # the first line's was dropped (_numbered_lines)
            raise UserError(f"{where}: starts with a byte order mark, which only a file's start may hold (files "
                            "joined with cat?); remove it")
        try:
            # Without its line end, a line cut off inside a string reads as unterminated, not as holding a newline.
            row = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{where}: not valid UTF-8; save the file as UTF-8") from None
        except json.JSONDecodeError as e:
            if number == 1 and raw.lstrip().startswith(b"["):
                raise UserError(f"{where}: starts a JSON array, not one object per line; write it as JSON lines "
                                "(jq -c '.[]' FILE > FILE.jsonl)") from None
            if e.msg == "Extra data" and b"\r" in raw.rstrip(b"\r\n"):
                raise UserError(f"{where}: holds several lines ended by a carriage return alone (old Mac line "
                                "endings); convert them to newlines") from None
            # Some of json's messages end in "at", for a position it leaves out of the message.
            raise UserError(f"{where}: invalid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); fix or remove "
                            "that line") from None
        except RecursionError:
            raise UserError(f"{where}: JSON nested too deep to read; fix or remove that line") from None
        except ValueError as e:
            if "digits" not in str(e):
                raise UserError(f"{where}: invalid JSON ({short_reason(e)}); fix or remove that line") from None
            raise UserError(f"{where}: holds a number of more than {sys.get_int_max_str_digits():,} digits, more than "
                            "Python reads; fix or remove that line") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {_kind(row)}; put one object per line")
        if b"\\u" in raw and not _valid_unicode(row):  # only a \u escape can make a lone surrogate
            raise UserError(f"{where}: holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                            "valid Unicode and no tokenizer or table takes; fix or remove that escape")
        if self.text_col not in row:
            keys = ", ".join(row) or "none"
            raise UserError(
                f"{where}: no '{self.text_col}' key (its keys: {keys}); "
                f"pass {self.text_flag} with the key that holds the text"
            )
        text = row[self.text_col]
        if text is not None and not isinstance(text, str):
            raise UserError(
                f"{where}: {self.text_col} is {_kind(text)}, not a string; "
                f"make it a string (or null) or pass {self.text_flag} with the key that holds the text"
            )
        return row

    def _line_id(self, f: _File, number: int, row: dict, first: tuple[int, bool]) -> str:
        """The line's id, or file:line when the file's lines have none; the first line decides which, since
        a file that mixes the two would mix real ids with numbers that may collide with them."""
        first_line, has_ids = first
        if (self.id_col in row) != has_ids:
            mismatch = (f"has no '{self.id_col}' key but line {first_line} has one" if has_ids
                        else f"has an '{self.id_col}' key but line {first_line} has none")
            raise UserError(f"{f.shown} line {number}: {mismatch}; {self._jsonl_id_fix}")
        if not has_ids:
            return f"{f.rel}:{number}"
        value = row[self.id_col]
        if value == "":
            raise UserError(f"{f.shown} line {number}: {self.id_col} is empty; {self._jsonl_id_fix}")
        if not isinstance(value, (str, int, float)):  # a boolean passes, as an int, to id_text
            raise UserError(f"{f.shown} line {number}: {self.id_col} is {_kind(value)}, not a string or number; "
                            f"{self._jsonl_id_fix}")
        try:
            return id_text(value)
        except BadId as bad:
            raise UserError(f"{f.shown} line {number}: {self.id_col} is {bad}, which names no row; "
                            f"store ids as strings or finite numbers, or pass {self.id_flag} naming the id key") from None

    def _jsonl_kept(self, f: _File, rows: list[dict], lines: list[int]) -> pa.Table | None:
        """The kept keys as a table whose schema the first chunk fixes for all later ones.

        A key that is null throughout the first chunk, or mixes types there, becomes a string column;
        non-string values in a string column are kept as JSON text. A later chunk whose values the fixed
        type cannot hold unchanged (3.99 in an int column, an object with a key the first ones lacked) is
        refused: cast, it would lose them.
        """
        if not self.keep:
            return None
        columns = {}
        for name in self.keep:
            known = self._kept_schema.field(name).type if self._kept_schema else None
            if name in f.folder_keys:
                kind = known or self._partition_types[name]
                columns[name] = self._folder_column(f, name, len(rows), pa.string() if pa.types.is_null(kind) else kind)
                continue
            values = [r.get(name) for r in rows]
            if known is not None and _is_text(known):
                values = [_as_text(v) for v in values]
            try:
                column = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:  # mixed types, or an int past int64
                if known is not None:
                    raise _unfit(f, lines, name, known, short_reason(e), self._kept_origins.get(name),
                                 self._typed_by) from None
                column = pa.array([_as_text(v) for v in values], pa.string())
            if known is None:
                columns[name] = column.cast(pa.string()) if pa.types.is_null(column.type) else column
            elif (fitted := _fitted(column, known)) is not None:
                columns[name] = fitted
            else:
                raise _unfit(f, lines, name, known, f"here it is {column.type}", self._kept_origins.get(name),
                             self._typed_by)
        table = pa.table(columns)
        if self._kept_schema is None:
            self._kept_schema, self._typed_by = table.schema, f"{f.shown} {_line_span(lines)}"
        return table


def _resolve_sources(paths: Sequence[str]) -> tuple[list[_File], list[str]]:
    """The files of one SOURCE (_resolve), or of several as the one glob that matched them all would read them
    (the shell's expansion of docs/*.jsonl, or a.jsonl b/): each file once, in the order given, named (the prefix
    of generated ids, the key=value folders) below the deepest folder common to them; and the .json files that
    their folders' walks left out."""
    resolved = [_resolve(path) for path in paths]
    if len(resolved) == 1:
        files, json_left_out, _ = resolved[0]
        return files, json_left_out
    filesystems = [files[0].fs for files, _, _ in resolved]
    if other := next((path for path, fs in zip(paths, filesystems) if fs != filesystems[0]), None):
        raise UserError(f"{paths[0]} and {other} are on different filesystems, which one run does not read together; "
                        "copy them to one place, or give them in runs of their own")
    common = posixpath.commonpath([base for *_, base in resolved])
    every: dict[str, _File] = {}
    for files, _, base in resolved:
        below = base[len(common):].strip("/")
        for f in files:
            rel = f"{below}/{f.rel}" if below else f.rel
            key = os.path.realpath(f.path) if isinstance(f.fs, LocalFileSystem) else f.path
            every.setdefault(key, replace(f, rel=rel, partitions=_partitions(rel)))
    return list(every.values()), list(dict.fromkeys(shown for _, json_left_out, _ in resolved for shown in json_left_out))


def _resolve(path: str) -> tuple[list[_File], list[str], str]:
    """The files a path names, sorted, each with its shown name and its name relative to the base; the .json
    files that a folder's walk found and left out, as the user would spell them; and the base (fsspec's path, with
    a trailing /: the folder given, a file's folder, or the folder a glob searches)."""
    try:
        fs, root = fsspec.core.url_to_fs(path)
    except (ValueError, ImportError, OSError) as e:
        raise UserError(f"cannot open {path} ({short_reason(e)}); give a local path or an fsspec URL") from None
    # A chained URL spells the path inside its first part (zip://docs/*.jsonl::data.zip), or after the bare names of
    # the protocols that wrap it (simplecache::s3://bucket/docs/); its files are shown so too.
    parts = path.split("::")
    at = next((i for i, part in enumerate(parts[:-1]) if not _BARE_PROTOCOL.fullmatch(part)), len(parts) - 1)
    before, head = "".join(part + "::" for part in parts[:at]), parts[at]
    after = "".join("::" + part for part in parts[at + 1:])
    try:
        named: set[str] = set()  # files the glob itself matches, not found in a folder it matches
        globbed = _is_glob(fs, root)
        if globbed:
            base = glob_base(head)
            found = []
            for match in _glob(fs, root):
                walked = _walk(fs, match)
                found += walked
                if walked == [match] and ".json" in head.rsplit("/", 1)[-1].lower():  # DIR/*.json*, not DIR/*
                    named.add(match)
        elif fs.isdir(root):
            base = head if head.endswith("/") else head + "/"
            found = _walk(fs, root)
        elif fs.isfile(root):
            if not _is_corpus_file(root, named=True):
                _refuse_other_compression(path)
                raise UserError(f"{path} is not a {_SUFFIX_LIST} file (or JSON lines named .json); rename it or "
                                "convert it")
            return [_File(fs, root, path, posixpath.basename(root))], [], root[:root.rfind("/") + 1]
        elif fs.exists(root):  # a pipe (/dev/stdin, <(...)) or a device: read once, with no name to tell its format
            raise UserError(f"{path} is not a regular file (a pipe or a device); save it to a {_SUFFIX_LIST} file and "
                            "give that")
        else:
            raise UserError(f"{path} does not exist; give a file, a directory or a glob of {_SUFFIX_LIST} files")
    except OSError as e:
        raise UserError(f"cannot list {path} ({short_reason(e)}); check the path and its permissions") from None
    base_root = glob_base(root) if globbed else root.rstrip("/") + "/"
    spelled = head[len(base):].split("/") if globbed else []  # the glob's own parts after its base
    if isinstance(fs, LocalFileSystem):
        found = _once_each(found)
    files, left_out, json_left_out = [], 0, []
    for p in sorted(set(found)):
        rel = p[len(base_root):] if p.startswith(base_root) else posixpath.basename(p)
        shown = before + base + rel + after
        # Hidden and underscore paths hold temporary or side files (a writer's unfinished parts, Spark's
        # _SUCCESS), as pyarrow's datasets take them; unless a part of the glob spells one so itself (_*.jsonl).
        side = any(part.startswith((".", "_")) and not any(glob[:1] == part[0] and fnmatch.fnmatchcase(part, glob)
                                                           for glob in spelled) for part in rel.split("/"))
        if not _is_corpus_file(p, named=p in named):
            if not side:
                _refuse_other_compression(shown)
                if p.lower().endswith(_JSON_SUFFIXES):
                    json_left_out.append(shown)
        elif side:
            left_out += 1
        elif isinstance(fs, LocalFileSystem) and not os.path.isfile(p):  # reading a pipe would wait for a writer
            raise UserError(f"{shown} is not a regular file (a pipe or a device); move it out of {path} or "
                            f"save what it gives to a {_SUFFIX_LIST} file")
        else:
            files.append(_File(fs, p, shown, rel, partitions=_partitions(rel)))
    if not files:
        hidden = (f" but {plural(left_out, 'file')} under a name that starts with . or _, which are left out as "
                  "temporary or side files; rename them, or name them in a glob (_*.jsonl)") if left_out else ""
        json_files = (f" but {plural(len(json_left_out), '.json file')}, read only where a path or glob names them "
                      "(DIR/*.json)") if json_left_out else ""
        raise UserError(f"{path} holds no {_SUFFIX_LIST} files{hidden}{json_files}; check the path")
    return files, json_left_out, base_root


def _partitions(rel: str) -> dict[str, str | None]:
    """The key=value folders of a file's path below SOURCE, as Hive, Spark and pyarrow's datasets lay out
    partitions (lang=en/part-0.parquet), their names and values unquoted; Hive's null is None."""
    pairs: dict[str, str | None] = {}
    for folder in rel.split("/")[:-1]:
        key, equals, value = folder.partition("=")
        if equals and key:
            pairs[urllib.parse.unquote(key)] = None if value == _HIVE_NULL else urllib.parse.unquote(value)
    return pairs


def _partitioned(files: list[_File], keep: list[str], text_keys: set[str]) -> dict[str, pa.DataType]:
    """The type of each --keep key that files take from their folders: int64 where every such folder's value is a
    whole number (year=2024), as pyarrow's datasets infer it, unless a file holds the key as text of its own
    (text_keys); null where every such folder is __HIVE_DEFAULT_PARTITION__ (the files' own columns type it);
    else string."""
    types = {}
    for key in keep:
        values = [f.partitions[key] for f in files if key in f.folder_keys]
        if values:
            known = [value for value in values if value is not None]
            if not known:
                types[key] = pa.null()
            elif key not in text_keys and all(_WHOLE.fullmatch(value) for value in known):
                types[key] = pa.int64()
            else:
                types[key] = pa.string()
    return types


def _refuse_other_compression(shown: str) -> None:
    """UserError for a corpus file compressed in a way it is not read in (docs.jsonl.lz4, docs.parquet.gz), which a
    folder or glob would otherwise leave out without a word."""
    if match := _OTHER_COMPRESSION.search(shown):
        fix = ("Parquet compresses inside the file: decompress it" if match.group(0).lower().startswith(".parquet")
               else "decompress it, or compress it as .gz, .zst, .bz2 or .xz")
        raise UserError(f"{shown} is compressed with .{match.group(1)}, which embedctl does not read; {fix}")


def is_glob(path: str) -> bool:
    """Whether SOURCE path is read as a glob: see _is_glob."""
    try:
        fs, root = fsspec.core.url_to_fs(path)
    except (ValueError, ImportError, OSError):
        return bool(_GLOB.search(path))  # refused when read; until then, as it is spelled
    return _is_glob(fs, root)


def _is_glob(fs: fsspec.AbstractFileSystem, root: str) -> bool:
    """Whether a path is a glob: it holds a wildcard (* ? [) and names nothing as spelled. A folder named
    corpus[v2] is that folder, as ls and pyarrow's datasets take it, not a glob that would read corpus2/
    (and prune corpus[v2]'s rows)."""
    if not _GLOB.search(root):
        return False
    try:
        return not fs.exists(root)
    except OSError:
        return True


def glob_base(path: str) -> str:
    """The folder a glob searches, as the glob spells it: "docs/" for "docs/*.jsonl", "" for "*.jsonl".
    A path without a wildcard is its own base."""
    magic = _GLOB.search(path)
    return path[: path.rfind("/", 0, magic.start()) + 1] if magic else path


def _parquet_ids(ids: pa.Array) -> list[str]:
    """An id column as text: numbers by id_text, as in JSONL; strings, binary, dates and integers by
    Arrow's cast, which writes integers as id_text does without a Python call per row."""
    kind = ids.type
    if not (pa.types.is_floating(kind) or pa.types.is_decimal(kind) or pa.types.is_boolean(kind)):
        return ids.cast(pa.string()).to_pylist()
    if pa.types.is_float32(kind):
        # As a double, float32 0.1 is 0.10000000149011612; its own shortest text, 0.1, is what an export writes.
        ids = ids.cast(pa.string()).cast(pa.float64())
    texts = []
    for index, value in enumerate(ids.to_pylist()):
        try:
            texts.append(id_text(value))
        except BadId as bad:
            bad.index = index
            raise
    return texts


class BadId(ValueError):
    """An id value that cannot name a row: a boolean (a mislabelled column), NaN or an infinity.
    index: its position in the column it came from, where there is one."""

    index = 0


def id_text(value: str | int | float | Decimal) -> str:
    """An id as text. A number gets the same text from a JSONL line as from a Parquet column, so that
    re-indexing a corpus exported in the other format matches the same rows (incremental indexing keys on id).

    A whole number is written as an integer whatever its type: 7, 7.0 and Decimal("7.00") give "7", 1e20
    gives "100000000000000000000". Exporters turn integer ids into floats freely (pandas does for an int
    column with a null; JavaScript has no integers), and Arrow already wrote whole Parquet floats so (below 1e16).
    Other numbers take Python's shortest text that reads back as the same double ("0.5", "1e-07"); a
    decimal keeps its own digits less trailing zeros ("1.5" for 1.50), which is the double's text too
    for up to 15 significant digits, and keeps longer decimal ids apart. BadId for a boolean, NaN or an
    infinity: NaN equals no other id, and all three come from a column that holds no ids.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise BadId(json.dumps(value))
    finite = value.is_finite() if isinstance(value, Decimal) else not isinstance(value, float) or math.isfinite(value)
    if not finite:
        raise BadId(str(value))
    if isinstance(value, Decimal):
        if value != value.to_integral_value():
            return format(value.normalize(), "f")
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _is_corpus_file(path: str, named: bool = False) -> bool:
    """Whether the file is read: by its suffix, and a .json one only where a path or glob names it (named)."""
    return path.lower().endswith(_SUFFIXES + _JSON_SUFFIXES if named else _SUFFIXES)


def glob_reads(pattern: str, path: str) -> bool:
    """Whether a glob, as a corpus source, would read the file at path (both local and absolute): a corpus
    file that it matches, or that lies in a folder it matches (a matched folder is read whole)."""
    if not _is_corpus_file(path):
        return False
    matches = re.compile(fsspec.utils.glob_translate(pattern)).fullmatch
    parts = path.split("/")
    return any(matches("/".join(parts[:end])) for end in range(2, len(parts) + 1))


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(_PARQUET)


def _unify(f: _File, known: pa.Schema | None, kept: pa.Schema) -> pa.Schema:
    if known is None:
        return kept
    try:
        return pa.unify_schemas(_decoded_where_mixed(known, kept), promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        folders = "".join(f", its folder {name}={f.partitions[name]} giving its '{name}'" for name in f.folder_keys)
        raise UserError(
            f"{f.shown}: a --keep column has a type that earlier files do not share ({short_reason(e)}{folders}); "
            "make the shards agree or drop that column from --keep"
        ) from None


def _decoded_where_mixed(*schemas: pa.Schema) -> list[pa.Schema]:
    """The schemas with a dictionary-encoded column decoded to its values' type where another schema holds that
    column in a type of its own: pandas writes a categorical as a dictionary, other tools the same column plain,
    and Arrow's type promotion merges neither with the other."""
    types: dict[str, set[pa.DataType]] = {}
    for schema in schemas:
        for column in schema:
            types.setdefault(column.name, set()).add(column.type)
    mixed = {name for name, kinds in types.items() if len(kinds) > 1 and any(map(pa.types.is_dictionary, kinds))}
    return [pa.schema([column.with_type(column.type.value_type) if column.name in mixed
                       and pa.types.is_dictionary(column.type) else column for column in schema])
            for schema in schemas]


def _fitted(column: pa.Array, known: pa.DataType) -> pa.Array | None:
    """column cast to known where that changes no value, else None: where _same_kind allows the cast.
    Other casts can change values: to an int column 3.99 becomes 3, to a struct a key it lacks is dropped."""
    if column.type == known:
        return column
    if not _same_kind(column.type, known):
        return None
    try:
        return column.cast(known)  # safe: an int that does not fit, or past 2**53 in a float column, raises
    except pa.ArrowInvalid:
        return None


def _same_kind(kind: pa.DataType, known: pa.DataType) -> bool:
    """Whether values of type kind cast to known unchanged wherever they fit: where Arrow promotes kind to
    known (nulls, ints in a float column, an object that lacks a key), or from ints to ints and text to text
    (plain, large, view or dictionary-encoded). A cast of ints to a narrower int raises for a value that
    does not fit, as one past 2**53 to a float column does."""
    return ((pa.types.is_integer(kind) and pa.types.is_integer(known)) or (_is_text(kind) and _is_text(known))
            or _promotes_to(kind, known))


def _promotes_to(kind: pa.DataType, known: pa.DataType) -> bool:
    """Whether Arrow's permissive type promotion of the two types gives known."""
    try:
        schemas = [pa.schema([("value", known)]), pa.schema([("value", kind)])]
        return pa.unify_schemas(schemas, promote_options="permissive").field("value").type == known
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return False


def _line_span(lines: list[int], noun: str = "line") -> str:
    return f"{noun} {lines[0]}" if lines[0] == lines[-1] else f"{noun}s {lines[0]}-{lines[-1]}"


def _unfit(f: _File, lines: list[int], name: str, known: pa.DataType, why: str, origin: str | None,
           typed_by: str = "earlier lines", kind: str = "key") -> UserError:
    """A --keep value (a JSONL key's, or a Parquet column's) that the type the files gave it cannot hold: the
    type of origin (a Parquet file) or, for None, the one the JSONL lines typed_by gave it."""
    span = _line_span(lines, "row" if kind == "column" else "line")
    where = f"{f.shown} {span}: --keep {kind} '{name}' does not fit the type {known}"
    if origin is not None:
        return UserError(f"{where} it has in {origin} ({why}); give it that type in every file, or leave it out "
                         "of --keep")
    return UserError(f"{where} that {typed_by} gave it ({why}); give it one type in every line (3.0, not 3, "
                     "where others hold 3.5; an object with every key, null where it has no value)")


def _walk(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The files under a folder, or the file itself."""
    if not fs.isdir(path):
        return [path]
    if not isinstance(fs, LocalFileSystem):
        return fs.find(path)
    return [entry for entry, is_folder in _local_tree(path, lambda parts: True) if not is_folder]


def _glob(fs: fsspec.AbstractFileSystem, pattern: str) -> list[str]:
    """The files and folders a glob matches; on a local disk through linked folders too (see _local_tree), going
    only into folders that can hold a match, so that an unreadable folder the glob never names stops nothing."""
    if not isinstance(fs, LocalFileSystem):
        return fs.glob(pattern)
    base = glob_base(pattern)
    if not os.path.isdir(base):
        return []  # as fs.glob has it: the path then holds no corpus files
    rest = pattern[len(base):].rstrip("/")
    matches = re.compile(fsspec.utils.glob_translate(rest)).fullmatch
    segments = rest.split("/")
    return [entry for entry, _ in _local_tree(base.rstrip("/") or "/", lambda parts: _may_hold(parts, segments))
            if matches(posixpath.relpath(entry, base))]


def _may_hold(parts: list[str], segments: list[str]) -> bool:
    """Whether the folder at these parts below a glob's base can hold a match of the glob's segments."""
    for part, segment in zip(parts, segments):
        if segment == "**":
            return True
        if not fnmatch.fnmatchcase(part, segment):
            return False
    return len(parts) < len(segments) or "**" in segments[:len(parts) + 1]


def _local_tree(top: str, enter: Callable[[list[str]], bool]) -> Iterator[tuple[str, bool]]:
    """Every entry under top as (path, whether a folder), in order, going into the folders that enter(their parts
    below top) takes, through links too, as find -L and pyarrow's datasets do (fsspec's find lists a linked folder
    as one entry, whose files were left out without a word, then pruned), but not into a link back to a folder
    above it (a loop). A folder reached by two links is walked under both; _once_each keeps one. UserError for a
    link to nothing where enter would go (storage unmounted, a folder moved): leaving out what it held would
    prune its rows."""

    def visit(folder: str, parts: list[str], above: frozenset[str]) -> Iterator[tuple[str, bool]]:
        with os.scandir(folder) as listing:  # an unreadable folder raises: its files must not look deleted
            entries = sorted(listing, key=lambda entry: entry.name)
        for entry in entries:
            path, inside = posixpath.join(folder, entry.name), [*parts, entry.name]
            if entry.is_dir():  # through a link too
                yield path, True
                real = os.path.realpath(path)
                if real not in above and enter(inside):
                    yield from visit(path, inside, above | {real})
            elif entry.is_symlink() and enter(inside) and not os.path.exists(path):
                raise UserError(f"{path} is a link to {os.readlink(path)}, which does not exist; mount or restore "
                                "what it names, or remove the link")
            else:
                yield path, False

    yield from visit(top, [], frozenset({os.path.realpath(top)}))


def _once_each(paths: list[str]) -> list[str]:
    """Local paths less those that reach a file already listed through other links: the shortest path is kept,
    whatever the SOURCE's spelling (a folder or a glob), so that the ids of files without an id column stay."""
    kept: dict[str, str] = {}
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p.split("/"))):
        kept.setdefault(os.path.realpath(path), path)
    return list(kept.values())


def _numbered_lines(f: _File, handle: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """Each line with its 1-based number; a UTF-8 byte order mark (which Windows editors write) is dropped
    from the start of the file, where it is no part of the JSON."""
    number = 0
    while True:
        try:
            raw = handle.readline()
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
            raise UserError(
                f"{f.shown} line {number + 1}: cannot read ({short_reason(e)}); check that the file is complete"
            ) from None
        if not raw:
            return
        number += 1
        yield number, raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw


def _unreadable_parquet(f: _File, e: Exception) -> UserError:
    return UserError(
        f"{f.shown} is not a readable Parquet file ({short_reason(e)}); check that it is a complete Parquet file"
    )


def _check_utf8(f: _File, batch: pa.RecordBatch, lines: list[int]) -> None:
    """UserError for a string that is not valid UTF-8: a Parquet reader hands its bytes on unchecked, and
    turning them into Python text later would fail with a traceback."""
    for name, column in zip(batch.schema.names, batch.columns):
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()  # the values its rows use: a file's chunks share one dictionary
        try:
            column.validate(full=True)
        except pa.ArrowInvalid as e:
            if "UTF8" not in str(e):  # Arrow tells bad UTF-8 from other invalid data only in its message
                raise _unreadable_parquet(f, e) from None
            row = _first_invalid(column)
            where = f"row {lines[row]}" if row is not None else f"rows {lines[0]}-{lines[-1]}"
            raise UserError(f"{f.shown} {where}: column '{name}' is not valid UTF-8; write the file with that "
                            "column's text encoded as UTF-8 (or as a binary column if it holds no text)") from None


def _first_invalid(column: pa.Array) -> int | None:
    """The position of the first value that fails full validation; None where none does alone (in a
    dictionary nested in the column, which every slice keeps whole)."""
    for row in range(len(column)):
        try:
            column.slice(row, 1).validate(full=True)
        except pa.ArrowInvalid:
            return row
    return None


def _is_text(kind: pa.DataType) -> bool:
    """A string column: plain, large, a view (as Polars writes) or dictionary-encoded (as pandas writes a
    categorical); to_pylist decodes them all, and the id cast turns each into a string."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _without_view(field: pa.Field) -> pa.Field:
    """A kept string_view column as a string: LanceDB stores it so, and a later run's schema must match."""
    return field.with_type(pa.string()) if pa.types.is_string_view(field.type) else field


def _as_text(value: object) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _valid_unicode(row: dict) -> bool:
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else "a string"
