"""Model-only throughput of the engine from several source trees, side by side in one run: the A/B of a change
that may move tokens/s (bench.step_latency is its batch-1 counterpart).

An arm is NAME=DIR, DIR holding an `engine/` package: `.` for the working tree, or a commit's engine exported
with `mkdir -p .ab/C && git archive C engine | tar -x -C .ab/C`. Options after the directory, each behind an @:
@freeze calls gc.freeze() after the load, as `embedctl serve` does, to tell Python's collector apart from the
engine; @lanes=N runs the arm on N lanes instead of --lanes (do lanes still overlap?). Each arm runs in a
process of its own, and the arms take turns for --rounds rounds, so a drift of the machine hits them alike.
Every arm embeds the same corpus documents (tokenized once here, cut at 512 tokens) through Engine.embed and
reports:
- tokens/s, the best of --passes passes after a first one that captures the graphs;
- Python's garbage collections during those passes, by generation, with their seconds;
- the host's seconds inside Engine.step per pass, and the batches each lane ran;
- from one more pass under torch.profiler: the GPU's busy share of the pass's wall time, and its
  concurrency, kernel time summed over busy time (above 1 where batches on several lanes overlap);
- how its vectors agree with the first arm's, row by row: the least cosine and the rows under 0.999 (before
  313c2cd every lane's graphs shared one cuBLAS workspace, and overlapping batches corrupted each other's GEMMs).
It was written when run169 (bench/results) found BERT-base's model-only throughput 7-13% under b25fad4's on
one H100 with the same kernel time per step; run171 found b25fad4's vectors mostly wrong for that reason.

    python3 -m bench.throughput_ab --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet \
        --arms new=.,old=.ab/b25fad4,new-frozen=.@freeze,new-one-lane=.@lanes=1 --out bench-out/throughput_ab
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench.common import arm_order, checkpoints, main_or_worker, parse_arms, run_arm_worker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", required=True, help="comma-separated NAME=DIR[@freeze][@lanes=N]")
    parser.add_argument("--minilm", type=Path, required=True, help="all-MiniLM-L6-v2 directory (its tokenizer too)")
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--model", choices=("minilm", "bert-base"), default="bert-base")
    parser.add_argument("--attention", default="varlen", help="the engine's attention backend")
    parser.add_argument("--lanes", type=int, default=3, help="lanes of the arms that name none")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3, help="timed passes per arm and round")
    parser.add_argument("--out", type=Path, default=Path("bench-out/throughput_ab"))
    args = parser.parse_args()
    args.arms = parse_arms(args.arms)
    return args


def main() -> None:
    args = parse_args()
    arms = {arm: arm_setup(arm, spec, args.lanes) for arm, spec in args.arms.items()}  # a typo fails before any arm runs
    with tempfile.TemporaryDirectory(prefix="embedctl-throughput-ab-") as folder:
        model = checkpoints([args.model], args.minilm, Path(folder))[args.model]
        ids_file = Path(folder) / "ids.npz"
        print("tokens", save_ids(args, model, ids_file), flush=True)
        rounds = []
        for round_index in range(args.rounds):
            for arm in arm_order(list(arms), round_index):
                vectors = Path(folder) / f"vectors-{arm}-{round_index}.npy"
                result = {"arm": arm, "round": round_index, **run_arm(arm, arms[arm], model, ids_file, vectors, args)}
                first = Path(folder) / f"vectors-{next(iter(arms))}-0.npy"
                if first.exists() and vectors != first:
                    result["against_first_arm"] = agreement(np.load(first), np.load(vectors))
                rounds.append(result)
                print(f"{arm}: {json.dumps(result)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"arms": args.arms, "rounds": rounds}, indent=2))
    report = render(list(arms), rounds)
    (args.out / "report.md").write_text(report)
    print(report)


def save_ids(args: argparse.Namespace, model: Path, ids_file: Path) -> int:
    """The corpus's first --docs documents (repeated if it has fewer) as token ids in ids_file; their token count."""
    from pipelines.tokenize import TextTokenizer

    corpus = pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist()
    texts = list(itertools.islice(itertools.cycle(corpus), args.docs))
    ids = TextTokenizer(model / "tokenizer.json", 512).encode(texts).ids
    np.savez(ids_file, flat=np.concatenate(ids).astype(np.int32), lengths=np.array([len(s) for s in ids]))
    return int(sum(map(len, ids)))


def arm_setup(arm: str, spec: str, lanes: int) -> dict:
    """An arm's tree and options from DIR[@freeze][@lanes=N]; lanes: --lanes, unless the arm names its own."""
    tree, *options = spec.split("@")
    setup = {"tree": str(Path(tree).resolve()), "freeze": False, "lanes": lanes}
    for option in options:
        if option == "freeze":
            setup["freeze"] = True
        elif option.startswith("lanes=") and option[6:].isdigit() and int(option[6:]) > 0:
            setup["lanes"] = int(option[6:])
        else:
            raise SystemExit(f"arm {arm}: unknown option @{option}; use @freeze or @lanes=N")
    return setup


def run_arm(arm: str, setup: dict, model: Path, ids_file: Path, vectors: Path, args: argparse.Namespace) -> dict:
    """One arm's figures, from a child process that imports the engine under the arm's tree."""
    job = {**setup, "model": str(model), "ids": str(ids_file), "vectors": str(vectors), "attention": args.attention,
           "passes": args.passes}
    return run_arm_worker("bench.throughput_ab", arm, job)


def worker(job: dict) -> None:
    """One arm: load the model with the arm's engine, embed the ids pass after pass; one JSON line on stdout."""
    sys.path.insert(0, job["tree"])
    import gc
    import time

    import torch

    import engine
    from engine import Engine, EngineConfig

    assert Path(engine.__file__).resolve().is_relative_to(job["tree"]), engine.__file__
    saved = np.load(job["ids"])
    ids = np.split(saved["flat"], np.cumsum(saved["lengths"])[:-1])
    tokens = int(saved["lengths"].sum())
    model = Engine.load(job["model"], EngineConfig(attention=job["attention"], max_length=512, lanes=job["lanes"]))
    drain = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    step_seconds = [0.0]
    step = model.step

    def timed_step(batch):  # noqa: ANN001, ANN202 - the arm's PackedBatch and LazyTensor
        started = time.perf_counter()
        try:
            return step(batch)
        finally:
            step_seconds[0] += time.perf_counter() - started

    model.step = timed_step  # embed() calls self.step, which now finds this
    vectors: list[np.ndarray] = []

    def one_pass() -> float:
        drain()
        started = time.perf_counter()
        vectors[:] = [model.embed(ids)]
        drain()
        return time.perf_counter() - started

    first = one_pass()
    if job["freeze"]:
        gc.collect()
        gc.freeze()
    collections = {str(generation): {"count": 0, "seconds": 0.0} for generation in range(3)}  # as JSON keys them
    collection_started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collection_started[0] = time.perf_counter()
        else:
            collections[str(info["generation"])]["count"] += 1
            collections[str(info["generation"])]["seconds"] += time.perf_counter() - collection_started[0]

    gc.callbacks.append(on_collection)
    step_seconds[0] = 0.0
    passes = [tokens / one_pass() for _ in range(job["passes"])]
    gc.callbacks.remove(on_collection)
    np.save(job["vectors"], vectors[0].astype(np.float32))  # the last timed pass's
    runner = getattr(model, "runner", None)
    out = {"engine": str(Path(engine.__file__).parent), "lanes": job["lanes"], "tokens": tokens, "first_pass": tokens / first,
           "passes": passes, "tokens_per_s": max(passes), "collections": collections,
           "step_host_s_per_pass": step_seconds[0] / job["passes"],
           "lane_batches": [lane.batches for lane in runner.lanes] if runner is not None else None}
    if torch.cuda.is_available():
        out.update(profiled_pass(one_pass))
    print(json.dumps(out), flush=True)


def profiled_pass(one_pass) -> dict:  # noqa: ANN001 - () -> wall seconds
    """One pass under torch.profiler: the GPU's busy share of its wall time, and kernel time over busy time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import gpu_span_and_idle_us

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        wall = one_pass()
    kernel_us = sum(e.time_range.end - e.time_range.start for e in trace.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    span, idle = gpu_span_and_idle_us(trace)
    busy = span - idle
    return {"profiled_wall_s": wall, "busy_share": busy / 1e6 / wall, "concurrency": kernel_us / busy if busy else None}


def agreement(first: np.ndarray, other: np.ndarray) -> dict:
    """Each row's cosine to the first arm's vector for it: the least, and how many rows fall under 0.999."""
    cosines = np.sum(first * other, axis=1) / np.linalg.norm(first, axis=1) / np.linalg.norm(other, axis=1)
    return {"min_cosine": float(cosines.min()), "rows_under_0.999": int((cosines < 0.999).sum()), "rows": len(cosines)}


def render(arms: list[str], rounds: list[dict]) -> str:
    best = {arm: max((r for r in rounds if r["arm"] == arm), key=lambda r: r["tokens_per_s"]) for arm in arms}
    base = best[arms[0]]["tokens_per_s"]
    lines = ["model-only tokens/s (each arm's best round) against the first arm's, and what its process saw", "",
             "| arm | tokens/s | full collections (s) | host s in step per pass | lane batches | GPU busy | "
             "concurrency | least cosine to the first arm |", "|---" * 8 + "|"]
    for arm in arms:
        r = best[arm]
        full = r["collections"]["2"]
        busy = f"{r['busy_share']:.0%}" if "busy_share" in r else "-"
        concurrency = f"{r['concurrency']:.2f}" if r.get("concurrency") else "-"
        cosine = f"{r['against_first_arm']['min_cosine']:.5f}" if "against_first_arm" in r else "-"
        lines.append(f"| {arm} | {r['tokens_per_s'] / 1e6:.3f}M ({r['tokens_per_s'] / base:.2f}x) | "
                     f"{full['count']} ({full['seconds']:.3f}) | {r['step_host_s_per_pass']:.3f} | {r['lane_batches'] or '-'} | "
                     f"{busy} | {concurrency} | {cosine} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main_or_worker(main, worker)
