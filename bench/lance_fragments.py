"""How a LanceDB table's fragment sizes change its queries, and what compaction costs a cron job: the evidence
for `embedctl index`'s upkeep (pipelines.writers.COMPACT_TARGET_ROWS and COMPACT_SMALL_FRAGMENTS).

The same random 384-dimensional vectors (MiniLM's width) are written as tables whose commits were of
different sizes, each commit one fragment, and then, for the small commits a cron job makes, compacted as
the upkeep compacts them (into fragments of about COMPACT_TARGET_ROWS rows) and as LanceDB's optimize()
does (about 1M rows). Queries are what a search application sends with no ANN index: a flat top-10 by
vector and a lookup by id. The tables take turns in every round, so a drift of the machine hits them alike.
Then a cron job's year: a 100,000-row table built in 10,000-row commits gets --cron-days daily runs of 45
updates and 5 new rows (LanceDB merge_insert), compacted as the upkeep compacts (into COMPACT_TARGET_ROWS) after
every run or once COMPACT_SMALL_FRAGMENTS neighbouring fragments are small (mergeable_small, as the upkeep
counts them): the rows each policy rewrites.

    python -m bench.lance_fragments --out bench-out/lance_fragments
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa

from pipelines.writers import COMPACT_SMALL_FRAGMENTS, COMPACT_TARGET_ROWS, mergeable_small

DIM = 384
# (rows, rows per commit, compaction target or None): a build in default commits, in small commits, in one
# commit; a cron job's tiny commits as they are, compacted by the upkeep and by LanceDB's default.
TABLES = [(100_000, 100_000, None), (100_000, 10_000, None), (100_000, 1_000, None),
          (20_000, 100, None), (20_000, 100, COMPACT_TARGET_ROWS), (20_000, 100, 1 << 20)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="timed queries of each kind per table")
    parser.add_argument("--cron-days", type=int, default=200, help="daily runs of the cron job")
    parser.add_argument("--out", type=Path, default=Path("bench-out/lance_fragments"))
    return parser.parse_args()


def build(db: lancedb.DBConnection, vectors: np.ndarray, rows: int, per_commit: int, target: int | None):
    def rows_between(start: int, stop: int) -> pa.Table:
        flat = pa.array(vectors[start:stop].reshape(-1))
        return pa.table({"id": [str(i) for i in range(start, stop)],
                         "vector": pa.FixedSizeListArray.from_arrays(flat, DIM)})

    table = db.create_table(f"t{rows}_{per_commit}_{target}", data=rows_between(0, per_commit))
    for start in range(per_commit, rows, per_commit):
        table.add(rows_between(start, start + per_commit))
    if target is not None:
        table.to_lance().optimize.compact_files(target_rows_per_fragment=target)
        table.checkout_latest()
    return table


def cron_rewrites(db: lancedb.DBConnection, days: int, wait_for: int) -> int:
    """Rows compaction rewrote over `days` of the cron job, compacting once `wait_for` neighbouring fragments are small."""
    rng = np.random.default_rng(1)

    def rows(ids: list[int]) -> pa.Table:
        flat = pa.array(rng.standard_normal(len(ids) * DIM, dtype=np.float32))
        return pa.table({"id": [str(i) for i in ids], "vector": pa.FixedSizeListArray.from_arrays(flat, DIM)})

    table = db.create_table(f"cron{wait_for}", data=rows(list(range(10_000))))
    for start in range(10_000, 100_000, 10_000):
        table.add(rows(list(range(start, start + 10_000))))
    rewritten, next_id = 0, 100_000
    for _ in range(days):
        changed = sorted({*map(int, rng.integers(0, next_id, 45)), *range(next_id, next_id + 5)})
        next_id += 5
        table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(rows(changed))
        dataset = table.to_lance()
        sizes = {fragment.fragment_id: fragment.metadata.physical_rows for fragment in dataset.get_fragments()}
        if mergeable_small(list(sizes.values()), COMPACT_TARGET_ROWS) >= wait_for:
            dataset.optimize.compact_files(target_rows_per_fragment=COMPACT_TARGET_ROWS)
            kept = {fragment.fragment_id for fragment in dataset.get_fragments()}
            rewritten += sum(size for fragment_id, size in sizes.items() if fragment_id not in kept)
            table.checkout_latest()
    return rewritten


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((max(rows for rows, _, _ in TABLES), DIM), dtype=np.float32)
    query = rng.standard_normal(DIM).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="embedctl-lance-fragments-") as folder:
        db = lancedb.connect(folder)
        tables = [build(db, vectors, *shape) for shape in TABLES]
        searches = {
            "flat top-10": lambda table: table.search(query).limit(10).to_arrow(),
            "id lookup": lambda table: table.search().where("id = '4242'").to_arrow(),
        }
        for table in tables:  # first reads open the files
            for search in searches.values():
                search(table)
        seconds = [{name: [] for name in searches} for _ in tables]
        for _ in range(args.rounds):
            for table, timings in zip(tables, seconds):
                for name, search in searches.items():
                    start = time.perf_counter()
                    search(table)
                    timings[name].append(time.perf_counter() - start)
        fragments = [table.stats()["fragment_stats"]["num_fragments"] for table in tables]
        cron = {wait_for: cron_rewrites(db, args.cron_days, wait_for) for wait_for in (1, COMPACT_SMALL_FRAGMENTS)}
    results = [{"rows": rows, "rows_per_commit": per_commit, "compacted_to": target, "fragments": count,
                **{f"{name} p50 ms": round(1e3 * statistics.median(timings[name]), 2) for name in searches}}
               for (rows, per_commit, target), count, timings in zip(TABLES, fragments, seconds)]
    lines = ["| rows | rows per commit | compacted to | fragments | " + " | ".join(f"{n} p50 ms" for n in searches) + " |",
             "|---|---|---|---|" + "---|" * len(searches)]
    lines += [f"| {r['rows']:,} | {r['rows_per_commit']:,} | {r['compacted_to'] or '-'} | {r['fragments']:,} | "
              + " | ".join(str(r[f"{n} p50 ms"]) for n in searches) + " |" for r in results]
    changed = args.cron_days * 50
    lines += ["", f"A cron job of {args.cron_days} daily runs changing 50 rows each ({changed:,} rows) of a "
              "100,000-row table:", "", "| compaction | rows rewritten | times the rows changed |", "|---|---|---|"]
    lines += [f"| {'after every run' if wait_for == 1 else f'once {wait_for} neighbouring fragments are small'} | {rows:,} | "
              f"{rows / changed:.1f} |" for wait_for, rows in cron.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"lancedb": lancedb.__version__, "rounds": args.rounds,
                                                       "tables": results, "cron_days": args.cron_days,
                                                       "cron_rows_rewritten": cron}, indent=2))
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
