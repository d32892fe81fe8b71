"""`embedctl serve` side by side with sentence-transformers behind a minimal FastAPI endpoint.

Both servers run in their own subprocess on a loopback port and answer the same POST /v1/embeddings
(texts in, base64 float32 vectors out, as the openai client asks by default), so tokenization, JSON
and HTTP are inside every figure. Clients are separate processes (no shared GIL), each with one
keep-alive connection, sending its next request when the previous one is answered. They speak raw
HTTP/1.1 over a socket (RawClient), as load generators such as wrk do, so a latency is the server's
and the loopback's, not the client library's: one point is also measured with httpx, whose own work
per request is part of its figure (`--client httpx` uses it everywhere).
  concurrency  1, 2, 4, 8, 16 clients; one short query (~16 tokens) or one 512-token document per
               request: p50/p99 latency, requests/s, tokens/s, errors
  batch        4 client processes sending requests of 100 corpus documents: tokens/s, against the
               engine's own model-only tokens/s on the same documents (measured first, in this process)
Each point runs a few untimed requests first. They do not reach every batch shape that concurrent
clients make, so a server without its graph warm-up (`--no-warmup`) still captures graphs inside
timed points: each point counts the captures and eager runs the server made while timed (/metrics),
and each server's seconds from start to healthy. The batch suite also records the CPU time each thread
of the server and each tokenizer worker took while timed (from /proc): whether one thread holds the
suite back (a worker polls for its next chunk a while, so its share is at least that busy); every
other point records them too. `--profile` runs the batch suite and the 16-client short queries once
more under py-spy (on the PATH or in the wheels run_on_gpu.sh installs), which records the server's
threads while they hold the GIL, the first figures staying the clean ones. `--suites` picks the
suites, `--also FLAGS` adds the same server with other flags. Prints a markdown table and writes
every figure as JSON to --out. `--smoke` runs tiny counts on any device.
Not here: the engine-only suites (bench/gpu_engine.py).

    python -m bench.serve_bench --minilm .bundle/minilm --corpus .bench-data/docstrings.parquet --out serve.json
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
CLIENTS = (1, 2, 4, 8, 16)
QUERY_TOKENS, DOC_TOKENS, MAX_LENGTH = 16, 512, 512
BATCH_PROCESSES, BATCH_DOCS = 4, 100
CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
TOTAL_TOKENS = re.compile(rb'"total_tokens": *(\d+)')


def main() -> None:
    args = parse_args()
    if args.peer_port is not None:
        run_peer(args.minilm, args.peer_port)
        return
    queries, documents, corpus = inputs(args)
    results: dict = {"device": device_name(), "model": str(args.minilm), "smoke": args.smoke, "batch_docs": args.batch_docs,
                     "client": args.client,
                     "engine_model_only_tokens_per_s": engine_tokens_per_second(args.minilm, corpus),
                     "servers": {}}
    servers = {"embedctl": ours_command(args.minilm)}
    for flags in args.also:
        servers[f"embedctl {flags}"] = [*ours_command(args.minilm), *flags.split()]
    if args.peers:
        servers["sentence-transformers"] = [sys.executable, "-m", "bench.serve_bench", "--minilm", str(args.minilm),
                                            "--peer-port", "{port}"]
    for name, command in servers.items():
        with Served(command) as served:
            print(f"== {name} at {served.url}, ready after {served.ready_seconds:.1f} s", flush=True)
            profile = args.out / f"py-spy-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}.txt" \
                if args.profile and name.startswith("embedctl") else None
            results["servers"][name] = {"ready_seconds": served.ready_seconds,
                                        **run_suites(args, served, queries, documents, corpus, profile)}
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, default=None, help="all-MiniLM-L6-v2 directory (default: the shipped copy)")
    parser.add_argument("--corpus", type=Path, default=REPO / "sample_data" / "corpus" / "part-000.parquet",
                        help="Parquet file with a text column")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per client per point")
    parser.add_argument("--batch-requests", type=int, default=40, help="timed 100-document requests per process")
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve_bench"), help="directory for results.json and report.md")
    parser.add_argument("--smoke", action="store_true", help="tiny counts (10-document batches) on any device: checks the script")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="measure embedctl only")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="the clients' HTTP: raw HTTP/1.1 on a socket (default) or the httpx library")
    parser.add_argument("--also", action="append", default=[], metavar="FLAGS",
                        help="also measure embedctl serve with these extra flags, e.g. --also='--no-warmup' (repeatable)")
    parser.add_argument("--suites", default="concurrency,batch", help="comma-separated, from: concurrency, batch")
    parser.add_argument("--profile", action="store_true",
                        help="run the batch suite and 16 clients' queries once more under py-spy, profiling each embedctl server")
    parser.add_argument("--peer-port", type=int, default=None, help=argparse.SUPPRESS)  # run as the peer server
    args = parser.parse_args()
    if args.minilm is None:
        from tests.models import minilm_path

        args.minilm = minilm_path()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.requests, args.batch_requests = 5, 2
    args.batch_docs = 10 if args.smoke else BATCH_DOCS
    return args


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def inputs(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """A ~16-token query, a 512-token document (special tokens included) and the corpus texts."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    corpus = [t for t in pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist() if t and not t.isspace()]
    tokenizer = Tokenizer.from_file(str(args.minilm / "tokenizer.json"))
    stream: list[int] = []
    for text in corpus:
        stream += tokenizer.encode(text, add_special_tokens=False).ids
        if len(stream) >= DOC_TOKENS:
            break
    query = tokenizer.decode(stream[: QUERY_TOKENS - 2])
    document = tokenizer.decode(stream[: DOC_TOKENS - 2])
    docs = BATCH_PROCESSES * 10 if args.smoke else max(len(corpus), BATCH_PROCESSES * BATCH_DOCS)
    return query, document, (corpus * (1 + docs // len(corpus)))[:docs]


def engine_tokens_per_second(model: Path, corpus: list[str]) -> float:
    """The engine alone on the batch suite's documents, pre-tokenized: the ceiling the server is held to."""
    import torch

    from engine import Engine, EngineConfig
    from pipelines.tokenize import TextTokenizer

    engine = Engine.load(str(model), EngineConfig(max_length=MAX_LENGTH))
    ids = TextTokenizer(engine.files.tokenizer_file, engine.max_length).encode(corpus).ids
    tokens = sum(len(i) for i in ids)
    engine.embed(ids)  # captures the graphs this mix of batches needs
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        engine.embed(ids)
        best = min(best, time.perf_counter() - started)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens / best


def ours_command(model: Path) -> list[str]:
    return [sys.executable, "-m", "embedctl.cli", "serve", "--port", "{port}", "--model", str(model),
            "--max-length", str(MAX_LENGTH)]


class Served:
    """A server subprocess on a free loopback port, entered once /health answers 200 (its url, ready_seconds)."""

    def __init__(self, command: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = [part.replace("{port}", str(self.port)) for part in command]

    def __enter__(self) -> Served:
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = started + 900  # torch.compile and model load on a cold machine
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.ready_seconds = time.monotonic() - started
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.command} was not healthy in time")

    def __exit__(self, *_: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run_suites(args: argparse.Namespace, served: Served, query: str, document: str, corpus: list[str],
               profile: Path | None) -> dict:
    url = served.url
    out: dict = {"concurrency": [], "batch": None}
    suites = (("query", query, args.requests), ("doc512", document, max(args.requests // 4, 5)))
    for kind, text, requests in suites if "concurrency" in args.suites else ():
        for clients in CLIENTS[:2] if args.smoke else CLIENTS:
            body = json.dumps({"input": [text], "encoding_format": "base64"}).encode()
            points = [(kind, args.client)]
            if (kind, clients, args.client) == ("query", 1, "raw"):  # what a client library adds, for the record
                points.append(("query, httpx client", "httpx"))
            if profile is not None and (kind, clients) == ("query", CLIENTS[-1]):
                points.append((f"{kind}, profiled", args.client))
            for label, http in points:
                profile_to = profile.with_name(f"{profile.stem}-{kind}-{clients}.txt") if label.endswith("profiled") else None
                point = measure(url, [[body]] * clients, requests, warmup=2 if args.smoke else 20, http=http,
                                watch=ServerWatch(served.process.pid, profile_to))
                out["concurrency"].append({"kind": label, "clients": clients, **point})
                print(f"  {label:7} {clients:2} clients: p50 {point['p50_ms']:.2f} ms, p99 {point['p99_ms']:.2f} ms, "
                      f"{point['requests_per_s']:.0f} req/s, {point['errors']} errors, "
                      f"graph captures / eager runs {stalls(point)}; busy share of a core: {busy_summary(point['cpu'])}",
                      flush=True)
    if "batch" not in args.suites:
        return out
    size = args.batch_docs
    bodies = []
    for process in range(BATCH_PROCESSES):
        docs = corpus[process::BATCH_PROCESSES]
        bodies.append([json.dumps({"input": docs[i: i + size], "encoding_format": "base64"}).encode()
                       for i in range(0, len(docs) - size + 1, size)])
    # every body once before timing: the same single pass over the corpus that the engine-alone figure had
    runs = [("batch", None)] + ([("batch_profiled", profile)] if profile is not None else [])
    for key, profile_to in runs:  # profiled a second time: py-spy slows what it samples, the first figure stays clean
        out[key] = measure(url, bodies, args.batch_requests, warmup=max(len(b) for b in bodies), http=args.client,
                           watch=ServerWatch(served.process.pid, profile_to))
        print(f"  {key} {BATCH_PROCESSES} x {size} docs: {out[key]['tokens_per_s']:,.0f} tokens/s, "
              f"{out[key]['errors']} errors; busy share of a core: {busy_summary(out[key]['cpu'])}", flush=True)
    return out


class ServerWatch:
    """The CPU seconds of every thread of a server and of its child processes (the tokenizer workers) over
    a timed point, as shares of the point's wall time; with `profile`, a py-spy profile of the same span
    (raw collapsed stacks of the threads holding the GIL, each process's own)."""

    def __init__(self, pid: int, profile: Path | None) -> None:
        self.pid, self.profile = pid, profile
        self.tick = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self.spy = None
        if self.profile is not None:
            spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.pathsep.join(
                str(Path(p) / "bin") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p))
            if spy is None:
                raise SystemExit("--profile needs py-spy on the PATH or in PYTHONPATH's bin/ (pip install py-spy)")
            # --nonblocking: pausing five processes 1,000 times a second cut the suite's tokens/s by two thirds
            self.spy = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--subprocesses", "--gil", "--threads",
                                         "--nonblocking", "--rate", "250", "--format", "raw", "--output", str(self.profile)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attaches before the timed requests start
        self.before, self.started = self.cpu_seconds(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.started
        after = self.cpu_seconds()
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            _, errors = self.spy.communicate(timeout=120)
            if self.spy.returncode not in (0, -signal.SIGINT):
                print(f"  py-spy failed ({self.spy.returncode}): {errors.decode()[-500:]}", flush=True)
        return {name: round((seconds - self.before.get(name, 0.0)) / wall, 3) for name, seconds in after.items()}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far by thread: "server main" (the event loop), "server thread TID", "worker PID"
        (a child process, all its threads)."""
        seconds = {}
        for tid, used in self.threads(self.pid):
            seconds["server main" if tid == self.pid else f"server thread {tid}"] = used
        for child in self.children():
            seconds[f"worker {child}"] = sum(used for _, used in self.threads(child))
        return seconds

    def threads(self, pid: int) -> list[tuple[int, float]]:
        found = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            found.append((int(task.name), (int(fields[11]) + int(fields[12])) / self.tick))  # utime, stime
        return found

    def children(self) -> list[int]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == self.pid:
                    found.append(int(stat.parent.name))
            except (OSError, IndexError, ValueError):
                continue
        return found


def busy_summary(cpu: dict[str, float]) -> str:
    """The busiest threads and workers of a ServerWatch reading, e.g. "server main 0.97, worker 123 0.55"."""
    shown = sorted(cpu.items(), key=lambda item: -item[1])[:8]
    return ", ".join(f"{name} {share:.2f}" for name, share in shown if share >= 0.02)


def measure(url: str, bodies: list[list[bytes]], requests: int, warmup: int, http: str,
            watch: ServerWatch | None = None) -> dict:
    """One client process per entry of bodies, cycling through its bodies; all start together. http: "raw" or "httpx"."""
    context = multiprocessing.get_context("spawn")
    warmed, go = context.Barrier(len(bodies) + 1), context.Barrier(len(bodies) + 1)
    results = context.Queue()
    workers = [context.Process(target=client, args=(url, mine, requests, warmup, warmed, go, results, http))
               for mine in bodies]
    for worker in workers:
        worker.start()
    try:
        warmed.wait()
        before = graph_counts(url)  # between the barriers: every client warmed up, none timing yet
        if watch is not None:
            watch.start()
        go.wait()
    except threading.BrokenBarrierError:
        before = {}  # a client failed: its report follows
    except BaseException:
        warmed.abort()  # the clients stop waiting, report and exit
        go.abort()
        raise
    started = time.perf_counter()
    outcomes = []
    while len(outcomes) < len(workers):
        try:
            outcomes.append(results.get(timeout=5))
        except queue.Empty:  # a client killed outright reports nothing
            if dead := [worker.exitcode for worker in workers if worker.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process died (exit code {dead[0]})") from None
    wall = time.perf_counter() - started
    cpu = watch.stop() if watch is not None else None
    if failures := [o["failure"] for o in outcomes if "failure" in o]:
        raise RuntimeError(f"{len(failures)} client(s) failed, first: {failures[0]}")
    after = graph_counts(url)
    for worker in workers:
        worker.join()
    latencies = np.concatenate([o["latencies"] for o in outcomes]) * 1e3
    tokens = sum(o["tokens"] for o in outcomes)
    return {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall,
            "errors": sum(o["errors"] for o in outcomes), "requests": len(latencies),
            **({"cpu": cpu} if cpu is not None else {}),
            **{name: after[name] - before[name] for name in after.keys() & before.keys()}}


def graph_counts(url: str) -> dict[str, int]:
    """The server's graph captures and eager runs so far, from /metrics (the peer has none): either stalls the
    requests in flight."""
    counts = {}
    reply = httpx.get(url + "/metrics", timeout=30)
    for line in reply.text.splitlines() if reply.status_code == 200 else []:
        for name in ("graph_captures", "eager_runs"):
            if line.startswith(f"embedctl_{name}_total "):
                counts[name] = int(float(line.split()[1]))
    return counts


def client(url: str, bodies: list[bytes], requests: int, warmup: int, warmed, go, results, http: str) -> None:
    """Send `warmup` requests untimed, meet the others at both barriers, then `requests` back to back.
    A failure is put on `results` too, so measure() reports it rather than waiting for this client."""
    latencies, tokens, errors = [], 0, 0
    try:
        with (RawClient if http == "raw" else HttpxClient)(url) as post:
            for i in range(warmup):
                post(bodies[i % len(bodies)])
            warmed.wait()
            go.wait()
            for i in range(requests):
                started = time.perf_counter()
                status, reply = post(bodies[i % len(bodies)])
                latencies.append(time.perf_counter() - started)
                if status == 200:
                    tokens += int(TOTAL_TOKENS.search(reply)[1])
                else:
                    errors += 1
    except Exception as error:  # noqa: BLE001 - handed to the parent process, which raises it
        warmed.abort()  # the others and the parent stop waiting for this client
        go.abort()
        results.put({"failure": f"{type(error).__name__}: {error}"})
        return
    results.put({"latencies": np.array(latencies), "tokens": tokens, "errors": errors})


def post_request(body: bytes) -> bytes:
    """A whole HTTP/1.1 POST /v1/embeddings of a JSON body, as RawClient sends it."""
    return (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class RawClient:
    """One keep-alive HTTP/1.1 connection: called with a JSON body, it posts it to /v1/embeddings and
    returns (status, reply body), reading the reply by its Content-Length (the servers here send one)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.address = host, int(port)
        self.requests: dict[bytes, bytes] = {}

    def __enter__(self) -> RawClient:
        self.connect()
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def connect(self) -> None:
        self.sock = socket.create_connection(self.address, timeout=300)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, body: bytes) -> tuple[int, bytes]:
        if body not in self.requests:
            self.requests[body] = post_request(body)
        try:
            return self.exchange(self.requests[body])
        except ConnectionError:  # before any reply: uvicorn closes a connection idle for 5 s, so open a new one
            self.sock.close()
            self.connect()
            return self.exchange(self.requests[body])

    def exchange(self, request: bytes) -> tuple[int, bytes]:
        self.sock.sendall(request)
        reply = self.receive(b"")
        while (head_end := reply.find(b"\r\n\r\n")) < 0:
            reply = self.receive(reply)
        if (length := CONTENT_LENGTH.search(reply, 0, head_end + 2)) is None:
            raise RuntimeError(f"a reply without Content-Length: {reply[:head_end]!r}")
        end = head_end + 4 + int(length[1])
        while len(reply) < end:
            reply = self.receive(reply)
        return int(reply[9:12]), reply[head_end + 4:end]

    def receive(self, reply: bytes) -> bytes:
        """The reply so far with the next bytes; a connection lost before any reply is a ConnectionError,
        one lost in the middle of a reply a RuntimeError (a failure, not a closed idle connection)."""
        try:
            chunk = self.sock.recv(1 << 20)
        except ConnectionError as error:
            if reply:
                raise RuntimeError(f"the connection broke in the middle of a reply ({error})") from None
            raise
        if not chunk:
            if reply:
                raise RuntimeError("the server closed the connection in the middle of a reply")
            raise ConnectionError("the server closed the connection")
        return reply + chunk


class HttpxClient:
    """RawClient's calls through an httpx.Client."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=300, headers={"Content-Type": "application/json"})

    def __enter__(self) -> HttpxClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def __call__(self, body: bytes) -> tuple[int, bytes]:
        reply = self.http.post("/v1/embeddings", content=body)
        return reply.status_code, reply.content


def run_peer(model: Path, port: int) -> None:
    """The peer: sentence-transformers encode() behind the smallest FastAPI endpoint that speaks the same API."""
    import torch
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = SentenceTransformer(str(model), device=device)
    st.max_seq_length = MAX_LENGTH
    if device == "cuda":
        st.half()
    tokenizer = st.tokenizer
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(body: dict) -> dict:
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = st.encode(texts, batch_size=len(texts), convert_to_numpy=True, normalize_embeddings=True)
        tokens = sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"])
        return {"object": "list", "model": body.get("model"),
                "data": [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def stalls(point: dict) -> str:
    if "graph_captures" not in point:
        return "n/a"
    return f"{point['graph_captures']} / {point['eager_runs']}"


def render(results: dict) -> str:
    engine = results["engine_model_only_tokens_per_s"]
    lines = [f"`embedctl serve` vs sentence-transformers behind FastAPI on {results['device']} "
             f"({Path(results['model']).name}{', smoke' if results['smoke'] else ''}; "
             f"{results.get('client', 'httpx')} HTTP clients)", "",
             "| requests | clients | server | p50 ms | p99 ms | req/s | tokens/s | errors | graph captures / eager runs while timed |",
             "|---|---|---|---|---|---|---|---|---|"]
    names = list(results["servers"])
    points = {(name, p["kind"], p["clients"]): p for name in names for p in results["servers"][name]["concurrency"]}
    for kind, clients in dict.fromkeys((k, c) for _, k, c in points):
        for name in names:
            if (p := points.get((name, kind, clients))) is not None:
                lines.append(f"| {kind} | {clients} | {name} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} | "
                             f"{p['requests_per_s']:,.0f} | {p['tokens_per_s']:,.0f} | {p['errors']} | "
                             f"{stalls(p)} |")
    lines += ["", f"{BATCH_PROCESSES} processes x requests of {results['batch_docs']} documents; the engine alone: {engine:,.0f} tokens/s", "",
              "| server | tokens/s | share of the engine alone | p50 ms per request | errors | busiest threads and workers, share of a core |",
              "|---|---|---|---|---|---|"]
    for name in names:
        if (b := results["servers"][name]["batch"]) is None:
            continue
        lines.append(f"| {name} | {b['tokens_per_s']:,.0f} | {b['tokens_per_s'] / engine:.0%} | {b['p50_ms']:.1f} | {b['errors']} | "
                     f"{busy_summary(b.get('cpu', {}))} |")
    lines += ["", "Seconds from start to a healthy server: "
              + ", ".join(f"{name} {results['servers'][name]['ready_seconds']:.1f}" for name in names)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
