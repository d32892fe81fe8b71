"""CorpusReader: path resolution, chunking, ids, kept columns, and a UserError for every bad input."""

import bz2
import codecs
import gzip
import json
import lzma
import os
import zipfile
from decimal import Decimal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.errors import UserError
from pipelines.readers import CorpusReader


def write_jsonl(path, rows, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def write_parquet(path, columns, row_group_size=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def read_all(reader):
    chunks = list(reader)
    return chunks, [i for c in chunks for i in c.ids], [t for c in chunks for t in c.texts]


def error(**kwargs):
    with pytest.raises(UserError) as info:
        list(CorpusReader(**kwargs))
    message = str(info.value)
    assert "\n" not in message
    return message


# Resolving paths


def test_directory_is_walked_recursively_in_sorted_order(tmp_path):
    write_parquet(tmp_path / "c" / "b.parquet", {"text": ["p1", "p2"]})
    write_jsonl(tmp_path / "c" / "a.jsonl", [{"text": "j1"}])
    write_jsonl(tmp_path / "c" / "sub" / "z.jsonl.gz", [{"text": "g1"}], gz=True)
    (tmp_path / "c" / "notes.txt").write_text("not a corpus file")
    (tmp_path / "c" / "d.json").write_text('{"text": "plain .json is not read"}')
    write_parquet(tmp_path / "c" / ".tmp-1" / "part-0.parquet", {"text": ["hidden"]})
    write_parquet(tmp_path / "c" / "_staging" / "x.parquet", {"text": ["hidden"]})

    reader = CorpusReader(f"{tmp_path}/c")
    assert reader.files == [f"{tmp_path}/c/a.jsonl", f"{tmp_path}/c/b.parquet", f"{tmp_path}/c/sub/z.jsonl.gz"]
    assert reader.json_left_out == [f"{tmp_path}/c/d.json"]
    chunks, ids, texts = read_all(reader)
    assert texts == ["j1", "p1", "p2", "g1"]
    assert ids == ["a.jsonl:1", "b.parquet:1", "b.parquet:2", "sub/z.jsonl.gz:1"]
    assert [c.source for c in chunks] == reader.files


def test_folders_reached_through_links_are_read_once_each_by_folder_and_by_glob(tmp_path):
    write_jsonl(tmp_path / "c" / "2025" / "a.jsonl", [{"id": "a", "text": "here"}])
    write_jsonl(tmp_path / "archive" / "2024" / "b.jsonl", [{"id": "b", "text": "linked"}])
    (tmp_path / "c" / "2024").symlink_to(tmp_path / "archive" / "2024")  # a year moved to other storage
    (tmp_path / "c" / "2024-again").symlink_to(tmp_path / "archive" / "2024")  # the same folder twice
    (tmp_path / "c" / "2025" / "up").symlink_to(tmp_path / "c")  # a loop
    write_jsonl(tmp_path / "c" / "deep" / "er" / "d.jsonl", [{"text": "numbered"}])
    (tmp_path / "c" / "z").symlink_to(tmp_path / "c" / "deep" / "er")  # a shorter way to it, and later in order
    expected = [f"{tmp_path}/c/2024/b.jsonl", f"{tmp_path}/c/2025/a.jsonl", f"{tmp_path}/c/z/d.jsonl"]
    for path in (f"{tmp_path}/c", f"{tmp_path}/c/*/*.jsonl", f"{tmp_path}/c/**/*.jsonl", f"{tmp_path}/c/*"):
        reader = CorpusReader(path)
        assert reader.files == expected, path
        assert read_all(reader)[1] == ["b", "a", "z/d.jsonl:1"]  # the same id however SOURCE is spelt
    assert CorpusReader(f"{tmp_path}/c/2024-a*/*.jsonl").files == [f"{tmp_path}/c/2024-again/b.jsonl"]


def test_a_link_to_nothing_is_refused_where_it_could_hold_corpus_files(tmp_path):
    write_jsonl(tmp_path / "c" / "2025" / "a.jsonl", [{"id": "a", "text": "here"}])
    (tmp_path / "c" / "other").mkdir()
    (tmp_path / "c" / "other" / "gone").symlink_to(tmp_path / "nowhere")  # in a folder the glob below never names
    assert CorpusReader(f"{tmp_path}/c/2025/*.jsonl").files == [f"{tmp_path}/c/2025/a.jsonl"]
    (tmp_path / "c" / "2024").symlink_to(tmp_path / "unmounted" / "2024")  # storage that is not there today
    for path in (f"{tmp_path}/c", f"{tmp_path}/c/*/*.jsonl"):  # leaving its files out would prune their rows
        assert error(path=path) == (f"{tmp_path}/c/2024 is a link to {tmp_path}/unmounted/2024, which does not "
                                    "exist; mount or restore what it names, or remove the link")


def test_a_path_that_exists_is_read_as_spelled_though_it_holds_glob_characters(tmp_path):
    # As a glob, corpus[v2] would match corpus2/: another corpus read, and the output's own rows pruned.
    write_jsonl(tmp_path / "corpus[v2]" / "a.jsonl", [{"id": "a", "text": "mine"}])
    write_jsonl(tmp_path / "corpus2" / "z.jsonl", [{"id": "z", "text": "another corpus"}])
    assert read_all(CorpusReader(f"{tmp_path}/corpus[v2]"))[1] == ["a"]
    assert read_all(CorpusReader(f"{tmp_path}/corpus[v2]/a.jsonl"))[1] == ["a"]
    assert read_all(CorpusReader(f"{tmp_path}/corpus[0-9]"))[1] == ["z"]  # a path that names nothing is a glob
    assert read_all(CorpusReader(f"{tmp_path}/corpus[[]v2]/*.jsonl"))[1] == ["a"]  # and [[] spells [ in one


def test_a_corpus_file_rewritten_with_other_columns_after_the_checks_is_named(tmp_path):
    write_parquet(tmp_path / "c" / "a.parquet", {"id": ["a"], "text": ["x"]})
    write_parquet(tmp_path / "c" / "b.parquet", {"id": ["b"], "text": ["y"]})
    reader = iter(CorpusReader(f"{tmp_path}/c"))
    assert next(reader).ids == ["a"]
    write_parquet(tmp_path / "c" / "b.parquet", {"doc_id": ["b"], "text": ["y"]})  # an export rewriting it meanwhile
    with pytest.raises(UserError, match=r"c/b.parquet changed while this run read the corpus \(its columns are not "
                                        r"those it had when the run started\); run again once the corpus is written$"):
        next(reader)


def test_a_pipe_in_a_corpus_folder_is_refused_not_waited_on(tmp_path):
    write_jsonl(tmp_path / "c" / "a.jsonl", [{"id": "a", "text": "x"}])
    os.mkfifo(tmp_path / "c" / "b.jsonl")  # opening it would wait for a writer that never comes
    for path in (f"{tmp_path}/c", f"{tmp_path}/c/*.jsonl"):
        assert error(path=path) == (f"{tmp_path}/c/b.jsonl is not a regular file (a pipe or a device); move it out "
                                    f"of {path} or save what it gives to a .parquet, .jsonl or .ndjson (plain or compressed as .gz, .zst, .bz2 or .xz) file")


def test_files_inside_a_chained_url_are_named_as_the_url_spells_them(tmp_path):
    with zipfile.ZipFile(tmp_path / "corpus.zip", "w") as archive:
        archive.writestr("docs/a.jsonl", '{"id": "a", "text": "zipped"}\n')
    write_jsonl(tmp_path / "docs" / "_part.jsonl", [{"id": "p", "text": "cached"}])
    # the path inside comes first in an archive's chain, last after the bare names of caches that wrap it
    for path, shown in ((f"zip://docs::{tmp_path}/corpus.zip", f"zip://docs/a.jsonl::{tmp_path}/corpus.zip"),
                        (f"zip://docs/*.jsonl::{tmp_path}/corpus.zip", f"zip://docs/a.jsonl::{tmp_path}/corpus.zip"),
                        (f"simplecache::file://{tmp_path}/docs/_*.jsonl", f"simplecache::file://{tmp_path}/docs/_part.jsonl"),
                        (f"blockcache::file://{tmp_path}/docs/_part.jsonl",
                         f"blockcache::file://{tmp_path}/docs/_part.jsonl")):
        reader = CorpusReader(path)
        assert reader.files == [shown]
        assert read_all(reader)[1:] == ((["a"], ["zipped"]) if path.startswith("zip") else (["p"], ["cached"]))
    with pytest.raises(UserError, match=r"docs/ holds no .* but 1 file under a name that starts with \. or _"):
        CorpusReader(f"simplecache::file://{tmp_path}/docs/")  # a folder's walk leaves the _ file out, as locally
    assert error(path=f"zip://a.jsonl::{tmp_path}/missing.zip").startswith(
        f"cannot open zip://a.jsonl::{tmp_path}/missing.zip (")


def test_json_lines_named_json_are_read_where_a_path_or_glob_names_them(tmp_path):
    write_jsonl(tmp_path / "spark" / "part-00000-1b2c.json", [{"id": "a", "text": "one"}])
    write_jsonl(tmp_path / "spark" / "part-00001-1b2c.json.gz", [{"id": "b", "text": "two"}], gz=True)
    (tmp_path / "spark" / "_SUCCESS").write_text("")
    assert read_all(CorpusReader(f"{tmp_path}/spark/*.json*"))[1:] == (["a", "b"], ["one", "two"])
    assert read_all(CorpusReader(f"{tmp_path}/spark/part-00000-1b2c.json"))[1] == ["a"]
    message = error(path=f"{tmp_path}/spark")  # a folder's walk leaves .json side files out, and says so
    assert message.endswith("but 2 .json files, read only where a path or glob names them (DIR/*.json); check the "
                            "path")
    (tmp_path / "array.json").write_text('[\n  {"id": "a", "text": "one"}\n]\n')
    assert error(path=f"{tmp_path}/array.json") == (f"{tmp_path}/array.json line 1: starts a JSON array, not one "
                                                    "object per line; write it as JSON lines (jq -c '.[]' FILE > "
                                                    "FILE.jsonl)")


def test_a_glob_that_spells_an_underscore_or_dot_takes_those_files_and_a_folder_of_only_them_says_why(tmp_path):
    write_jsonl(tmp_path / "d" / "_under.jsonl", [{"text": "u"}])
    write_jsonl(tmp_path / "d" / ".dot.jsonl", [{"text": "d"}])
    write_jsonl(tmp_path / "d" / "_side" / "x.jsonl", [{"text": "s"}])
    assert CorpusReader(f"{tmp_path}/d/_*.jsonl").files == [f"{tmp_path}/d/_under.jsonl"]
    assert CorpusReader(f"{tmp_path}/d/.*.jsonl").files == [f"{tmp_path}/d/.dot.jsonl"]
    assert CorpusReader(f"{tmp_path}/d/_side/*.jsonl").files == [f"{tmp_path}/d/_side/x.jsonl"]
    assert CorpusReader(f"{tmp_path}/d/**/_*.jsonl").files == [f"{tmp_path}/d/_under.jsonl"]  # not _side: not _*.jsonl
    for path in (f"{tmp_path}/d", f"{tmp_path}/d/*"):  # not spelled: left out, and the error says so
        with pytest.raises(UserError, match=r"holds no .* files but 3 files under a name that starts with \. or _, "
                                            r"which are left out as temporary or side files; rename them"):
            CorpusReader(path)


def test_relative_paths_are_shown_as_the_user_wrote_them(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": "x"}])
    monkeypatch.chdir(tmp_path)
    assert CorpusReader("corpus").files == ["corpus/a.jsonl"]
    assert CorpusReader("corpus/").files == ["corpus/a.jsonl"]
    assert CorpusReader("corpus/*.jsonl").files == ["corpus/a.jsonl"]
    assert CorpusReader("*/a.jsonl").files == ["corpus/a.jsonl"]


def test_glob_matches_files_and_ids_are_relative_to_its_directory(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    write_parquet(tmp_path / "c.parquet", {"text": ["c"]})
    reader = CorpusReader(f"{tmp_path}/*.jsonl")
    assert reader.files == [f"{tmp_path}/a.jsonl", f"{tmp_path}/b.jsonl"]
    assert read_all(reader)[1] == ["a.jsonl:1", "b.jsonl:1"]
    reader = CorpusReader(f"{tmp_path}/**/*.parquet")
    assert reader.files == [f"{tmp_path}/c.parquet"]


def test_single_file_ids_use_its_base_name(tmp_path):
    path = write_jsonl(tmp_path / "deep" / "one.jsonl", [{"text": "a"}, {"text": "b"}])
    reader = CorpusReader(str(path))
    assert reader.files == [str(path)]
    assert read_all(reader)[1] == ["one.jsonl:1", "one.jsonl:2"]


def test_memory_url():
    fs = fsspec.filesystem("memory")
    fs.pipe("/readers-test/corpus/a.jsonl", b'{"id": "x", "text": "from memory"}\n')
    with fs.open("/readers-test/corpus/b.parquet", "wb") as f:
        pq.write_table(pa.table({"text": ["parquet in memory"]}), f)
    try:
        reader = CorpusReader("memory://readers-test/corpus")
        assert reader.files == ["memory://readers-test/corpus/a.jsonl", "memory://readers-test/corpus/b.parquet"]
        chunks, ids, texts = read_all(reader)
        assert ids == ["x", "b.parquet:1"]
        assert texts == ["from memory", "parquet in memory"]
        assert chunks[0].source == "memory://readers-test/corpus/a.jsonl"
    finally:
        fs.rm("/readers-test", recursive=True)


def test_several_sources_read_as_the_one_glob_that_matched_them_all(tmp_path):
    # the shell's expansion of shards/*.jsonl gives the ids the quoted glob gives
    for name in ("1", "2"):
        write_jsonl(tmp_path / "shards" / f"{name}.jsonl", [{"text": f"row {name}"}])
    expanded = CorpusReader([f"{tmp_path}/shards/1.jsonl", f"{tmp_path}/shards/2.jsonl"])
    assert read_all(expanded)[1:] == read_all(CorpusReader(f"{tmp_path}/shards/*.jsonl"))[1:] \
        == (["1.jsonl:1", "2.jsonl:1"], ["row 1", "row 2"])
    # folders: each file named below the folder common to them, so files of one name stay apart; in the order given
    write_jsonl(tmp_path / "b" / "p.jsonl", [{"text": "b's"}])
    write_jsonl(tmp_path / "a" / "p.jsonl", [{"text": "a's"}])
    reader = CorpusReader([f"{tmp_path}/b", f"{tmp_path}/a/"])
    assert reader.files == [f"{tmp_path}/b/p.jsonl", f"{tmp_path}/a/p.jsonl"]
    assert read_all(reader)[1:] == (["b/p.jsonl:1", "a/p.jsonl:1"], ["b's", "a's"])
    # a file that two SOURCEs reach is read once, named as the first reached it
    assert read_all(CorpusReader([f"{tmp_path}/shards", f"{tmp_path}/shards/2.jsonl", f"{tmp_path}/shards/"]))[1] \
        == ["1.jsonl:1", "2.jsonl:1"]
    # one SOURCE in a list is that SOURCE
    assert read_all(CorpusReader([f"{tmp_path}/a/p.jsonl"]))[1] == read_all(CorpusReader(f"{tmp_path}/a/p.jsonl"))[1]
    # a SOURCE that names nothing is named, whichever it is
    assert error(path=[f"{tmp_path}/a", f"{tmp_path}/absent"]).startswith(f"{tmp_path}/absent does not exist")


def test_several_sources_take_the_key_value_folders_below_the_one_common_to_them(tmp_path):
    for lang, part in (("en", 0), ("fr", 0), ("en", 1)):
        write_jsonl(tmp_path / "data" / f"lang={lang}" / f"part-{part}.jsonl", [{"text": lang}])
    both = CorpusReader([f"{tmp_path}/data/lang=en/", f"{tmp_path}/data/lang=fr/"], keep=["lang"])
    assert [chunk.kept.to_pylist() for chunk in both] == [[{"lang": "en"}], [{"lang": "en"}], [{"lang": "fr"}]]
    # as 'data/lang=*/' would; within one folder's files the key is above them, as for one SOURCE
    one_folder = [f"{tmp_path}/data/lang=en/part-0.jsonl", f"{tmp_path}/data/lang=en/part-1.jsonl"]
    assert error(path=one_folder, keep=["lang"]).endswith(
        "check its spelling or drop it from --keep (a folder lang=VALUE counts only below the folder common to the "
        "SOURCEs)")


def test_sources_on_different_filesystems_are_refused(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "local"}])
    fs = fsspec.filesystem("memory")
    fs.pipe("/readers-test-two/b.jsonl", b'{"text": "in memory"}\n')
    try:
        assert error(path=[str(tmp_path / "a.jsonl"), "memory://readers-test-two/b.jsonl"]) == (
            f"{tmp_path}/a.jsonl and memory://readers-test-two/b.jsonl are on different filesystems, which one run "
            "does not read together; copy them to one place, or give them in runs of their own")
    finally:
        fs.rm("/readers-test-two", recursive=True)


def test_jsonl_gz(tmp_path):
    rows = [{"id": f"d{i}", "text": f"text {i}"} for i in range(50)]
    reader = CorpusReader(str(write_jsonl(tmp_path / "a.jsonl.gz", rows, gz=True)), chunk_rows=16)
    _, ids, texts = read_all(reader)
    assert ids == [r["id"] for r in rows]
    assert texts == [r["text"] for r in rows]


def test_ndjson_is_read_like_jsonl(tmp_path):
    write_jsonl(tmp_path / "c" / "a.ndjson", [{"id": "a1", "text": "plain"}])
    write_jsonl(tmp_path / "c" / "b.ndjson.gz", [{"text": "gzipped"}], gz=True)
    reader = CorpusReader(f"{tmp_path}/c")
    assert reader.files == [f"{tmp_path}/c/a.ndjson", f"{tmp_path}/c/b.ndjson.gz"]
    chunks, ids, texts = read_all(reader)
    assert (ids, texts) == (["a1", "b.ndjson.gz:1"], ["plain", "gzipped"])
    assert chunks[1].where(0) == f"{tmp_path}/c/b.ndjson.gz line 1"
    single = CorpusReader(str(tmp_path / "c" / "b.ndjson.gz"))
    assert read_all(single)[1:] == (["b.ndjson.gz:1"], ["gzipped"])


def test_suffixes_match_in_any_case_and_paths_keep_theirs(tmp_path):
    write_jsonl(tmp_path / "c" / "DATA.JSONL", [{"text": "upper"}])
    write_jsonl(tmp_path / "c" / "More.NDJSON.GZ", [{"text": "upper gz"}], gz=True)
    write_parquet(tmp_path / "c" / "part-0.Parquet", {"text": ["mixed"]})
    reader = CorpusReader(f"{tmp_path}/c")
    assert reader.files == [f"{tmp_path}/c/DATA.JSONL", f"{tmp_path}/c/More.NDJSON.GZ", f"{tmp_path}/c/part-0.Parquet"]
    assert reader.total_rows is None
    chunks, ids, texts = read_all(reader)
    assert texts == ["upper", "upper gz", "mixed"]
    assert ids == ["DATA.JSONL:1", "More.NDJSON.GZ:1", "part-0.Parquet:1"]
    assert chunks[2].where(0) == f"{tmp_path}/c/part-0.Parquet row 1"
    single = CorpusReader(str(tmp_path / "c" / "part-0.Parquet"))
    assert single.total_rows == 1 and read_all(single)[2] == ["mixed"]


# Chunks


def test_parquet_chunks_never_exceed_chunk_rows_and_number_rows(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": [f"t{i}" for i in range(100)]}, row_group_size=30)
    write_parquet(tmp_path / "b.parquet", {"text": [f"u{i}" for i in range(5)]})
    reader = CorpusReader(str(tmp_path), chunk_rows=7)
    assert reader.total_rows == 105
    chunks, ids, texts = read_all(reader)
    assert all(1 <= len(c.ids) <= 7 for c in chunks)
    assert all(len(c.ids) == len(c.texts) == len(c.lines) for c in chunks)
    assert texts == [f"t{i}" for i in range(100)] + [f"u{i}" for i in range(5)]
    assert [n for c in chunks if c.source.endswith("a.parquet") for n in c.lines] == list(range(1, 101))
    assert ids[:2] == ["a.parquet:1", "a.parquet:2"] and ids[-1] == "b.parquet:5"


def test_jsonl_chunks_never_exceed_chunk_rows_and_keep_line_numbers(tmp_path):
    lines = []
    for i in range(23):
        lines.append(json.dumps({"text": f"t{i}"}))
        if i % 5 == 0:
            lines.append("   ")  # blank lines are skipped but still counted
    write_jsonl(tmp_path / "a.jsonl", lines)
    reader = CorpusReader(str(tmp_path / "a.jsonl"), chunk_rows=4)
    assert reader.total_rows is None
    chunks, ids, texts = read_all(reader)
    assert [len(c.ids) for c in chunks] == [4, 4, 4, 4, 4, 3]
    assert texts == [f"t{i}" for i in range(23)]
    expected = [n + 1 for n, line in enumerate(lines) if line.strip()]
    assert [n for c in chunks for n in c.lines] == expected
    assert ids == [f"a.jsonl:{n}" for n in expected]


def test_texts_come_as_they_are_and_null_is_none(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "  padded \n"}, {"text": None}, {"text": ""}])
    write_parquet(tmp_path / "b.parquet", {"text": pa.array(["  x ", None], pa.large_string())})
    assert read_all(CorpusReader(str(tmp_path)))[2] == ["  padded \n", None, "", "  x ", None]


def test_ids_are_stringified_from_the_id_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": [7, 8], "text": ["a", "b"]})
    write_jsonl(tmp_path / "b.jsonl", [{"id": 9, "text": "c"}, {"id": "s", "text": "d"}])
    write_parquet(tmp_path / "c.parquet", {"doc": ["x1"], "body": ["e"]})
    reader = CorpusReader(f"{tmp_path}/[ab].*")
    assert read_all(reader)[1] == ["7", "8", "9", "s"]
    assert read_all(CorpusReader(str(tmp_path / "c.parquet"), text_col="body", id_col="doc"))[1] == ["x1"]


@pytest.mark.parametrize(
    "column, json_ids, expected",
    [
        (pa.array([7, 2**63 - 1]), ["7.0", "9223372036854775807"], ["7", "9223372036854775807"]),
        (pa.array([2**64 - 1], pa.uint64()), ["18446744073709551615"], ["18446744073709551615"]),
        (pa.array([1.0, 7.0, -0.0, 1e20, 1.5, 0.1, 1e-7]), ["1", "7.00", "-0.0", "1e20", "1.5", "0.1", "1e-7"],
         ["1", "7", "0", "100000000000000000000", "1.5", "0.1", "1e-07"]),
        (pa.array([0.1, 7.0], pa.float32()), ["0.1", "7"], ["0.1", "7"]),
        (pa.array([Decimal("7.00"), Decimal("1.50")], pa.decimal128(10, 2)), ["7.00", "1.50"], ["7", "1.5"]),
        (pa.array([Decimal(2**70)], pa.decimal128(38, 0)), [str(2**70)], [str(2**70)]),
        (pa.array(["7.0", "0x1"]), ['"7.0"', '"0x1"'], ["7.0", "0x1"]),
    ],
)
def test_numeric_ids_read_the_same_from_parquet_and_jsonl(tmp_path, column, json_ids, expected):
    texts = [f"t{i}" for i in range(len(column))]
    write_parquet(tmp_path / "a.parquet", {"id": column, "text": texts})
    write_jsonl(tmp_path / "a.jsonl", [f'{{"id": {i}, "text": "{t}"}}' for i, t in zip(json_ids, texts)])
    assert read_all(CorpusReader(str(tmp_path / "a.parquet")))[1] == expected
    assert read_all(CorpusReader(str(tmp_path / "a.jsonl")))[1] == expected


def test_decimal_ids_keep_their_digits(tmp_path):
    ids = pa.array([Decimal("12345678901234567890.1"), Decimal("12345678901234567890.2"), Decimal("0.50")],
                   pa.decimal128(38, 2))
    write_parquet(tmp_path / "a.parquet", {"id": ids, "text": ["a", "b", "c"]})
    assert read_all(CorpusReader(str(tmp_path / "a.parquet")))[1] == ["12345678901234567890.1",
                                                                     "12345678901234567890.2", "0.5"]


@pytest.mark.parametrize(
    "column, parquet_row, json_id, shown",
    [(pa.array([7.0, float("nan")]), 2, "NaN", "nan"), (pa.array([7.0, float("-inf")]), 2, "-Infinity", "-inf"),
     (pa.array([True, False]), 1, "true", "true")],
)
def test_ids_that_name_no_row_are_refused_with_where_they_are(tmp_path, column, parquet_row, json_id, shown):
    write_parquet(tmp_path / "a.parquet", {"id": column, "text": ["a", "b"]})
    write_jsonl(tmp_path / "a.jsonl", ['{"id": 7, "text": "a"}', f'{{"id": {json_id}, "text": "b"}}'])
    for name, where in (("a.parquet", f"row {parquet_row}"), ("a.jsonl", "line 2")):
        with pytest.raises(UserError, match=rf"a\.{name[2:]} {where}: id is {shown}, which names no row;"):
            read_all(CorpusReader(str(tmp_path / name)))


def test_ids_are_stable_across_reads(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": [f"t{i}" for i in range(20)]})
    assert read_all(CorpusReader(str(tmp_path), chunk_rows=3))[1] == read_all(CorpusReader(str(tmp_path)))[1]


def test_kept_columns_are_preserved_with_one_schema(tmp_path):
    write_parquet(
        tmp_path / "a.parquet",
        {"text": ["a", "b", "c"], "lang": ["en", "de", None], "year": pa.array([1, 2, 3], pa.int32())},
        row_group_size=2,
    )
    reader = CorpusReader(str(tmp_path / "a.parquet"), keep=["lang", "year"], chunk_rows=2)
    chunks = list(reader)
    kept = pa.concat_tables(c.kept for c in chunks)
    assert kept.column_names == ["lang", "year"]
    assert kept.schema.field("year").type == pa.int32()
    assert kept.to_pydict() == {"lang": ["en", "de", None], "year": [1, 2, 3]}
    assert all(c.kept.num_rows == len(c.ids) for c in chunks)
    assert CorpusReader(str(tmp_path / "a.parquet")).__iter__().__next__().kept is None


def test_jsonl_kept_keys_missing_are_null_and_types_hold_across_chunks(tmp_path):
    rows = [
        {"text": "a", "n": 1, "mixed": 1},
        {"text": "b", "n": None, "mixed": "x"},
        {"text": "c", "lang": "en", "n": 3, "mixed": "y"},
        {"text": "d", "n": 4, "lang": 5, "mixed": [1]},
    ]
    write_jsonl(tmp_path / "a.jsonl", rows)
    chunks = list(CorpusReader(str(tmp_path / "a.jsonl"), keep=["lang", "n", "mixed"], chunk_rows=2))
    # the first chunk fixes the schema: lang (all null there) and mixed (mixed types) become strings
    expected = pa.schema([("lang", pa.string()), ("n", pa.int64()), ("mixed", pa.string())])
    assert [c.kept.schema for c in chunks] == [expected, expected]
    assert pa.concat_tables(c.kept for c in chunks).to_pydict() == {
        "lang": [None, None, "en", "5"],
        "n": [1, None, 3, 4],
        "mixed": ["1", "x", "y", "[1]"],
    }


def test_jsonl_kept_key_seen_only_on_the_last_line_is_kept(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, "", {"text": "b", "lang": "en"}])
    chunks = list(CorpusReader(str(tmp_path / "a.jsonl"), keep=["lang"], chunk_rows=1))
    assert pa.concat_tables(c.kept for c in chunks).to_pydict() == {"lang": [None, "en"]}


@pytest.mark.parametrize("name, values, shown", [
    ("price", [3, 3.99], "the type int64 that A line 1 gave it (here it is double)"),
    ("meta", [{"a": 1}, {"a": 2, "b": "lost"}], "the type struct<a: int64> that A line 1 gave it (here it is "
                                                 "struct<a: int64, b: string>)"),
    ("n", [1, 2**70], "the type int64 that A line 1 gave it (Python int too large"),
])
def test_jsonl_kept_values_the_first_chunks_type_would_change_are_refused(tmp_path, name, values, shown):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"t{i}", name: value} for i, value in enumerate(values)])
    message = error(path=str(tmp_path / "a.jsonl"), keep=[name], chunk_rows=1)
    shown = shown.replace("A line", f"{tmp_path}/a.jsonl line")  # the first chunk, which typed the key
    assert message.startswith(f"{tmp_path}/a.jsonl line 2: --keep key '{name}' does not fit {shown}")
    assert message.endswith("; give it one type in every line (3.0, not 3, where others hold 3.5; an object with "
                            "every key, null where it has no value)")


def test_a_jsonl_value_that_does_not_fit_names_the_file_and_lines_that_typed_its_key(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "v": 1}, {"text": "y", "v": 2}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "z", "v": 2.5}])
    assert error(path=str(tmp_path), keep=["v"]).startswith(
        f"{tmp_path}/b.jsonl line 1: --keep key 'v' does not fit the type int64 that {tmp_path}/a.jsonl lines 1-2 "
        "gave it (here it is double)")


def test_jsonl_kept_values_take_the_first_chunks_type_where_none_changes(tmp_path):
    rows = [{"text": "a", "price": 1.5, "meta": {"a": 1, "b": "x"}, "tags": ["x"], "n": 1},
            {"text": "b", "price": 2, "meta": {"a": 2}, "tags": [], "n": None},
            {"text": "c", "price": None, "meta": None, "tags": None, "n": 3}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    names = ["price", "meta", "tags", "n"]
    chunks = list(CorpusReader(str(tmp_path / "a.jsonl"), keep=names, chunk_rows=1))
    kept = pa.concat_tables(c.kept for c in chunks)
    assert kept.schema == next(iter(CorpusReader(str(tmp_path / "a.jsonl"), keep=names))).kept.schema
    assert kept.to_pylist() == [{"price": 1.5, "meta": {"a": 1, "b": "x"}, "tags": ["x"], "n": 1},
                                {"price": 2.0, "meta": {"a": 2, "b": None}, "tags": [], "n": None},
                                {"price": None, "meta": None, "tags": None, "n": 3}]


def test_a_kept_column_categorical_in_one_shard_and_plain_in_another_is_kept_as_text(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "lang": pa.array(["en"]).dictionary_encode()})  # pandas'
    write_parquet(tmp_path / "b.parquet", {"text": ["b"], "lang": pa.array(["de"])})
    reader = CorpusReader(str(tmp_path), keep=["lang"])
    assert reader.kept_schema == pa.schema([("lang", pa.string())])
    assert pa.concat_tables(c.kept for c in reader).to_pydict() == {"lang": ["en", "de"]}


def test_jsonl_kept_ints_fit_a_parquet_shards_narrower_int_and_text_its_categorical(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "n": pa.array([1], pa.int32()),
                                           "lang": pa.array(["en"]).dictionary_encode()})
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b", "n": 2, "lang": "de"}])
    chunks = list(CorpusReader(str(tmp_path), keep=["n", "lang"]))
    assert pa.concat_tables(c.kept for c in chunks).to_pydict() == {"n": [1, 2], "lang": ["en", "de"]}
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b", "n": 2**40, "lang": "de"}])
    assert error(path=str(tmp_path), keep=["n", "lang"]) == (
        f"{tmp_path}/b.jsonl line 1: --keep key 'n' does not fit the type int32 it has in {tmp_path}/a.parquet "
        "(here it is int64); give it that type in every file, or leave it out of --keep")


def test_a_jsonl_value_that_does_not_fit_names_the_parquet_file_that_typed_its_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "n": pa.array([1], pa.int32()), "m": pa.array([1], pa.int8())})
    write_parquet(tmp_path / "b.parquet", {"text": ["b"], "n": pa.array([2.5]), "m": pa.array([2], pa.int8())})
    write_jsonl(tmp_path / "c.jsonl", [{"text": "c", "n": "three", "m": 3}])
    assert error(path=str(tmp_path), keep=["m", "n"]).startswith(
        f"{tmp_path}/c.jsonl line 1: --keep key 'n' does not fit the type double it has in {tmp_path}/b.parquet")


def test_parquet_kept_types_are_unified_across_files(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "n": pa.array([1], pa.int32())})
    write_parquet(tmp_path / "b.parquet", {"text": ["b"], "n": pa.array([2], pa.int64())})
    chunks = list(CorpusReader(str(tmp_path), keep=["n"]))
    assert [c.kept.schema.field("n").type for c in chunks] == [pa.int64(), pa.int64()]


def test_a_reader_reads_only_the_columns_it_needs(tmp_path):
    # A column of a type the reader could not turn into a list of texts must not be touched.
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "blob": pa.array([{"x": [1, 2]}])})
    chunk = next(iter(CorpusReader(str(tmp_path / "a.parquet"))))
    assert chunk.texts == ["a"]


# Bad input: every message is one line that names the file (and the line for JSONL)


def test_missing_path(tmp_path):
    message = error(path=f"{tmp_path}/nope")
    assert f"{tmp_path}/nope does not exist" in message


def test_a_pipe_is_named_as_one_rather_than_missing(tmp_path):
    os.mkfifo(tmp_path / "queries")  # what /dev/stdin and <(...) are when piped into
    assert error(path=str(tmp_path / "queries")) == (f"{tmp_path}/queries is not a regular file (a pipe or a device); "
                                                     "save it to a .parquet, .jsonl or .ndjson (plain or compressed "
                                                     "as .gz, .zst, .bz2 or .xz) file and give that")


def test_directory_without_corpus_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert "holds no .parquet, .jsonl or .ndjson (plain or compressed as .gz, .zst, .bz2 or .xz) files" in error(path=str(tmp_path))
    assert "holds no" in error(path=f"{tmp_path}/*.parquet")
    assert error(path=f"{tmp_path}/nope/*.parquet").endswith("holds no .parquet, .jsonl or .ndjson (plain or "
                                                             "compressed as .gz, .zst, .bz2 or .xz) files; check the path")


@pytest.mark.parametrize("name, fix", [("c.jsonl.lz4", "decompress it, or compress it as .gz, .zst, .bz2 or .xz"),
                                       ("c.NDJSON.ZSTD", "decompress it, or compress it as .gz, .zst, .bz2 or .xz"),
                                       ("c.parquet.gz", "Parquet compresses inside the file: decompress it")])
def test_a_corpus_file_compressed_in_a_way_it_is_not_read_in_is_refused_not_left_out(tmp_path, name, fix):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    (tmp_path / name).write_bytes(b"compressed")
    (tmp_path / "dataset_info.json").write_text("{}")  # a side file of another kind stays left out
    (tmp_path / f".{name}").write_bytes(b"compressed")  # so does a hidden one
    extension = name.rsplit(".", 1)[1]
    for given in (tmp_path, f"{tmp_path}/*", tmp_path / name):
        assert error(path=str(given)) == (f"{tmp_path}/{name} is compressed with .{extension}, which embedctl does not "
                                          f"read; {fix}")


def zstd(data: bytes) -> bytes:
    """data as a .zst file holds it, in two frames, as zstd -c a b > c.zst writes two files"""
    half = len(data) // 2
    return b"".join(pa.compress(part, "zstd", asbytes=True) for part in (data[:half], data[half:]))


@pytest.mark.parametrize("suffix, compress", [(".jsonl.zst", zstd), (".NDJSON.BZ2", bz2.compress),
                                              (".jsonl.xz", lzma.compress), (".json.zst", zstd)])
def test_json_lines_compressed_as_dolma_and_fineweb_ship_them_are_read(tmp_path, suffix, compress):
    lines = "".join(json.dumps({"id": f"d{i}", "text": f"text {i}"}) + "\n" for i in range(3000)).encode()
    (tmp_path / f"c{suffix}").write_bytes(compress(lines))
    reader = CorpusReader(str(tmp_path / f"c{suffix}"), chunk_rows=1000)
    assert read_all(reader)[1:] == ([f"d{i}" for i in range(3000)], [f"text {i}" for i in range(3000)])
    if not suffix.startswith(".json."):  # a folder's walk finds it too (.json files only where named)
        assert CorpusReader(str(tmp_path)).files == [f"{tmp_path}/c{suffix}"]
    (tmp_path / f"c{suffix}").write_bytes(compress(lines)[:200])  # cut short: a download that stopped
    assert error(path=str(tmp_path / f"c{suffix}")).startswith(f"{tmp_path}/c{suffix} line ")


def test_unsupported_single_file(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    message = error(path=str(tmp_path / "a.csv"))
    assert "a.csv is not a .parquet, .jsonl or .ndjson (plain or compressed as .gz, .zst, .bz2 or .xz) file" in message


def test_unreadable_parquet_at_construction(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(UserError) as info:
        CorpusReader(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path}/bad.parquet is not a readable Parquet file (")
    assert "check that it is a complete Parquet file" in str(info.value)


def test_truncated_parquet(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", {"text": ["x"] * 10})
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(UserError, match="a.parquet is not a readable Parquet file"):
        CorpusReader(str(path))


def test_corrupt_parquet_found_mid_stream(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", {"text": [f"row {i} " * 50 for i in range(200)]}, row_group_size=100)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))

    chunks = iter(CorpusReader(str(path), chunk_rows=100))
    assert len(next(chunks).ids) == 100
    with pytest.raises(UserError) as info:
        next(chunks)
    assert str(info.value).startswith(f"{path} is not a readable Parquet file (")


def test_parquet_missing_text_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": ["1"], "body": ["x"]})
    message = error(path=str(tmp_path))
    assert message == (
        f"{tmp_path}/a.parquet has no column 'text' (its columns: id, body); "
        "pass --text-col with the column that holds the text"
    )


def test_parquet_text_column_not_a_string(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": [1, 2]})
    message = error(path=str(tmp_path))
    assert f"{tmp_path}/a.parquet" in message and "'text' is int64, not a string" in message


def test_a_parquet_shard_whose_columns_are_all_null_reads_as_null_texts(tmp_path):
    # pandas writes an empty or all-None object column with Arrow's null type, not as strings
    write_parquet(tmp_path / "a.parquet", {"id": ["x"], "text": ["one"]})
    write_parquet(tmp_path / "b.parquet", {"id": pa.array([], pa.null()), "text": pa.array([], pa.null())})
    write_parquet(tmp_path / "c.parquet", {"id": ["y", "z"], "text": pa.array([None, None], pa.null())})
    assert read_all(CorpusReader(str(tmp_path)))[1:] == (["x", "y", "z"], ["one", None, None])


def test_parquet_dictionary_encoded_strings_are_read_decoded(tmp_path):
    for values in (pa.string(), pa.large_string()):
        dictionary = pa.dictionary(pa.int32(), values)
        write_parquet(tmp_path / "a.parquet", {"id": pa.array(["x", "y", "x2"]).cast(dictionary),
                                               "text": pa.array(["same", None, "same"]).cast(dictionary)})
        _, ids, texts = read_all(CorpusReader(str(tmp_path)))
        assert (ids, texts) == (["x", "y", "x2"], ["same", None, "same"])
    write_parquet(tmp_path / "a.parquet", {"text": pa.array([b"\xff", b"b"]).dictionary_encode()})
    assert "'text' is dictionary<values=binary, indices=int32, ordered=0>, not a string" in error(path=str(tmp_path))


def test_parquet_string_view_columns_are_read_as_strings(tmp_path):
    # Polars writes string columns as string_view; a kept one is stored as a string, as LanceDB stores it.
    view = pa.string_view()
    write_parquet(tmp_path / "a.parquet", {"id": pa.array(["x", "y"], view), "text": pa.array(["one", None], view),
                                           "lang": pa.array(["en", "de"], view)})
    chunks, ids, texts = read_all(CorpusReader(str(tmp_path), keep=["lang"]))
    assert (ids, texts) == (["x", "y"], ["one", None])
    assert chunks[0].kept.schema == pa.schema([("lang", pa.string())])
    assert chunks[0].kept.to_pydict() == {"lang": ["en", "de"]}


@pytest.mark.parametrize("column", ["text", "id", "lang"])
@pytest.mark.parametrize("encode", [lambda array: array, lambda array: array.dictionary_encode()],
                         ids=["plain", "dictionary"])
def test_parquet_strings_that_are_not_utf8_name_the_file_column_and_row(tmp_path, column, encode):
    columns = {name: pa.array(["fine", "good", "ok"]) for name in ("id", "text", "lang")}
    columns[column] = encode(pa.array([b"fine", b"good", b"caf\xe9 bad"], pa.binary()).view(pa.string()))
    write_parquet(tmp_path / "a.parquet", columns)
    assert error(path=str(tmp_path), keep=["lang"], chunk_rows=2) == (
        f"{tmp_path}/a.parquet row 3: column '{column}' is not valid UTF-8; write the file with that column's text "
        "encoded as UTF-8 (or as a binary column if it holds no text)")


def test_parquet_missing_keep_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["x"]})
    message = error(path=str(tmp_path), keep=["lang"])
    assert f"{tmp_path}/a.parquet has no column 'lang' for --keep (its columns: text), nor a folder lang=VALUE; check " \
           "its spelling" in message


def test_hive_partition_folders_give_columns_to_keep(tmp_path):
    # Spark's and pyarrow's layout: the partition key is in the path, not in the files
    write_parquet(tmp_path / "c" / "year=2024" / "lang=en" / "part-0.parquet", {"id": ["a", "b"], "text": ["x", "y"]})
    write_jsonl(tmp_path / "c" / "year=2025" / "lang=de%2Fat" / "part-0.jsonl", [{"id": "c", "text": "z"}])
    write_jsonl(tmp_path / "c" / "year=__HIVE_DEFAULT_PARTITION__" / "lang=fr" / "part-0.jsonl",
                [{"id": "d", "text": "w", "lang": "fr-CA"}])  # a key of the file's own wins over its folder's
    reader = CorpusReader(f"{tmp_path}/c", keep=["lang", "year"])
    chunks = list(reader)
    kept = pa.concat_tables([chunk.kept for chunk in chunks])
    assert kept.schema == pa.schema([("lang", pa.string()), ("year", pa.int64())])
    assert kept.to_pylist() == [{"lang": "en", "year": 2024}, {"lang": "en", "year": 2024},
                                {"lang": "de/at", "year": 2025}, {"lang": "fr-CA", "year": None}]
    assert CorpusReader(f"{tmp_path}/c", keep=["year"])._partition_types["year"] == pa.int64()
    write_jsonl(tmp_path / "d" / "n=2\uff10\uff12\uff14" / "p.jsonl", [{"text": "v"}])  # fullwidth digits: text, as pyarrow
    assert CorpusReader(f"{tmp_path}/d", keep=["n"])._partition_types["n"] == pa.string()
    write_parquet(tmp_path / "c" / "loose.parquet", {"text": ["v"]})  # a file outside the partitions has no key
    assert error(path=f"{tmp_path}/c", keep=["lang"]).startswith(f"{tmp_path}/c/loose.parquet has no column 'lang'")


def test_a_partition_key_that_files_also_hold_as_text_is_text_in_every_file(tmp_path):
    # whole numbers in the folders, but a file's own column of the key holds text: one string column, in either
    # format and whichever file comes first
    write_parquet(tmp_path / "p" / "n=1" / "a.parquet", {"text": ["x"]})
    write_parquet(tmp_path / "p" / "n=2" / "b.parquet", {"text": ["y"], "n": ["two"]})
    write_jsonl(tmp_path / "j" / "n=1" / "a.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "j" / "n=2" / "b.jsonl", [{"text": "y", "n": "two"}])
    for corpus in ("p", "j"):
        kept = pa.concat_tables([chunk.kept for chunk in CorpusReader(f"{tmp_path}/{corpus}", keep=["n"])])
        assert kept.schema == pa.schema([("n", pa.string())]) and kept.column("n").to_pylist() == ["1", "two"]


def test_a_null_partition_first_still_types_the_key_by_the_other_folders(tmp_path):
    write_jsonl(tmp_path / "c" / "a" / "year=__HIVE_DEFAULT_PARTITION__" / "x.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "c" / "b" / "year=2024" / "y.jsonl", [{"text": "y"}])
    kept = pa.concat_tables([chunk.kept for chunk in CorpusReader(f"{tmp_path}/c", keep=["year"])])
    assert kept.schema == pa.schema([("year", pa.int64())]) and kept.column("year").to_pylist() == [None, 2024]


def test_a_jsonl_file_whose_first_line_has_the_partition_key_keeps_its_own_values(tmp_path):
    # the first line decides, as it does for ids: a line without the key is null, not the folder's value
    write_jsonl(tmp_path / "c" / "lang=en" / "a.jsonl", [{"text": "x", "lang": "fr"}, {"text": "y"}])
    kept = pa.concat_tables([chunk.kept for chunk in CorpusReader(f"{tmp_path}/c", keep=["lang"])])
    assert kept.column("lang").to_pylist() == ["fr", None]
    # and a line that contradicts the folder its file's values come from is refused rather than overruled
    write_jsonl(tmp_path / "d" / "lang=en" / "a.jsonl", [{"text": "x"}, {"text": "y", "lang": "en"},
                                                         {"text": "z", "lang": "fr"}])
    assert error(path=f"{tmp_path}/d", keep=["lang"]) == (
        f"{tmp_path}/d/lang=en/a.jsonl line 3: 'lang' is \"fr\", but line 1 has no 'lang', so the folder lang=en "
        "gives every line its value; give the key in every line of the file, or in none")


def test_a_partition_folder_in_source_itself_is_named_in_the_missing_column_message(tmp_path):
    # as in pyarrow's datasets, only the folders below SOURCE are partitions
    write_parquet(tmp_path / "c" / "lang=en" / "a.parquet", {"text": ["x"]})
    write_jsonl(tmp_path / "d" / "lang=en" / "a.jsonl", [{"text": "x"}])
    write_parquet(tmp_path / "c" / "lang=fr" / "a.parquet", {"text": ["y"]})
    hint = "(a folder lang=VALUE counts only below SOURCE: give a glob that spells it, '{}')"
    assert error(path=f"{tmp_path}/c/lang=en", keep=["lang"]).endswith(
        f"nor a folder lang=VALUE; check its spelling or drop it from --keep {hint.format(f'{tmp_path}/c/[l]ang=en')}")
    assert error(path=f"{tmp_path}/d/lang=en/", keep=["lang"]) == (
        f"{tmp_path}/d/lang=en/a.jsonl: no line has the --keep key 'lang' (its keys: text), nor a folder lang=VALUE; "
        f"check its spelling or drop it from --keep {hint.format(f'{tmp_path}/d/[l]ang=en/')}")
    # the glob reads what SOURCE read, lang=fr not among it
    assert [c.kept.to_pylist() for c in CorpusReader(f"{tmp_path}/c/[l]ang=en", keep=["lang"])] == [[{"lang": "en"}]]
    assert [c.kept.to_pylist() for c in CorpusReader(f"{tmp_path}/d/[l]ang=en/", keep=["lang"])] == [[{"lang": "en"}]]
    # a SOURCE read as spelled keeps its own brackets in the glob: data[v2] must not become a class matching data2
    write_parquet(tmp_path / "data[v2]" / "lang=en" / "a.parquet", {"text": ["mine"]})
    write_parquet(tmp_path / "data2" / "lang=en" / "b.parquet", {"text": ["another corpus"]})
    glob = f"{tmp_path}/data[[]v2]/[l]ang=en"
    assert error(path=f"{tmp_path}/data[v2]/lang=en", keep=["lang"]).endswith(hint.format(glob))
    assert [c.texts for c in CorpusReader(glob, keep=["lang"])] == [["mine"]]


def test_jsonl_kept_key_in_no_line_is_refused_up_front(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "lang": "en"}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "1", "text": "y"}, "", {"id": "2", "text": "z", "year": 2}])
    with pytest.raises(UserError) as info:
        CorpusReader(str(tmp_path), keep=["lang"])  # construction, before a row is handed on
    assert str(info.value) == (
        f"{tmp_path}/b.jsonl: no line has the --keep key 'lang' (its keys: id, text, year), nor a folder lang=VALUE; "
        "check its spelling or drop it from --keep"
    )


def test_jsonl_without_rows_needs_no_kept_key(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["", "  "])
    assert list(CorpusReader(str(tmp_path / "a.jsonl"), keep=["lang"])) == []


def test_parquet_keep_columns_that_disagree_across_files(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "n": [1]})
    write_parquet(tmp_path / "b.parquet", {"text": ["b"], "n": [[1, 2]]})
    message = error(path=str(tmp_path), keep=["n"])
    assert message.startswith(f"{tmp_path}/b.parquet: a --keep column has a type that earlier files do not share")


@pytest.mark.parametrize("first, second, reason", [
    (pa.array([2**53 + 1], pa.int64()), pa.array([0.5]), "Integer value 9007199254740993 not in range"),
    (pa.array([2**64 - 1], pa.uint64()), pa.array([1], pa.int64()), "Integer value 18446744073709551615 not in range"),
], ids=["int64 past float64's integers", "uint64 past int64"])
def test_parquet_kept_values_the_unified_type_cannot_hold_name_the_file_and_column(tmp_path, first, second, reason):
    write_parquet(tmp_path / "a.parquet", {"text": ["a"], "n": first})
    write_parquet(tmp_path / "b.parquet", {"text": ["b"], "n": second})
    message = error(path=str(tmp_path), keep=["n"])
    assert message.startswith(f"{tmp_path}/a.parquet row 1: --keep column 'n' does not fit the type ")
    assert f"it has in {tmp_path}/b.parquet ({reason}" in message and message.endswith("or leave it out of --keep")


@pytest.mark.parametrize("column", ["text", "id", "n"])
def test_parquet_with_two_columns_of_one_name_says_so(tmp_path, column):
    columns = {"text": pa.array(["a"]), "id": pa.array(["x"]), "n": pa.array([1])}
    names = list(columns) + [column]
    pq.write_table(pa.Table.from_arrays([*columns.values(), columns[column]], names=names), tmp_path / "a.parquet")
    assert error(path=str(tmp_path), keep=["n"]) == (
        f"{tmp_path}/a.parquet has 2 columns named '{column}', which no reader can tell apart; rename all but one")


def test_parquet_id_column_that_cannot_be_a_string(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": [[1, 2]], "text": ["x"]})
    message = error(path=str(tmp_path))
    assert f"{tmp_path}/a.parquet" in message and "cannot serve as an id" in message


def test_parquet_null_id_names_the_row(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": ["a", "b", None], "text": ["x", "y", "z"]})
    assert f"{tmp_path}/a.parquet row 3: id is null" in error(path=str(tmp_path), chunk_rows=2)


def test_empty_ids_name_the_row(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": ["a", "", "c"], "text": ["x", "y", "z"]})
    assert f"{tmp_path}/a.parquet row 2: id is empty" in error(path=str(tmp_path / "a.parquet"))
    write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "text": "x"}, {"id": "", "text": "y"}])
    assert f"{tmp_path}/b.jsonl line 2: id is empty" in error(path=str(tmp_path / "b.jsonl"))


def test_parquet_binary_ids_that_are_not_utf8(tmp_path):
    write_parquet(tmp_path / "a.parquet", {"id": pa.array([b"\xff\xfe", b"b"], pa.binary()), "text": ["x", "y"]})
    assert "a.parquet: id does not read as text" in error(path=str(tmp_path))


def test_jsonl_invalid_json_names_file_and_line(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, "", '{"text": "missing comma" "id": 1}'])
    message = error(path=str(tmp_path))
    assert message == (
        f"{tmp_path}/a.jsonl line 3: invalid JSON (Expecting ',' delimiter at column 26); fix or remove that line"
    )


@pytest.mark.parametrize("line, phrase", [
    ('{"text": "cut off', "invalid JSON (Unterminated string starting at column 10)"),  # json's message ends in "at"
    ('{"text": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deep to read"),
    ('{"text": "x", "n": ' + "9" * 5000 + "}", "holds a number of more than 4,300 digits, more than Python reads"),
], ids=["truncated", "deep", "long number"])
def test_jsonl_that_python_cannot_read_is_one_line_naming_the_line(tmp_path, line, phrase):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, line])
    assert error(path=str(tmp_path)) == f"{tmp_path}/a.jsonl line 2: {phrase}; fix or remove that line"


def test_jsonl_lines_ended_by_a_carriage_return_alone_say_so(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "x"}\r{"text": "y"}\r')
    assert error(path=str(tmp_path)) == (f"{tmp_path}/a.jsonl line 1: holds several lines ended by a carriage return "
                                         "alone (old Mac line endings); convert them to newlines")


def test_jsonl_line_that_is_not_an_object(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, ["a", "list"]])
    assert f"{tmp_path}/a.jsonl line 2: expected a JSON object, got a list" in error(path=str(tmp_path))


def test_jsonl_missing_text_key(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"body": "x", "id": 1}])
    message = error(path=str(tmp_path))
    assert message.startswith(f"{tmp_path}/a.jsonl line 1: no 'text' key (its keys: body, id)")
    assert "--text-col" in message


def test_jsonl_text_not_a_string(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"text": 3}])
    assert f"{tmp_path}/a.jsonl line 2: text is a number, not a string;" in error(path=str(tmp_path))
    write_jsonl(tmp_path / "a.jsonl", [{"text": {"a": 1}}])
    assert f"{tmp_path}/a.jsonl line 1: text is an object, not a string;" in error(path=str(tmp_path))


def test_jsonl_bad_id(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": [1], "text": "x"}])
    assert f"{tmp_path}/a.jsonl line 1: id is a list" in error(path=str(tmp_path))
    write_jsonl(tmp_path / "a.jsonl", [{"id": None, "text": "x"}])
    assert f"{tmp_path}/a.jsonl line 1: id is null" in error(path=str(tmp_path))


def test_jsonl_ids_on_some_lines_only_name_the_line(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": "x"}, "", {"id": "b", "text": "y"}, {"text": "z"}])
    assert error(path=str(tmp_path)) == (
        f"{tmp_path}/a.jsonl line 4: has no 'id' key but line 1 has one; give every line an id, "
        "or pass --id-col naming a key the file lacks to number lines instead"
    )
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"id": "a.jsonl:1", "text": "y"}])
    assert f"{tmp_path}/a.jsonl line 2: has an 'id' key but line 1 has none;" in error(path=str(tmp_path))


def test_jsonl_ids_are_decided_per_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": "x"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "y"}])
    assert read_all(CorpusReader(str(tmp_path)))[1] == ["a", "b.jsonl:1"]


def test_jsonl_byte_order_mark_is_dropped_at_the_start_only(tmp_path):
    lines = json.dumps({"id": "a", "text": "x"}) + "\n" + json.dumps({"id": "b", "text": "y"}) + "\n"
    (tmp_path / "a.jsonl").write_bytes(codecs.BOM_UTF8 + lines.encode())
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(codecs.BOM_UTF8 + b'{"id": "c", "text": "z"}\n'))
    _, ids, texts = read_all(CorpusReader(str(tmp_path)))
    assert (ids, texts) == (["a", "b", "c"], ["x", "y", "z"])
    (tmp_path / "a.jsonl").write_bytes(lines.encode() + codecs.BOM_UTF8 + lines.encode())  # two files joined with cat
    assert error(path=str(tmp_path / "a.jsonl")) == (
        f"{tmp_path}/a.jsonl line 3: starts with a byte order mark, which only a file's start may hold (files joined "
        "with cat?); remove it")


def test_jsonl_not_utf8(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert f"{tmp_path}/a.jsonl line 2: not valid UTF-8" in error(path=str(tmp_path))


def test_jsonl_lone_surrogate_names_the_line_and_a_pair_is_fine(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ['{"text": "an emoji \\ud83d\\ude00 is a pair"}', '{"text": "bad \\ud800 here"}'])
    assert f"{tmp_path}/a.jsonl line 2: holds a lone surrogate" in error(path=str(tmp_path))
    write_jsonl(tmp_path / "a.jsonl", ['{"text": "fine", "id": "\\udfff"}'])
    assert f"{tmp_path}/a.jsonl line 1: holds a lone surrogate" in error(path=str(tmp_path))
    write_jsonl(tmp_path / "a.jsonl", ['{"text": "an emoji \\ud83d\\ude00 is a pair"}'])
    [chunk] = list(CorpusReader(str(tmp_path), "text", "id"))
    assert chunk.texts == ["an emoji \U0001F600 is a pair"]


def test_jsonl_gz_that_is_cut_short(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": f"row {i}"} for i in range(2000)], gz=True)
    path.write_bytes(path.read_bytes()[:-50])
    message = error(path=str(path))
    assert message.startswith(f"{path} line ") and "check that the file is complete" in message


def test_jsonl_gz_that_is_not_gzip(tmp_path):
    (tmp_path / "a.jsonl.gz").write_text('{"text": "plain"}\n')
    assert error(path=str(tmp_path)).startswith(f"{tmp_path}/a.jsonl.gz line 1: cannot read (")


def test_jsonl_kept_key_that_changes_type(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a", "n": 1}, {"text": "b", "n": "two"}])
    message = error(path=str(tmp_path), keep=["n"], chunk_rows=1)
    assert message.startswith(f"{tmp_path}/a.jsonl line 2: --keep key 'n' does not fit the type int64")


def test_a_key_whose_folders_are_all_null_takes_the_type_of_the_files_that_hold_it(tmp_path):
    """__HIVE_DEFAULT_PARTITION__ says nothing of the type: a Parquet file's own int column decides."""
    write_parquet(tmp_path / "a" / "year=__HIVE_DEFAULT_PARTITION__" / "p.parquet", {"id": ["n"], "text": ["x"]})
    write_parquet(tmp_path / "a" / "extra.parquet", {"id": ["e"], "text": ["y"], "year": [2024]})
    reader = CorpusReader(str(tmp_path / "a"), keep=["year"])
    assert reader.kept_schema.field("year").type == pa.int64()
    assert {row_id: year for chunk in reader
            for row_id, year in zip(chunk.ids, chunk.kept.column("year").to_pylist())} == {"n": None, "e": 2024}


def test_a_folder_key_typed_apart_from_a_files_column_is_named_in_the_message(tmp_path):
    write_parquet(tmp_path / "d" / "lang=en" / "a.parquet", {"text": ["x"]})
    write_parquet(tmp_path / "d" / "b.parquet", {"text": ["y"], "lang": [5]})
    assert f"its folder lang=en giving its 'lang'); make the shards agree" in error(path=f"{tmp_path}/d", keep=["lang"])
