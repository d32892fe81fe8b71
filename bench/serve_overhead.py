"""What `embedctl serve` costs around the engine, measured on the CPU.

The real `embedctl serve` runs in a subprocess on a loopback port with a random-weight BERT of one
layer and hidden size 32 (MiniLM's tokenizer), so the engine's share is small and known (it is
measured alone first, in this process) and the rest is the Python request path: HTTP, JSON,
validation, tokenization, the hops between the event loop and the scheduler thread, the reply.
Requests are POST /v1/embeddings with base64 replies, as bench/serve_bench.py sends them.
  single   one connection, one short query per request: p50/p99 latency
  clients  16 concurrent connections, short queries: requests/s, p50/p99 latency
  batch    4 concurrent connections sending 100 corpus documents per request: tokens/s, against
           the engine alone on the same documents
Every suite also reports CPU time per request, of the whole server process and of its event loop
(the main thread). The loop's is the steadiest figure on a small shared machine, and the one that
bounds requests/s on a host with cores to spare. The clients are one separate process speaking raw
HTTP/1.1 over keep-alive connections (uvloop), so their own cost stays small and out of the
server's process. The engine runs on one torch thread, as the GPU would leave the CPU's cores to
the request path; note that a CPU woken from idle runs it slower than the back-to-back figure
measured alone. `--profile` records each suite with py-spy (`pip install py-spy`) into --out as
speedscope JSON. Not here: GPU figures (bench/serve_bench.py).

    python -m bench.serve_overhead --out bench-out/serve_overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from bench.serve_bench import CONTENT_LENGTH, TOTAL_TOKENS, Served, post_request

REPO = Path(__file__).resolve().parents[1]
TINY_BERT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=512)
MAX_LENGTH, MAX_BATCH_TOKENS = 512, 16384  # serve_bench's max length; the GPU's default token budget
QUERY = "how do I read a parquet file into a table"
CLIENTS, BATCH_CONNECTIONS, BATCH_DOCS = 16, 4, 100


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads here, and inherited by the server
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        documents = corpus_documents(args.corpus)
        query_body = json.dumps({"input": [QUERY], "encoding_format": "base64"}).encode()
        batch_bodies = [json.dumps({"input": documents[i: i + BATCH_DOCS], "encoding_format": "base64"}).encode()
                        for i in range(0, len(documents) - BATCH_DOCS + 1, BATCH_DOCS)]
        results = {"engine": engine_alone(model, [QUERY], documents[:BATCH_DOCS])}
        command = [sys.executable, "-m", "embedctl.cli", "serve", "--port", "{port}", "--device", "cpu", "--model",
                   str(model), "--max-length", str(MAX_LENGTH), "--max-batch-tokens", str(MAX_BATCH_TOKENS)]
        server = Served(command)
        with server, ProcessPoolExecutor(1, mp_context=get_context("spawn")) as clients:
            port = server.port
            suites = {"single": ([[query_body]], args.requests, 200),
                      "clients": ([[query_body]] * CLIENTS, args.requests // 4, 50),
                      "batch": ([batch_bodies[n::BATCH_CONNECTIONS] for n in range(BATCH_CONNECTIONS)],
                                args.batch_requests, len(batch_bodies))}
            for name, (bodies, requests, warmup) in suites.items():
                if name not in args.suites:
                    continue
                with profiled(args.out / f"{name}.speedscope.json" if args.profile else None, server.process.pid):
                    results[name] = clients.submit(drive, port, server.process.pid, bodies, requests, warmup).result()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(render(results))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "sample_data" / "corpus" / "part-000.parquet",
                        help="Parquet file with a text column")
    parser.add_argument("--requests", type=int, default=2000, help="timed single-client requests (a quarter per client at 16)")
    parser.add_argument("--batch-requests", type=int, default=25, help="timed 100-document requests per connection")
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve_overhead"), help="directory for results.json")
    parser.add_argument("--suites", type=lambda text: text.split(","), default=["single", "clients", "batch"],
                        help="which suites to run, comma-separated")
    parser.add_argument("--profile", action="store_true", help="record each suite with py-spy into --out")
    return parser.parse_args()


def tiny_model(directory: Path) -> Path:
    from tests.models import save_random_model

    return save_random_model(directory / "tiny-bert", pooling="mean", **TINY_BERT)


def corpus_documents(corpus: Path) -> list[str]:
    """The corpus texts, repeated to make BATCH_CONNECTIONS x 4 requests of BATCH_DOCS documents."""
    import pyarrow.parquet as pq

    texts = [t for t in pq.read_table(corpus, columns=["text"]).column("text").to_pylist() if t and not t.isspace()]
    wanted = BATCH_CONNECTIONS * 4 * BATCH_DOCS
    return (texts * (1 + wanted // len(texts)))[:wanted]


def engine_alone(model: Path, query: list[str], documents: list[str]) -> dict:
    """Engine.embed on pre-tokenized inputs: the query's latency and the documents' tokens/s."""
    from engine import Engine, EngineConfig
    from pipelines.tokenize import TextTokenizer

    engine = Engine.load(str(model), EngineConfig(device="cpu", max_length=MAX_LENGTH, max_batch_tokens=MAX_BATCH_TOKENS))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    query_ids, doc_ids = tokenizer.encode(query).ids, tokenizer.encode(documents).ids

    def best(ids: list, runs: int) -> float:
        engine.embed(ids)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            engine.embed(ids)
            times.append(time.perf_counter() - started)
        return float(np.median(times))

    tokens = sum(len(ids) for ids in doc_ids)
    return {"query_ms": best(query_ids, 500) * 1e3, "batch_tokens": tokens, "batch_tokens_per_s": tokens / best(doc_ids, 20)}


@contextmanager
def profiled(path: Path | None, pid: int):
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    recorder = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "speedscope", "--output", str(path),
                                 "--rate", "500", "--nonblocking"], stdout=subprocess.DEVNULL)
    time.sleep(1)  # py-spy attaches before the suite starts
    try:
        yield
    finally:
        recorder.send_signal(2)  # SIGINT: py-spy writes the profile and exits
        recorder.wait(60)


def drive(port: int, pid: int, bodies: list[list[bytes]], requests: int, warmup: int) -> dict:
    """One keep-alive connection per entry of bodies, each cycling through its bodies; runs in the client process.

    Besides latencies and rates, CPU time per timed request: the server process's (all its threads)
    and its event loop's (the main thread), which bounds requests/s on a machine with cores to spare.
    """
    import uvloop

    return uvloop.run(_drive(port, pid, bodies, requests, warmup))


def cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _drive(port: int, pid: int, bodies: list[list[bytes]], requests: int, warmup: int) -> dict:
    warmed = [asyncio.Event() for _ in bodies]
    go = asyncio.Event()

    async def connection(number: int, mine: list[bytes]) -> tuple[list[float], int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        heads = [post_request(body) for body in mine]
        latencies, tokens, errors = [], 0, 0

        async def post(i: int) -> bytes | None:
            writer.write(heads[i % len(heads)])
            head = await reader.readuntil(b"\r\n\r\n")
            reply = await reader.readexactly(int(CONTENT_LENGTH.search(head)[1]))
            return reply if head[9:12] == b"200" else None

        for i in range(warmup):
            await post(i)
        warmed[number].set()
        await go.wait()
        for i in range(requests):
            started = time.perf_counter()
            reply = await post(i)
            latencies.append(time.perf_counter() - started)
            if reply is None:
                errors += 1
            else:
                tokens += int(TOTAL_TOKENS.search(reply)[1])
        writer.close()
        return latencies, tokens, errors

    tasks = [asyncio.create_task(connection(n, mine)) for n, mine in enumerate(bodies)]
    for event in warmed:
        await event.wait()
    process, loop = Path(f"/proc/{pid}/stat"), Path(f"/proc/{pid}/task/{pid}/stat")
    started, cpu, loop_cpu = time.perf_counter(), cpu_seconds(process), cpu_seconds(loop)
    go.set()
    outcomes = await asyncio.gather(*tasks)
    wall, cpu, loop_cpu = time.perf_counter() - started, cpu_seconds(process) - cpu, cpu_seconds(loop) - loop_cpu
    latencies = np.concatenate([o[0] for o in outcomes]) * 1e3
    return {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "requests_per_s": len(latencies) / wall, "tokens_per_s": sum(o[1] for o in outcomes) / wall,
            "server_cpu_ms_per_request": cpu / len(latencies) * 1e3,
            "loop_cpu_ms_per_request": loop_cpu / len(latencies) * 1e3, "errors": sum(o[2] for o in outcomes),
            "requests": len(latencies)}


def render(results: dict) -> str:
    engine = results["engine"]
    lines = [f"engine alone: query {engine['query_ms']:.3f} ms; {BATCH_DOCS} documents ({engine['batch_tokens']} tokens) "
             f"at {engine['batch_tokens_per_s']:,.0f} tokens/s"]
    if single := results.get("single"):
        lines.append(f"single   1 client : p50 {single['p50_ms']:.3f} ms, p99 {single['p99_ms']:.3f} ms, "
                     f"CPU per request {single['server_cpu_ms_per_request']:.3f} ms (loop {single['loop_cpu_ms_per_request']:.3f}), "
                     f"{single['errors']} errors")
    if many := results.get("clients"):
        lines.append(f"clients {CLIENTS} clients: {many['requests_per_s']:,.0f} req/s, p50 {many['p50_ms']:.2f} ms, "
                     f"p99 {many['p99_ms']:.2f} ms, CPU per request {many['server_cpu_ms_per_request']:.3f} ms "
                     f"(loop {many['loop_cpu_ms_per_request']:.3f}), {many['errors']} errors")
    if batch := results.get("batch"):
        lines.append(f"batch    {BATCH_CONNECTIONS} x {BATCH_DOCS} docs: {batch['tokens_per_s']:,.0f} tokens/s "
                     f"({batch['tokens_per_s'] / engine['batch_tokens_per_s']:.0%} of the engine alone), "
                     f"p50 {batch['p50_ms']:.1f} ms, CPU per request {batch['server_cpu_ms_per_request']:.1f} ms "
                     f"(loop {batch['loop_cpu_ms_per_request']:.1f}), {batch['errors']} errors")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
