"""The GPU engine on a real CUDA device: correctness of every GPU path. Skipped without CUDA.

Run on the device machine with `pytest -m gpu` (EMBEDCTL_TEST_MODEL may point at a MiniLM copy).
Tolerances are bf16/fp16 ones: cosine >= 0.999 against fp32 references.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import embedctl
from engine import Engine, EngineConfig, PackedBatch
from engine.attention import (FEW_SEQUENCES, AttentionLayout, FlashInferAttention, SdpaAttention, TritonAttention,
                              VarlenAttention, flashinfer_available)
from engine.graphs import all_shapes
from tests.models import BERT_BASE, save_dense_model, save_random_model

pytestmark = pytest.mark.gpu

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="flashinfer-python is not installed")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    corpus = pq.read_table("sample_data/corpus/part-000.parquet").column("text").to_pylist()
    return corpus + ["", "   ", "Ünïcödé 日本語 🚀", "short", "word " * 600]


@pytest.fixture(scope="module")
def cpu_minilm(minilm_dir) -> Engine:
    return Engine.load(str(minilm_dir), EngineConfig(device="cpu"))


@pytest.mark.parametrize("attention", ["varlen", "triton"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_real_minilm_matches_sentence_transformers_fp32(minilm_dir, texts, dtype: str, attention: str) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cuda").encode(texts, convert_to_numpy=True)
    model = embedctl.load(str(minilm_dir), dtype=dtype, attention=attention)
    for _ in range(3):  # eager, then each batch shape captured, then replayed
        assert cosine(model.embed(texts), reference).min() >= 0.999
    assert model.engine.stats.replays >= 1


def test_graph_replay_equals_eager(minilm_dir, texts) -> None:
    model = embedctl.load(str(minilm_dir))
    batch = PackedBatch.of(model.tokenizer.encode(texts[:40]).ids)
    first, captured, replayed = (model.engine.step(batch).result() for _ in range(3))
    stats = model.engine.stats
    assert (stats.eager_runs, stats.captures, stats.replays) == (1, 1, 1)
    assert cosine(captured, first).min() >= 0.9999
    # Bitwise: pool_normalize sums each sequence's rows in one program, in a fixed order.
    np.testing.assert_array_equal(replayed, captured)
    no_graphs = embedctl.load(str(minilm_dir), cuda_graphs=False)
    assert cosine(no_graphs.engine.step(batch).result(), captured).min() >= 0.9999
    assert no_graphs.engine.stats.captures == 0


def test_embed_from_threads_at_once_on_the_gpu_equals_one_call_at_a_time(minilm_dir, texts) -> None:
    from concurrent.futures import ThreadPoolExecutor

    model = embedctl.load(str(minilm_dir))
    batches = [texts[i::4] for i in range(4)] * 3
    alone = [model.embed(batch) for batch in batches]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(model.embed, batches))
    for one, other in zip(alone, together):  # eager and replayed runs differ in rounding only
        assert cosine(other, one).min() >= 0.9999


def test_matryoshka_dim_on_the_gpu_equals_the_cpu(minilm_dir, texts) -> None:
    gpu = Engine.load(str(minilm_dir), EngineConfig(dim=100))
    cpu = Engine.load(str(minilm_dir), EngineConfig(device="cpu", dim=100))
    sequences = embedctl.Embedder(cpu).tokenizer.encode(texts).ids
    expected = cpu.embed(sequences)
    for _ in range(3):  # eager, capture, replay
        vectors = gpu.embed(sequences)
        assert vectors.shape == (len(texts), 100)
        assert cosine(vectors, expected).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("total", [64, 65, 1024, 1025, 3000])
def test_bucket_boundaries(minilm_dir, cpu_minilm, total: int) -> None:
    rng = np.random.default_rng(total)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(rng.integers(2, 200)), total - sum(lengths)))
    sequences = [np.concatenate([[101], rng.integers(1000, 29000, n - 2), [102]])[:n] for n in lengths]
    batch = PackedBatch.of(sequences)
    assert batch.num_tokens == total
    engine = Engine.load(str(minilm_dir))
    results = [engine.step(batch).result() for _ in range(3)]  # eager, capture, replay
    reference = cpu_minilm.step(batch).result()
    for result in results:
        assert cosine(result, reference).min() >= 0.999


def test_readback_ring_never_overwrites_unread_results(minilm_dir, texts, cpu_minilm) -> None:
    engine = Engine.load(str(minilm_dir), EngineConfig(pinned_slots=2, max_batch_tokens=1024))
    model = embedctl.load(str(minilm_dir), device="cpu")
    ids = model.tokenizer.encode(texts).ids
    batches = [PackedBatch.of(ids[i:i + 5]) for i in range(0, 60, 5)]
    expected = [cpu_minilm.step(batch).result() for batch in batches]
    for _ in range(3):  # eager runs, then captures, then replays, on whichever lanes are free
        pending = [engine.step(batch) for batch in batches]  # far more batches than slots, none read yet
        for lazy, reference in zip(pending, expected):
            assert cosine(lazy.result(), reference).min() >= 0.999
    assert engine.stats.replays > 0


def test_a_batch_takes_the_first_free_lane_and_every_lane_gives_the_same_vectors(minilm_dir, texts, cpu_minilm) -> None:
    engine = Engine.load(str(minilm_dir))
    lanes = engine.runner.lanes
    assert len(lanes) == EngineConfig.lanes > 1
    batch = PackedBatch.of(embedctl.load(str(minilm_dir), device="cpu").tokenizer.encode(texts[:8]).ids)
    expected = cpu_minilm.step(batch).result()
    engine.step(batch).result()  # the shape's first hit: eager, on lane 0
    for free in range(len(lanes)):
        for lane in lanes[:free]:  # keep the lanes before `free` busy for some 20 ms
            with torch.cuda.stream(lane.stream):
                torch.cuda._sleep(40_000_000)
            lane.done.record(lane.stream)
        before = [lane.batches for lane in lanes]
        vectors = engine.step(batch).result()  # lane `free` captures its own graph of the shape
        assert [lane.batches - count for lane, count in zip(lanes, before)] == [int(i == free) for i in range(len(lanes))]
        assert cosine(vectors, expected).min() >= 0.999
    assert engine.stats.captures == len(lanes)
    for _ in range(2):  # replays on lane 0, its work done
        assert cosine(engine.step(batch).result(), expected).min() >= 0.999
    assert engine.stats.replays == 2 and lanes[0].batches == 4


@pytest.mark.parametrize("backend", ["varlen", "triton", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_lanes_replaying_full_batches_at_once_give_one_lanes_vectors(tmp_path, backend: str) -> None:
    """Lanes share no scratch memory (GEMM workspaces, attention plans and buffers). Before each lane
    captured on its own stream, every lane's graphs wrote one cuBLAS workspace, and BERT-base's
    16,384-token GEMMs replaying on three lanes at once gave most vectors wrong, some at cosine 0
    (bench/results/gpu-2026-12-07-run171-lanes-workspace-ab-h100)."""
    path = save_random_model(tmp_path / "bert-base", pooling="mean", **BERT_BASE)
    rng = np.random.default_rng(3)
    sequences = [np.concatenate([[101], rng.integers(1000, 29000, n), [102]]) for n in rng.integers(100, 510, 240)]
    one_lane = Engine.load(str(path), EngineConfig(attention=backend, lanes=1))
    for _ in range(3):  # eager, then captures, then replays
        expected = one_lane.embed(sequences)
    engine = Engine.load(str(path), EngineConfig(attention=backend, lanes=3))
    for _ in range(5):  # eager, then each lane captures as a batch first reaches it, then replays on all three
        assert cosine(engine.embed(sequences), expected).min() >= 0.999
    lanes = engine.runner.lanes
    assert engine.max_batch_tokens == 16_384 and sum(map(len, sequences)) > 4 * engine.max_batch_tokens
    assert engine.stats.replays >= 10 and all(lane.graphs and lane.batches >= 3 for lane in lanes)


def test_warmup_captures_every_bucket(minilm_dir, texts) -> None:
    model = embedctl.load(str(minilm_dir), max_batch_tokens=2048, warmup=True)
    shapes = len(all_shapes(2048, 512, model.engine.max_length))
    assert model.engine.stats.captures == shapes  # on the first lane; the others capture as batches reach them
    model.embed(texts[:30])
    assert model.engine.stats.eager_runs == 0 and model.engine.stats.replays > 0


def test_no_garbage_collection_runs_while_a_graph_captures(minilm_dir, texts, cpu_minilm) -> None:
    # Collecting an engine dropped earlier destroys its graphs, which CUDA refuses during a capture, failing it.
    engine = Engine.load(str(minilm_dir))
    batch = PackedBatch.of(embedctl.Embedder(cpu_minilm).tokenizer.encode(texts[:8]).ids)
    capturing: list[bool] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            capturing.append(torch.cuda.is_current_stream_capturing())

    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # a young-generation collection at nearly every allocation
    gc.callbacks.append(record)
    try:
        for _ in range(3):  # eager, capture, replay
            engine.step(batch).result()
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)
    assert engine.stats.captures == 1
    assert capturing and not any(capturing)
    assert gc.isenabled()


def test_a_step_leaves_the_callers_stream_current_whether_it_ends_or_fails(minilm_dir, texts) -> None:
    """A lane's stream is current only while a step enqueues its work (eager, capture and replay),
    also when reading its result back fails."""
    model = embedctl.load(str(minilm_dir))
    batch = PackedBatch.of(model.tokenizer.encode(texts[:3]).ids)
    runner, caller = model.engine.runner, torch.cuda.Stream()

    def failing_read(vectors: torch.Tensor, stream: torch.cuda.Stream) -> None:
        assert torch.cuda.current_stream() == stream != caller
        raise RuntimeError("read failed")

    with torch.cuda.stream(caller):
        for _ in range(3):
            model.engine.step(batch).result()
            assert torch.cuda.current_stream() == caller
        with pytest.raises(RuntimeError, match="read failed"):
            runner.run(batch, failing_read)
        assert torch.cuda.current_stream() == caller
    assert model.engine.stats.eager_runs == 1 and model.engine.stats.captures == 1 and model.engine.stats.replays == 2
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.parametrize(("backend", "head_dim"), [
    ("varlen", 32), ("varlen", 64), ("varlen", 128), ("triton", 32), ("triton", 64), ("triton", 128),
    pytest.param("flashinfer", 64, marks=needs_flashinfer), pytest.param("flashinfer", 128, marks=needs_flashinfer)])
@pytest.mark.parametrize("lengths", [[1, 7, 128, 300, 512, 0, 64, 65, 16], [3, 16, 0, 1, 9]])
def test_attention_backend_matches_exact_sdpa(backend: str, head_dim: int, lengths: list[int]) -> None:
    cu = [0] + np.cumsum(lengths).tolist()
    # q, k and v strided as the model's views of one QKV projection give them
    q, k, v = torch.randn(cu[-1], 3, 12, head_dim, device="cuda", dtype=torch.bfloat16).unbind(1)
    layout = AttentionLayout(torch.tensor(cu, dtype=torch.int32, device="cuda"), cu, max(lengths), cu[-1])
    reference = SdpaAttention()
    reference.plan(layout)
    expected = reference(q.float(), k.float(), v.float())
    if backend == "varlen":
        attention = VarlenAttention()
    elif backend == "triton":
        attention = TritonAttention()
    else:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        attention = FlashInferAttention(12, head_dim, torch.bfloat16, workspace, pooled=True)
    attention.plan(layout)
    out = attention(q, k, v).float()
    assert torch.linalg.norm(out - expected) / torch.linalg.norm(expected) < 1e-2
    for start, end in zip(cu[:-1], cu[1:]):  # every sequence right, not just the long ones that dominate the norm
        if end > start:
            assert torch.linalg.norm(out[start:end] - expected[start:end]) / torch.linalg.norm(expected[start:end]) < 1e-2
    first_rows = [min(start, cu[-1] - 1) for start in cu[:-1]]  # CLS rows; the empty sequence's is any row
    pooled_expected = reference.pooled(q[first_rows].float(), k.float(), v.float())
    pooled = attention.pooled(q[first_rows], k, v).float()
    assert torch.linalg.norm(pooled - pooled_expected) / torch.linalg.norm(pooled_expected) < 1e-2
    assert not pooled[lengths.index(0)].any()  # an empty sequence's row is zeros


@pytest.mark.parametrize("hidden_size", [384, 1024])
@pytest.mark.parametrize("dim", [None, 100])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("block", ["short", "long"])
def test_pool_normalize_equals_torch_pooling(hidden_size: int, dim: int | None, normalize: bool, block: str) -> None:
    from engine.pooling import finish, pool, pooled_rows
    from engine.triton_kernels import LONG_POOL_BLOCK, SHORT_POOL_BLOCK, pool_normalize

    lengths = [3, 0, 512, 1, 40, 17]
    cu_seqlens = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    total = int(cu_seqlens[-1])
    torch.manual_seed(0)
    hidden = torch.randn(total + 9, hidden_size, device="cuda", dtype=torch.bfloat16)
    hidden[total:] = 1e4  # padding rows, which no sequence may read
    seq_ids = torch.full((total + 9,), len(lengths), dtype=torch.int32, device="cuda")
    seq_ids[:total] = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                              torch.tensor(lengths, device="cuda"))
    width = dim or hidden_size
    expected = finish(pool(hidden, seq_ids, cu_seqlens, "mean"), dim, normalize)
    blocks = {"short": SHORT_POOL_BLOCK, "long": LONG_POOL_BLOCK}
    torch.testing.assert_close(pool_normalize(hidden, width, normalize, cu_seqlens=cu_seqlens, block=blocks[block]),
                               expected, rtol=1e-5, atol=1e-5)
    for mode in ("cls", "last") if block == "short" else ():  # one row per sequence: no block to choose
        rows = pooled_rows(cu_seqlens, mode, hidden.shape[0])
        expected = finish(pool(hidden, seq_ids, cu_seqlens, mode), dim, normalize)
        torch.testing.assert_close(pool_normalize(hidden, width, normalize, rows=rows), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(pool_normalize(hidden[rows], width, normalize), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["varlen", "triton", pytest.param("flashinfer", marks=needs_flashinfer),
                                     pytest.param("auto", marks=needs_flashinfer)])
def test_bert_base_shape_backends_equal_cpu_fp32(tmp_path, backend: str) -> None:
    path = save_random_model(tmp_path / "bert-base", pooling="mean", **BERT_BASE)
    rng = np.random.default_rng(1)
    sequences = [np.concatenate([[101], rng.integers(1000, 29000, n), [102]]) for n in (5, 510, 100, 62, 300, 1)]
    reference = Engine.load(str(path), EngineConfig(device="cpu")).embed(sequences)
    # A budget that makes three batches, all in flight at once, on whichever lanes are free; then
    # the six sequences in one batch of 8 slots.
    engine = Engine.load(str(path), EngineConfig(attention=backend, max_batch_tokens=512))
    whole = Engine.load(str(path), EngineConfig(attention=backend))
    for model in (engine, whole):
        for _ in range(4):  # eager, then captures, then replays
            assert cosine(model.embed(sequences), reference).min() >= 0.999
        assert model.stats.replays >= 1
    graphs = [(shape, graph.attention) for model in (engine, whole) for lane in model.runner.lanes
              for shape, graph in lane.graphs.items()]
    assert {shape[1] for shape, _ in graphs} >= {1, 4, 8}  # slots of the graphs captured
    classes = {"flashinfer": FlashInferAttention, "triton": TritonAttention, "varlen": VarlenAttention}
    for (_, slots, _), attention in graphs:
        # auto: FlashInfer for the model, Triton for graphs of up to FEW_SEQUENCES slots (few_sequences_backend).
        chosen = ("triton" if slots <= FEW_SEQUENCES else "flashinfer") if backend == "auto" else backend
        assert type(attention) is classes[chosen]
    assert engine.attention == (backend if backend != "auto" else "flashinfer")


@needs_flashinfer
def test_flashinfer_reuses_a_plan_only_for_the_same_layout(tmp_path) -> None:
    path = save_random_model(tmp_path / "bert-base", pooling="mean", **BERT_BASE)
    rng = np.random.default_rng(2)
    # Two layouts of one graph shape (192 tokens, 4 slots): the same lengths in another order.
    lengths = {"a": (5, 100, 62), "b": (62, 100, 5)}
    batches = {name: [np.concatenate([[101], rng.integers(1000, 29000, n), [102]]) for n in sizes]
               for name, sizes in lengths.items()}
    cpu = Engine.load(str(path), EngineConfig(device="cpu"))
    expected = {name: cpu.embed(batch) for name, batch in batches.items()}
    engine = Engine.load(str(path), EngineConfig(attention="flashinfer"))
    assert cosine(engine.embed(batches["a"]), expected["a"]).min() >= 0.999  # eager; the bucket now exists
    (graph,) = engine.runner.lanes[0].graphs.values()  # one batch at a time: always the first lane
    plans, plan = [], graph.attention.wrapper.plan
    graph.attention.wrapper.plan = lambda *args, **kwargs: (plans.append(args[0].tolist()), plan(*args, **kwargs))[1]
    for name in ["b", "a", "a", "b", "b", "a"]:  # capture, then replays that replan or reuse the plan
        assert cosine(engine.embed(batches[name]), expected[name]).min() >= 0.999, name
    assert (engine.stats.eager_runs, engine.stats.captures, engine.stats.replays) == (1, 1, 5)
    assert len(engine.runner.lanes[0].graphs) == 1 and not engine.runner.lanes[1].graphs
    # Sequence offsets over 4 slots (the last one empty), then the bucket's padding as one more sequence.
    offsets = {name: np.cumsum([0, *(n + 2 for n in sizes), 0]).tolist() + [192] for name, sizes in lengths.items()}
    assert plans == [offsets["b"], offsets["a"], offsets["b"], offsets["a"]]


@needs_flashinfer
def test_flashinfer_plans_kept_by_one_graph_hold_after_another_graph_ran(tmp_path) -> None:
    # Each graph shape plans into its own wrappers' buffers but a lane's share one scratch workspace: a
    # plan one bucket reuses must still be right after another bucket planned and ran in between.
    # CLS pooling, so each bucket keeps two plans (the last layer's pooled queries have their own).
    path = save_random_model(tmp_path / "bert-base", pooling="cls", **BERT_BASE)
    rng = np.random.default_rng(3)
    lengths = {"a": (5, 100, 62), "c": (300, 20)}  # 192 tokens x 4 slots; 384 tokens x 2 slots
    batches = {name: [np.concatenate([[101], rng.integers(1000, 29000, n), [102]]) for n in sizes]
               for name, sizes in lengths.items()}
    cpu = Engine.load(str(path), EngineConfig(device="cpu"))
    expected = {name: cpu.embed(batch) for name, batch in batches.items()}
    engine = Engine.load(str(path), EngineConfig(attention="flashinfer"))
    for name in ["a", "c", "a", "c"]:  # each bucket: eager, then capture
        assert cosine(engine.embed(batches[name]), expected[name]).min() >= 0.999, name
    plans: list[list[int]] = []
    for graph in engine.runner.lanes[0].graphs.values():
        assert graph.attention.pooled_wrapper is not None
        for wrapper in (graph.attention.wrapper, graph.attention.pooled_wrapper):
            plan = wrapper.plan
            wrapper.plan = lambda *args, plan=plan, **kwargs: (plans.append(args[0].tolist()), plan(*args, **kwargs))[1]
    for name in ["a", "c", "a", "a", "c"]:  # replays on kept plans, the other bucket's runs in between
        assert cosine(engine.embed(batches[name]), expected[name]).min() >= 0.999, name
    assert (engine.stats.eager_runs, engine.stats.captures, engine.stats.replays) == (2, 2, 5)
    assert len(engine.runner.lanes[0].graphs) == 2 and plans == []


def test_index_on_gpu_equals_cpu(minilm_dir, tmp_path) -> None:
    from pipelines.index import IndexModel, IndexOptions, run_index

    outputs = {}
    for device in ("cuda", "cpu"):
        engine = Engine.load(str(minilm_dir), EngineConfig(device=device))
        out = tmp_path / f"{device}.parquet"
        report = run_index(IndexModel.loaded(engine), IndexOptions(source="sample_data/corpus", out=str(out)))
        assert report.rows_written == 300
        outputs[device] = pq.read_table(out)
    assert outputs["cuda"].column("id").to_pylist() == outputs["cpu"].column("id").to_pylist()
    gpu, cpu = (np.stack(outputs[d].column("vector").to_numpy(zero_copy_only=False)) for d in ("cuda", "cpu"))
    assert cosine(gpu, cpu).min() >= 0.999


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: run it on the device's nvidia-h200-x2")
def test_index_on_two_gpus_equals_one(minilm_dir, tmp_path) -> None:
    """`--device cuda:0,cuda:1`: batches alternate between the GPUs, rows come out in order, vectors as on one."""
    from typer.testing import CliRunner

    from embedctl.cli import app

    tables, reports = {}, {}
    for devices in ("cuda:0", "cuda:0,cuda:1"):
        out, report = tmp_path / f"{len(devices)}.parquet", tmp_path / f"{len(devices)}.json"
        result = CliRunner().invoke(app, ["index", "sample_data/corpus", "--out", str(out), "--model", str(minilm_dir),
                                          "--device", devices, "--max-batch-tokens", "1024", "--report", str(report)])
        assert result.exit_code == 0, result.output
        tables[devices], reports[devices] = pq.read_table(out), json.loads(report.read_text())
    one, two = tables["cuda:0"], tables["cuda:0,cuda:1"]
    assert reports["cuda:0,cuda:1"]["device"] == "cuda:0,cuda:1" and reports["cuda:0,cuda:1"]["rows_written"] == 300
    assert two.column("id").to_pylist() == one.column("id").to_pylist()
    vectors = [np.stack(table.column("vector").to_numpy(zero_copy_only=False)) for table in (one, two)]
    assert cosine(*vectors).min() >= 0.99999


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_dense_modules_on_the_gpu_equal_the_cpu(tmp_path, texts, pooling: str) -> None:
    """Pooled by the Triton kernel without normalising, then Dense in float32, then normalised, in the graph."""
    path = save_dense_model(save_random_model(tmp_path / "bert"), tmp_path / "dense", torch.nn.Tanh(), pooling)
    cpu, gpu = Engine.load(str(path), EngineConfig(device="cpu")), Engine.load(str(path))
    sequences = embedctl.Embedder(cpu).tokenizer.encode(texts).ids
    expected = cpu.embed(sequences)
    for _ in range(3):  # eager, capture, replay
        vectors = gpu.embed(sequences)
        assert vectors.shape == (len(texts), 32) and cosine(vectors, expected).min() >= 0.99
    assert gpu.stats.captures >= 1 and gpu.stats.replays >= 1
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("attention", ["varlen", "triton", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_cross_encoder_on_the_gpu_equals_the_cpu(tmp_path, attention: str) -> None:
    path = save_random_model(tmp_path / "cross-encoder", "BertForSequenceClassification", num_labels=2, **BERT_BASE)
    reference = Engine.load(str(path), EngineConfig(device="cpu"))
    engine = Engine.load(str(path), EngineConfig(attention=attention))
    rng = np.random.default_rng(0)
    ids = [np.concatenate([[101], rng.integers(2000, 20000, n), [102]]).astype(np.int32) for n in (14, 300, 509, 60)]
    types = [np.where(np.arange(len(seq)) > len(seq) // 3, 1, 0).astype(np.int32) for seq in ids]
    expected = reference.embed(ids, types)
    results = [engine.embed(ids, types) for _ in range(3)]  # eager, capture, replay
    assert (engine.stats.eager_runs, engine.stats.captures, engine.stats.replays) == (1, 1, 1)
    spread = np.abs(expected).max()
    for scores in results:
        assert scores.shape == (4, 2)
        assert np.abs(scores - expected).max() <= 0.02 * spread + 1e-3


@pytest.mark.parametrize("similarity", ["dot", "euclidean", "manhattan"])
def test_score_top_k_on_the_gpu_equals_the_cpu_in_any_chunking(similarity: str) -> None:
    """`embedctl score` ranks on the GPU when there is one: each pair's score, rounded from float64,
    is the same there, on the CPU, and in every chunking, so the ranks and the order among ties are too,
    for each similarity a model may name."""
    from pipelines.score import RunningTopK

    rng = np.random.default_rng(2)
    queries = rng.standard_normal((70, 384)).astype(np.float32)
    docs = rng.standard_normal((3000, 384)).astype(np.float32)
    docs[1500] = docs[10]  # a tie, which document order decides

    def top(device: str, chunk: int) -> RunningTopK:
        running = RunningTopK(torch.from_numpy(queries).to(device), 20, similarity)
        for start in range(0, len(docs), chunk):
            running.add(torch.from_numpy(docs[start:start + chunk]).to(device))
        return running

    expected = top("cpu", len(docs))
    for chunk in (7, 1000, len(docs)):
        found = top("cuda", chunk)
        assert torch.equal(found.indices.cpu(), expected.indices)
        assert torch.equal(found.scores.cpu(), expected.scores)
