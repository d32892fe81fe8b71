"""What a cron re-run of `embedctl index` costs when nothing changed, against the full index.

What it measures (issue 6: re-indexing an unchanged corpus costs under 5% of the full index time):
- input: the first --docs rows of --corpus with a non-blank text and a new id, written to a
  temporary Parquet file;
- the command, run as a user runs it (a fresh process each time, so interpreter start, imports and
  model loading count): `embedctl index INPUT --out OUT.lance --max-length 128 --quiet --report R`
  plus --device when given;
- full: the first run into a new table; unchanged: the same command again, --repeats times (median);
- each run's report must say what was done: all rows added by the full run, all unchanged and no
  tokens embedded by the re-runs.

Results: a section appended to bench/results/reindex.md.

    python -m bench.reindex [--docs 10000] [--repeats 3] [--corpus PATH] [--device cuda] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import run_record
from bench.cpu_index import make_input

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "reindex.md"
OUTPUTS = {"lance": "vectors.lance", "parquet": "vectors/"}
DEFAULT_CORPUS = "/work/shared/corpus/docstrings.parquet"
MAX_LENGTH = 128


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default=None, help="a model directory (the GPU machine has no packaged MiniLM)")
    parser.add_argument("--output", choices=("lance", "parquet"), default="lance",
                        help="the table written: LanceDB, or a directory of Parquet parts (where lancedb is missing)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the markdown file the section is appended to")
    parser.add_argument("--out", type=Path, default=None, help="a directory for reindex.md instead of --results")
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        args.results = args.out / "reindex.md"
    return args


def timed_index(command: list[str], report: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
    return seconds, json.loads(report.read_text())


def environment(device: str) -> dict[str, str]:
    return {
        **run_record(),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "none used",
        "torch": torch.__version__,
        "threads": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
    }


def main() -> None:
    args = parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    with tempfile.TemporaryDirectory() as tmp:
        source, report = Path(tmp) / "docs.parquet", Path(tmp) / "report.json"
        out = os.path.join(tmp, OUTPUTS[args.output])  # a string: the trailing / marks a directory of parts
        make_input(args.corpus, args.docs, source)
        command = [sys.executable, "-m", "embedctl.cli", "index", str(source), "--out", str(out),
                   "--max-length", str(MAX_LENGTH), "--device", device, "--quiet", "--report", str(report)]
        if args.model is not None:
            command += ["--model", args.model]
        full_s, full = timed_index(command, report)
        assert full["added"] == args.docs and full["unchanged"] == 0, full
        again = []
        for _ in range(args.repeats):
            seconds, rerun = timed_index(command, report)
            assert rerun["unchanged"] == args.docs and rerun["rows_written"] == 0 and rerun["tokens"] == 0, rerun
            again.append(seconds)
    loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    env = environment(device)
    shown = f"embedctl index DOCS.parquet --out {OUTPUTS[args.output].replace('vectors', 'OUT')} --max-length {MAX_LENGTH} --device {device} --quiet --report R"
    unchanged_s = statistics.median(again)
    section = "\n".join([
        f"\n## {env['date']}\n",
        *(f"- {key}: {value}" for key, value in env.items()),
        f"- benchmark: python {' '.join(sys.argv)}",
        f"- command timed (a fresh process each run): `{shown}`",
        f"- corpus: the first {args.docs:,} usable rows of {args.corpus}",
        f"- load average (1, 5, 15 min) before / after: {loads[0]} / {loads[1]}",
        "",
        "| run | wall s | rows embedded | tokens | in-pipeline s |",
        "|---|---:|---:|---:|---:|",
        f"| full index (new table) | {full_s:.2f} | {full['rows_written']:,} | {full['tokens']:,} | {full['seconds']:.2f} |",
        f"| unchanged re-run, median of {args.repeats} | {unchanged_s:.2f} | 0 | 0 | {rerun['seconds']:.2f} (last) |",
        "",
        f"Unchanged re-runs, wall s: {', '.join(f'{s:.2f}' for s in again)}. "
        f"Ratio unchanged / full: **{unchanged_s / full_s:.1%}** (required < 5%).",
        "",
    ])
    with args.results.open("a") as f:
        if f.tell() == 0:
            f.write("# Re-indexing an unchanged corpus (bench/reindex.py)\n")
        f.write(section)
    print(section)


if __name__ == "__main__":
    main()
