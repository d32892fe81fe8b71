"""`embedctl index` as a user runs it: real subprocesses, real files, checked from the outside.

The oracles are independent of embedctl's own pipeline: expected ids and kept columns come from
reading the inputs with pyarrow and json, token counts from the `tokenizers` library, the weights
hash from hashlib, neighbours from lancedb's own search. Bad inputs must end with exit code 2, one
`error:` line on stderr that names the file (and line) and the fix, and no output left behind.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer
from typer.main import get_command

import embedctl
from embedctl.cli import app
from embedctl.progress import TokenRate
from engine.checkpoint import files_digest, resolve_model
from tests.files import (ENV, assert_one_error_line, good_rows, hears_ctrl_c, read_only, run_cli, run_cli_in_terminal,
                         snapshot, write_jsonl)

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "corpus"
MAX_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json
# One torch thread per run: on this shared two-core machine, two-thread CPU kernels wait on each
# other under load and make every run several times slower. The vectors are the same.
def embedctl_index(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli("index", *args, cwd=cwd)


def run_side_by_side(jobs: list[tuple[list, Path]]) -> list[subprocess.CompletedProcess]:
    """Run (arguments, cwd) jobs one per core: each spends most of its time importing torch."""
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(lambda job: embedctl_index(*job[0], cwd=job[1]), jobs))


# Bad input. Each case writes its files into tmp and returns (arguments, phrases the error must hold).
# A bad line sits in the second shard of docs/, so it is met after the writer has opened the output.


def _bad_second_shard(tmp: Path, bad: object) -> str:
    write_jsonl(tmp / "docs" / "a.jsonl", good_rows("a"))
    write_jsonl(tmp / "docs" / "b.jsonl", [*good_rows("b"), bad])
    return "docs/b.jsonl line 3"


def _missing_path(tmp: Path) -> tuple[list, list[str]]:
    return ["nowhere/docs.jsonl"], ["nowhere/docs.jsonl", "does not exist", "give a file"]


def _corrupt_parquet(tmp: Path) -> tuple[list, list[str]]:
    good = pq.read_table(SAMPLE / "part-000.parquet")
    buffer = pa.BufferOutputStream()
    pq.write_table(good, buffer)
    data = buffer.getvalue().to_pybytes()
    (tmp / "docs.parquet").write_bytes(data[: len(data) // 2])
    return ["docs.parquet"], ["docs.parquet", "not a readable Parquet file", "complete Parquet file"]


def _malformed_json(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, '{"id": "x", "text": "no closing brace"')
    return ["docs"], [where, "invalid JSON", "fix or remove that line"]


def _missing_text_jsonl(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"id": "x", "body": "text under another key"})
    return ["docs"], [where, "no 'text' key", "--text-col"]


def _missing_text_parquet(tmp: Path) -> tuple[list, list[str]]:
    pq.write_table(pa.table({"id": ["a"], "body": ["text under another column"]}), tmp / "docs.parquet")
    return ["docs.parquet"], ["docs.parquet", "no column 'text'", "--text-col"]


def _non_string_text(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"id": "x", "text": 42})
    return ["docs"], [where, "not a string", "make it a string"]


def _model_missing_files(tmp: Path) -> tuple[list, list[str]]:
    model = tmp / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(resolve_model(None).path / name, model / name)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--model", model], [str(model), "tokenizer.json", "--model"]


def _ids_on_some_lines(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"text": "a line without an id, after lines with one"})
    return ["docs"], [where, "has no 'id' key but line 1 has one", "give every line an id", "--id-col"]


def _duplicate_ids(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"id": "a1", "text": "another text under an id used before"})
    return ["docs"], [where, "duplicate id 'a1'", "--on-duplicate skip"]


def _empty_text_refused(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"id": "x", "text": "  \n "})
    return ["docs", "--on-empty", "error"], [where, "empty text", "--on-empty skip"]


def _long_text_refused(tmp: Path) -> tuple[list, list[str]]:
    where = _bad_second_shard(tmp, {"id": "x", "text": "word " * 400})
    return ["docs", "--on-long", "error"], [where, f"longer than the model's {MAX_LENGTH} tokens", "--on-long truncate"]


def _old_overwrite_flag(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--overwrite"], ["--overwrite is gone", "drop the flag", "--rebuild"]


def _lance_table(tmp: Path, dim: int = 384, content_key: bool = True) -> None:
    """x.lance shaped like an embedctl output (or, without content_key, an older one), made with lancedb alone."""
    columns = {"id": (pa.string(), "old"), "vector": (pa.list_(pa.float32(), dim), [0.5] * dim),
               "n_tokens": (pa.int32(), 3), "truncated": (pa.bool_(), False), "content_key": (pa.string(), "k")}
    if not content_key:
        del columns["content_key"]
    schema = pa.schema([pa.field(name, kind) for name, (kind, _) in columns.items()], metadata={"embedctl.dim": str(dim)})
    lancedb.connect(tmp).create_table("x", data=pa.table({name: [value] for name, (_, value) in columns.items()},
                                                         schema=schema))


def _existing_lance_without_keys(tmp: Path) -> tuple[list, list[str]]:
    _lance_table(tmp, content_key=False)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl"], ["cannot update x.lance", "no content_key column", "--rebuild"]


def _existing_parquet(tmp: Path) -> tuple[list, list[str]]:
    pq.write_table(pa.table({"anything": [1, 2, 3]}), tmp / "x.parquet")
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl"], ["x.parquet holds data that embedctl did not write", "pick another --out"]


def _someone_elses_parquet_with_rebuild(tmp: Path) -> tuple[list, list[str]]:
    pq.write_table(pa.table({"anything": [1, 2, 3]}), tmp / "x.parquet")
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--rebuild"], ["x.parquet holds data that embedctl did not write", "pick another --out"]


def _someone_elses_parquet_folder_with_rebuild(tmp: Path) -> tuple[list, list[str]]:
    (tmp / "out").mkdir()
    pq.write_table(pa.table({"anything": [1, 2, 3]}), tmp / "out" / "data.parquet")
    (tmp / "out" / "README").write_text("their notes")
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--rebuild"], ["out/ holds data that embedctl did not write", "pick another --out"]


def _someone_elses_folder_named_lance(tmp: Path) -> tuple[list, list[str]]:
    (tmp / "x.lance").mkdir()
    (tmp / "x.lance" / "notes.txt").write_text("their notes")
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl"], ["x.lance is a folder of other files than a LanceDB table's (notes.txt)", "pick another --out"]


def _other_dim(tmp: Path) -> tuple[list, list[str]]:
    _lance_table(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--dim", "128"], ["x.lance", "dim 384 and this run's dim is 128", "--rebuild"]


def _failed_rebuild(tmp: Path) -> tuple[list, list[str]]:
    _lance_table(tmp)
    where = _bad_second_shard(tmp, "not json")
    return ["docs", "--rebuild"], [where, "invalid JSON"]


# Each case with one kind of output; the cases that fail mid-stream cover all three kinds.
BAD_INPUTS = [(_missing_path, "x.lance"), (_corrupt_parquet, "x.parquet"), (_malformed_json, "x.lance"),
              (_missing_text_jsonl, "x.parquet"), (_missing_text_parquet, "out/"), (_non_string_text, "out/"),
              (_model_missing_files, "x.lance"), (_duplicate_ids, "x.parquet"), (_ids_on_some_lines, "x.lance"),
              (_empty_text_refused, "out/"), (_long_text_refused, "x.lance"), (_old_overwrite_flag, "x.parquet"),
              (_existing_lance_without_keys, "x.lance"), (_existing_parquet, "x.parquet"), (_other_dim, "x.lance"),
              (_failed_rebuild, "x.lance"), (_someone_elses_parquet_with_rebuild, "x.parquet"),
              (_someone_elses_parquet_folder_with_rebuild, "out/"), (_someone_elses_folder_named_lance, "x.lance")]


@dataclass
class BadRun:
    directory: Path
    output_existed: bool
    before: dict[str, bytes]  # every file in directory
    phrases: list[str]  # what the error line must say
    result: subprocess.CompletedProcess | None = None


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BadRun]:
    """Every bad-input case, run once, by name."""
    runs, jobs = {}, []
    for case, out in BAD_INPUTS:
        tmp = tmp_path_factory.mktemp(case.__name__.strip("_"))
        args, phrases = case(tmp)
        runs[case.__name__] = BadRun(tmp, (tmp / out).exists(), snapshot(tmp), phrases)
        jobs.append(([*args, "--out", out, "--report", "r.json"], tmp))
    for run, result in zip(runs.values(), run_side_by_side(jobs)):
        run.result = result
    return runs


@pytest.mark.parametrize(("case", "out"), BAD_INPUTS, ids=[case.__name__.strip("_") for case, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_changes_nothing(bad_runs: dict[str, BadRun], case, out: str) -> None:
    run = bad_runs[case.__name__]
    assert_one_error_line(run.result, *run.phrases)
    assert (run.directory / out).exists() == run.output_existed
    after = snapshot(run.directory)
    assert json.loads(after.pop("r.json")) == {"error": run.result.stderr.strip().removeprefix("error: ")}
    assert after == run.before  # no temporary files either


# Paths and options refused before anything is read or written; these write no report either, since
# the report path may be the very file to protect.

def _unknown_kind_in_new_folders(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "typo/sub/v.json"], ["cannot tell what kind of output typo/sub/v.json is"]


def _rebuild_onto_its_source(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs" / "a.jsonl", good_rows("a"))
    return ["docs", "--out", "docs/", "--rebuild"], ["--out docs/ and the input docs overlap", "outside the input"]


def _output_inside_its_source(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs" / "a.jsonl", good_rows("a"))
    return ["docs", "--out", "docs/vectors.parquet"], ["overlap"]


def _output_inside_its_second_source(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "a.jsonl", good_rows("a"))
    write_jsonl(tmp / "docs" / "b.jsonl", good_rows("b"))
    return ["a.jsonl", "docs", "--out", "docs/vectors.parquet"], ["--out docs/vectors.parquet and the input docs overlap"]


def _output_its_glob_would_match(tmp: Path) -> tuple[list, list[str]]:
    (tmp / "docs").mkdir()
    pq.write_table(pa.Table.from_pylist(good_rows("a")), tmp / "docs" / "a.parquet")
    return ["docs/*.parquet", "--out", "docs/embeddings.parquet"], ["--out docs/embeddings.parquet and the input "
                                                                    "docs/*.parquet overlap"]


def _output_a_bare_glob_would_match(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["*", "--out", "vectors.parquet"], ["--out vectors.parquet and the input * overlap"]


def _parts_folder_its_glob_would_read(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "g" / "a.jsonl", good_rows("a"))
    return ["g/*", "--out", "g/vectors/"], ["--out g/vectors/ and the input g/* overlap"]


def _report_its_glob_would_read(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["d*.jsonl", "--out", "x.lance", "--report", "d-report.jsonl"], [
        "--report d-report.jsonl would be read as input by d*.jsonl on a later run"]


def _empty_source(tmp: Path) -> tuple[list, list[str]]:
    return ["", "--out", "x.lance"], ["an input path is empty; give a file, a directory or a glob"]


def _other_parquet_among_the_parts(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "out").mkdir()
    pq.write_table(pa.table({"id": ["a"]}), tmp / "out" / "part-00000.parquet")
    pq.write_table(pa.table({"id": ["kept"]}), tmp / "out" / "backup.parquet")  # a store would have deleted it
    return ["docs.jsonl", "--out", "out/"], ["out/ holds Parquet files that are not embedctl's parts (backup.parquet)"]


def _table_in_a_parts_folder(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "mix").mkdir()
    pq.write_table(pa.table({"id": ["a"]}), tmp / "mix" / "part-00000.parquet")
    return ["docs.jsonl", "--out", "mix", "--table", "t"], ["--out mix is a folder of Parquet parts written by "
                                                            "embedctl, not a LanceDB database"]


def _parquet_file_among_parts(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "nest").mkdir()
    pq.write_table(pa.table({"id": ["a"]}), tmp / "nest" / "part-00000.parquet")
    return ["docs.jsonl", "--out", "nest/latest.parquet"], ["--out nest/latest.parquet would lie among the Parquet "
                                                            "parts of the embedctl output nest/"]


def _quiet_and_verbose(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.lance", "--quiet", "--verbose"], ["--quiet leaves out the summary that --verbose"]


def _no_rows_per_commit(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.lance", "--commit-rows", "0"], ["--commit-rows 0: give a positive number of rows"]


def _report_onto_the_output(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    pq.write_table(pa.table({"id": ["old"]}), tmp / "x.parquet")
    return ["docs.jsonl", "--out", "x.parquet", "--report", "x.parquet"], ["--report x.parquet would overwrite x.parquet"]


def _report_onto_a_new_output_whose_name_looks_like_a_glob(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))  # x[1].parquet names no file yet, but an output is never a glob
    return ["docs.jsonl", "--out", "x[1].parquet", "--report", "x[1].parquet"], [
        "--report x[1].parquet would overwrite x[1].parquet"]


def _table_with_parquet(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.parquet", "--table", "t"], ["--table t", "drop --table"]


def _unknown_device(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.lance", "--device", "tpu"], ["--device tpu", "cpu, cuda or cuda:N"]


def _device_list_with_an_empty_entry(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.lance", "--device", "cuda:0,"], ["--device 'cuda:0,' has an empty entry"]


def _device_list_with_the_cpu(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "x.lance", "--device", "cpu,cuda:0"], ["a list names GPUs only", "give cpu alone"]


def _output_under_a_file(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "plain").write_text("a file, not a folder")
    return ["docs.jsonl", "--out", "plain/x.lance"], ["cannot write beside plain/x.lance: plain is a file, not a folder; "
                                                      "pick another output"]


def _folder_output_that_is_a_file(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "parts").write_text("a file where the folder would be")
    return ["docs.jsonl", "--out", "parts/"], ["--out parts/ names a folder for Parquet parts, but parts is a file"]


def _empty_output(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", ""], ["--out '' names no output of its own"]


def _root_output(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "/"], ["--out '/' names no output of its own"]


def _empty_database_with_a_table(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "", "--table", "docs"], ["--out '' names no output of its own",
                                                             "a database folder with --table"]


def _table_inside_a_table(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["docs.jsonl", "--out", "v.lance", "--table", "docs"], ["--out v.lance names a LanceDB table",
                                                                   "give --out the database folder"]


def _lance_output_that_is_a_file(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "x.lance").write_text("a file where the table would be")
    return ["docs.jsonl", "--out", "x.lance"], ["cannot open x.lance as a LanceDB table", "pick another --out"]


REFUSED = [_unknown_kind_in_new_folders, _lance_output_that_is_a_file, _folder_output_that_is_a_file, _empty_output,
           _empty_database_with_a_table, _table_inside_a_table, _root_output, _rebuild_onto_its_source,
           _output_inside_its_source, _output_inside_its_second_source, _report_onto_the_output,
           _report_onto_a_new_output_whose_name_looks_like_a_glob, _table_with_parquet, _unknown_device,
           _device_list_with_an_empty_entry, _device_list_with_the_cpu, _output_under_a_file,
           _output_its_glob_would_match, _output_a_bare_glob_would_match, _parts_folder_its_glob_would_read,
           _report_its_glob_would_read, _empty_source,
           _quiet_and_verbose, _other_parquet_among_the_parts, _table_in_a_parts_folder,
           _parquet_file_among_parts, _no_rows_per_commit]


def test_overlapping_paths_and_impossible_options_are_one_line_and_change_nothing(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    cases = []
    for case in REFUSED:
        tmp = tmp_path_factory.mktemp(case.__name__.strip("_"))
        args, phrases = case(tmp)
        cases.append((tmp, snapshot(tmp), phrases, args))
    for (tmp, before, phrases, _), result in zip(cases, run_side_by_side([(args, tmp) for tmp, _, _, args in cases])):
        assert_one_error_line(result, *phrases)
        assert snapshot(tmp) == before
        assert not (tmp / "typo").exists()  # no folder made for an output that was refused


def test_an_output_reached_through_a_missing_folder_and_back_makes_no_folder(tmp_path: Path) -> None:
    """--out new/../x.parquet is x.parquet, whether the run is refused or runs."""
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    refused, done = run_side_by_side([(["docs.jsonl", "--out", "new/../x.parquet", "--report", "x.parquet"], tmp_path),
                                      (["docs.jsonl", "--out", "./new/../x.parquet", "-q"], tmp_path)])
    assert_one_error_line(refused, "--report x.parquet would overwrite x.parquet")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "x.parquet").num_rows == len(good_rows("a"))
    assert not (tmp_path / "new").exists()


def test_verbose_settings_on_a_terminal_get_a_line_of_their_own_above_the_bar(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    code, shown = run_cli_in_terminal("index", "docs.jsonl", "--out", "x.lance", "-v", cwd=tmp_path)
    assert code == 0, shown
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown).replace("\r", "\n").splitlines()
    settings = [line for line in lines if " on cpu (torch.float32), attention" in line]  # rich wraps the rest
    assert settings and all(line.startswith("model ") for line in settings), shown


def test_a_report_named_dash_goes_to_stdout_and_score_keeps_stdout_for_its_run(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    with ThreadPoolExecutor(2) as pool:
        indexed, mixed = pool.map(lambda args: run_cli(*args, cwd=tmp_path),
                                  [("index", "docs.jsonl", "--out", "x.lance", "-q", "--report", "-"),
                                   ("score", "docs.jsonl", "docs.jsonl", "-q", "--report", "-")])
    assert indexed.returncode == 0, indexed.stderr
    assert json.loads(indexed.stdout)["added"] == len(good_rows("a"))
    assert_one_error_line(mixed, "--report - would mix the report into the run on standard output; give --out FILE")
    assert not (tmp_path / "-").exists()
    both = subprocess.run(f"{sys.executable} -m embedctl.cli score docs.jsonl docs.jsonl -q --report - "
                          "--out /dev/stdout > both.txt", shell=True, cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert_one_error_line(both, "--report - would mix the report into the run on standard output")
    # -v's settings line goes nowhere with stderr closed, rather than into the report on stdout
    closed = subprocess.run(f"{sys.executable} -m embedctl.cli index docs.jsonl --out y.lance -v --report - 2>&-",
                            shell=True, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True, timeout=300)
    assert json.loads(closed.stdout)["added"] == len(good_rows("a"))
    # with stdout closed, the report would be lost without a word
    lost = subprocess.run(f"{sys.executable} -m embedctl.cli index docs.jsonl --out z.lance --report - >&-",
                          shell=True, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert_one_error_line(lost, "standard output is closed, and --report - writes there; give --report FILE")
    assert not (tmp_path / "z.lance").exists()


def test_a_glob_in_the_output_folder_takes_an_output_it_would_never_read(tmp_path: Path) -> None:
    """`index '*.jsonl' --out vectors.lance`: a Lance output holds no corpus files, and a glob reads only what it
    matches, so outputs beside the files a glob searches are fine unless the glob would read them next time."""
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    results = run_side_by_side([(["*.jsonl", "--out", "vectors.lance", "-q"], tmp_path),
                                (["**/*.jsonl", "--out", "out/vectors.parquet", "-q"], tmp_path),
                                (["d*.jsonl", "--out", "more.lance", "--report", "report.json", "-q"], tmp_path),
                                (["*.jsonl", "--out", "parts/", "-q"], tmp_path)])
    for result in results:
        assert result.returncode == 0, result.stderr
    assert lancedb.connect(tmp_path).open_table("vectors").count_rows() == len(good_rows("a"))
    assert pq.read_table(tmp_path / "out" / "vectors.parquet").num_rows == len(good_rows("a"))


def test_a_database_around_the_source_takes_a_table_beside_it_but_not_inside_it(tmp_path: Path) -> None:
    """--out DB --table NAME writes DB/NAME.lance: only that folder must stay out of the source."""
    write_jsonl(tmp_path / "data" / "corpus" / "a.jsonl", good_rows("a"))
    beside, inside = run_side_by_side([(["data/corpus", "--out", "data", "--table", "vectors", "-q"], tmp_path),
                                       (["data", "--out", "data", "--table", "vectors", "-q"], tmp_path)])
    assert beside.returncode == 0, beside.stderr
    assert lancedb.connect(tmp_path / "data").open_table("vectors").count_rows() == len(good_rows("a"))
    assert_one_error_line(inside, "--out data/vectors.lance and the input data overlap")


def test_a_table_name_lancedb_refuses_is_one_line_before_any_work(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    before = snapshot(tmp_path)
    outputs = {"my vectors": ["--out", "my vectors.lance"], "café": ["--out", "café.lance"],
               "a b": ["--out", "db", "--table", "a b"]}
    segments = {".": ["--out", "db", "--table", "."], "..": ["--out", "...lance"]}  # LanceDB's own error was a traceback
    suffixed = ["--out", "db", "--table", "t.lance"]  # was written quietly as a new table, db/t.lance.lance
    results = run_side_by_side([(["docs.jsonl", *out], tmp_path) for out in [*outputs.values(), *segments.values(), suffixed]])
    for (name, out), result in zip(outputs.items(), results):
        assert_one_error_line(result, f"{' '.join(out[-2:])}: LanceDB takes only ASCII letters, digits, underscores, "
                                      f"hyphens and periods in a table name, not '{name}'; rename it")
    for (name, out), result in zip(segments.items(), results[len(outputs):]):
        assert_one_error_line(result, f"{' '.join(out[-2:])}: '{name}' is a path segment, not a table name; rename it")
    assert_one_error_line(results[-1], "--table t.lance: LanceDB names a table's folder after it with .lance added",
                          "pass --table t")
    assert snapshot(tmp_path) == before


def _report_in_a_read_only_folder(tmp: Path) -> tuple[str, list[str], AbstractContextManager]:
    (tmp / "reports").mkdir()
    return ("reports/r.json", ["cannot write the report reports/r.json", "reports is read-only", "writable --report"],
            read_only(tmp / "reports"))


def _report_that_is_a_folder(tmp: Path) -> tuple[str, list[str], AbstractContextManager]:
    (tmp / "r.json").mkdir()
    return "r.json", ["--report r.json is a directory", "give the report a file name"], nullcontext()


@pytest.mark.parametrize("case", [_report_in_a_read_only_folder, _report_that_is_a_folder],
                         ids=["read-only folder", "a folder"])
def test_a_report_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path, case) -> None:
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    report, phrases, context = case(tmp_path)
    before = snapshot(tmp_path)
    with context:
        result = embedctl_index("docs.jsonl", "--out", "x.parquet", "--report", report, cwd=tmp_path)
    assert_one_error_line(result, *phrases)
    assert snapshot(tmp_path) == before  # no output, and no report


# Usage errors, which click finds before a command runs: one line, exit code 2.

USAGE_ERRORS = {
    "unknown option": (["index", "docs.jsonl", "--out", "x.lance", "--frobnicate"],
                       ["error: No such option: --frobnicate", "(see embedctl index --help)"]),
    "missing argument": (["index"], ["error: Missing argument 'SOURCE' (see embedctl index --help)"]),
    "missing option value": (["index", "docs.jsonl", "--out"],
                             ["error: Option '--out' requires an argument (see embedctl index --help)"]),
    "bad choice": (["index", "docs.jsonl", "--out", "x.lance", "--on-long", "sometimes"],
                   ["'--on-long'", "'sometimes' is not one of 'truncate', 'error'", "(see embedctl index --help)"]),
    "not a number": (["score", "queries.jsonl", "docs.jsonl", "--top-k", "many"], ["'--top-k'", "(see embedctl score --help)"]),
    "a glob the shell expanded": (["score", "queries.jsonl", "a.jsonl", "b.jsonl"],
                                  ["error: Got unexpected extra argument(s) (b.jsonl); QUERIES and DOCS are one path "
                                   "each: quote a glob ('docs/*.jsonl') so that the shell passes it whole, or give the "
                                   "folder (see embedctl score --help)"]),
    "a device list to score": (["score", "queries.jsonl", "docs.jsonl", "--device", "cuda:0,cuda:1"],
                               ["error: Invalid value for '--device': cuda:0,cuda:1 lists several devices; this command "
                                "runs on one (cpu, cuda or cuda:N): only index spreads its work over several GPUs "
                                "(see embedctl score --help)"]),
    "an extra argument of serve": (["serve", "some/model"], ["error: Got unexpected extra argument(s) (some/model) (see "
                                                            "embedctl serve --help)"]),
    "unknown command": (["reindex"], ["error: No such command 'reindex'", "Did you mean 'index'?", "(see embedctl --help)"]),
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_usage_errors_are_one_line(tmp_path: Path, case: str) -> None:
    args, phrases = USAGE_ERRORS[case]
    result = run_cli(*args, cwd=tmp_path)
    assert_one_error_line(result, *phrases)
    assert result.stdout == ""


def test_the_bare_command_prints_its_help(tmp_path: Path) -> None:
    result = run_cli(cwd=tmp_path)
    assert result.returncode == 2 and "error" not in result.stderr
    assert "Usage: embedctl [OPTIONS] COMMAND" in result.stdout + result.stderr


@pytest.mark.parametrize("command, option", [("index", "--lanes"), ("serve", "--lanes"), ("score", "--top-k")])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_zero(tmp_path: Path, command: str, option: str, flag: str) -> None:
    result = run_cli(command, flag, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert f"Usage: embedctl {command}" in result.stdout and option in result.stdout


def test_every_command_that_loads_a_model_takes_the_engine_options(tmp_path: Path) -> None:
    engine_options = ["--device", "--dtype", "--max-batch-tokens", "--max-seqs", "--lanes", "--attention", "--eager",
                      "--compile"]
    for command in ("index", "score", "serve"):
        shown = run_cli(command, "--help", cwd=tmp_path).stdout
        assert [option for option in engine_options if option not in shown] == [], command


@pytest.mark.parametrize("width", [80, 60])
@pytest.mark.parametrize("command", [[], ["index"], ["score"], ["serve"]], ids=["embedctl", "index", "score", "serve"])
def test_help_shows_every_option_name_whole(tmp_path: Path, command: list[str], width: int) -> None:
    """At a narrow terminal no option name is cut ("--tokenizer-pr…"). click's help lists each option on
    a line of its own at an indent of two, its names (and metavar) before the first double space."""
    group = get_command(app)
    params = (group.commands[command[0]] if command else group).params
    names = {name for param in params if param.param_type_name == "option" and not param.hidden
             for name in (*param.opts, *param.secondary_opts)}
    result = run_cli(*command, "--help", cwd=tmp_path, env={"COLUMNS": str(width)})
    assert result.returncode == 0, result.stderr
    rows = [match.group(1) for line in result.stdout.splitlines() if (match := re.match(r"  (-\S.*?)(?:  |$)", line))]
    shown = {word for row in rows for word in re.split(r"[\s,/]+", row) if word.startswith("-")}
    assert names and names <= shown, result.stdout
    assert max(map(len, result.stdout.splitlines())) <= width


def test_version_as_the_script_and_as_python_m_embedctl(tmp_path: Path) -> None:
    from importlib.metadata import version

    script = run_cli("--version", cwd=tmp_path)
    module = subprocess.run([sys.executable, "-m", "embedctl", "--version"], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=60)
    for result in (script, module):
        assert result.returncode == 0 and result.stdout == f"embedctl {version('embedctl')}\n", result.stderr


# The happy path: sample_data/corpus (a Parquet and a JSONL shard) plus a shard of empty texts.

EMPTY_SHARD = [{"id": "e1", "text": "", "source": "x"}, {"id": "e2", "text": None, "source": "x"},
               {"id": "e3", "text": "A short text that is kept.", "source": "extra"}, {"id": "e4", "text": " \t\n"}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    shutil.copytree(SAMPLE, root / "corpus")
    write_jsonl(root / "corpus" / "part-002.jsonl", EMPTY_SHARD)
    return root / "corpus"


@pytest.fixture(scope="module")
def expected(corpus: Path) -> pa.Table:
    """id, text, source of every input row in input order, read without embedctl."""
    tables = [pq.read_table(corpus / "part-000.parquet", columns=["id", "text", "source"])]
    for name in ("part-001.jsonl", "part-002.jsonl"):
        rows = [json.loads(line) for line in (corpus / name).read_text().splitlines()]
        tables.append(pa.table({key: [row.get(key) for row in rows] for key in ("id", "text", "source")},
                               schema=tables[0].schema))
    return pa.concat_tables(tables)


OUTPUTS = ["x.lance", "x.parquet", "dir/"]


@pytest.fixture(scope="module")
def happy_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus indexed into each kind of output, side by side in one directory."""
    work = tmp_path_factory.mktemp("out")
    jobs = [([corpus, "--out", out, "--keep", "source", "--report", f"r{n}.json"], work)
            for n, out in enumerate(OUTPUTS)]
    for result in run_side_by_side(jobs):
        assert result.returncode == 0, result.stderr
        summary = result.stderr.splitlines()
        assert len(summary) == 1 and " rows: " in summary[0] and "tokens/s" in summary[0], result.stderr
    return work


@pytest.fixture(params=OUTPUTS)
def indexed(request: pytest.FixtureRequest, happy_runs: Path) -> tuple[Path, str]:
    return happy_runs, request.param


def read_output(work: Path, out: str) -> pa.Table:
    if out.endswith(".lance"):
        return lancedb.connect(work).open_table(out.removesuffix(".lance")).to_arrow()
    return pq.read_table(work / out)


def test_rows_are_inputs_minus_reported_skips(indexed: tuple[Path, str], expected: pa.Table) -> None:
    work, out = indexed
    report = json.loads((work / f"r{OUTPUTS.index(out)}.json").read_text())
    assert report["rows_read"] == expected.num_rows
    assert report["skipped"] == report["skipped_empty"] == 3
    assert read_output(work, out).num_rows == report["rows_written"] == expected.num_rows - report["skipped"]
    assert report["rows_committed"] == report["rows_written"]


def test_ids_and_kept_columns_in_input_order(indexed: tuple[Path, str], expected: pa.Table) -> None:
    work, out = indexed
    table = read_output(work, out)
    kept = [row for row in expected.to_pylist() if row["text"] and row["text"].strip()]
    assert table.column("id").to_pylist() == [row["id"] for row in kept]
    assert table.column("source").to_pylist() == [row["source"] for row in kept]


def test_token_counts_and_truncation(indexed: tuple[Path, str], expected: pa.Table) -> None:
    work, out = indexed
    table = read_output(work, out)
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = dict(zip(expected.column("id").to_pylist(), expected.column("text").to_pylist()))
    full = [len(e.ids) for e in tokenizer.encode_batch([texts[i] for i in table.column("id").to_pylist()])]
    assert table.column("n_tokens").to_pylist() == [min(n, MAX_LENGTH) for n in full]
    assert table.column("truncated").to_pylist() == [n > MAX_LENGTH for n in full]
    assert sum(table.column("truncated").to_pylist()) > 0  # the sample has long documents


def test_metadata_records_the_model(indexed: tuple[Path, str]) -> None:
    work, out = indexed
    metadata = {k.decode(): v.decode() for k, v in read_output(work, out).schema.metadata.items()}
    path = resolve_model(None).path
    weights = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert metadata == {"embedctl.model": "sentence-transformers/all-MiniLM-L6-v2", "embedctl.weights_sha256": weights,
                        "embedctl.files_sha256": files_digest(path), "embedctl.dim": "384", "embedctl.pooling": "mean",
                        "embedctl.normalize": "true", "embedctl.max_length": str(MAX_LENGTH), "embedctl.prompt": ""}


@pytest.fixture(scope="module")
def model() -> embedctl.Embedder:
    return embedctl.load()


def test_vectors_are_the_models(indexed: tuple[Path, str], expected: pa.Table, model: embedctl.Embedder) -> None:
    work, out = indexed
    table = read_output(work, out)
    texts = dict(zip(expected.column("id").to_pylist(), expected.column("text").to_pylist()))
    picks = [0, 149, 150, table.num_rows - 1]  # both shards and the extra one
    ids = [table.column("id")[i].as_py() for i in picks]
    vectors = np.stack([table.column("vector")[i].values.to_numpy() for i in picks])
    np.testing.assert_allclose(vectors, model.embed([texts[i] for i in ids]), atol=1e-5)


def test_the_python_api_names_a_text_that_is_not_a_string(model: embedctl.Embedder) -> None:
    # one text is one vector, as sentence-transformers' encode() gives it
    one = model.embed_query("one text")
    assert one.shape == (384,)
    np.testing.assert_allclose(one, model.embed_query(["one text", "another"])[0], atol=1e-6)
    for bad, kind in ((None, "NoneType"), (1, "int")):
        with pytest.raises(TypeError, match=rf"texts\[1\] is {kind}, not a string; embed\(\) takes a list of texts"):
            model.embed_query(["fine", bad])
    assert model.embed(text for text in ["a", "b"]).shape == (2, 384)  # any iterable of texts
    # but one whose order the rows could not be matched to
    with pytest.raises(TypeError, match=r"not a set, whose order the rows could not be matched to; .* sorted\(s\)"):
        model.embed({"a", "b"})
    with pytest.raises(TypeError, match=r"not a dict, .* list\(d.values\(\)\) for its texts"):
        model.embed({"a": "the text"})
    # prompts by keyword only: sentence-transformers' encode(texts, "query") means prompt_name, not a prompt's text
    with pytest.raises(TypeError, match="positional"):
        model.embed_query(["a"], "query")


@pytest.mark.parametrize("indexed", ["x.lance"], indirect=True)
def test_lancedb_search_finds_a_document_by_its_own_text(indexed: tuple[Path, str], expected: pa.Table,
                                                        model: embedctl.Embedder) -> None:
    work, _ = indexed
    table = lancedb.connect(work).open_table("x")
    docs = expected.slice(140, 20).to_pylist()  # across the Parquet/JSONL boundary
    vectors = model.embed([doc["text"] for doc in docs])
    for doc, vector in zip(docs, vectors):
        hits = table.search(vector).limit(3).to_list()
        assert hits[0]["id"] == doc["id"]


def test_a_jsonl_with_a_bom_and_a_dictionary_encoded_parquet_are_read(tmp_path: Path, model: embedctl.Embedder) -> None:
    rows = good_rows("a")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_bytes(codecs.BOM_UTF8 + "".join(json.dumps(row) + "\n" for row in rows).encode())
    texts = ["A categorical text.", "Another categorical text."]
    dictionary = pa.dictionary(pa.int32(), pa.string())  # what pandas writes for a categorical column
    pq.write_table(pa.table({"id": pa.array(["b0", "b1"]).cast(dictionary), "text": pa.array(texts).cast(dictionary)}),
                   tmp_path / "docs" / "b.parquet")
    result = embedctl_index("docs", "--out", "x.parquet", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = pq.read_table(tmp_path / "x.parquet")
    assert table.column("id").to_pylist() == ["a0", "a1", "b0", "b1"]
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(vectors, model.embed([row["text"] for row in rows] + texts), atol=1e-5)


# Changing an existing LanceDB table made by embedctl (made next to the happy-path outputs).

EXTRA = [{"id": "n1", "text": "A new document about tables.", "source": "new"},
         {"id": "n2", "text": "Another new document.", "source": "new"}]


@pytest.fixture
def existing(tmp_path: Path, happy_runs: Path) -> Path:
    """tmp_path with a copy of the happy path's LanceDB table as x.lance, and extra.jsonl."""
    shutil.copytree(happy_runs / "x.lance", tmp_path / "x.lance")
    write_jsonl(tmp_path / "extra.jsonl", EXTRA)
    return tmp_path


def lance_ids(work: Path) -> list[str]:
    return lancedb.connect(work).open_table("x").to_arrow().column("id").to_pylist()


def test_rebuild_replaces(existing: Path) -> None:
    result = embedctl_index("extra.jsonl", "--out", "x.lance", "--keep", "source", "--rebuild", "-q", cwd=existing)
    assert result.returncode == 0, result.stderr
    assert lance_ids(existing) == ["n1", "n2"]


def test_a_first_build_with_rebuild_prints_the_summary_alone(tmp_path: Path) -> None:
    """A cron line with --rebuild from its first run on: no log line of Lance's own (an overwrite of no table
    warns on stderr) above the summary."""
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    result = embedctl_index("docs.jsonl", "--out", "new.lance", "--rebuild", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr.splitlines()[0].startswith("2 rows: 2 added"), result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_another_source_into_the_same_output_adds_its_rows(existing: Path) -> None:
    old = lance_ids(existing)
    result = embedctl_index("extra.jsonl", "--out", "x.lance", "--keep", "source", "-q", cwd=existing)
    assert result.returncode == 0, result.stderr
    assert lance_ids(existing) == [*old, "n1", "n2"]


def test_several_sources_are_one_corpus_and_prune_keeps_the_rows_of_each(existing: Path) -> None:
    write_jsonl(existing / "more" / "extra.jsonl", [{"id": "n3", "text": "A third new document.", "source": "more"}])
    result = embedctl_index("extra.jsonl", "more", "--out", "x.lance", "--keep", "source", "--prune", "-q",
                            cwd=existing)
    assert result.returncode == 0, result.stderr
    assert lance_ids(existing) == ["n1", "n2", "n3"]


def test_a_read_only_table_is_one_line_and_unchanged(existing: Path) -> None:
    before = snapshot(existing)
    with read_only(existing / "x.lance"):
        result = embedctl_index("extra.jsonl", "--out", "x.lance", "--keep", "source", cwd=existing)
    assert_one_error_line(result, "cannot write x.lance", "Permission denied", "check free space and permissions")
    assert snapshot(existing) == before


def test_rows_numbered_for_want_of_the_id_column_are_named_in_the_summary_and_report(tmp_path: Path) -> None:
    """A misspelt --id-col numbers every row FILE:ROW, and the next run with the right one would add every row
    again: the summary says so, and the report counts the files."""
    write_jsonl(tmp_path / "docs" / "a.jsonl", good_rows("a"))
    write_jsonl(tmp_path / "docs" / "b.jsonl", [{"text": "no id here"}])
    misspelt = embedctl_index("docs", "--out", "x.lance", "--id-col", "doc_id", "--report", "r.json", cwd=tmp_path)
    assert misspelt.returncode == 0, misspelt.stderr
    assert "; the rows of 2 files numbered FILE:ROW for want of an id column -> x.lance" in misspelt.stderr
    assert json.loads((tmp_path / "r.json").read_text())["numbered_files"] == 2
    right = embedctl_index("docs", "--out", "y.lance", "--report", "r.json", cwd=tmp_path)
    assert "; the rows of 1 file numbered FILE:ROW" in right.stderr  # b.jsonl has no ids
    assert json.loads((tmp_path / "r.json").read_text())["numbered_files"] == 1


def test_a_cron_job_leaves_an_output_of_many_commits_optimized_unless_told_not_to(tmp_path: Path) -> None:
    """Twenty commits of one row each make twenty small fragments of a LanceDB table, or parts of a Parquet
    directory: the run that makes them ends by merging them and says so; --no-optimize leaves them, for users who
    keep an output's upkeep to themselves."""
    write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Text number {i}."} for i in range(20)])
    jobs = [(["docs.jsonl", "--out", out, "--commit-rows", "1", "--report", f"{out.strip('/')}.json", *flags], tmp_path)
            for out, flags in (("x.lance", []), ("y.lance", ["--no-optimize"]), ("parts/", []))]
    optimized, left, merged = run_side_by_side(jobs)
    assert optimized.returncode == left.returncode == merged.returncode == 0, optimized.stderr + left.stderr + merged.stderr
    assert "-> x.lance; table optimized: 20 fragments rewritten as 1" in optimized.stderr
    assert json.loads((tmp_path / "x.lance.json").read_text())["optimized"] == "20 fragments rewritten as 1"
    assert json.loads((tmp_path / "y.lance.json").read_text())["optimized"] is None
    fragments = [lancedb.connect(tmp_path).open_table(name).stats()["fragment_stats"]["num_fragments"] for name in "xy"]
    assert fragments == [1, 20]
    assert "-> parts/; table optimized: 20 parts merged into 1" in merged.stderr
    assert [path.name for path in (tmp_path / "parts").iterdir()] == ["part-00019.parquet"]
    assert pq.read_table(tmp_path / "parts").num_rows == 20


# Ctrl-C and SIGTERM


@pytest.mark.parametrize(("stop", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["Ctrl-C", "SIGTERM"])
def test_a_stopped_run_exits_with_its_code_says_so_in_the_report_and_leaves_nothing(
        tmp_path: Path, stop: signal.Signals, code: int, word: str) -> None:
    sentence = "Interrupting a long run must leave no half-written vector table behind it. "
    write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"{i} {sentence * 4}"} for i in range(3000)])
    (tmp_path / "r.json").write_text('{"rows_written": 3000}')  # the last run's report, which must not stand
    before = snapshot(tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "index", "docs.jsonl", "--out", "x.parquet",
                                "--report", "r.json"],
                               cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=hears_ctrl_c)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".x.parquet.*.tmp")):  # the writer is open: the run is under way
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    time.sleep(1.0)
    process.send_signal(stop)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr + stdout
    assert stderr.splitlines() == [f"{word}; x.parquet was not written"]  # it was not there before
    after = snapshot(tmp_path)
    written = json.loads(after.pop("r.json"))
    assert written == {"error": f"{word}; x.parquet was not written", "rows_read": written["rows_read"],
                       "rows_committed": 0}  # one Parquet file is written whole at the end
    assert 0 < written["rows_read"] <= 3000
    before.pop("r.json")
    assert after == before


def test_ctrl_c_while_the_command_line_loads_ends_with_130_and_no_traceback(tmp_path: Path) -> None:
    """The console script's guard, for the half second its libraries take to load: the interrupt is raised where
    Python raises a Ctrl-C, inside an import (here pipelines.index's, through an import hook)."""
    script = ("import sys\n"
              "class CtrlC:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'pipelines.index':\n"
              "            raise KeyboardInterrupt\n"
              "sys.meta_path.insert(0, CtrlC())\n"
              "sys.argv = ['embedctl', 'index', 'docs', '--out', 'x.lance']\n"
              "from embedctl.__main__ import main\n"
              "main()\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**ENV, "PYTHONPATH": str(Path.cwd())},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "")


@pytest.mark.parametrize("out", ["x.parquet/", "existing.parquet"], ids=["trailing slash", "existing folder"])
def test_ctrl_c_into_a_folder_of_parts_named_parquet_says_the_run_resumes(tmp_path: Path, out: str) -> None:
    """A folder is a directory of parts whatever its name: its committed parts stay, and the message says so."""
    folder = tmp_path / out.rstrip("/")
    folder.mkdir()
    write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"{i} A sentence to embed. " * 8}
                                          for i in range(3000)])
    process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "index", "docs.jsonl", "--out", out,
                                "--commit-rows", "50", "--report", "r.json"],
                               cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=hears_ctrl_c)
    deadline = time.monotonic() + 120
    while not list(folder.glob("part-*.parquet")):  # a group is committed
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    message = f"interrupted; the same command resumes from the last commit to {out}"
    assert (process.returncode, stderr.splitlines()) == (130, [message])
    written = json.loads((tmp_path / "r.json").read_text())
    parts = list(folder.glob("part-*.parquet"))
    # The report counts the rows the committed parts hold: those the next run will not embed again.
    assert written == {"error": message, "rows_read": written["rows_read"],
                       "rows_committed": sum(pq.read_metadata(part).num_rows for part in parts)}
    assert 0 < written["rows_committed"] <= written["rows_read"] <= 3000


def test_a_quoted_tilde_means_the_home_folder_for_every_path(tmp_path: Path) -> None:
    """`--out '~/v.lance'` (quoted, so the shell left the ~): the data, the lock and score's run file all go
    to $HOME, and no folder named ~ appears where the command ran."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    write_jsonl(home / "docs.jsonl", good_rows("a"))
    write_jsonl(home / "queries.jsonl", [{"id": "q", "text": "a question"}])
    env = {**ENV, "HOME": str(home)}
    for command in (["index", "~/docs.jsonl", "--out", "~/v.lance", "-q"],
                    ["score", "~/queries.jsonl", "--index", "~/v.lance", "--out", "~/run.jsonl", "--top-k", "2", "-q"]):
        done = subprocess.run([sys.executable, "-m", "embedctl.cli", *command], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert len(lancedb.connect(home).open_table("v").to_arrow()) == len(good_rows("a"))
    assert len((home / "run.jsonl").read_text().splitlines()) == 2
    assert list(elsewhere.iterdir()) == []



@pytest.mark.parametrize(("flags", "warmup"), [([], True), (["--no-warmup"], False)])
def test_serve_warms_up_its_graphs_unless_told_not_to(monkeypatch, flags: list[str], warmup: bool) -> None:
    # Which EngineConfig the command hands the server: the warm-up itself needs a GPU (tests/test_gpu.py).
    import embedctl.serve
    from embedctl.cli import app
    from typer.testing import CliRunner

    configs = []
    monkeypatch.setattr(embedctl.serve, "serve", lambda model, config, options: configs.append(config))
    result = CliRunner().invoke(app, ["serve", "--port", "0", *flags])
    assert result.exit_code == 0, result.output
    assert [config.warmup for config in configs] == [warmup]


def test_serve_takes_an_empty_prompt_from_the_environment_as_no_prompt(monkeypatch) -> None:
    # click takes an empty variable for an unset one, which would give the model's own prompt instead of none
    import embedctl.serve
    from typer.testing import CliRunner

    options = []
    monkeypatch.setattr(embedctl.serve, "serve", lambda model, config, given: options.append(given))
    environment = {"EMBEDCTL_DOC_PROMPT": "", "EMBEDCTL_QUERY_PROMPT": "", "EMBEDCTL_PORT": "0"}
    assert CliRunner().invoke(app, ["serve"], env=environment).exit_code == 0
    assert (options[0].doc_prompt, options[0].query_prompt, options[0].port) == ("", "", 0)
    assert CliRunner().invoke(app, ["serve"], env={"EMBEDCTL_QUERY_PROMPT": "query: "}).exit_code == 0
    assert (options[1].doc_prompt, options[1].query_prompt) == (None, "query: ")


def test_the_bars_token_rate_leaves_out_the_time_before_the_first_embedded_batch() -> None:
    """A run that loaded its model for 10 s, then embedded 1,000 tokens a second: the bar says 1,000, not 181."""
    rate = TokenRate()
    assert rate(1_000, now=10.0) is None  # the first batch: no span yet
    assert rate(2_000, now=11.0) == 1_000
    assert rate(4_000, now=13.0) == 1_000
