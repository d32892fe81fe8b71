"""Re-indexing as cron runs it: real `embedctl index` subprocesses, killed with SIGKILL, re-run, raced.

The oracle is a clean, uninterrupted run of the same command: after kills at several points and a
resume, or after rows change, the output must hold the same rows (each id exactly once) with the same
vectors, and the report must show that committed or unchanged rows were not embedded again. A small
random BERT with a small token budget and small commit groups makes many engine steps and commits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.files import ENV, assert_one_error_line, snapshot, write_jsonl
from tests.models import save_random_model

WORDS = "table vector index corpus model token batch commit resume kill lock cron query document engine".split()
FAST = ["--max-batch-tokens", "128", "--commit-rows", "100"]


def documents(n: int, seed: int = 0, prefix: str = "d") -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{i}", "text": f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}
            for i in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a small random model (bert/) and a corpus that takes seconds to embed (big.jsonl)."""
    root = tmp_path_factory.mktemp("incremental")
    save_random_model(root / "bert", pooling="mean")
    write_jsonl(root / "big.jsonl", documents(3000))
    return root


def index_args(source: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "embedctl.cli", "index", source, "--out", out, "--model", "bert", *FAST, *extra]


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(index_args(*args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def side_by_side(cwd: Path, *jobs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: run(cwd, *job), jobs))
    for result in results:
        assert result.returncode == 0, result.stderr
    return results


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(index_args(*args), cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool]) -> None:
    """SIGKILL process as soon as ready() holds; it must still be running then."""
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.communicate()


def read(cwd: Path, out: str) -> pa.Table:
    if out.endswith(".lance"):
        return lancedb.connect(cwd).open_table(out.removesuffix(".lance")).to_arrow()
    return pq.read_table(cwd / out)


def report(cwd: Path, name: str = "r.json") -> dict:
    return json.loads((cwd / name).read_text())


def assert_same_rows(table: pa.Table, reference: pa.Table) -> None:
    """Each id once, and every row equal to the reference's (vectors to 1e-6)."""
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids))
    table, reference = table.sort_by("id"), reference.sort_by("id")
    assert table.column("id").to_pylist() == reference.column("id").to_pylist()
    for name in ("n_tokens", "truncated", "content_key"):
        assert table.column(name).to_pylist() == reference.column(name).to_pylist(), name
    vectors, expected = (np.stack(t.column("vector").to_numpy(zero_copy_only=False)) for t in (table, reference))
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def clean(work: Path) -> pa.Table:
    """big.jsonl indexed in one uninterrupted run (into one Parquet file)."""
    side_by_side(work, ("big.jsonl", "clean.parquet"))
    return read(work, "clean.parquet")


def count(directory: Path, prefix: str, suffix: str) -> int:
    try:
        return sum(name.startswith(prefix) and name.endswith(suffix) for name in os.listdir(directory))
    except FileNotFoundError:
        return 0


def kill_point(point: str, target: Path) -> Callable[[], bool]:
    """When to kill a run on target: early (the lock is taken, the model loads, nothing is committed),
    mid-batch (three more groups committed) or during a Lance commit (a group's data file appears
    before the manifest that makes it visible)."""
    lance = target.suffix == ".lance"
    if point == "early":
        return (target.parent / f".{target.name}.lock").exists
    if point == "mid-batch":
        where, groups = (target / "_versions", ("", ".manifest")) if lance else (target, ("part-", ".parquet"))
        committed = count(where, *groups)
        return lambda: count(where, *groups) >= committed + 3
    before = count(target / "data", "", ".lance")
    return lambda: count(target / "data", "", ".lance") > before


def plant_a_half_written_part(target: Path) -> None:
    """What a kill while a Parquet part is written leaves behind (the write lasts well under a
    millisecond, too short to hit from outside): the part's first half under its temporary name."""
    part = sorted(target.glob("part-*.parquet"))[-1].read_bytes()
    (target / ".tmp-part-09999.parquet").write_bytes(part[: len(part) // 2])


@pytest.mark.parametrize("out", ["x.lance", "dir/"])
def test_killed_at_any_point_then_resumed_equals_a_clean_run(work: Path, clean: pa.Table, out: str) -> None:
    target = work / out.rstrip("/")
    for point in ("early", "mid-batch") + (("during a commit",) if out == "x.lance" else ()):
        kill_when(start(work, "big.jsonl", out), kill_point(point, target))
    if out == "dir/":
        plant_a_half_written_part(target)
    committed = read(work, out).num_rows
    assert 0 < committed < clean.num_rows  # the kills left a partial output, the intended exception

    result = run(work, "big.jsonl", out, "--report", "r.json")
    assert result.returncode == 0, result.stderr
    assert_same_rows(read(work, out), clean)
    done = report(work)
    assert done["unchanged"] == committed  # committed groups were not embedded again
    assert done["added"] == done["rows_written"] == clean.num_rows - committed
    assert not list(work.glob(f".{target.name}.lock")) and not list(target.glob(".tmp-*"))


def changed_corpus(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """rows with 5 texts changed, 7 rows deleted and 4 added; the counts a re-run must report."""
    changed = [dict(row) for row in rows]
    for row in changed[10:15]:
        row["text"] += " (edited)"
    del changed[50:57]
    changed += documents(4, seed=1, prefix="new")
    return changed, {"added": 4, "updated": 5, "unchanged": len(rows) - 12, "deleted": 7}


OUTPUTS = ["y.lance", "y.parquet", "ydir/"]


def test_changed_rows_alone_are_embedded_and_the_output_equals_a_fresh_build(work: Path) -> None:
    rows = documents(300, seed=2)
    write_jsonl(work / "v1.jsonl", rows)
    side_by_side(work, *[("v1.jsonl", out) for out in OUTPUTS])
    changed, counts = changed_corpus(rows)
    write_jsonl(work / "v2.jsonl", changed)

    kept = run(work, "v2.jsonl", "y.lance", "--report", "kept.json")  # without --prune, deleted ids stay
    assert kept.returncode == 0, kept.stderr
    assert report(work, "kept.json")["deleted"] == 0 and read(work, "y.lance").num_rows == len(changed) + 7
    assert kept.stderr.startswith(f"{len(changed)} rows: 4 added, 5 updated, {counts['unchanged']} unchanged, 0 deleted")
    side_by_side(work, *[("v2.jsonl", out, "--prune", "--report", f"r{n}.json") for n, out in enumerate(OUTPUTS)],
                 ("v2.jsonl", "fresh.parquet"))

    fresh = read(work, "fresh.parquet")
    for n, out in enumerate(OUTPUTS):
        done = report(work, f"r{n}.json")
        expected = {"added": 0, "updated": 0, "unchanged": len(changed), "deleted": 7} if out == "y.lance" else counts
        assert {key: done[key] for key in expected} == expected, out
        table = read(work, out)
        embedded = set(row["id"] for row in changed[10:15] + changed[-4:])
        if out != "y.lance":  # the run's tokens are those of the re-embedded rows alone
            assert done["tokens"] == sum(n for i, n in zip(table.column("id").to_pylist(),
                                                           table.column("n_tokens").to_pylist()) if i in embedded)
        assert_same_rows(table, fresh)


def test_a_text_emptied_in_the_source_deletes_its_old_vector_without_prune(work: Path) -> None:
    rows = documents(40, seed=7, prefix="e")
    write_jsonl(work / "e1.jsonl", rows)
    outputs = ["e.lance", "e.parquet", "edir/"]
    side_by_side(work, *[("e1.jsonl", out) for out in outputs])
    emptied = [dict(row) for row in rows]
    for row, text in zip(emptied[3:6], ["", "  \n", None]):
        row["text"] = text
    write_jsonl(work / "e2.jsonl", emptied)

    side_by_side(work, *[("e2.jsonl", out, "--report", f"e{n}.json") for n, out in enumerate(outputs)],
                 ("e2.jsonl", "efresh.parquet"))
    fresh = read(work, "efresh.parquet")
    assert fresh.num_rows == len(rows) - 3
    for n, out in enumerate(outputs):
        done = report(work, f"e{n}.json")
        assert (done["deleted"], done["skipped_empty"], done["unchanged"]) == (3, 3, len(rows) - 3), out
        assert_same_rows(read(work, out), fresh)


def test_a_rerun_keeps_the_kept_columns_types_and_order_of_its_output(work: Path) -> None:
    """A JSONL key's type is guessed from the run's first chunk, but an output being updated already has one: a new
    file whose first rows are all null there kept the column an int on no output and failed the next run, which
    typed it as text; and the same --keep names in another order asked for a --rebuild."""
    (work / "k").mkdir()
    write_jsonl(work / "k" / "b.jsonl", [{**row, "year": 2000 + i, "lang": "en"} for i, row in
                                         enumerate(documents(30, seed=9, prefix="k"))])
    outputs = ["k.lance", "k.parquet", "kdir/"]
    side_by_side(work, *[("k", out, "--keep", "year", "--keep", "lang") for out in outputs])
    write_jsonl(work / "k" / "a.jsonl", [{"id": "k-null", "text": "a year not known", "year": None, "lang": None}])
    side_by_side(work, *[("k", out, "--keep", "lang", "--keep", "year", "--report", f"k{n}.json")
                         for n, out in enumerate(outputs)])
    for n, out in enumerate(outputs):
        table = read(work, out)
        assert (table.schema.field("year").type, table.schema.names[-2:]) == (pa.int64(), ["year", "lang"]), out
        assert (report(work, f"k{n}.json")["added"], table.num_rows) == (1, 31), out
    write_jsonl(work / "k" / "c.jsonl", [{"id": "k-half", "text": "half a year", "year": 2000.5, "lang": "en"}])
    assert_one_error_line(run(work, "k", "k.lance", "--keep", "year", "--keep", "lang"),
                          "k/c.jsonl line 1: --keep key 'year' does not fit the type int64 that the existing output "
                          "k.lance gave it")


def test_a_parquet_export_in_wider_or_narrower_types_updates_the_output(work: Path) -> None:
    """A nightly export moved from pandas to Polars writes large_string for string (and a narrower int for
    int64): the values fit the output's columns, so the run casts them and embeds nothing; a value that does
    not fit the stored type is named."""
    (work / "w").mkdir()
    rows = documents(20, seed=4, prefix="w")
    year = pa.array([2000 + i for i in range(20)], pa.int64())

    def export(text_type: pa.DataType, year: pa.Array) -> None:
        pq.write_table(pa.table({"id": [r["id"] for r in rows], "text": pa.array([r["text"] for r in rows], text_type),
                                 "tag": pa.array(["a"] * 19 + ["b"], text_type), "year": year}), work / "w" / "p.parquet")

    outputs = ["w.lance", "w.parquet", "wdir/"]
    export(pa.string(), year)
    side_by_side(work, *[("w", out, "--keep", "tag", "--keep", "year") for out in outputs])
    export(pa.large_string(), year.cast(pa.int32()))
    side_by_side(work, *[("w", out, "--keep", "tag", "--keep", "year", "--report", f"w{n}.json")
                         for n, out in enumerate(outputs)])
    for n, out in enumerate(outputs):
        table = read(work, out)
        assert (table.schema.field("tag").type, table.schema.field("year").type) == (pa.string(), pa.int64()), out
        assert (report(work, f"w{n}.json")["unchanged"], table.num_rows) == (20, 20), out
    side_by_side(work, ("w", "w32.parquet", "--keep", "tag", "--keep", "year"))  # an output of int32 years
    export(pa.string(), pa.array([2000 + i for i in range(19)] + [1 << 40], pa.int64()))
    before = (work / "w32.parquet").read_bytes()
    assert_one_error_line(run(work, "w", "w32.parquet", "--keep", "tag", "--keep", "year"),
                          "w/p.parquet row", "--keep column 'year' does not fit the type int32 it has in the existing "
                          "output w32.parquet")
    assert (work / "w32.parquet").read_bytes() == before


def test_other_settings_are_refused_and_rebuild_replaces(work: Path) -> None:
    write_jsonl(work / "s.jsonl", documents(200, seed=3))
    side_by_side(work, ("s.jsonl", "s.lance"))
    before = snapshot(work / "s.lance")

    refused = run(work, "s.jsonl", "s.lance", "--max-length", "32")
    assert_one_error_line(refused, "cannot update s.lance", "max length 128 and this run's max length is 32", "--rebuild")
    assert snapshot(work / "s.lance") == before

    rebuilt = run(work, "s.jsonl", "s.lance", "--max-length", "32", "--rebuild", "--report", "rebuilt.json")
    assert rebuilt.returncode == 0, rebuilt.stderr
    table = read(work, "s.lance")
    assert table.schema.metadata[b"embedctl.max_length"] == b"32"
    done = report(work, "rebuilt.json")
    assert (done["added"], done["updated"], done["deleted"]) == (0, table.num_rows, 0) and table.num_rows == 200
    assert max(table.column("n_tokens").to_pylist()) == 32
    assert not (work / ".s.rebuild.lance").exists()  # the replacement was staged there and copied over


def test_a_second_run_is_refused_and_a_killed_runs_lock_is_recovered(work: Path) -> None:
    first = start(work, "big.jsonl", "z.lance")
    lock = work / ".z.lance.lock"
    deadline = time.monotonic() + 120
    while not lock.exists() or not lock.read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)

    second = run(work, "big.jsonl", "z.lance", "--report", "second.json")
    assert second.returncode == 75, second.stderr
    assert second.stderr.splitlines() == [
        f"error: z.lance is being written by another embedctl run (pid {first.pid} on {socket.gethostname()}, "
        f"started {json.loads(lock.read_text())['started']}); wait for it to finish, or write to another output"]
    assert not (work / "second.json").exists()  # the running job owns the report

    kill_when(first, lambda: True)
    assert lock.exists()  # left by the killed run: stale, since the kernel dropped its flock
    third = run(work, "big.jsonl", "z.lance")
    assert third.returncode == 0, third.stderr
    assert read(work, "z.lance").num_rows == 3000 and not lock.exists()


def test_an_up_to_date_output_is_checked_without_loading_the_model(work: Path) -> None:
    """A cron re-run over an unchanged corpus loads no weights and starts no GPU: torch is never imported."""
    write_jsonl(work / "u.jsonl", documents(100, seed=4))
    side_by_side(work, ("u.jsonl", "u.lance"))
    probe = ("import sys\nfrom embedctl.cli import app\ntry:\n    app(sys.argv[1:])\n"
             "except SystemExit as end:\n    print('torch' in sys.modules, end.code)")
    result = subprocess.run([sys.executable, "-c", probe, *index_args("u.jsonl", "u.lance", "--report", "u.json")[3:]],
                            cwd=work, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["False", "0"], result.stderr
    assert "; nothing to embed (" in result.stderr and "tokens/s" not in result.stderr
    done = report(work, "u.json")
    assert (done["unchanged"], done["rows_written"], done["device"], done["graphs"]) == (100, 0, None, {})

    # A bad option is refused with nothing to embed too, not only once a row changes.
    too_small = run(work, "u.jsonl", "u.lance", "--max-batch-tokens", "10")
    assert_one_error_line(too_small, "--max-batch-tokens 10 is smaller than the max length 128")
    gpu_only = run(work, "u.jsonl", "u.lance", "--device", "cpu", "--attention", "varlen")
    assert_one_error_line(gpu_only, "attention backend 'varlen' needs a CUDA GPU")
    misspelt = run(work, "u.jsonl", "u.lance", "--device", "gpu")
    assert_one_error_line(misspelt, "--device gpu is not a device embedctl runs on; use cpu, cuda or cuda:N")

    write_jsonl(work / "u.jsonl", documents(101, seed=4))  # one row more: now the model loads
    assert run(work, "u.jsonl", "u.lance", "--report", "u.json").returncode == 0
    assert report(work, "u.json")["device"] == "cpu"
