"""Side-by-side GPU benchmarks: the embedctl engine against sentence-transformers and plain transformers.

One run measures every suite of the design (../shared/DESIGN.md) on the same GPU, same inputs:
  latency     batch 1 at 16, 128 and 512 tokens, p50/p99 ms: ours with graphs (engine step, and
              text in through the tokenizer), ours eager, sentence-transformers encode(), HF forward
  throughput  --docs corpus documents, model-only tokens/s (ours pre-tokenized; ST encode() at
              batch 32/128/512; HF forward on length-sorted batches of 128) and end to end, file in
              to file out (ours: run_index Parquet -> Parquet; peer: pyarrow + ST encode + Parquet),
              with the share of wall time the GPU was busy during our end-to-end run, and ours again
              with tokenizer worker processes (which a run of fewer rows than MIN_ROWS does without);
              read + tokenize alone, in this process and in workers
  saturation  our tokens/s against tokens per batch, 64 to 16,384 (batches of real-length sequences),
              and on to 65,536 under a --max-batch-tokens that allows it (eager past 16,384: engine.graphs)
  graphs      graphs against eager for small batches
  profile     where our GPU time goes at the largest batch, by kernel class
Models: all-MiniLM-L6-v2 (real weights, --minilm) and a BERT-base-shaped random-weight model (the
same timings as real weights). Writes results.json, report.md and saturation.png under --out and
prints the report last. `--smoke` runs tiny sizes on any device to check the script itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.common import percentiles, random_bert_base
from engine import Engine, EngineConfig, PackedBatch
from pipelines.index import IndexModel, IndexOptions, run_index
from pipelines.readers import CorpusReader
from pipelines.tokenize import TextTokenizer
from pipelines.tokenize_pool import TokenizerPool, default_processes

LATENCY_TOKENS = (16, 128, 512)
SATURATION_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
GRAPH_BATCHES = ((1, 16), (1, 64), (1, 256), (4, 256))  # (sequences, tokens each)
ST_BATCH_SIZES = (32, 128, 512)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    corpus = pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist()
    texts = list(itertools.islice(itertools.cycle(corpus), args.docs))  # a smaller corpus is repeated
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "docs": len(texts), "models": {}}
    scratch = Path(tempfile.mkdtemp(prefix="embedctl-bench-"))
    for name, path in model_dirs(args, scratch).items():
        for backend, lanes in [(backend, lanes) for backend in args.attention for lanes in args.lanes]:
            label = f"{name} ({backend})" if len(args.lanes) == 1 else f"{name} ({backend}, {lanes} lanes)"
            try:
                engine = load(path, backend, lanes=lanes, max_batch_tokens=args.max_batch_tokens)
            except Exception as error:  # noqa: BLE001 - a backend that cannot run this model is reported, not fatal
                results["models"][label] = {"skipped": str(error)}
                continue
            print(f"== {label}: attention {engine.attention_label}, dtype {engine.dtype}", flush=True)
            first = backend == args.attention[0] and lanes == args.lanes[0]
            results["models"][label] = run_suites(args, engine, path, texts, scratch, peers=args.peers and first)
            del engine
            torch.cuda.empty_cache() if device == "cuda" else None
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report = render(results)
    (args.out / "report.md").write_text(report)
    plot(results, args.out / "saturation.png")
    print(report)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="all-MiniLM-L6-v2 directory")
    parser.add_argument("--corpus", type=Path, required=True, help="Parquet file with a text column")
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--models", default="minilm,bert-base")
    parser.add_argument("--attention", default="auto", help="comma-separated backends to compare")
    parser.add_argument("--lanes", default=str(EngineConfig.lanes), help="comma-separated lane counts to compare")
    parser.add_argument("--max-batch-tokens", type=int, help="the engine's token budget (default: its own)")
    parser.add_argument("--suites", default="latency,throughput,saturation,graphs,profile")
    parser.add_argument("--repeats", type=int, default=300, help="timed calls per latency point")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="measure embedctl only")
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.attention = args.attention.split(",")
    args.lanes = [int(lanes) for lanes in args.lanes.split(",")]
    args.suites = set(args.suites.split(","))
    if args.smoke:
        args.docs, args.repeats = min(args.docs, 40), 3
    return args


def model_dirs(args: argparse.Namespace, scratch: Path) -> dict[str, Path]:
    dirs = {}
    if "minilm" in args.models:
        dirs["MiniLM-L6"] = args.minilm
    if "bert-base" in args.models:
        dirs["BERT-base"] = random_bert_base(scratch / "bert-base")
    return dirs


def load(path: Path, backend: str, **options: object) -> Engine:
    # 512 tokens everywhere so MiniLM runs the 512-token latency point like the peers do.
    return Engine.load(str(path), EngineConfig(attention=backend, max_length=512, **options))


def run_suites(args: argparse.Namespace, engine: Engine, path: Path, texts: list[str], scratch: Path,
               peers: bool) -> dict:
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    ids = tokenizer.encode(texts).ids
    out: dict = {"attention": engine.attention_label, "tokens": int(sum(map(len, ids)))}
    st = hf = None
    if peers:
        from sentence_transformers import SentenceTransformer
        from transformers import AutoModel

        st = SentenceTransformer(str(path), device=engine.device.type, model_kwargs={"dtype": engine.dtype})
        st.max_seq_length = engine.max_length
        hf = AutoModel.from_pretrained(path, dtype=engine.dtype, attn_implementation="sdpa").to(engine.device).eval()
    if "latency" in args.suites:
        out["latency"] = latency_suite(args, engine, path, tokenizer, st, hf)
    if "throughput" in args.suites:
        out["throughput"] = throughput_suite(engine, tokenizer, texts, ids, scratch, st, hf)
    if "saturation" in args.suites:
        out["saturation"] = saturation_suite(engine, ids, args.smoke)
    if "graphs" in args.suites:
        out["graphs"] = graphs_suite(args, engine, path)
    if "profile" in args.suites and engine.device.type == "cuda":
        out["profile"] = profile_suite(engine, ids)
    out["graph_stats"] = vars(engine.stats)
    return out


def latency_suite(args, engine: Engine, path: Path, tokenizer: TextTokenizer, st, hf) -> dict:
    from embedctl.api import Embedder

    eager = load(path, engine.config.attention, cuda_graphs=False, lanes=engine.config.lanes)
    uncompiled = load(path, engine.config.attention, compile=False, lanes=engine.config.lanes)
    as_text = Embedder(engine)
    suite = {}
    for tokens in LATENCY_TOKENS:
        text = " ".join(["hello"] * (tokens - 2))  # "hello" is one token; [CLS] and [SEP] make two more
        batch = PackedBatch.of(tokenizer.encode([text]).ids)
        assert batch.num_tokens == tokens, batch.num_tokens
        point = {
            "ours_graphs": percentiles(lambda: engine.step(batch).result(), args.repeats),
            "ours_graphs_uncompiled": percentiles(lambda: uncompiled.step(batch).result(), args.repeats),
            "ours_text_in": percentiles(lambda: as_text.embed([text]), args.repeats),
            "ours_eager": percentiles(lambda: eager.step(batch).result(), args.repeats),
        }
        if st is not None:
            point["sentence_transformers"] = percentiles(lambda: st.encode([text]), args.repeats)
            point["hf_transformers"] = percentiles(lambda: hf_embed(hf, [batch.input_ids], engine.device), args.repeats)
        suite[tokens] = point
        print(f"latency {tokens}: {json.dumps(point)}", flush=True)
    return suite


def hf_embed(hf, sequences: list[np.ndarray], device: torch.device) -> np.ndarray:
    """Plain transformers as most users run it: padded batch, forward, masked mean, normalise, to host."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
        mask[row, : len(seq)] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()


def timed(call: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def throughput_suite(engine: Engine, tokenizer: TextTokenizer, texts: list[str], ids: list[np.ndarray],
                     scratch: Path, st, hf) -> dict:
    tokens = sum(map(len, ids))
    rate = lambda seconds: tokens / seconds  # noqa: E731 - one formula for every row
    suite = {"ours_model_first_pass": rate(timed(lambda: engine.embed(ids)))}  # includes lazy captures
    # The best of two more passes: a shape first seen in the last pass's last batch is captured in the next one.
    suite["ours_model"] = rate(min(timed(lambda: engine.embed(ids)) for _ in range(2)))
    source = scratch / "corpus.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(len(texts))], "text": texts}), source)
    options = IndexOptions(source=str(source), out=str(scratch / "ours.parquet"), rebuild=True)
    suite["ours_end_to_end"] = rate(timed(lambda: run_index(IndexModel.loaded(engine), options)))
    suite["ours_end_to_end_gpu_busy"] = gpu_busy_share(lambda: run_index(IndexModel.loaded(engine), options))
    in_workers = replace(options, tokenizer_processes=default_processes(engine.device.type == "cuda"))
    suite["ours_end_to_end_tokenizing_in_workers"] = rate(timed(lambda: run_index(IndexModel.loaded(engine), in_workers)))
    suite["ours_read_and_tokenize_only"] = rate(timed(lambda: [tokenizer.encode([t or "" for t in chunk.texts])
                                                              for chunk in CorpusReader(str(source))]))
    with TokenizerPool(tokenizer, default_processes(engine.device.type == "cuda")) as pool:
        pool.wait_for_workers()
        suite["ours_read_and_tokenize_in_workers"] = rate(timed(lambda: [
            future.result() for future in [pool.submit([t or "" for t in chunk.texts]) for chunk in CorpusReader(str(source))]]))
    if st is not None:
        st.encode(texts[:256], batch_size=128)
        for batch_size in ST_BATCH_SIZES:
            suite[f"sentence_transformers_bs{batch_size}"] = rate(timed(lambda: st.encode(texts, batch_size=batch_size)))
        best = max(ST_BATCH_SIZES, key=lambda b: suite[f"sentence_transformers_bs{b}"])
        suite["sentence_transformers_end_to_end"] = rate(timed(lambda: peer_index(st, source, scratch / "peer.parquet", best)))
        order = np.argsort([len(s) for s in ids])
        batches = [[ids[i] for i in order[start:start + 128]] for start in range(0, len(ids), 128)]
        suite["hf_transformers_sorted_bs128"] = rate(timed(lambda: [hf_embed(hf, b, engine.device) for b in batches]))
    print(f"throughput: {json.dumps(suite)}", flush=True)
    return suite


def peer_index(st, source: Path, out: Path, batch_size: int) -> None:
    """The peer's whole run: read the Parquet file, encode, write vectors to Parquet."""
    table = pq.read_table(source)
    vectors = st.encode(table.column("text").to_pylist(), batch_size=batch_size, convert_to_numpy=True)
    flat = pa.array(vectors.astype(np.float32).reshape(-1))
    pq.write_table(pa.table({"id": table.column("id"),
                             "vector": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])}), out)


def gpu_busy_share(call: Callable[[], object]) -> float | None:
    """Share of wall time with a kernel or copy running on the GPU, from the torch profiler's trace."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        wall = timed(call)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in trace.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:  # union of intervals, in microseconds
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6 / wall


def batch_of(ids: list[np.ndarray], tokens: int, start: int = 0) -> PackedBatch:
    """Real-length sequences in corpus order, the last one cut so the batch has exactly `tokens`."""
    picked, total, index = [], 0, start
    while total < tokens:
        seq = ids[index % len(ids)][: tokens - total]
        picked.append(seq)
        total += len(seq)
        index += 1
    return PackedBatch.of(picked)


def saturation_suite(engine: Engine, ids: list[np.ndarray], smoke: bool) -> dict:
    suite = {}
    for tokens in SATURATION_TOKENS[:3] if smoke else SATURATION_TOKENS:
        if tokens > engine.max_batch_tokens:
            break
        batch = batch_of(ids, tokens)
        for _ in range(2):  # eager, then captures on the lanes the batches in flight take
            burst(engine, batch, 4)
        steps = 3 if smoke else max(20, 400_000 // tokens)
        seconds = timed(lambda: burst(engine, batch, steps))
        suite[tokens] = tokens * steps / seconds
    if not smoke:
        uncompiled = load(engine.files.path, engine.config.attention, compile=False, lanes=engine.config.lanes,
                          max_batch_tokens=engine.max_batch_tokens)
        batch = batch_of(ids, engine.max_batch_tokens)
        for _ in range(2):
            burst(uncompiled, batch, 4)
        steps = 40
        seconds = timed(lambda: burst(uncompiled, batch, steps))
        suite[f"{batch.num_tokens}_uncompiled"] = batch.num_tokens * steps / seconds
    print(f"saturation: {json.dumps(suite)}", flush=True)
    return suite


def burst(engine: Engine, batch: PackedBatch, steps: int) -> None:
    """`steps` steps of one batch in flight at once, every result read: on several lanes the last
    batch enqueued can finish before an earlier one."""
    for lazy in [engine.step(batch) for _ in range(steps)]:
        lazy.result()


def graphs_suite(args, engine: Engine, path: Path) -> dict:
    eager = load(path, engine.config.attention, cuda_graphs=False, lanes=engine.config.lanes)
    rng = np.random.default_rng(0)
    suite = {}
    for seqs, length in GRAPH_BATCHES:
        batch = PackedBatch.of([np.concatenate([[101], rng.integers(1000, 29000, length - 2), [102]]) for _ in range(seqs)])
        suite[f"{seqs}x{length}"] = {
            "graphs": percentiles(lambda: engine.step(batch).result(), args.repeats),
            "eager": percentiles(lambda: eager.step(batch).result(), args.repeats),
        }
    print(f"graphs: {json.dumps(suite)}", flush=True)
    return suite


KERNEL_CLASSES = (("attention", ("flash", "fmha", "prefill", "attention")),
                  ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90")),
                  ("layer_norm", ("layer_norm",)),
                  ("gelu", ("gelu",)),
                  ("copy", ("memcpy", "copy")),
                  ("index/pool", ("index", "scatter", "gather", "pool")))


def profile_suite(engine: Engine, ids: list[np.ndarray]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    batch = batch_of(ids, engine.max_batch_tokens)
    for _ in range(3):
        engine.step(batch).result()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(10):
            engine.step(batch).result()
    classes: dict[str, float] = {}
    for event in trace.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = next((label for label, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other elementwise")
        classes[kind] = classes.get(kind, 0.0) + event.self_device_time_total
    total = sum(classes.values())
    suite = {kind: round(100 * t / total, 1) for kind, t in sorted(classes.items(), key=lambda kv: -kv[1])}
    suite["top_kernels"] = [(e.key[:80], round(e.self_device_time_total / 10)) for e in sorted(
        (e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: -e.self_device_time_total)[:8]]
    print(f"profile (% of GPU time at {batch.num_tokens} tokens): {json.dumps(suite)}", flush=True)
    return suite


def render(results: dict) -> str:
    lines = [f"GPU: {results['device']}, torch {results['torch']}, {results['docs']} corpus documents", ""]
    for label, model in results["models"].items():
        if "skipped" in model:
            lines += [f"### {label}: skipped ({model['skipped']})", ""]
            continue
        lines += [f"### {label}", ""]
        if "latency" in model:
            lines += ["| batch 1 | " + " | ".join(next(iter(model["latency"].values()))) + " |",
                      "|---" * (1 + len(next(iter(model["latency"].values())))) + "|"]
            for tokens, point in model["latency"].items():
                lines.append(f"| {tokens} tok p50 / p99 ms | " + " | ".join(
                    f"{v['p50_ms']:.3f} / {v['p99_ms']:.3f}" for v in point.values()) + " |")
            lines.append("")
        if "throughput" in model:
            lines += ["| throughput | tokens/s |", "|---|---|"]
            lines += [f"| {k} | {v:,.0f} |" if k != "ours_end_to_end_gpu_busy" else f"| {k} | {v:.0%} |"
                      for k, v in model["throughput"].items() if v is not None]
            lines.append("")
        if "saturation" in model:
            lines += ["| tokens per batch | " + " | ".join(str(t) for t in model["saturation"]) + " |",
                      "|---" * (1 + len(model["saturation"])) + "|",
                      "| Mtok/s | " + " | ".join(f"{v / 1e6:.2f}" for v in model["saturation"].values()) + " |", ""]
        if "graphs" in model:
            lines += ["| batch | graphs p50 ms | eager p50 ms | speed-up |", "|---|---|---|---|"]
            for shape, point in model["graphs"].items():
                g, e = point["graphs"]["p50_ms"], point["eager"]["p50_ms"]
                lines.append(f"| {shape} | {g:.3f} | {e:.3f} | {e / g:.1f}x |")
            lines.append("")
        if "profile" in model:
            lines += ["GPU time by kernel class at the largest batch: " + ", ".join(
                f"{k} {v}%" for k, v in model["profile"].items() if k != "top_kernels"), ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for label, model in results["models"].items():
        if "saturation" in model:
            curve = {int(k): v for k, v in model["saturation"].items() if str(k).isdigit()}
            line, = axis.plot(list(curve), [v / 1e6 for v in curve.values()], marker="o", label=f"embedctl {label}")
            peer = model.get("throughput", {}).get("sentence_transformers_bs512")
            if peer:
                axis.axhline(peer / 1e6, linestyle="--", color=line.get_color(), label=f"sentence-transformers bs512 {label}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens per batch")
    axis.set_ylabel("million tokens/s")
    axis.set_title(f"embedctl saturation curve, {results['device']}")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
