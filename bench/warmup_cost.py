"""What the graph warm-up (`--warmup`, on by default in `embedctl serve`) costs per model: start-up time and memory.

Each model loads twice, in a fresh process each time (its own CUDA context), on one lane as `embedctl
serve` runs it: without warm-up, and with every graph shape of batches of sequences up to 512 tokens
captured at load (engine.graphs.GraphRunner.capture_all); each then runs one short batch, as serve's
own warm-up does. Per load: seconds until that batch is back,
graphs captured and the seconds that took, the device memory in use (torch's allocator, which holds the
graphs' pool and FlashInfer's plan buffers) and the process's resident host memory (page-locked plan
buffers included). The warm-up's cost is the difference between the two loads.
Models: all-MiniLM-L6-v2 (--minilm), and random-weight BERT-base and Qwen3-Embedding-0.6B shapes (the
latter built on a GPU: without one, a smoke run of the script takes minilm and bert-base only).
Results up to 8b2dba8 (run63-run65) stopped the clock at load, before any forward pass: without warm-up
that left out torch.compile and first-use costs that the warm-up load included.

    python3 -m bench.warmup_cost --minilm .bundle/minilm --models minilm,bert-base,qwen3-0.6b --out bench-out/warmup_cost
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import checkpoints, run_record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="all-MiniLM-L6-v2 directory")
    parser.add_argument("--models", default="minilm,bert-base,qwen3-0.6b", help="comma-separated: minilm, bert-base, qwen3-0.6b")
    parser.add_argument("--out", type=Path, default=Path("bench-out/warmup_cost"))
    return parser.parse_args()


def main() -> None:
    if sys.argv[1:2] == ["--load"]:  # a child process: one load, as a JSON line
        print(json.dumps(load(sys.argv[2], sys.argv[3] == "warm")), flush=True)
        return
    args = parse_args()
    results: dict = {"run": run_record(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="embedctl-warmup-cost-") as folder:
        for name, path in checkpoints(args.models.split(","), args.minilm, Path(folder)).items():
            results["models"][name] = {mode: child(path, mode) for mode in ("cold", "warm")}
            print(f"{name}: {json.dumps(results['models'][name])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)


def child(path: Path, mode: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "bench.warmup_cost", "--load", str(path), mode],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"loading {path} ({mode}) failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def load(path: str, warmup: bool) -> dict:
    import time

    import numpy as np
    import torch

    from engine import Engine, EngineConfig, PackedBatch

    gpu = torch.cuda.is_available()  # without one there is nothing to capture: a smoke run of the script
    started = time.perf_counter()
    engine = Engine.load(path, EngineConfig(warmup=warmup, lanes=1))
    # One short batch either way, as serve's own warm-up sends: the first forward pass (torch.compile,
    # library set-up) is then in both figures, not only in the one whose captures ran it.
    engine.step(PackedBatch.of([np.arange(100, 116, dtype=np.int32)])).result()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "attention": engine.attention_label, "graphs": engine.stats.captures,
            "capture_seconds": engine.stats.capture_seconds,
            "device_gib": torch.cuda.memory_reserved() / 2**30 if gpu else 0.0, "host_rss_gib": resident_bytes() / 2**30}


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def render(results: dict) -> str:
    lines = [f"Graph warm-up on one lane, {results['run']['date']}, {results['run']['commit']}", "",
             "| model | attention | ready without warm-up s | with warm-up s | graphs | capturing s | "
             "device memory GiB (without / with) | host resident GiB (without / with) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, loads in results["models"].items():
        cold, warm = loads["cold"], loads["warm"]
        lines.append(f"| {name} | {warm['attention']} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | {warm['graphs']} | "
                     f"{warm['capture_seconds']:.1f} | {cold['device_gib']:.2f} / {warm['device_gib']:.2f} | "
                     f"{cold['host_rss_gib']:.2f} / {warm['host_rss_gib']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
