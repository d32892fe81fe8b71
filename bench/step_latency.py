"""Batch-1 step latency of the engine from several source trees, side by side in one run: the A/B of an engine change.

An arm is a name and a directory holding an `engine/` package: `.` for the working tree, or a commit's
engine exported with `mkdir -p .ab/C && git archive C engine | tar -x -C .ab/C`. Each arm runs in a
process of its own (so it imports its own engine) and the arms take turns for --rounds rounds, so a
drift of the machine hits them alike. Per arm, model and token count: p50 / p99 ms of
Engine.step(batch).result() with the device drained after each call (as bench.gpu_engine and
bench.gpu_qwen3 time it), the engine at its defaults but for --attention; the report keeps each arm's
best round and the ratio of its p50 to the first arm's. With --profile, one more step per point runs
under torch.profiler: its kernels, their GPU time, and the span and idle time of the step on the GPU
(bench.common.gpu_span_and_idle_us), so a difference shows as GPU work or as gaps.
Models: all-MiniLM-L6-v2 (the real checkpoint, --minilm), and random-weight BERT-base and
Qwen3-Embedding-0.6B shapes, made once and shared by every arm (random weights time like real ones).

    python3 -m bench.step_latency --minilm .bundle/minilm --arms new=.,before=.ab/042c3c4 --out bench-out/step_latency
writes results.json and report.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import arm_order, checkpoints, main_or_worker, parse_arms, run_arm_worker

POINTS = {"minilm": (16, 128), "bert-base": (16, 128), "qwen3-0.6b": (128, 512, 4096)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", required=True, help="comma-separated NAME=DIR, DIR holding an engine/ package")
    parser.add_argument("--minilm", type=Path, required=True, help="all-MiniLM-L6-v2 directory")
    parser.add_argument("--models", default=",".join(POINTS), help=f"comma-separated, from: {', '.join(POINTS)}")
    parser.add_argument("--attention", default="auto", help="the engine's attention backend")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per point")
    parser.add_argument("--profile", action="store_true", help="profile one step per point and arm")
    parser.add_argument("--out", type=Path, default=Path("bench-out/step_latency"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    arms = parse_arms(args.arms)
    with tempfile.TemporaryDirectory(prefix="embedctl-step-latency-") as folder:
        paths = checkpoints(args.models.split(","), args.minilm, Path(folder))
        models = {name: str(path) for name, path in paths.items()}
        rounds = [{"arm": arm, "round": round_index, **run_arm(arm, arms[arm], models, args)}
                  for round_index in range(args.rounds) for arm in arm_order(list(arms), round_index)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"arms": arms, "rounds": rounds}, indent=2))
    report = render(list(arms), rounds)
    (args.out / "report.md").write_text(report)
    print(report)


def run_arm(arm: str, tree: str, models: dict[str, str], args: argparse.Namespace) -> dict:
    """One arm's figures, from a child process that imports the engine under `tree`."""
    job = {"tree": str(Path(tree).resolve()), "models": models, "attention": args.attention, "repeats": args.repeats,
           "profile": args.profile}
    result = run_arm_worker("bench.step_latency", arm, job)
    print(f"{arm}: {json.dumps(result)}", flush=True)
    return result


def worker(job: dict) -> None:
    """One arm: load each model with the arm's engine, time batch 1 at each point; one JSON line on stdout."""
    sys.path.insert(0, job["tree"])
    import numpy as np
    import torch

    import engine
    from bench.common import percentiles
    from engine import Engine, EngineConfig, PackedBatch

    assert Path(engine.__file__).resolve().is_relative_to(job["tree"]), engine.__file__
    drain = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    rng = np.random.default_rng(0)
    out: dict = {"engine": str(Path(engine.__file__).parent), "latency": {}, "profile": {}}
    for name, path in job["models"].items():
        model = Engine.load(path, EngineConfig(attention=job["attention"]))
        out["attention " + name] = getattr(model, "attention_label", model.attention)  # older trees lack the label
        for tokens in POINTS[name]:
            batch = PackedBatch.of([rng.integers(1000, 29000, tokens).astype(np.int32)])
            out["latency"][f"{name} {tokens}"] = percentiles(
                lambda: (model.step(batch).result(), drain()), job["repeats"])
            if job["profile"]:
                out["profile"][f"{name} {tokens}"] = profiled(lambda: model.step(batch).result())
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)


def profiled(step: Callable[[], object]) -> dict:
    """One step under torch.profiler: kernel count and GPU time, the step's span and idle time on the
    GPU (microseconds), and its eight costliest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import gpu_span_and_idle_us

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        step()
    kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    span, idle = gpu_span_and_idle_us(trace)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    return {"kernels": sum(e.count for e in kernels), "kernel_us": sum(e.self_device_time_total for e in kernels),
            "span_us": span, "idle_us": idle,
            "top": [[e.key[:90], e.count, round(e.self_device_time_total, 1)] for e in top]}


def render(arms: list[str], rounds: list[dict]) -> str:
    points = list(rounds[0]["latency"])
    best = {arm: {point: min((r["latency"][point] for r in rounds if r["arm"] == arm), key=lambda p: p["p50_ms"])
                  for point in points} for arm in arms}
    lines = ["batch 1, p50 / p99 ms (best round of each arm), and p50 against the first arm's", "",
             "| arm | " + " | ".join(points) + " |", "|---" * (1 + len(points)) + "|"]
    for arm in arms:
        cells = []
        for point in points:
            p50, p99 = best[arm][point]["p50_ms"], best[arm][point]["p99_ms"]
            cells.append(f"{p50:.3f} / {p99:.3f} ({p50 / best[arms[0]][point]['p50_ms']:.2f}x)")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    profiles = [r for r in rounds if r.get("profile")]
    if profiles:
        lines += ["", "profiled step: kernels, kernel us, GPU span us, idle us (each arm's first round)", "",
                  "| arm | " + " | ".join(points) + " |", "|---" * (1 + len(points)) + "|"]
        for arm in arms:
            first = next(r["profile"] for r in profiles if r["arm"] == arm)
            lines.append(f"| {arm} | " + " | ".join(
                "{kernels} / {kernel_us:.0f} / {span_us:.0f} / {idle_us:.0f}".format(**first[point]) for point in points) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main_or_worker(main, worker)
