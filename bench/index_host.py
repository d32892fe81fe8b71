"""Where `embedctl index` spends the host's time beside a GPU: end to end on a corpus large enough
that start-up does not hide the steady state.

The corpus's documents are repeated (with fresh ids) up to --docs and written as Parquet shards of
--shard-docs rows. Each setting of --processes runs in a fresh subprocess: load the model, index
the first shard (which captures the CUDA graphs), then index the whole corpus, timed: tokens/s and
the seconds to the first rows embedded. With --py-spy BINARY a second subprocess per setting runs
the same with py-spy sampling the timed run (GIL holders only, per thread) into
py-spy-SETTING.txt: the functions that hold the GIL longest, which bound a pipeline of threads.
--models picks MiniLM (the --minilm directory) and/or a BERT-base-shaped model of random weights
with MiniLM's tokenizer (random weights time like real ones; bench.gpu_engine builds it the same way).

    python -m bench.index_host --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --docs 60000 \
        [--models minilm,bert-base]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.common import random_bert_base
from engine import Engine, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="model directory")
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--docs", type=int, default=60_000)
    parser.add_argument("--shard-docs", type=int, default=10_000)
    parser.add_argument("--processes", default="0,default", help="comma-separated --tokenizer-processes values")
    parser.add_argument("--models", default="minilm", help="comma-separated: minilm, bert-base")
    parser.add_argument("--py-spy", type=Path, default=None, help="py-spy binary: also sample a run of each setting")
    parser.add_argument("--py-spy-idle", action="store_true",
                        help="sample every thread, waiting ones included, instead of the GIL holders")
    parser.add_argument("--switch-intervals", default="default",
                        help="comma-separated sys.setswitchinterval values (seconds) to run each setting under")
    parser.add_argument("--switch-interval", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench-out/index_host"))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one run in this process
    parser.add_argument("--source", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        if args.switch_interval != "default":
            sys.setswitchinterval(float(args.switch_interval))
        print(json.dumps(one_run(args.minilm, args.source, args.measure, args.py_spy, args.py_spy_idle, args.out)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"docs": args.docs, "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        source = write_corpus(args.corpus, Path(scratch) / "corpus", args.docs, args.shard_docs)
        for name in args.models.split(","):
            model = args.minilm if name == "minilm" else bert_base(args.minilm, Path(scratch))
            for setting, interval in itertools.product(args.processes.split(","), args.switch_intervals.split(",")):
                command = [sys.executable, "-m", "bench.index_host", "--minilm", str(model), "--corpus",
                           str(args.corpus), "--source", str(source), "--measure", setting, "--out", str(args.out),
                           "--switch-interval", interval]
                runs = [measure(command)]
                if args.py_spy is not None:
                    runs.append(measure([*command, "--py-spy", str(args.py_spy)] + ["--py-spy-idle"] * args.py_spy_idle))
                key = " ".join([*([name] if name != "minilm" else []), setting,
                                *([f"switch {interval}"] if interval != "default" else [])])
                results["runs"][key] = runs
                print(f"{key}: {json.dumps(runs)}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


def bert_base(minilm: Path, scratch: Path) -> Path:
    """A BERT-base-shaped checkpoint of random weights that tokenizes with MiniLM's tokenizer."""
    os.environ["EMBEDCTL_TEST_MODEL"] = str(minilm)  # where tests.models takes the tokenizer files from
    return random_bert_base(scratch / "bert-base")


def write_corpus(corpus: Path, directory: Path, docs: int, shard_docs: int) -> Path:
    texts = [t for t in pq.read_table(corpus, columns=["text"]).column("text").to_pylist() if t and not t.isspace()]
    directory.mkdir(parents=True)
    for start in range(0, docs, shard_docs):
        rows = range(start, min(docs, start + shard_docs))
        pq.write_table(pa.table({"id": [f"d{i}" for i in rows], "text": [texts[i % len(texts)] for i in rows]}),
                       directory / f"part-{start // shard_docs:04d}.parquet")
    return directory


def measure(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])  # py-spy talks after


def one_run(model: Path, source: Path, setting: str, py_spy: Path | None, idle: bool, out: Path) -> dict:
    """Load the model, index the first shard to capture the graphs, then time an index of them all."""
    from pipelines.index import IndexModel, IndexOptions, run_index

    engine = Engine.load(str(model), EngineConfig(max_length=512))
    processes = None if setting == "default" else int(setting)
    with tempfile.TemporaryDirectory() as scratch:
        first_shard = str(sorted(source.iterdir())[0])
        run_index(IndexModel.loaded(engine), IndexOptions(source=first_shard, out=f"{scratch}/warm.parquet"))
        options = IndexOptions(source=str(source), out=f"{scratch}/out.parquet", tokenizer_processes=processes)
        first: list[float] = []  # seconds to the first rows embedded
        started = time.perf_counter()

        def progress(rows: int, tokens: int, total: int | None) -> None:
            if rows and not first:
                first.append(time.perf_counter() - started)

        before = replace(engine.stats)
        label = f"{model.name}-{setting}-{sys.getswitchinterval()}"
        with sampled(py_spy, idle, out / f"py-spy-{label}.txt"):
            report = run_index(IndexModel.loaded(engine), options, progress)
    run = {"tokens_per_s": round(report.tokens_per_second), "seconds": round(report.seconds, 3),
           "first_rows_s": round(first[0], 3), "tokens": report.tokens, "sampled": py_spy is not None,
           "eager_runs": engine.stats.eager_runs - before.eager_runs, "captures": engine.stats.captures - before.captures}
    if py_spy is None:
        run["model_only_tokens_per_s"] = round(model_only(engine, source))
    return run


def model_only(engine: Engine, source: Path) -> float:
    """Tokens/s of Engine.embed alone on the same corpus, packed the same way: the rate the index run would
    reach if the host never kept the device waiting (the best of two passes, after the index run's captures)."""
    from pipelines.index import IndexModel

    tokenizer = IndexModel.loaded(engine).tokenizer
    ids = [row for shard in sorted(source.iterdir())
           for row in tokenizer.encode(pq.read_table(shard, columns=["text"]).column("text").to_pylist()).ids]
    tokens = sum(map(len, ids))
    best = float("inf")
    for _ in range(2):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine.embed(ids)
        best = min(best, time.perf_counter() - started)
    return tokens / best


@contextmanager
def sampled(py_spy: Path | None, idle: bool, summary: Path) -> Iterator[None]:
    """py-spy samples this process while the block runs, GIL holders only (idle: every thread, waiting
    ones too); summary gets the top functions."""
    if py_spy is None:
        yield
        return
    raw, log = summary.with_suffix(".raw"), summary.with_suffix(".log")
    with log.open("w") as sink:
        sampler = subprocess.Popen([str(py_spy), "record", "--pid", str(os.getpid()), "--idle" if idle else "--gil",
                                    "--threads", "--rate", "500", "--format", "raw", "--output", str(raw)],
                                   stdout=sink, stderr=sink)
    time.sleep(1)  # py-spy attaches
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
        sampler.wait(60)
    summary.write_text(summarize(raw, "of every thread" if idle else "holding the GIL") if raw.exists() else f"py-spy sampled nothing:\n{log.read_text()}")
    raw.unlink(missing_ok=True)
    log.unlink()


def summarize(raw: Path, sampled: str, top: int = 40) -> str:
    """py-spy's raw samples as the functions seen most often, by thread: innermost (where the time is
    spent, or waited) and anywhere on the stack (which stage spends it)."""
    own, anywhere, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        own[thread, frames[-1] if frames else "?"] += int(count)
        for function in {frame.rpartition(":")[0] for frame in frames}:  # a function, whichever line
            anywhere[thread, function] += int(count)
        total += int(count)
    lines = [f"{total} samples {sampled}", ""]
    for title, counts in (("innermost function", own), ("anywhere on the stack", anywhere)):
        lines += [f"share | thread | {title}", "---|---|---"]
        lines += [f"{count / total:.1%} | {thread} | {frame}" for (thread, frame), count in counts.most_common(top)]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
