"""What the benchmarks share: latency percentiles of a call, the record of when and where a run ran, a
profiled step's GPU span and idle time, the models by name: MiniLM, and the BERT-base- and
Qwen3-0.6B-shaped checkpoints of random weights that stand in for real ones (random weights time like
real ones), and the arms of an A/B between engine trees (bench.step_latency, bench.throughput_ab)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def percentiles(call: Callable[[], object], repeats: int, warmup: int = 10,
                before: Callable[[], object] | None = None) -> dict:
    """p50 and p99 wall milliseconds of call() over `repeats` timed calls, after `warmup` untimed ones;
    before(), when given, runs untimed ahead of each call."""
    for _ in range(warmup):
        if before is not None:
            before()
        call()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def run_record() -> dict[str, str]:
    """The date, the commit (and whether the tree had uncommitted changes) and the CPU of this run."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
               platform.processor())
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD") + (" (tree dirty: uncommitted changes)" if dirty else ""),
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
    }


def gpu_span_and_idle_us(trace) -> tuple[float, float]:  # noqa: ANN001 - torch.profiler.profile
    """From the first GPU activity of a profiled step to its last, and how much of that the GPU had
    nothing running: launch gaps between kernels and waits on the host."""
    import torch

    intervals = sorted((e.time_range.start, e.time_range.end) for e in trace.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    if not intervals:
        return 0.0, 0.0
    idle, reached = 0.0, intervals[0][1]
    for start, end in intervals[1:]:
        idle += max(0.0, start - reached)
        reached = max(reached, end)
    return reached - intervals[0][0], idle


def random_bert_base(directory: Path) -> Path:
    """A BERT-base-shaped sentence-transformers checkpoint of random weights (mean pooling, normalised,
    512 tokens) in directory, with the tokenizer files tests.models copies (EMBEDCTL_TEST_MODEL's)."""
    from tests.models import BERT_BASE, save_random_model

    path = save_random_model(directory, pooling="mean", normalize=True, **BERT_BASE)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return path


def checkpoints(names: list[str], minilm: Path, folder: Path) -> dict[str, Path]:
    """The folders of the benchmarks' models by name: "minilm" (the real checkpoint at minilm), and
    "bert-base" and "qwen3-0.6b" (Qwen3-Embedding-0.6B's shape), of random weights written under folder."""
    from tests.test_qwen3 import QWEN3_06B, save_random_qwen3

    makers = {"minilm": lambda: minilm, "bert-base": lambda: random_bert_base(folder / "bert-base"),
              "qwen3-0.6b": lambda: save_random_qwen3(folder / "qwen3", device="cuda", **QWEN3_06B)}
    return {name: makers[name]() for name in names}


def parse_arms(text: str) -> dict[str, str]:
    """--arms NAME=DIR,NAME=DIR,... as {NAME: DIR}: the source trees, each holding an engine/ package, that an A/B compares."""
    return dict(arm.split("=", 1) for arm in text.split(","))


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """The arms' turns in a round: each round starts one arm later, so a drift of the machine hits them alike."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


def run_arm_worker(module: str, arm: str, job: dict) -> dict:
    """One arm's figures from a child process, `python3 -m MODULE --worker JOB`, which imports the engine of
    the arm's tree (so each arm has its own): the JSON of its last line on stdout."""
    child = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(job)], capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main_or_worker(main: Callable[[], None], worker: Callable[[dict], None]) -> None:
    """An A/B benchmark's entry point: worker(job) in a child process started by run_arm_worker, else main()."""
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        main()
