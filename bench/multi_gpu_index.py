"""`embedctl index` on one GPU and on several (`--device cuda:0,cuda:1`), side by side: tokens/s end to end.

For each model of --models (minilm: the real checkpoint at --minilm; bert-base and qwen3-0.6b: shapes of
random weights, which time like real ones), the corpus's documents, repeated with fresh ids up to --docs,
are indexed into Parquet through run_index as the CLI calls it, once with one engine on cuda:0 and once
with one engine per GPU. Each runs in a subprocess of its own: load the engines, index the first shard
(which captures the CUDA graphs), then index the whole corpus, timed. Reported per model: tokens/s of
each, their ratio, each engine's share of the batches, and the largest difference between the two
outputs' vectors (the same ids in the same order). The tokenizer workers are index's default.

    python -m bench.multi_gpu_index --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet \\
        --docs 20000 --out bench-out/multi_gpu_index
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from bench.common import checkpoints
from bench.index_host import write_corpus

if TYPE_CHECKING:
    from engine import LazyTensor, PackedBatch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="all-MiniLM-L6-v2 directory")
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--models", default="minilm,bert-base,qwen3-0.6b", help="comma-separated")
    parser.add_argument("--docs", type=int, default=20_000, help="documents indexed (the corpus repeated)")
    parser.add_argument("--shard-docs", type=int, default=2_000, help="documents per Parquet shard")
    parser.add_argument("--out", type=Path, default=Path("bench-out/multi_gpu_index"))
    return parser.parse_args()


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        return
    import torch

    args = parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"this machine has {gpus} GPU(s); the comparison needs two or more (nvidia-h200-x2)")
    settings = {"one GPU": ["cuda:0"], f"{gpus} GPUs": [f"cuda:{i}" for i in range(gpus)]}
    results: dict = {"gpus": gpus, "docs": args.docs, "models": {}}
    with tempfile.TemporaryDirectory(prefix="embedctl-multi-gpu-") as folder:
        scratch = Path(folder)
        source = write_corpus(args.corpus, scratch / "corpus", args.docs, args.shard_docs)
        for name, path in checkpoints(args.models.split(","), args.minilm, scratch / "models").items():
            runs = {}
            outputs = [scratch / f"{name}-{position}.parquet" for position in range(len(settings))]
            for (setting, devices), out in zip(settings.items(), outputs):
                job = {"model": str(path), "devices": devices, "source": str(source), "out": str(out)}
                child = subprocess.run([sys.executable, "-m", "bench.multi_gpu_index", "--worker", json.dumps(job)],
                                       capture_output=True, text=True)
                if child.returncode != 0:
                    raise SystemExit(f"{name} on {devices} failed:\n{child.stderr[-4000:]}")
                runs[setting] = json.loads(child.stdout.strip().splitlines()[-1])
                print(f"{name} {setting}: {json.dumps(runs[setting])}", flush=True)
            first, last = (pq.read_table(out) for out in outputs)
            assert first.column("id").to_pylist() == last.column("id").to_pylist(), "rows out of order"
            vectors = [np.stack(t.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32)
                       for t in (first, last)]
            runs["max_abs_diff"] = float(np.abs(vectors[0] - vectors[1]).max())
            results["models"][name] = runs
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report = render(results, list(settings))
    (args.out / "report.md").write_text(report)
    print(report)


def worker(job: dict) -> None:
    """One setting: engines loaded, the first shard indexed untimed, then the corpus timed; one JSON line."""
    from engine import Engine, EngineConfig
    from pipelines.index import IndexModel, IndexOptions, run_index

    engines = [Engine.load(job["model"], EngineConfig(device=device)) for device in job["devices"]]
    steps = [0] * len(engines)
    for position, engine in enumerate(engines):
        engine.step = counted(engine.step, steps, position)
    model = IndexModel.loaded(*engines)
    source = Path(job["source"])
    warm = Path(job["out"]).with_suffix(".warm.parquet")
    run_index(model, IndexOptions(source=str(sorted(source.glob("*.parquet"))[0]), out=str(warm)))
    steps[:] = [0] * len(engines)
    started = time.perf_counter()
    report = run_index(model, IndexOptions(source=str(source), out=job["out"]))
    seconds = time.perf_counter() - started
    print(json.dumps({"devices": report.device, "rows": report.rows_written, "tokens": report.tokens,
                      "seconds": round(seconds, 3), "tokens_per_s": round(report.tokens / seconds),
                      "batches_per_engine": steps}), flush=True)


def counted(step: Callable[[PackedBatch], LazyTensor], steps: list[int], position: int) -> Callable:
    """step, counting its calls into steps[position]."""
    def count_then_step(batch: PackedBatch) -> LazyTensor:
        steps[position] += 1
        return step(batch)
    return count_then_step


def render(results: dict, settings: list[str]) -> str:
    lines = [f"`embedctl index` of {results['docs']:,} documents end to end (file in, Parquet out), tokens/s", "",
             "| model | " + " | ".join(settings) + " | ratio | batches per engine | max abs diff |",
             "|---" * (len(settings) + 4) + "|"]
    for name, runs in results["models"].items():
        rates = [runs[setting]["tokens_per_s"] for setting in settings]
        lines.append(f"| {name} | " + " | ".join(f"{rate / 1e6:.2f}M" for rate in rates)
                     + f" | {rates[-1] / rates[0]:.2f}x | {runs[settings[-1]]['batches_per_engine']} "
                     + f"| {runs['max_abs_diff']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
