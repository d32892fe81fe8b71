"""embedctl index against sentence-transformers encode() on the CPU, whole runs from file in to file out.

What it measures (issue 2's speed clause: embedctl index at least 1.3x the peer's tokens/s on the CPU):
- input: the first --docs rows with a non-blank text and a unique id of --corpus, written to a
  temporary Parquet file that both sides read;
- peer: pyarrow reads the Parquet file -> SentenceTransformer.encode() (fp32, batch_size 32, its
  defaults; the model's own Normalize module L2-normalises) -> a LanceDB table (id, vector);
- ours: run_index(IndexModel.loaded(Engine.load(...)), IndexOptions(...)) with default settings,
  the same calls `embedctl index INPUT --out OUT.lance` makes, in this process;
- both load the same all-MiniLM-L6-v2 directory on the CPU with torch's default thread count. Model
  loading, plus one untimed warm-up run of each on a few documents (first-call allocations, lazy
  imports, our weights hash), is timed apart and not counted;
- tokens are counted once, the same for both: the sum of token counts after truncation at the
  model's max length (256), from our tokenizer (the same tokenizer.json the peer uses);
- rounds alternate peer, ours, peer, ours ... (--repeats of each) so drift on a shared machine hits
  both; the table gives the median wall seconds, the median process CPU seconds, and tokens/s from
  the median wall time; the ratio is ours/peer tokens/s;
- agreement: mean cosine between our vector and the peer's for every id (must be >= 0.9999);
- budget sweep: Engine.embed (what Embedder.embed calls after tokenizing) on the same pre-tokenized
  texts at several --max-batch-tokens values, model only, median of --sweep-repeats, interleaved.

Results: a section appended to bench/results/cpu_index.md and to bench/results/cpu_budget.txt.

    python bench/cpu_index.py [--docs 500] [--repeats 3] [--corpus PATH] [--no-sweep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.common import run_record
from engine import Engine, EngineConfig
from engine.checkpoint import resolve_model
from pipelines.index import IndexModel, IndexOptions, run_index

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_CORPUS = "/work/shared/corpus/docstrings.parquet"
PEER_BATCH_SIZE = 32
WARMUP_DOCS = 64
MIN_COSINE = 0.9999
SWEEP_BUDGETS = (512, 1024, 2048, 4096, 16384)


@dataclass
class Side:
    """One contender: how long it took to load, and each timed run's wall and CPU seconds."""

    name: str
    slug: str
    load_s: float = 0.0
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / statistics.median(self.wall)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="Parquet file with id and text columns")
    parser.add_argument("--docs", type=int, default=500,
                        help="documents to embed (at the rates seen on the shared 2-core VM, 1,000 took >8 min)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternated")
    parser.add_argument("--sweep-repeats", type=int, default=2, help="runs per budget in the sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the --max-batch-tokens sweep")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    return parser.parse_args()


def make_input(corpus: str, docs: int, path: Path) -> pa.Table:
    """The first `docs` rows with a usable text and a new id, written to `path` as (id, text)."""
    table = pq.read_table(corpus, columns=["id", "text"])
    seen: set[str] = set()
    keep = []
    for row, (row_id, text) in enumerate(zip(table["id"].to_pylist(), table["text"].to_pylist())):
        if text and text.strip() and row_id not in seen:
            seen.add(row_id)
            keep.append(row)
            if len(keep) == docs:
                break
    if len(keep) < docs:
        sys.exit(f"{corpus} has only {len(keep)} usable rows; pass --docs {len(keep)} or another --corpus")
    table = table.take(keep)
    pq.write_table(table, path)
    return table


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall and process-CPU seconds of run()."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


# --- the peer: sentence-transformers, file in to file out -------------------------------------------------

def load_peer(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


def run_peer(model, source: Path, out: Path) -> None:
    import lancedb

    table = pq.read_table(source, columns=["id", "text"])
    vectors = model.encode(table["text"].to_pylist(), batch_size=PEER_BATCH_SIZE, convert_to_numpy=True,
                           show_progress_bar=False)
    vector = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), vectors.shape[1])
    db, name = lancedb_location(out)
    lancedb.connect(db).create_table(name, data=pa.table({"id": table["id"], "vector": vector}), rebuild=True)


# --- ours: embedctl index, through the calls the CLI makes -------------------------------------------------

def load_ours() -> IndexModel:
    return IndexModel.loaded(Engine.load(None, EngineConfig()))


def run_ours(loaded: IndexModel, source: Path, out: Path) -> None:
    run_index(loaded, IndexOptions(source=str(source), out=str(out), rebuild=True))


# --- checks and the sweep ----------------------------------------------------------------------------------

def lancedb_location(out: Path) -> tuple[str, str]:
    return str(out.parent), out.name.removesuffix(".lance")


def read_vectors(out: Path) -> dict[str, np.ndarray]:
    import lancedb

    db, name = lancedb_location(out)
    table = lancedb.connect(db).open_table(name).to_arrow()
    vectors = table["vector"].combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return dict(zip(table["id"].to_pylist(), vectors))


def mean_cosine(ours: dict[str, np.ndarray], peer: dict[str, np.ndarray]) -> float:
    if ours.keys() != peer.keys():
        raise SystemExit(f"outputs hold different ids: {len(ours)} ours, {len(peer)} peer")
    a = np.stack([ours[i] for i in peer])
    b = np.stack(list(peer.values()))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.mean())


def sweep(ids: list[np.ndarray], budgets: tuple[int, ...], repeats: int) -> dict[int, list[float]]:
    """Seconds of Engine.embed(ids) per token budget; budgets interleaved in each round."""
    engines = {b: Engine.load(None, EngineConfig(max_batch_tokens=b)) for b in budgets}
    engines[budgets[0]].embed(ids[:WARMUP_DOCS])
    seconds: dict[int, list[float]] = {b: [] for b in budgets}
    for round_ in range(repeats):
        for budget in budgets if round_ % 2 == 0 else reversed(budgets):
            seconds[budget].append(timed(lambda: engines[budget].embed(ids))[0])
            print(f"  sweep {budget:>6} tokens: {seconds[budget][-1]:.1f} s", flush=True)
    return seconds


# --- the record --------------------------------------------------------------------------------------------

def environment() -> dict[str, str]:
    import sentence_transformers

    return {
        **run_record(),
        "torch": torch.__version__,
        "sentence-transformers": sentence_transformers.__version__,
        "threads": f"torch intra-op {torch.get_num_threads()}",
        "command": " ".join(["python", *sys.argv]),
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def figures_table(sides: list[Side], tokens: int, docs: int) -> str:
    rows = ["| side | load s | median wall s | median CPU s | tokens/s (median) | fastest s | wall s per run |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for side in sides:
        rows.append(f"| {side.name} | {side.load_s:.2f} | {statistics.median(side.wall):.2f} | "
                    f"{statistics.median(side.cpu):.2f} | {side.tokens_per_s(tokens):,.0f} | {min(side.wall):.2f} | "
                    f"{', '.join(f'{s:.1f}' for s in side.wall)} |")
    peer, ours = sides
    ratio = ours.tokens_per_s(tokens) / peer.tokens_per_s(tokens)
    paired = [p / o for p, o in zip(peer.wall, ours.wall)]
    rows += ["", f"{docs:,} documents, {tokens:,} tokens embedded. "
             f"Ratio ours/peer (tokens/s, medians): **{ratio:.2f}x**; per round (peer s / ours s): "
             f"{', '.join(f'{r:.2f}' for r in paired)}, median {statistics.median(paired):.2f}x; "
             f"fastest runs: {min(peer.wall) / min(ours.wall):.2f}x"]
    return "\n".join(rows)


def sweep_table(seconds: dict[int, list[float]], tokens: int) -> str:
    best = min(statistics.median(s) for s in seconds.values())
    lines = ["max_batch_tokens  median s  tokens/s  vs best  fastest s  runs (s)"]
    for budget, runs in seconds.items():
        median = statistics.median(runs)
        lines.append(f"{budget:>16}  {median:>8.2f}  {tokens / median:>8,.0f}  {median / best:>6.2f}x  "
                     f"{min(runs):>9.2f}  {', '.join(f'{s:.1f}' for s in runs)}")
    return "\n".join(lines)


def append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(text)


def record(env: dict[str, str], table: str, cosine: float, loads: tuple[str, str], sweep_text: str | None) -> None:
    header = "\n".join(f"- {key}: {value}" for key, value in env.items())
    append(RESULTS / "cpu_index.md",
           f"\n## {env['date']}\n\n{header}\n- load average (1, 5, 15 min) before / after: {loads[0]} / {loads[1]}\n"
           "- the machine was shared: other engineers ran tests on the same 2 cores during this run, hence "
           "the alternated rounds and medians\n\n"
           f"{table}\n\nMean cosine, ours vs peer, same ids: {cosine:.6f} (required >= {MIN_COSINE})\n")
    if sweep_text is not None:
        append(RESULTS / "cpu_budget.txt",
               f"\n# {env['date']}  commit {env['commit']}\n# {env['cpu']}, torch {env['torch']}, "
               f"{env['threads']}; Engine.embed on pre-tokenized texts, model only; shared machine\n"
               f"# {env['command']}\n{sweep_text}\n")


# --- the run -----------------------------------------------------------------------------------------------

def load_with_warmup(load: Callable[[], object], run: Callable, out: Path) -> tuple[object, float]:
    """Load a side and run it once on the warm-up file; returns the model and the seconds both took."""
    started = time.perf_counter()
    model = load()
    run(model, out.parent / "warmup.parquet", out)
    return model, time.perf_counter() - started


def alternate(contenders: list[tuple[Side, Callable, object]], source: Path, work: Path, repeats: int) -> None:
    """Time each contender on `source` once per round, in the same order every round (ABAB...)."""
    for round_ in range(repeats):
        for side, run, model in contenders:
            wall, cpu = timed(lambda: run(model, source, work / f"{side.slug}.lance"))
            side.wall.append(wall)
            side.cpu.append(cpu)
            print(f"  round {round_ + 1} {side.name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)


def main() -> None:
    args = parse_args()
    env = environment()
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="embedctl-cpu-bench-") as tmp:
        work = Path(tmp)
        source = work / "input.parquet"
        texts = make_input(args.corpus, args.docs, source)["text"].to_pylist()
        pq.write_table(pq.read_table(source).slice(0, WARMUP_DOCS), work / "warmup.parquet")

        peer, ours = Side("sentence-transformers encode()", "peer"), Side("embedctl index", "ours")
        peer_model, peer.load_s = load_with_warmup(lambda: load_peer(resolve_model(None).path), run_peer,
                                                   work / "peer-warmup.lance")
        our_model, ours.load_s = load_with_warmup(load_ours, run_ours, work / "ours-warmup.lance")
        ids = our_model[1].encode(texts).ids
        tokens = sum(len(i) for i in ids)
        print(f"{len(texts):,} documents, {tokens:,} tokens; torch threads {torch.get_num_threads()}", flush=True)

        alternate([(peer, run_peer, peer_model), (ours, run_ours, our_model)], source, work, args.repeats)
        cosine = mean_cosine(read_vectors(work / "ours.lance"), read_vectors(work / "peer.lance"))
    print(f"mean cosine ours vs peer: {cosine:.6f}", flush=True)
    sweep_text = None
    if not args.no_sweep:
        sweep_text = sweep_table(sweep(ids, SWEEP_BUDGETS, args.sweep_repeats), tokens)
        print(sweep_text, flush=True)
    table = figures_table([peer, ours], tokens, len(texts))
    if not args.no_record:
        record(env, table, cosine, (load_before, load_average()), sweep_text)
    print(table)
    if cosine < MIN_COSINE:
        raise SystemExit(f"outputs disagree: mean cosine {cosine:.6f} < {MIN_COSINE}")

if __name__ == "__main__":
    main()
