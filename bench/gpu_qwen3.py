"""Side-by-side GPU benchmark for a Qwen3-Embedding-0.6B-shaped model: embedctl against sentence-transformers.

One run, one GPU, the same random-weight checkpoint (bf16; random weights time like real ones) and the
same pre-tokenized inputs, so both sides are model-only (no tokenizer, no files):
  throughput  --docs documents of 512 tokens: ours through Engine.embed at a 16,384-token budget
              (CUDA graphs; on the default lanes and on one: engine.graphs) and at the model's
              default budget (32,768 tokens: eager steps, see engine.graphs); sentence-transformers'
              forward on padding-free batches of 128
  latency     batch 1 at 128, 512 and 4,096 tokens (the design's low-latency suite), p50/p99 ms,
              host result included: ours with graphs, ours eager, sentence-transformers
  agreement   the smallest cosine between our vectors and sentence-transformers' for 16 documents
Writes every figure to results.json and the markdown table to report.md under --out, and prints the
table last. `--smoke` runs a tiny config on whatever device there is (the CPU here) to check the script.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import common
from engine import Engine, EngineConfig, PackedBatch
from tests.test_qwen3 import QWEN3_06B, SMALL_QWEN3, save_random_qwen3

LATENCY_TOKENS = (128, 512, 4096)
DOC_TOKENS, ST_BATCH = 512, 128
BF16_CEILING = 796e12  # FLOP/s, measured on the H200 (8192^3 matmul; ../shared/gpu/README.md)
TARGETS = {"throughput_tok_s": 0.45e6, "p50_ms": {128: 1.5, 512: 2.5, 4096: 10.0}}


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = {**SMALL_QWEN3, "max_position_embeddings": 16384, "vocab_size": 30522} if args.smoke else QWEN3_06B
    path = save_random_qwen3(Path(tempfile.mkdtemp(prefix="embedctl-qwen3-")) / "model", device=device, **shape)
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, min(shape["vocab_size"], 30000), DOC_TOKENS).astype(np.int32) for _ in range(args.docs)]
    singles = {n: rng.integers(5, 30000, n).astype(np.int32) for n in LATENCY_TOKENS}
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                     "shape": {k: v for k, v in shape.items() if k != "rope_parameters"}, "docs": args.docs,
                     "flop_per_token": flop_per_token(shape, DOC_TOKENS), "ours": {}}
    samples: dict[str, np.ndarray] = {}
    for backend in args.attention:
        try:
            results["ours"][backend] = ours(path, backend, docs, singles, args, samples)
        except Exception as error:  # noqa: BLE001 - a backend that cannot run here is reported, not fatal
            results["ours"][backend] = {"skipped": f"{type(error).__name__}: {error}"}
        write(args.out, results)
    if args.peers:
        results["sentence_transformers"], reference = peer(path, docs, singles, args, device)
        for backend, vectors in samples.items():
            results["ours"][backend]["min_cosine_vs_st"] = float(cosine(vectors, reference).min())
    write(args.out, results)
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2048, help="documents of 512 tokens for the throughput suite")
    parser.add_argument("--attention", default="auto", help="comma-separated backends: auto, varlen, flashinfer")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per latency point")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu_qwen3"))
    parser.add_argument("--smoke", action="store_true", help="tiny config on any device: checks the script")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="measure embedctl only")
    args = parser.parse_args()
    args.attention = args.attention.split(",")
    if args.smoke:
        args.docs, args.repeats = min(args.docs, 2 * ST_BATCH // 16), 3
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def flop_per_token(shape: dict, seqlen: int) -> float:
    """Dense GEMMs plus causal attention at `seqlen` (QK^T and PV over seqlen / 2 keys on average)."""
    hidden, d, layers = shape["hidden_size"], shape["head_dim"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    dense = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * shape["intermediate_size"]
    return layers * (2 * dense + 2 * 2 * q * seqlen / 2)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call: Callable[[], object]) -> float:
    synchronize()
    started = time.perf_counter()
    call()
    synchronize()
    return time.perf_counter() - started


def percentiles(call: Callable[[], object], repeats: int) -> dict:
    """bench.common.percentiles of call() with the device drained at the end of each call."""
    return common.percentiles(lambda: (call(), synchronize()), repeats, warmup=5)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def ours(path: Path, backend: str, docs: list[np.ndarray], singles: dict, args: argparse.Namespace,
         samples: dict[str, np.ndarray]) -> dict:
    tokens = len(docs) * DOC_TOKENS
    out: dict = {"throughput_tok_s": {}, "latency": {}}
    budgets = {"16384 (graphs)": EngineConfig(attention=backend, max_batch_tokens=16384, max_length=16384),
               "16384 (graphs, one lane)": EngineConfig(attention=backend, max_batch_tokens=16384, max_length=16384,
                                                        lanes=1),
               "default (eager past 16384)": EngineConfig(attention=backend)}
    for label, config in budgets.items():
        engine = Engine.load(str(path), config)
        out["attention"], out["dtype"] = engine.attention, str(engine.dtype)
        engine.embed(docs)  # first hit of each shape eager, second captures
        engine.embed(docs)
        seconds = min(timed(lambda: engine.embed(docs)) for _ in range(3))
        out["throughput_tok_s"][f"budget {engine.max_batch_tokens} {label.split(' ', 1)[1]}"] = tokens / seconds
        out[f"graph_stats {label}"] = vars(engine.stats)
        print(f"{backend} {label}: {tokens / seconds:,.0f} tok/s", flush=True)
    graphs = Engine.load(str(path), EngineConfig(attention=backend))
    eager = Engine.load(str(path), EngineConfig(attention=backend, cuda_graphs=False))
    samples[backend] = graphs.embed(docs[:16])
    for n, ids in singles.items():
        batch = PackedBatch.of([ids])
        out["latency"][n] = {"graphs": percentiles(lambda: graphs.step(batch).result(), args.repeats),
                             "eager": percentiles(lambda: eager.step(batch).result(), args.repeats)}
        print(f"{backend} batch 1 x {n}: {json.dumps(out['latency'][n])}", flush=True)
    return out


def peer(path: Path, docs: list[np.ndarray], singles: dict, args: argparse.Namespace,
         device: str) -> tuple[dict, np.ndarray]:
    """sentence-transformers on the same checkpoint (Transformer + last-token Pooling), forward only;
    its figures and its vectors for the first 16 documents."""
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    st = SentenceTransformer(str(path), device=device, model_kwargs={"dtype": dtype})

    def forward(rows: list[np.ndarray]) -> np.ndarray:
        ids = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.inference_mode():
            features = st({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return features["sentence_embedding"].float().cpu().numpy()

    batches = [docs[i:i + ST_BATCH] for i in range(0, len(docs), ST_BATCH)]
    forward(batches[0])
    seconds = min(timed(lambda: [forward(b) for b in batches]) for _ in range(2))
    out = {"throughput_tok_s": {f"batch {ST_BATCH}": len(docs) * DOC_TOKENS / seconds}, "latency": {}}
    for n, ids in singles.items():
        out["latency"][n] = percentiles(lambda: forward([ids]), args.repeats)
    print(f"sentence-transformers: {json.dumps(out)}", flush=True)
    return out, forward(docs[:16])


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))


def render(results: dict) -> str:
    flop = results["flop_per_token"]
    ceiling = BF16_CEILING / flop
    lines = [f"GPU: {results['device']}, torch {results['torch']}, Qwen3 shape "
             f"{results['shape']['num_hidden_layers']} layers x {results['shape']['hidden_size']}, "
             f"{flop / 1e9:.2f} GFLOP/token at {DOC_TOKENS} tokens (bf16 ceiling {ceiling / 1e6:.2f}M tok/s)", "",
             "| | tokens/s (share of ceiling) | " + " | ".join(f"batch 1, {n} tok p50 / p99 ms" for n in LATENCY_TOKENS) + " |",
             "|---" * (2 + len(LATENCY_TOKENS)) + "|"]
    rows = []
    for backend, run in results["ours"].items():
        if "skipped" in run:
            lines.append(f"| embedctl ({backend}) | skipped: {run['skipped'][:80]} |")
            continue
        for label, rate in run["throughput_tok_s"].items():
            rows.append((f"embedctl {run['attention']}, {label}", rate, {}))
        agreement = f" (cosine vs ST >= {run['min_cosine_vs_st']:.4f})" if "min_cosine_vs_st" in run else ""
        rows.append((f"embedctl {run['attention']}, batch 1, graphs{agreement}", None,
                     {n: p["graphs"] for n, p in run["latency"].items()}))
        rows.append((f"embedctl {run['attention']}, batch 1, eager", None, {n: p["eager"] for n, p in run["latency"].items()}))
    if "sentence_transformers" in results:
        peer_run = results["sentence_transformers"]
        rows.append((f"sentence-transformers, batch {ST_BATCH}", next(iter(peer_run["throughput_tok_s"].values())),
                     peer_run["latency"]))
    for label, rate, latency in rows:
        cells = [f"{rate:,.0f} ({rate / ceiling:.0%})" if rate else ""]
        cells += [f"{latency[n]['p50_ms']:.2f} / {latency[n]['p99_ms']:.2f}" if n in latency else "" for n in LATENCY_TOKENS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(f"| target | {TARGETS['throughput_tok_s']:,.0f} | "
                 + " | ".join(f"p50 <= {TARGETS['p50_ms'][n]}" for n in LATENCY_TOKENS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
