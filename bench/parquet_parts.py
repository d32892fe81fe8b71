"""What a Parquet directory's small parts cost the next `embedctl index` run and its readers: the evidence for
merging them (pipelines.writers._ParquetDirStore._tidy, by COMPACT_TARGET_ROWS and COMPACT_SMALL_FRAGMENTS).

A cron job's output: 20,000 rows built in 10,000-row commits, then a year of daily runs adding 50 rows each (one
part a day), as they stand and as the upkeep merges them. Rows are what `embedctl index` writes for MiniLM
(384-dimensional vectors, a kept text of about 300 characters). Measured on each layout, the layouts taking turns
in every round: an unchanged run's work on the output (open_store reads every part's ids and keys, finish reads
them again, the upkeep reads their footers), a run's work on it when 50 rows changed (their parts rewritten without
them, a part of the new rows written, the upkeep), the changed rows among the last 1,000 or anywhere, each on a
fresh copy of the layout; a reader's whole scan (pyarrow), and a lookup by id (pyarrow's dataset filter).

    python -m bench.parquet_parts --out bench-out/parquet_parts
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.writers import COMPACT_TARGET_ROWS, open_store, output_schema

DIM = 384
BUILT, DAILY, DAYS = 20_000, 50, 365
ROWS = BUILT + DAILY * DAYS
CHANGED = 50
METADATA = {"embedctl.model": "bench", "embedctl.weights_sha256": "0" * 64, "embedctl.dim": str(DIM)}
SCHEMA = output_schema(DIM, pa.schema([("text", pa.string())]), METADATA)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each measure per layout")
    parser.add_argument("--out", type=Path, default=Path("bench-out/parquet_parts"))
    return parser.parse_args()


def rows(ids: range | list[int], rng: np.random.Generator, version: str = "") -> pa.RecordBatch:
    flat = pa.array(rng.standard_normal(len(ids) * DIM, dtype=np.float32))
    return pa.record_batch([
        pa.array([f"doc-{i}" for i in ids]), pa.FixedSizeListArray.from_arrays(flat, DIM),
        pa.array([64] * len(ids), pa.int32()), pa.array([False] * len(ids)), pa.array([f"key-{i}{version}" for i in ids]),
        pa.array([f"Document {i}: " + "lorem ipsum dolor sit amet " * 11 for i in ids]),
    ], schema=SCHEMA.remove_metadata())


def build(folder: str, merge: bool) -> dict[str, str]:
    """The cron job's directory, merged by the upkeep at the end of every run or never; returns its source."""
    rng = np.random.default_rng(0)
    source: dict[str, str] = {}
    for start, stop, commit_rows in [(0, BUILT, 10_000)] + [(BUILT + day * DAILY, BUILT + (day + 1) * DAILY, DAILY)
                                                             for day in range(DAYS)]:
        store = open_store(folder, SCHEMA, commit_rows=commit_rows, optimize=merge)
        store.write(rows(range(start, stop), rng))
        source |= {f"doc-{i}": f"key-{i}" for i in range(start, stop)}
        store.finish(source, prune=False)
    return source


def changed_run(folder: str, merge: bool, source: dict[str, str], ids: list[int]) -> None:
    """A run's work on the output when the rows of ids changed: written as new rows, their old copies removed."""
    store = open_store(folder, SCHEMA, optimize=merge)
    store.write(rows(ids, np.random.default_rng(1), version="-v2"))
    store.finish(source | {f"doc-{i}": f"key-{i}-v2" for i in ids}, prune=False)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="embedctl-parquet-parts-") as temp:
        layouts = {"as committed": f"{temp}/daily/", "merged by the upkeep": f"{temp}/merged/"}
        merges = {name: name != "as committed" for name in layouts}
        sources = {name: build(folder, merges[name]) for name, folder in layouts.items()}
        parts = {name: len(list(Path(folder).glob("*.parquet"))) for name, folder in layouts.items()}
        picks = np.random.default_rng(2)
        recent = sorted(map(int, picks.choice(np.arange(ROWS - 1_000, ROWS), CHANGED, replace=False)))
        anywhere = sorted(map(int, picks.choice(ROWS, CHANGED, replace=False)))
        scratch = f"{temp}/scratch/"
        # (whether it changes the layout, so runs on a fresh copy; what it does with the folder and the layout's name)
        measures = {
            "unchanged run": (False, lambda folder, name: open_store(folder, SCHEMA, optimize=merges[name]).finish(
                sources[name], prune=False)),
            f"run, {CHANGED} recent rows changed": (
                True, lambda folder, name: changed_run(folder, merges[name], sources[name], recent)),
            f"run, {CHANGED} rows anywhere changed": (
                True, lambda folder, name: changed_run(folder, merges[name], sources[name], anywhere)),
            "whole scan": (False, lambda folder, name: pq.read_table(folder)),
            "id lookup": (False, lambda folder, name: pq.read_table(folder, filters=[("id", "=", "doc-4242")])),
        }
        seconds = {name: {measure: [] for measure in measures} for name in layouts}
        for _ in range(args.rounds):
            for name in layouts:
                for measure, (changes, run) in measures.items():
                    folder = layouts[name]
                    if changes:
                        shutil.rmtree(scratch, ignore_errors=True)
                        shutil.copytree(folder, scratch)
                        folder = scratch
                    start = time.perf_counter()
                    run(folder, name)
                    seconds[name][measure].append(time.perf_counter() - start)
    results = [{"layout": name, "parts": parts[name],
                **{f"{measure} p50 ms": round(1e3 * statistics.median(timings), 1)
                   for measure, timings in seconds[name].items()}} for name in layouts]
    lines = [f"{BUILT:,} rows built in 10,000-row commits, then {DAYS} daily runs adding {DAILY} rows "
             f"({ROWS:,} rows); merge target {COMPACT_TARGET_ROWS:,} rows.", "",
             "| layout | parts | " + " | ".join(f"{measure} p50 ms" for measure in measures) + " |",
             "|---|---|" + "---|" * len(measures)]
    lines += [f"| {r['layout']} | {r['parts']:,} | " + " | ".join(str(r[f'{m} p50 ms']) for m in measures) + " |"
              for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"pyarrow": pa.__version__, "rounds": args.rounds,
                                                       "layouts": results}, indent=2))
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
