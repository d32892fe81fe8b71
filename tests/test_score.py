"""`embedctl score`: the streaming top-k, the ranking on sample_data, the reranker, --index, qrels
metrics, and the command line.

Oracles: numpy's stable argsort over the full score matrix for the top-k; for the pipeline, vectors
from the Python API (embedctl.load().embed) ranked by numpy; for the reranker, transformers'
BertForSequenceClassification scoring each pair alone; for metrics, values worked out by hand; for
the command, the files it writes.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import embedctl
from embedctl.api import Embedder
from pipelines import score
from pipelines.qrels import evaluate, read_qrels, trec_order
from pipelines.score import (Queries, Ranking, RunningTopK, ScoreOptions, open_inputs, pair_groups, pair_scores, rank,
                             rerank, run_score, write_run)
from engine import Engine, LazyTensor, PackedBatch, UserError
from tests.models import add_token_past_the_table, minilm_path, save_random_model
from pipelines.readers import Chunk
from pipelines.tokenize_pool import TokenizerPool
from tests.files import snapshot, write_jsonl
from tests.files import ENV, assert_one_error_line, good_rows, run_cli, run_cli_in_terminal

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"
QUERIES, CORPUS = SAMPLE / "queries.jsonl", SAMPLE / "corpus"


def brute_force(queries: np.ndarray, docs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) [queries, k]: all scores at once, best first, ties in document order."""
    scores = queries @ docs.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def streamed(queries: np.ndarray, docs: np.ndarray, k: int, chunk: int) -> RunningTopK:
    top = RunningTopK(torch.from_numpy(queries), k)
    for start in range(0, len(docs), chunk):
        top.add(torch.from_numpy(docs[start: start + chunk]))
    return top


def unit_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


# The streaming top-k

CHUNKS = [1, 3, 7, 10, 64, 500]  # smaller than k, around k, larger than the corpus


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("query_block", [score.QUERY_BLOCK, 4])
def test_topk_equals_brute_force(chunk: int, query_block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(score, "QUERY_BLOCK", query_block)
    rng = np.random.default_rng(chunk)
    queries, docs = unit_rows(rng, 11, 32), unit_rows(rng, 300, 32)
    indices, scores = brute_force(queries, docs, 10)
    top = streamed(queries, docs, 10, chunk)
    np.testing.assert_array_equal(top.indices.numpy(), indices)
    np.testing.assert_allclose(top.scores.numpy(), scores, atol=1e-6)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_ties_rank_in_document_order_whatever_the_chunking(chunk: int) -> None:
    # Small integer vectors: every score is exact, so many documents tie and the order among them shows.
    rng = np.random.default_rng(0)
    queries = rng.integers(-1, 2, (9, 4)).astype(np.float32)
    docs = rng.integers(-1, 2, (120, 4)).astype(np.float32)
    indices, scores = brute_force(queries, docs, 10)
    assert (scores[:, :-1] == scores[:, 1:]).any(), "the data should hold ties"
    top = streamed(queries, docs, 10, chunk)
    np.testing.assert_array_equal(top.indices.numpy(), indices)
    np.testing.assert_array_equal(top.scores.numpy(), scores)


@pytest.mark.parametrize("chunk", [2, 5, 40])
def test_streamed_equals_in_memory(chunk: int) -> None:
    rng = np.random.default_rng(1)
    queries, docs = unit_rows(rng, 20, 16), unit_rows(rng, 40, 16)
    whole = streamed(queries, docs, 7, len(docs))
    parts = streamed(queries, docs, 7, chunk)
    np.testing.assert_array_equal(parts.indices.numpy(), whole.indices.numpy())
    np.testing.assert_array_equal(parts.scores.numpy(), whole.scores.numpy())


def test_k_beyond_the_corpus_keeps_every_document() -> None:
    rng = np.random.default_rng(2)
    queries, docs = unit_rows(rng, 3, 8), unit_rows(rng, 5, 8)
    top = streamed(queries, docs, 10, 2)
    np.testing.assert_array_equal(top.indices.numpy(), brute_force(queries, docs, 5)[0])


# The pipeline on sample_data


@pytest.fixture(scope="module")
def model(minilm_dir: Path) -> Embedder:
    """The Python API over the engine that rank() uses: its embed() plus numpy is the oracle."""
    return embedctl.load(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def sample_ranking(model: Embedder) -> tuple[Queries, Ranking]:
    # Chunks of 64 rows: several chunks per shard, across one Parquet and one JSONL shard.
    options = ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), top_k=3, chunk_rows=64)
    inputs = open_inputs(options)
    return inputs.queries, rank(model.engine, model.tokenizer, inputs.queries, inputs.docs, options)


def test_a_query_finds_its_own_document(sample_ranking: tuple[Queries, Ranking]) -> None:
    _, ranking = sample_ranking
    wanted = {row["id"]: row["doc_id"] for row in map(json.loads, QUERIES.read_text().splitlines())}
    found = np.mean([wanted[q] in hits for q, hits in zip(ranking.query_ids, ranking.doc_ids)])
    # Measured with all-MiniLM-L6-v2 on the CPU: 50 of 50 queries (1.00) have their document in the
    # top 3 (48 of 50 at rank 1); allow one or two to slip with another dtype or device.
    assert found >= 0.96


def test_ranking_equals_numpy_over_the_python_api(sample_ranking: tuple[Queries, Ranking], model: Embedder) -> None:
    queries, ranking = sample_ranking
    docs = [json.loads(line) for line in (CORPUS / "part-001.jsonl").read_text().splitlines()]
    first = pq.read_table(CORPUS / "part-000.parquet").to_pylist()
    doc_ids = [row["id"] for row in first + docs]
    indices, scores = brute_force(model.embed(queries.texts), model.embed([r["text"] for r in first + docs]), 3)
    assert ranking.documents == len(doc_ids) and ranking.skipped_empty == 0
    # documents cut at the max length are counted, as index counts them (the sample's queries are short)
    truncated = sum(model.tokenizer.encode([r["text"] for r in first + docs]).truncated)
    assert ranking.truncated == truncated > 0 and ranking.to_dict()["truncated"] == truncated
    assert ranking.doc_ids == [[doc_ids[i] for i in row] for row in indices]
    np.testing.assert_allclose(ranking.scores, scores, atol=1e-5)


def test_prompts_are_prepended_and_empty_documents_skipped(model: Embedder) -> None:
    texts = ["first document", "second document"]
    docs = [Chunk("docs.jsonl", ["a", "empty", "b"], [texts[0], " ", texts[1]], [1, 2, 3], None)]
    options = ScoreOptions(queries="q.jsonl", docs="docs.jsonl", top_k=2, query_prompt="query: ", doc_prompt="passage: ")
    ranking = rank(model.engine, model.tokenizer, Queries(["q"], ["a question"]), docs, options)
    indices, scores = brute_force(model.embed(["query: a question"]), model.embed([f"passage: {t}" for t in texts]), 2)
    assert ranking.doc_ids == [[["a", "b"][i] for i in indices[0]]]
    assert (ranking.documents, ranking.skipped_empty) == (2, 1)
    np.testing.assert_allclose(ranking.scores, scores, atol=1e-5)
    plain = model.embed(["a question"]) @ model.embed(texts).T
    assert not np.allclose(np.sort(plain, axis=1)[:, ::-1], scores, atol=1e-3)


def test_a_text_holding_a_token_past_the_embedding_table_is_named(random_bert: Path) -> None:
    """Qwen3-Embedding-4B's <think>: the query or the document to fix, not an unnamed failed batch."""
    add_token_past_the_table(random_bert)
    model = embedctl.load(str(random_bert), device="cpu")
    options = ScoreOptions(queries="q.jsonl", docs="docs.jsonl", top_k=2)
    docs = [Chunk("docs.jsonl", ["a", "b"], ["a cat", "a <think> dog"], [1, 2], None)]
    with pytest.raises(UserError, match=r"^docs.jsonl line 2: document 'b' holds token id 30522, which the tokenizer adds"):
        rank(model.engine, model.tokenizer, Queries(["q"], ["a pet"]), docs, options)
    with pytest.raises(UserError, match=r"^query 'q2' holds token id 30522, which the tokenizer adds"):
        rank(model.engine, model.tokenizer, Queries(["q1", "q2"], ["a pet", "<think> a pet"]), docs[:0], options)
    docs = [Chunk("docs.jsonl", ["a", "b"], ["a cat", "a dog"], [1, 2], None)]
    assert rank(model.engine, model.tokenizer, Queries(["q"], ["a pet"]), docs, options).doc_ids[0] in (["a", "b"],
                                                                                                     ["b", "a"])


def test_prompts_come_from_the_model_config_by_role_or_name(tmp_path: Path, minilm_dir: Path) -> None:
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(minilm_dir, model_dir)
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: find code\nQuery: ", "document": "", "short": "q: "}, "default_prompt_name": None}))
    model = embedctl.load(str(model_dir), device="cpu")
    docs = [Chunk("docs.jsonl", ["a", "b"], ["first document", "second document"], [1, 2], None)]

    def ranked(**prompts: str) -> np.ndarray:
        options = ScoreOptions(queries="q.jsonl", docs="docs.jsonl", top_k=2, **prompts)
        return rank(model.engine, model.tokenizer, Queries(["q"], ["a question"]), docs, options).scores

    doc_vectors = model.embed(["first document", "second document"])
    for expected_prompt, prompts in [("Instruct: find code\nQuery: ", {}), ("q: ", {"query_prompt_name": "short"}),
                                     ("", {"query_prompt": ""})]:
        expected = np.sort(model.embed([expected_prompt + "a question"]) @ doc_vectors.T, axis=1)[:, ::-1]
        np.testing.assert_allclose(ranked(**prompts), expected, atol=1e-5)
    with pytest.raises(UserError, match=r"has no prompt named 'long' \(it has: document, query, short\)"):
        ranked(query_prompt_name="long")


def test_jsonl_rows_to_stdout(sample_ranking: tuple[Queries, Ranking], capsys: pytest.CaptureFixture) -> None:
    queries, ranking = sample_ranking
    write_run(ranking, ScoreOptions(queries=str(QUERIES), docs=str(CORPUS)))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [(q, d, r, s) for q, hits, scores in zip(queries.ids, ranking.doc_ids, ranking.scores)
                for r, (d, s) in enumerate(zip(hits, scores), start=1)]
    assert [(row["query_id"], row["doc_id"], row["rank"]) for row in rows] == [hit[:3] for hit in expected]
    # each score reads back as the very float32 the ranking holds
    assert [np.float32(row["score"]) for row in rows] == [np.float32(hit[3]) for hit in expected]


def test_a_run_to_dev_stdout_reaches_a_pipe_and_a_redirected_file(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "embedctl.cli", "score", str(QUERIES), str(CORPUS), "--top-k", "2", "--out",
               "/dev/stdout", "-q"]
    rows = 2 * len(QUERIES.read_text().splitlines())
    piped = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == rows, piped.stderr
    # `>> log.txt`: /dev/stdout opens the log itself, whose earlier lines must stay
    log = tmp_path / "log.txt"
    log.write_text("line-before\n")
    with log.open("a") as handle:
        redirected = subprocess.run(command, env=ENV, stdout=handle, stderr=subprocess.STDOUT, timeout=300)
    lines = log.read_text().splitlines()
    assert redirected.returncode == 0 and lines[0] == "line-before" and len(lines) == 1 + rows


def test_a_run_to_a_full_or_closed_stdout_is_one_line_and_a_closed_stderr_stops_nothing(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "embedctl.cli", "score", str(QUERIES), str(CORPUS), "--top-k", "1"]
    with open("/dev/full", "w") as full:
        to_full = subprocess.run(command, env=ENV, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    closed = subprocess.run(command, env=ENV, stderr=subprocess.PIPE, text=True, timeout=300,
                            preexec_fn=lambda: os.close(1))
    assert (to_full.returncode, to_full.stderr.splitlines()[-1]) == (2, "error: cannot write the run to standard output "
                                                                     "([Errno 28] No space left on device); check free "
                                                                     "space, or give --out FILE")
    assert "Traceback" not in to_full.stderr and "Exception ignored" not in to_full.stderr
    assert (closed.returncode, closed.stderr.strip()) == (2, "error: standard output is closed, and the run goes there "
                                                             "without --out; give --out FILE")
    quiet = subprocess.run([*command, "--out", str(tmp_path / "run.jsonl")], env=ENV, capture_output=True, text=True,
                           timeout=300, preexec_fn=lambda: os.close(2))
    assert quiet.returncode == 0 and len((tmp_path / "run.jsonl").read_text().splitlines()) == len(
        QUERIES.read_text().splitlines())


def test_out_dash_is_stdout_and_out_inside_a_file_says_so(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "embedctl.cli", "score", str(QUERIES), str(CORPUS), "--top-k", "1", "-o", "-", "-q"]
    dashed = subprocess.run(command, env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert dashed.returncode == 0 and len(dashed.stdout.splitlines()) == len(QUERIES.read_text().splitlines())
    assert list(tmp_path.iterdir()) == []  # no file named "-"
    (tmp_path / "exist.jsonl").write_text("a file\n")
    with pytest.raises(UserError, match=r"exist.jsonl is a file, not a directory; pick another path$"):
        score._check_out(tmp_path / "exist.jsonl" / "run.jsonl", overwrite=False)


def test_only_names_of_open_descriptors_and_files_that_are_not_regular_are_written_in_place(tmp_path: Path) -> None:
    for name in ("/dev/stdout", "/dev/stderr", "/dev/fd/1", "/proc/self/fd/1", "/dev/null", str(tmp_path / "fifo")):
        if name.endswith("fifo"):
            os.mkfifo(name)
        assert score._written_in_place(name), name
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path  # a file there is replaced like any other
    run = shm / f"embedctl-test-{os.getpid()}.jsonl"
    try:
        run.write_text("an old run\n")
        assert not score._written_in_place(str(run)) and not score._written_in_place(str(run) + ".new")
        with pytest.raises(UserError, match="already exists; pass --overwrite"):
            score._check_out(run, overwrite=False)
    finally:
        run.unlink(missing_ok=True)


def test_a_run_written_through_a_link_or_into_a_fifo_leaves_them_in_place(
        sample_ranking: tuple[Queries, Ranking], tmp_path: Path) -> None:
    _, ranking = sample_ranking
    (tmp_path / "target.jsonl").write_text("an old run\n")
    (tmp_path / "link.jsonl").symlink_to("target.jsonl")
    write_run(ranking, ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), out=str(tmp_path / "link.jsonl"), overwrite=True))
    assert (tmp_path / "link.jsonl").is_symlink()
    rows = (tmp_path / "target.jsonl").read_text().splitlines()
    assert len(rows) == sum(map(len, ranking.doc_ids)) and json.loads(rows[0])["rank"] == 1

    os.mkfifo(tmp_path / "fifo")
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.extend((tmp_path / "fifo").read_text().splitlines()))
    reader.start()
    write_run(ranking, ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), out=str(tmp_path / "fifo")))
    reader.join(10)
    assert received == rows and stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)


# Metrics against qrels


@pytest.mark.parametrize("documents, missing", [("abcdefwxyz", ()), ("abcdefwxy", ("z",))],
                         ids=["every judged document ranked", "a judged document outside the ranked set"])
def test_metrics_equal_the_values_worked_out_by_hand(tmp_path: Path, documents: str, missing: tuple[str, ...]) -> None:
    qrels_file = tmp_path / "qrels.txt"
    qrels_file.write_text("q1 0 a 2\nq1 0 b 1\nq1 0 z 1\nq2 0 c 1\nq3 0 d 0\n")
    qrels = read_qrels(str(qrels_file), ["q1", "q2", "q3"])
    run = [["x", "a", "b"], ["c", "y", "w"], ["d", "e", "f"], ["g", "h", "i"]]
    metrics = evaluate(["q1", "q2", "q3", "q4"], run, qrels, 3, documents)
    # q1: gains 0, 2, 1 -> DCG 2/log2(3) + 1/2; ideal 2, 1, 1 -> 2 + 1/log2(3) + 1/2; first hit at rank 2;
    # 2 of 3 relevant found. q2: perfect at rank 1. q3, judged without a relevant document, scores 0 on each,
    # as in trec_eval; q4, not judged, is counted, not scored.
    # z, relevant to q1, is not found whether or not it is among the documents, as in trec_eval.
    ndcg_q1 = (2 / np.log2(3) + 0.5) / (2 + 1 / np.log2(3) + 0.5)
    assert metrics.ndcg_at_10 == pytest.approx((ndcg_q1 + 1 + 0) / 3)
    assert metrics.mrr_at_10 == pytest.approx((0.5 + 1 + 0) / 3)
    assert metrics.recall_at_k == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert (metrics.queries_scored, metrics.queries_unjudged) == (3, 1)
    assert (metrics.docs_missing, metrics.docs_missing_examples) == (len(missing), missing)
    # Each judged query's own figures, as trec_eval -q prints them, in the run's order; q4 has none.
    assert list(metrics.per_query) == ["q1", "q2", "q3"]
    assert metrics.per_query["q1"] == pytest.approx((ndcg_q1, 0.5, 2 / 3))
    assert metrics.per_query["q2"] == (1.0, 1.0, 1.0) and metrics.per_query["q3"] == (0.0, 0.0, 0.0)
    report = metrics.to_dict()
    assert report["per_query"]["q1"] == {"ndcg@10": round(ndcg_q1, 6), "mrr@10": 0.5, "recall@3": round(2 / 3, 6)}
    for name in ("ndcg@10", "mrr@10", "recall@3"):
        assert np.mean([figures[name] for figures in report["per_query"].values()]) == pytest.approx(report[name], abs=1e-6)


def trec_eval_order(run: dict[str, float]) -> list[str]:
    """A query's hits as trec_eval orders them (form_res_rels.c, comp_sim_docno): higher score first, then
    strcmp(docno2, docno1), the greater docno first."""
    def compare(a: str, b: str) -> int:
        if run[a] != run[b]:
            return -1 if run[a] > run[b] else 1
        return (a < b) - (a > b)

    return sorted(run, key=functools.cmp_to_key(compare))


def trec_eval_figures(judged: dict[str, int], run: dict[str, float], written: dict[str, float],
                      k: int) -> tuple[float, float, float]:
    """One query's ndcg_cut.10 and recip_rank of run's first ten hits, and recall.k of the run file `written`,
    transcribed from trec_eval (m_ndcg_cut.c, m_recip_rank.c, m_recall.c) at its default relevance_level 1: a
    hit's gain is its judged relevance where above 0, the ideal comes from the count of judged documents at
    each relevance level, and a query without a relevant document scores 0."""
    ranked = trec_eval_order(run)[:10]
    dcg = sum(judged[doc] / math.log2(rank + 2) for rank, doc in enumerate(ranked) if judged.get(doc, 0) > 0)
    levels = Counter(relevance for relevance in judged.values() if relevance > 0)
    ideal = [level for level in sorted(levels, reverse=True) for _ in range(levels[level])][:10]
    ideal_dcg = sum(gain / math.log2(rank + 2) for rank, gain in enumerate(ideal))
    recip_rank = next((1 / (rank + 1) for rank, doc in enumerate(ranked) if judged.get(doc, 0) >= 1), 0.0)
    relevant = sum(relevance >= 1 for relevance in judged.values())
    found = sum(judged.get(doc, 0) >= 1 for doc in trec_eval_order(written)[:k])
    return dcg / ideal_dcg if ideal_dcg else 0.0, recip_rank, found / relevant if relevant else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_metrics_equal_trec_evals_per_query_and_averaged_over_the_queries_it_evaluates(seed: int) -> None:
    """Against trec_eval's measures, as pytrec_eval (and so BEIR and MTEB) computes them: graded and negative
    judgements, queries judged without a relevant document (evaluated, 0) or not judged (not evaluated),
    relevant documents the run cannot find, and many equal scores, with ids whose string order is not their
    numeric order. As in run_score: hits in document order, ten deep; the run file holds the first k."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        documents = [f"d{i}" for i in range(rng.integers(1, 30))]
        k = int(rng.integers(1, 15))
        query_ids = [f"q{i}" for i in range(rng.integers(1, 8))]
        qrels = {query_id: {str(doc): int(rng.choice([-1, 0, 0, 1, 2, 3]))
                            for doc in rng.choice(documents + ["gone1", "gone2"], rng.integers(1, 8))}
                 for query_id in query_ids if rng.random() < 0.8}
        hits = [list(rng.permutation(documents)[:max(k, 10)]) for _ in query_ids]
        scores = [sorted(rng.choice([0.25, 0.5, 0.75, 1.0], len(row)), reverse=True) for row in hits]
        metrics = evaluate(query_ids, [trec_order(row, row_scores) for row, row_scores in zip(hits, scores)], qrels, k,
                           documents, written=[row[:k] for row in hits])
        expected = {query_id: trec_eval_figures(qrels[query_id], dict(zip(row, row_scores)),
                                                dict(zip(row[:k], row_scores[:k])), k)
                    for query_id, row, row_scores in zip(query_ids, hits, scores) if query_id in qrels}
        assert metrics.per_query.keys() == expected.keys()
        for query_id, figures in expected.items():
            assert metrics.per_query[query_id] == pytest.approx(figures, abs=1e-12), query_id
        means = np.mean(list(expected.values()), axis=0) if expected else np.zeros(3)
        assert (metrics.ndcg_at_10, metrics.mrr_at_10, metrics.recall_at_k) == pytest.approx(tuple(means), abs=1e-12)
        assert (metrics.queries_scored, metrics.queries_unjudged) == (len(expected), len(query_ids) - len(expected))


def test_equal_scores_are_judged_in_trec_evals_order(model: Embedder, tmp_path: Path) -> None:
    """trec_eval ignores a run file's ranks: it orders hits by score, and equal ones by doc id from the last.
    Two copies of one document tie, so the copy named "b" comes first, ahead of the relevant "a"."""
    same = "The quick brown fox jumps over the lazy dog."
    write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": same}, {"id": "c", "text": "Stock markets fell today."},
                                          {"id": "b", "text": same}])
    write_jsonl(tmp_path / "queries.jsonl", [{"id": "q", "text": "a fox jumping over a dog"}])
    (tmp_path / "qrels.txt").write_text("q 0 a 1\n")
    options = ScoreOptions(queries=str(tmp_path / "queries.jsonl"), docs=str(tmp_path / "docs.jsonl"),
                           qrels=str(tmp_path / "qrels.txt"))
    ranking, metrics = run_score(model.engine, model.tokenizer, open_inputs(options), options)
    assert ranking.doc_ids == [["a", "b", "c"]] and ranking.scores[0, 0] == ranking.scores[0, 1]
    assert metrics.mrr_at_10 == pytest.approx(0.5)
    assert metrics.ndcg_at_10 == pytest.approx(1 / np.log2(3))
    # Recall@k counts the hits the run file holds: with --top-k 1, "a", which trec_eval finds there.
    options = replace(options, top_k=1)
    ranking, metrics = run_score(model.engine, model.tokenizer, open_inputs(options), options)
    assert ranking.doc_ids == [["a"]] and metrics.recall_at_k == 1.0 and metrics.mrr_at_10 == pytest.approx(0.5)


def test_jsonl_qrels_read_like_trec(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "qrels.jsonl", [{"query_id": "q1", "doc_id": "a", "relevance": 2}, {"query_id": "q2", "doc_id": "b"}])
    assert read_qrels(str(tmp_path / "qrels.jsonl"), ["q1", "q2"]) == {"q1": {"a": 2}, "q2": {"b": 1}}


def test_beir_qrels_read_like_trec(tmp_path: Path) -> None:
    # BEIR's qrels/test.tsv (header and all), and MTEB's JSONL rows, name the grade "score".
    (tmp_path / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\ta\t2\nq2\tb\t0\n")
    assert read_qrels(str(tmp_path / "test.tsv"), ["q1", "q2"]) == {"q1": {"a": 2}, "q2": {"b": 0}}
    write_jsonl(tmp_path / "qrels.jsonl", [{"query-id": "q1", "corpus-id": "a", "score": 0}])
    assert read_qrels(str(tmp_path / "qrels.jsonl"), ["q1"]) == {"q1": {"a": 0}}
    # Three fields only under BEIR's header: else a TREC line missing its doc id, q1 0 7, would judge document "0"
    for name, text, message in (("late.tsv", "q1\ta\t1\nquery-id\tcorpus-id\tscore\n", "line 1: expected 'query_id "
                                 "iteration doc_id relevance' (TREC)"),
                                ("trec.txt", "q1 0 a 1\nq1 0 7\n", "line 2: expected 'query_id iteration doc_id"),
                                ("mixed.tsv", "query-id\tcorpus-id\tscore\nq1\ta\t1\nq1 0 b 1\n",
                                 "line 3: expected 'query-id corpus-id score', as its BEIR header says, with")):
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match=re.escape(f"{name} {message}")):
            read_qrels(str(tmp_path / name), ["q1"])


def test_a_jsonl_grade_under_a_key_of_another_name_is_refused_not_read_as_relevant(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "qrels.jsonl", [{"query_id": "q1", "doc_id": "a", "label": 0}])
    with pytest.raises(UserError, match=r"qrels.jsonl line 1: no relevance key \(its keys: query_id, doc_id, label\); "
                                        r"name the grade relevance \(or score\), or keep only query_id and doc_id"):
        read_qrels(str(tmp_path / "qrels.jsonl"), ["q1"])


def test_jsonl_qrels_read_number_ids_as_the_corpus_readers_do(tmp_path: Path) -> None:
    # A corpus row {"id": 10.0} is document "10", so a judgement naming doc_id 10.0 must judge it.
    write_jsonl(tmp_path / "qrels.jsonl", [{"query_id": 1, "doc_id": 10.0, "relevance": 1}, {"query_id": 2.0, "doc_id": 20}])
    assert read_qrels(str(tmp_path / "qrels.jsonl"), ["1", "2"]) == {"1": {"10": 1}, "2": {"20": 1}}
    write_jsonl(tmp_path / "bad.jsonl", [{"query_id": True, "doc_id": "a"}])
    with pytest.raises(UserError, match="bad.jsonl line 1: not a JSON object with query_id, doc_id"):
        read_qrels(str(tmp_path / "bad.jsonl"), ["1"])


@pytest.mark.parametrize("name, text", [("qrels.txt", "q1 0 a 2\n"), ("qrels.jsonl", '{"query_id": "q1", "doc_id": "a", "relevance": 2}\n')])
def test_qrels_starting_with_a_byte_order_mark_read_as_without(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())  # as Windows editors save UTF-8
    assert read_qrels(str(tmp_path / name), ["q1"]) == {"q1": {"a": 2}}


def test_gzipped_qrels_read_as_plain_and_a_repeated_judgement_must_agree(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "qrels.txt.gz", "wt") as handle:
        handle.write("q1 0 a 2\nq1 0 a 2\nq1 0 b 1\n")  # the same judgement twice changes nothing
    assert read_qrels(str(tmp_path / "qrels.txt.gz"), ["q1"]) == {"q1": {"a": 2, "b": 1}}
    (tmp_path / "qrels.txt").write_text("q1 0 a 1\nq1 0 b 1\nq1 0 a 0\n")
    with pytest.raises(UserError, match=r"line 3: query 'q1' document 'a' is judged 0 here and 1 on line 1; "
                                        r"keep one judgement per pair$"):
        read_qrels(str(tmp_path / "qrels.txt"), ["q1"])
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00q")
    with pytest.raises(UserError, match=r"binary.txt: it is not UTF-8 text; give a TREC qrels or JSONL qrels"):
        read_qrels(str(tmp_path / "binary.txt"), ["q1"])


@pytest.mark.parametrize("text, phrases", [
    ("q9 0 a 1\n", ["judges 1 query not in the query set", "'q9'"]),
    ("q1 0 a\n", ["line 1", "query_id iteration doc_id relevance"]),
    ("q1 0 a high\n", ["line 1", "integer relevance"]),
    ("q1 0 a --1\n", ["line 1", "integer relevance"]),
    ("q1 0 a 1\u00b2\n", ["line 1", "integer relevance"]),  # str.isdigit passes the superscript, int() does not
    ('{"query_id": "q1"}\n', ["line 1", "JSON object"]),
    ("\n", ["holds no judgements"]),
])
def test_bad_qrels_name_the_problem(tmp_path: Path, text: str, phrases: list[str]) -> None:
    (tmp_path / "qrels.txt").write_text(text)
    with pytest.raises(UserError) as error:
        read_qrels(str(tmp_path / "qrels.txt"), ["q1"])
    for phrase in phrases:
        assert phrase in str(error.value)


def test_queries_may_name_their_columns_apart_from_the_documents(model: Embedder, tmp_path: Path) -> None:
    """Queries as {"qid", "query"} beside a corpus of {"id", "text"}, a common layout, need no rewriting."""
    rows = [json.loads(line) for line in QUERIES.read_text().splitlines()[:5]]
    write_jsonl(tmp_path / "plain.jsonl", rows)
    write_jsonl(tmp_path / "renamed.jsonl", [{"qid": row["id"], "query": row["text"]} for row in rows])
    plain = ScoreOptions(queries=str(tmp_path / "plain.jsonl"), docs=str(CORPUS), top_k=3)
    renamed = replace(plain, queries=str(tmp_path / "renamed.jsonl"), query_text_col="query", query_id_col="qid")
    ranked = [run_score(model.engine, model.tokenizer, open_inputs(options), options)[0] for options in (plain, renamed)]
    assert ranked[0].query_ids == ranked[1].query_ids == [row["id"] for row in rows]
    assert ranked[0].doc_ids == ranked[1].doc_ids
    with pytest.raises(UserError, match=r"no 'query' key \(its keys: id, text, doc_id\); pass --query-text-col with the key"):
        open_inputs(replace(plain, query_text_col="query"))  # the flag that would fix it, not --text-col


def test_metrics_at_ten_do_not_depend_on_top_k(model: Embedder) -> None:
    """nDCG@10 and MRR@10 look ten hits deep even when the run file keeps fewer."""
    results = {}
    for k in (1, 10):
        options = ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), top_k=k, qrels=str(SAMPLE / "qrels.txt"))
        results[k] = run_score(model.engine, model.tokenizer, open_inputs(options), options)
    (one, at_one), (ten, at_ten) = results[1], results[10]
    assert [len(hits) for hits in one.doc_ids] == [1] * len(one.query_ids) and one.scores.shape[1] == 1
    assert one.doc_ids == [hits[:1] for hits in ten.doc_ids]
    assert (at_one.ndcg_at_10, at_one.mrr_at_10) == (at_ten.ndcg_at_10, at_ten.mrr_at_10)
    assert at_one.mrr_at_10 < 1.0  # some query's document ranks below first: the cut would have shown
    # trec_eval on a run file of one hit a query scores less: the summary says where the figures come from
    assert at_one.summary().endswith("; nDCG@10 and MRR@10 look 10 hits deep, past the 1 a query the run file holds")
    assert at_ten.summary().endswith("without judgements)")


def test_sample_qrels_score_the_sample_ranking(sample_ranking: tuple[Queries, Ranking]) -> None:
    queries, ranking = sample_ranking
    metrics = evaluate(ranking.query_ids, ranking.doc_ids, read_qrels(str(SAMPLE / "qrels.txt"), queries.ids), 3,
                       ranking.corpus_ids)
    assert metrics.docs_missing == 0
    wanted = {row["id"]: row["doc_id"] for row in map(json.loads, QUERIES.read_text().splitlines())}
    first = [1.0 / (hits.index(wanted[q]) + 1) if wanted[q] in hits else 0.0 for q, hits in zip(ranking.query_ids, ranking.doc_ids)]
    assert metrics.mrr_at_10 == pytest.approx(np.mean(first))
    assert metrics.recall_at_k == pytest.approx(np.mean([wanted[q] in hits for q, hits in zip(ranking.query_ids, ranking.doc_ids)]))


# Queries that are also documents (ArguAna, Quora)

# Three arguments, each a query and a document, whose counter-arguments the qrels judge relevant; q9 is a query only.
ARGUMENTS = {"a1": "The cat sat on the warm windowsill all afternoon.",
             "a2": "Stock markets fell sharply after the bank raised interest rates.",
             "a3": "The recipe calls for two cups of flour and a pinch of salt.",
             "a4": "A kitten napped in the sunshine by the window.",
             "a5": "Investors sold shares as borrowing costs climbed.",
             "a6": "Bake the dough for twenty minutes until golden."}
ARGUMENT_QRELS = {"a1": "a4", "a2": "a5", "a3": "a6", "q9": "a6"}


def _arguments(tmp: Path) -> None:
    write_jsonl(tmp / "corpus.jsonl", [{"id": doc_id, "text": text} for doc_id, text in ARGUMENTS.items()])
    write_jsonl(tmp / "queries.jsonl", [{"id": doc_id, "text": ARGUMENTS[doc_id]} for doc_id in ("a1", "a2", "a3")]
                + [{"id": "q9", "text": "How long should bread bake?"}])
    (tmp / "qrels.txt").write_text("".join(f"{query} 0 {doc} 1\n" for query, doc in ARGUMENT_QRELS.items()))


def _arguments_ranked(model: Embedder, query_ids: list[str], ignore_identical_ids: bool) -> list[list[str]]:
    """Every document for each query, best first, by numpy over the Python API's vectors; without the
    query's own document if ignore_identical_ids."""
    query_texts = [ARGUMENTS.get(query_id, "How long should bread bake?") for query_id in query_ids]
    scores = model.embed(query_texts) @ model.embed(list(ARGUMENTS.values())).T
    order = np.argsort(-scores, axis=1, kind="stable")
    return [[doc_id for doc_id in np.array(list(ARGUMENTS))[row] if not (ignore_identical_ids and doc_id == query_id)]
            for query_id, row in zip(query_ids, order)]


@pytest.mark.parametrize("ignore_identical_ids", [False, True], ids=["kept", "ignored"])
def test_a_query_s_own_document_is_left_out_when_asked_and_k_hits_remain(model: Embedder, tmp_path: Path,
                                                                          ignore_identical_ids: bool) -> None:
    _arguments(tmp_path)
    options = ScoreOptions(queries=str(tmp_path / "queries.jsonl"), docs=str(tmp_path / "corpus.jsonl"), top_k=3,
                           qrels=str(tmp_path / "qrels.txt"), ignore_identical_ids=ignore_identical_ids)
    ranking, metrics = run_score(model.engine, model.tokenizer, open_inputs(options), options)
    expected = _arguments_ranked(model, ranking.query_ids, ignore_identical_ids)
    assert ranking.doc_ids == [hits[:3] for hits in expected]
    assert ranking.scores.shape == (4, 3) and np.isfinite(ranking.scores).all()
    if not ignore_identical_ids:  # an argument finds itself first, as in ArguAna
        assert [hits[0] for hits in ranking.doc_ids[:3]] == ["a1", "a2", "a3"]
    # Each query's figures from the rank of its one relevant document in the oracle's order.
    ranks = {query_id: hits.index(ARGUMENT_QRELS[query_id]) + 1 for query_id, hits in zip(ranking.query_ids, expected)}
    for query_id, rank_ in ranks.items():
        wanted = (1 / np.log2(rank_ + 1) if rank_ <= 10 else 0.0, 1 / rank_ if rank_ <= 10 else 0.0, float(rank_ <= 3))
        assert metrics.per_query[query_id] == pytest.approx(wanted), query_id
    assert ranking.own_ids_dropped == (3 if ignore_identical_ids else 0)
    assert metrics.own_ids_ranked == (0 if ignore_identical_ids else 3)
    warnings = [warning for warning in metrics.warnings() if "own id" in warning]
    assert len(warnings) == (0 if ignore_identical_ids else 1)
    assert all("3 judged queries rank" in warning and "pass --ignore-identical-ids" in warning for warning in warnings)


def test_an_own_document_judged_relevant_is_no_cause_for_a_warning(model: Embedder, tmp_path: Path) -> None:
    _arguments(tmp_path)
    (tmp_path / "qrels.txt").write_text("a1 0 a1 1\n")  # a query meant to find itself (a known-item search)
    options = ScoreOptions(queries=str(tmp_path / "queries.jsonl"), docs=str(tmp_path / "corpus.jsonl"),
                           qrels=str(tmp_path / "qrels.txt"))
    _, metrics = run_score(model.engine, model.tokenizer, open_inputs(options), options)
    assert metrics.per_query == {"a1": (1.0, 1.0, 1.0)} and metrics.own_ids_ranked == 0 and metrics.warnings() == []


def test_a_query_without_its_own_document_in_a_small_corpus_holds_one_hit_fewer(
        model: Embedder, cross_encoder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Six documents and --top-k 10: the arguments keep the other five, q9 all six, through the reranker too."""
    _arguments(tmp_path)
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    options = ScoreOptions(queries=str(tmp_path / "queries.jsonl"), docs=str(tmp_path / "corpus.jsonl"),
                           qrels=str(tmp_path / "qrels.txt"), ignore_identical_ids=True)
    inputs = open_inputs(options)
    first = rank(model.engine, model.tokenizer, inputs.queries, inputs.docs, options)
    assert first.doc_ids == _arguments_ranked(model, first.query_ids, ignore_identical_ids=True)
    assert [len(hits) for hits in first.doc_ids] == [5, 5, 5, 6] and first.scores.shape == (4, 6)
    assert np.isneginf(first.scores[:3, 5]).all() and np.isfinite(first.scores[3]).all()
    ranking, metrics = run_score(model.engine, model.tokenizer, inputs, options,
                                 reranker=(reranker.engine, reranker.tokenizer))
    assert [sorted(hits) for hits in ranking.doc_ids] == [sorted(hits) for hits in first.doc_ids]
    assert ranking.reranked == 5 + 5 + 5 + 6 and metrics.queries_scored == 4
    write_run(ranking, options)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["query_id"] for row in rows] == ["a1"] * 5 + ["a2"] * 5 + ["a3"] * 5 + ["q9"] * 6
    assert all(row["query_id"] != row["doc_id"] and np.isfinite(row["score"]) for row in rows)


# The cross-encoder reranker


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("reranker") / "model", "BertForSequenceClassification", num_labels=1)


def test_qrels_change_neither_what_the_reranker_rescores_nor_the_run(model: Embedder, cross_encoder: Path) -> None:
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    runs = {}
    for qrels in (None, str(SAMPLE / "qrels.txt")):
        options = ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), top_k=3, qrels=qrels)
        runs[qrels] = run_score(model.engine, model.tokenizer, open_inputs(options), options,
                                reranker=(reranker.engine, reranker.tokenizer))
    (plain, _), (judged, metrics) = runs.values()
    assert judged.doc_ids == plain.doc_ids and judged.reranked == plain.reranked == 3 * len(plain.query_ids)
    assert metrics.queries_scored > 0


def test_rerank_orders_by_the_transformers_cross_encoder(sample_ranking: tuple[Queries, Ranking], cross_encoder: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setattr(score, "PAIR_GROUP", 2)  # several groups of pairs
    queries, ranking = sample_ranking
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    texts = {row["id"]: row["text"] for row in _sample_docs()}
    reranked = rerank(reranker.engine, reranker.tokenizer, queries, ranking, texts, top_k=2)
    reference = transformers.BertForSequenceClassification.from_pretrained(cross_encoder).eval()
    for q, hits in enumerate(ranking.doc_ids[:10]):
        pairs = reranker.tokenizer.tokenizer.encode_batch([(queries.texts[q], texts[d]) for d in hits])
        with torch.no_grad():
            expected = [torch.sigmoid(reference(input_ids=torch.tensor([p.ids]), token_type_ids=torch.tensor([p.type_ids])).logits)[0, 0].item()
                        for p in pairs]
        order = np.argsort(-np.array(expected), kind="stable")[:2]
        assert reranked.doc_ids[q] == [hits[i] for i in order]
        np.testing.assert_allclose(reranked.scores[q], np.array(expected)[order], atol=1e-5)
    assert reranked.reranked == 3 * len(queries.ids) and reranked.scores.shape == (len(queries.ids), 2)


@pytest.mark.parametrize(("pairs", "sizes"), [(0, []), (1, [1]), (4, [4]), (5, [4, 1]), (8, [4, 4]), (12, [4, 4, 4]),
                                              (30, [4, 4, 8, 14]), (60, [4, 4, 8, 16, 28])])
def test_pair_groups_hold_even_groups_then_double(monkeypatch: pytest.MonkeyPatch, pairs: int, sizes: list[int]) -> None:
    monkeypatch.setattr(score, "PAIR_GROUP", 4)
    monkeypatch.setattr(score, "EVEN_PAIR_GROUPS", 2)

    groups = list(pair_groups(pairs))

    assert [end - start for start, end in groups] == sizes
    assert [start for start, _ in groups] == [sum(sizes[:i]) for i in range(len(sizes))]


@pytest.mark.parametrize(("pairs", "sizes"), [(5, [2, 2, 1]), (14, [2, 2, 2, 2, 2, 2, 2]),
                                              (40, [2, 2, 2, 2, 2, 2, 4, 8, 8, 8])])
def test_pair_groups_grow_no_larger_than_the_largest(pairs: int, sizes: list[int]) -> None:
    groups = list(pair_groups(pairs, even_groups=6, largest=8))

    assert [end - start for start, end in groups] == sizes
    assert [start for start, _ in groups] == [sum(sizes[:i]) for i in range(len(sizes))]


# Documents from a table built by `embedctl index`


@pytest.fixture(scope="module")
def sample_table(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("table") / "vectors.lance"
    result = subprocess.run([sys.executable, "-m", "embedctl.cli", "index", str(CORPUS), "--out", str(out),
                             "--model", str(minilm_dir), "--keep", "text", "-q"], env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("named", ["", "database", "database/"], ids=["x.lance", "database and --table",
                                                                     "database/ and --table"])
def test_index_table_ranks_like_the_documents(sample_table: Path, sample_ranking: tuple[Queries, Ranking], model: Embedder,
                                              named: str) -> None:
    queries, ranking = sample_ranking
    # A trailing slash names the database folder as index's --out takes it (it was refused as a Parquet folder).
    where = ({"index": str(sample_table.parent) + named.removeprefix("database"), "table": "vectors"} if named
             else {"index": str(sample_table)})
    options = ScoreOptions(queries=str(QUERIES), top_k=3, chunk_rows=64, **where)
    inputs = open_inputs(options)
    calls = []
    from_table = rank(model.engine, model.tokenizer, inputs.queries, inputs.table, options,
                      progress=lambda *args: calls.append(args))
    assert from_table.doc_ids == ranking.doc_ids and from_table.documents == 300
    np.testing.assert_allclose(from_table.scores, ranking.scores, atol=1e-5)
    assert inputs.table.texts({"doc-00279"}) == {"doc-00279": next(r["text"] for r in _sample_docs() if r["id"] == "doc-00279")}
    done = [done for done, _, _ in calls]
    assert calls[0] == (0, 0, 300) and calls[-1] == (300, 0, 300) and done == sorted(done) and len(calls) > 2


def test_progress_counts_documents_and_their_tokens_then_reranked_queries(model: Embedder, cross_encoder: Path) -> None:
    docs = [Chunk("docs.jsonl", ["a", "empty", "b"], ["first document", " ", "the second document"], [1, 2, 3], None),
            Chunk("docs.jsonl", ["c"], ["a third one"], [4], None)]
    options = ScoreOptions(queries="q.jsonl", docs="docs.jsonl", top_k=2)
    queries = Queries(["q1", "q2", "q3"], ["a question", "another question", "a third question"])
    ranked = []
    ranking = rank(model.engine, model.tokenizer, queries, docs, options, progress=lambda *args: ranked.append(args))
    tokens = sum(len(ids) for ids in model.tokenizer.encode(["first document", "the second document", "a third one"]).ids)
    assert ranked == [(0, 0, None), (3, ranked[1][1], None), (4, tokens, None)] and 0 < ranked[1][1] < tokens
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    reranked = []
    texts = {"a": "first document", "b": "the second document", "c": "a third one"}
    rerank(reranker.engine, reranker.tokenizer, queries, ranking, texts, top_k=2, progress=lambda *args: reranked.append(args))
    done = [done for done, _, _ in reranked]
    assert reranked[0] == (0, 0, 3) and reranked[-1] == (3, 0, 3) and done == sorted(set(done))
    assert {call[1:] for call in reranked} == {(0, 3)}


class ProgressRecorder:
    """A Progress that keeps every report it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int | None]] = []

    def __call__(self, done: int, tokens: int, total: int | None) -> None:
        self.calls.append((done, tokens, total))

    def advances(self) -> list[int]:
        done = [done for done, _, _ in self.calls]
        return [now - before for before, now in zip(done, done[1:])]


def test_the_rerank_bar_moves_as_each_query_is_scored(cross_encoder: Path) -> None:
    """Not once per block of RERANK_QUERY_BLOCK queries: steps of at most two pairs, three pairs a query."""
    queries = Queries([f"q{i}" for i in range(5)], [f"question number {i}" for i in range(5)])
    texts = {doc_id: f"document {doc_id}" for doc_id in "abc"}
    ranking = Ranking(query_ids=queries.ids, doc_ids=[list("abc") for _ in range(5)], scores=np.zeros((5, 3), np.float32),
                      corpus_ids=list("abc"))
    reranker = embedctl.load(str(cross_encoder), device="cpu", max_seqs=2)
    progress = ProgressRecorder()
    reranked = rerank(reranker.engine, reranker.tokenizer, queries, ranking, texts, top_k=3, progress=progress)
    assert progress.calls[0] == (0, 0, 5) and {call[1:] for call in progress.calls} == {(0, 5)}
    assert sum(progress.advances()) == 5 and all(step > 0 for step in progress.advances())
    assert len(progress.advances()) > 1
    quiet = rerank(reranker.engine, reranker.tokenizer, queries, ranking, texts, top_k=3)
    assert reranked.doc_ids == quiet.doc_ids
    np.testing.assert_array_equal(reranked.scores, quiet.scores)


def test_the_summary_counts_one_query_document_and_pair_in_the_singular() -> None:
    one = Ranking(query_ids=["q1"], doc_ids=[["a"]], scores=np.ones((1, 1), np.float32), corpus_ids=["a"],
                  skipped_empty=1, truncated=1, reranked=1, own_ids_dropped=1)
    assert one.summary(None) == ("1 query x 1 document, top 1, 1 pair reranked in 0.0 s; 1 empty document skipped, "
                                 "1 truncated, 1 own-id hit dropped -> stdout")
    many = Ranking(query_ids=[f"q{i}" for i in range(1200)], doc_ids=[["a"] for _ in range(1200)],
                   scores=np.ones((1200, 1), np.float32), corpus_ids=["a", "b"], reranked=2400)
    assert many.summary("run.jsonl") == ("1,200 queries x 2 documents, top 1, 2,400 pairs reranked in 0.0 s; "
                                         "0 empty documents skipped, 0 truncated -> run.jsonl")


class UnreadyResult:
    """A step's result that is never ready before it is waited for; the log records the wait."""

    def __init__(self, lazy: LazyTensor, log: list[str]) -> None:
        self.lazy, self.log = lazy, log

    def ready(self) -> bool:
        return False

    def result(self) -> np.ndarray:
        self.log.append("wait")
        return self.lazy.result()


class RecordingEngine:
    """The engine, recording the steps and waits in the order they happen and each step's pairs. With
    unready, every result stays pending until waited for, as a slow device would look to pair_scores."""

    def __init__(self, engine: Engine, unready: bool) -> None:
        self.engine, self.max_batch_tokens, self.config = engine, engine.max_batch_tokens, engine.config
        self.activate = engine.activate
        self.unready = unready
        self.log: list[str] = []
        self.step_pairs: list[int] = []

    def step(self, batch: PackedBatch) -> LazyTensor | UnreadyResult:
        self.log.append("step")
        self.step_pairs.append(batch.num_seqs)
        lazy = self.engine.step(batch)
        return UnreadyResult(lazy, self.log) if self.unready else lazy


def test_pair_scores_enqueues_every_step_before_waiting_for_one(cross_encoder: Path) -> None:
    reranker = embedctl.load(str(cross_encoder), device="cpu", max_seqs=2)
    firsts, seconds = ["a question"] * 9, [f"document {i}" for i in range(9)]
    unready, scored = RecordingEngine(reranker.engine, unready=True), []
    scores = pair_scores(unready, reranker.tokenizer, firsts, seconds, scored.append)
    steps = unready.log.count("step")
    assert steps >= 5 and unready.log == ["step"] * steps + ["wait"] * steps
    assert len(scored) == steps and scored == sorted(scored) and scored[-1] == 9
    np.testing.assert_array_equal(scores, pair_scores(reranker.engine, reranker.tokenizer, firsts, seconds))


def test_pairs_gather_into_one_step_while_the_device_has_steps_queued(cross_encoder: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of two: the first two groups leave at once (fewer than QUEUED_STEPS steps queued), the
    next ones wait for a larger step while both stay unready, and the last group's pairs leave with
    them. On the CPU every step is done when step() returns, so each group is a step."""
    monkeypatch.setattr(score, "PAIR_GROUP", 2)
    monkeypatch.setattr(score, "QUEUED_STEPS", 2)
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    firsts, seconds = ["a question"] * 10, [f"document {i}" for i in range(10)]
    unready, cpu = RecordingEngine(reranker.engine, unready=True), RecordingEngine(reranker.engine, unready=False)

    scores = pair_scores(unready, reranker.tokenizer, firsts, seconds)

    assert unready.step_pairs == [2, 2, 6]
    np.testing.assert_allclose(scores, pair_scores(cpu, reranker.tokenizer, firsts, seconds), atol=1e-6)
    assert cpu.step_pairs == [2, 2, 2, 2, 2]


@pytest.mark.parametrize(("pairs", "submitted"), [(20, [2, 2, 2, 2, 4, 8]), (15, [1] * 14), (1, [])])
def test_pairs_tokenized_in_worker_processes_score_as_in_this_one(cross_encoder: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  pairs: int, submitted: list[int]) -> None:
    """With a pool's workers running and at least POOL_MIN_PAIRS pairs, every group goes to them up
    front, two per worker in small groups first; fewer go to them a pair each but the first, which is
    tokenized here, and a lone pair stays here. The scores are the ones tokenizing here gives, long
    and non-ASCII documents included."""
    assert score.POOL_MIN_PAIRS == 16
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    firsts = ["a question"] * pairs
    seconds = [f"document {i} " + ("about tables and columns, " * 60 if i % 3 == 0 else "Ünïcödé 漢字") for i in range(pairs)]
    here = pair_scores(reranker.engine, reranker.tokenizer, firsts, seconds)
    with TokenizerPool(reranker.tokenizer, processes=2, pulled=True) as pool:  # as run_score makes it
        pool.wait_for_workers()
        sizes: list[int] = []
        submit_pairs = pool.submit_pairs
        monkeypatch.setattr(pool, "submit_pairs", lambda a, b: sizes.append(len(a)) or submit_pairs(a, b))
        scored: list[int] = []

        in_workers = pair_scores(reranker.engine, reranker.tokenizer, firsts, seconds, scored.append, pool)

    assert sizes == submitted
    np.testing.assert_allclose(in_workers, here, atol=1e-6)
    assert scored[-1] == pairs and scored == sorted(scored)


def test_no_pairs_score_nothing_with_workers_running(cross_encoder: Path) -> None:
    reranker = embedctl.load(str(cross_encoder), device="cpu")
    with TokenizerPool(reranker.tokenizer, processes=1, pulled=True) as pool:
        pool.wait_for_workers()
        assert pair_scores(reranker.engine, reranker.tokenizer, [], [], pool=pool).shape == (0,)


@pytest.mark.parametrize(("options", "phrase"), [
    (dict(docs=str(CORPUS), rerank_depth=20), "--rerank-depth 20 sets how many hits --reranker rescores, and there is no --reranker"),
    # the missing reranker is named before a depth below --top-k, which no depth without one would fix
    (dict(docs=str(CORPUS), rerank_depth=0), "--rerank-depth 0 sets how many hits --reranker rescores, and there is no --reranker"),
    (dict(docs=str(CORPUS), tokenizer_processes=2), "--tokenizer-processes 2 sets the processes that tokenize --reranker's"),
    (dict(docs=str(CORPUS), overwrite=True), "--overwrite lets --out replace an existing file, and there is no --out"),
    (dict(index="TABLE", docs=str(CORPUS)), "DOCS is read only for --reranker's texts; drop DOCS"),
    (dict(index="TABLE", doc_prompt="passage: "), "--doc-prompt puts a prompt before documents this run embeds"),
    (dict(index="TABLE", doc_prompt_name="document"), "--doc-prompt-name puts a prompt before documents"),
], ids=["depth without reranker", "zero depth without reranker", "tokenizer processes without reranker",
        "overwrite without out", "docs beside index", "doc prompt with index", "doc prompt name with index"])
def test_options_that_would_do_nothing_are_refused(sample_table: Path, options: dict, phrase: str) -> None:
    if options.get("index") == "TABLE":
        options = {**options, "index": str(sample_table)}
    with pytest.raises(UserError, match=phrase):
        open_inputs(ScoreOptions(queries=str(QUERIES), **options))


@pytest.mark.parametrize(("options", "message"), [
    (dict(reranker=""), "--reranker '' names no model; give the cross-encoder's directory or hub id, or drop --reranker"),
    (dict(out=""), "--out '' names no file; give a file path, or - (or no --out) for standard output"),
], ids=["reranker", "out"])
def test_an_empty_name_is_named_as_given(options: dict, message: str) -> None:
    with pytest.raises(UserError) as refused:
        open_inputs(ScoreOptions(queries=str(QUERIES), docs=str(CORPUS), **options))
    assert str(refused.value) == message


def test_index_built_with_other_settings_is_refused(sample_table: Path, minilm_dir: Path) -> None:
    options = ScoreOptions(queries=str(QUERIES), index=str(sample_table))
    inputs = open_inputs(options)
    other = embedctl.load(str(minilm_dir), device="cpu", dim=128)
    with pytest.raises(UserError, match="was built with dim 384 but the query model has 128"):
        rank(other.engine, other.tokenizer, inputs.queries, inputs.table, options)


def test_index_built_with_other_model_files_names_them_rather_than_their_hashes(sample_table: Path, minilm_dir: Path,
                                                                                tmp_path: Path) -> None:
    copy = tmp_path / "minilm-copy"
    shutil.copytree(minilm_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))  # same weights, other settings
    options = ScoreOptions(queries=str(QUERIES), index=str(sample_table))
    inputs = open_inputs(options)
    other = embedctl.load(str(copy), device="cpu")
    with pytest.raises(UserError) as refused:
        rank(other.engine, other.tokenizer, inputs.queries, inputs.table, options)
    assert str(refused.value).startswith(
        f"--index {sample_table} was built with the same weights but other config, tokenizer or module files than "
        f"{other.engine.files.name}'s (the table names the model ")
    assert "sha256" not in str(refused.value)


def test_index_table_with_a_repeated_id_is_refused(sample_table: Path, tmp_path: Path, model: Embedder) -> None:
    import lancedb

    table = lancedb.connect(str(sample_table.parent)).open_table("vectors").to_arrow()
    repeated = tmp_path / "repeated.parquet"  # as if a second run had been appended by hand
    pq.write_table(pa.concat_tables([table, table.slice(7, 1)]), repeated)
    options = ScoreOptions(queries=str(QUERIES), index=str(repeated))
    inputs = open_inputs(options)
    doc_id = table.column("id")[7].as_py()
    with pytest.raises(UserError, match=f"duplicate document id '{doc_id}'; if an `embedctl index` run into it is "
                                        "ending, score once it has ended; if one was cut off, run it again to finish "
                                        "it; else rebuild the table"):
        rank(model.engine, model.tokenizer, inputs.queries, inputs.table, options)


def test_a_table_without_embedctl_settings_or_with_a_null_text_is_one_line(sample_table: Path, tmp_path: Path,
                                                                             model: Embedder) -> None:
    import lancedb

    table = lancedb.connect(str(sample_table.parent)).open_table("vectors").to_arrow()
    plain = tmp_path / "plain.parquet"  # its id and vector columns, without the settings index records
    pq.write_table(table.select(["id", "vector"]).replace_schema_metadata(None), plain)
    with pytest.raises(UserError, match="records no embedctl settings .* give a table written by `embedctl index`"):
        open_inputs(ScoreOptions(queries=str(QUERIES), index=str(plain)))

    holed = tmp_path / "holed.parquet"
    texts = table.column("text").to_pylist()
    texts[4] = None
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts, pa.string())), holed)
    inputs = open_inputs(ScoreOptions(queries=str(QUERIES), index=str(holed)))
    doc_id = table.column("id")[4].as_py()
    with pytest.raises(UserError, match=f"document '{doc_id}' has None in its text column 'text', not a text"):
        score.document_texts(inputs, {doc_id})


def test_a_ranked_document_gone_from_docs_on_the_second_pass_is_one_line(tmp_path: Path) -> None:
    """The reranker reads DOCS again for the texts of the hits; a corpus rewritten in between lacks some."""
    write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "kept"}])
    inputs = open_inputs(ScoreOptions(queries=str(QUERIES), docs=str(tmp_path / "docs.jsonl")))
    with pytest.raises(UserError, match=r"^1 ranked document is no longer in .*docs.jsonl \(first: 'b'\): DOCS changed "
                                        r"while the run read it; run score again once the documents are written$"):
        score.document_texts(inputs, {"a", "b"})


@pytest.mark.parametrize("similarity", ["dot", "euclidean", "manhattan", None])
def test_the_model_s_own_similarity_ranks_as_sentence_transformers_scores(tmp_path: Path, similarity: str | None) -> None:
    """config_sentence_transformers.json's similarity_fn_name, on a model without a Normalize module (where
    each of the four ranks differently): the run equals sentence-transformers' model.similarity over its
    encode(), and a streamed chunking the whole corpus at once."""
    from sentence_transformers import SentenceTransformer

    model_dir = save_random_model(tmp_path / "model", pooling="mean")
    if similarity is not None:
        (model_dir / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": similarity}))
    texts = [json.loads(line)["text"] for line in (CORPUS / "part-001.jsonl").read_text().splitlines()[:40]]
    write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": text} for i, text in enumerate(texts)])
    queries = [text.split(".")[0] for text in texts[:5]]
    write_jsonl(tmp_path / "queries.jsonl", [{"id": f"q{i}", "text": text} for i, text in enumerate(queries)])
    peer = SentenceTransformer(str(model_dir), device="cpu")
    assert peer.similarity_fn_name == (similarity or "cosine")
    expected = peer.similarity(peer.encode(queries, convert_to_tensor=True), peer.encode(texts, convert_to_tensor=True))
    expected_order = torch.sort(expected, dim=1, descending=True, stable=True)
    embedder = embedctl.load(str(model_dir), device="cpu")
    runs = []
    for chunk_rows in (7, 1000):
        options = ScoreOptions(queries=str(tmp_path / "queries.jsonl"), docs=str(tmp_path / "docs.jsonl"), top_k=10,
                               chunk_rows=chunk_rows)
        ranking = rank(embedder.engine, embedder.tokenizer, open_inputs(options).queries, open_inputs(options).docs, options)
        runs.append(ranking)
        assert ranking.similarity == (similarity or "cosine")
        assert ranking.doc_ids == [[f"d{i}" for i in row[:10]] for row in expected_order.indices.tolist()]
        np.testing.assert_allclose(ranking.scores, expected_order.values[:, :10].numpy(), rtol=1e-4, atol=1e-4)
    assert runs[0].doc_ids == runs[1].doc_ids and np.array_equal(runs[0].scores, runs[1].scores)


def test_a_multi_vector_similarity_is_refused_in_one_line(tmp_path: Path) -> None:
    model_dir = save_random_model(tmp_path / "model", pooling="mean")
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "maxsim"}))
    write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "a document"}])
    write_jsonl(tmp_path / "queries.jsonl", [{"id": "q", "text": "a query"}])
    result = run_cli("score", "queries.jsonl", "docs.jsonl", "--model", str(model_dir), "--device", "cpu", cwd=tmp_path)
    assert_one_error_line(result, "its similarity_fn_name 'maxsim' (config_sentence_transformers.json) is not one "
                                  "embedctl scores by (cosine, dot, euclidean, manhattan); use a single-vector model")


def test_equal_documents_score_equal_for_a_single_query() -> None:
    """A matrix-vector product rounds a chunk's last rows apart from the others (half of these sizes, with
    numpy's BLAS); equal documents must still score equal, so that ties keep document order."""
    torch.manual_seed(0)
    for n in range(2, 60):
        docs = torch.nn.functional.normalize(torch.randn(n, 384), dim=1)
        docs[-1] = docs[0]
        top = RunningTopK(torch.nn.functional.normalize(torch.randn(1, 384), dim=1), n)
        top.add(docs)
        order, scores = top.indices[0].tolist(), top.scores[0].tolist()
        assert scores[order.index(0)] == scores[order.index(n - 1)] and order.index(0) < order.index(n - 1)


def test_a_directory_of_parquet_parts_ranks_like_the_lance_table(sample_table: Path, sample_ranking: tuple[Queries, Ranking],
                                                                   tmp_path: Path, model: Embedder) -> None:
    # Row groups of 128 rows read in chunks of 50, so most batches are slices of their group's vectors;
    # and a file beside the parts that is not the table's, which index leaves there too.
    import lancedb

    table = lancedb.connect(str(sample_table.parent)).open_table("vectors").to_arrow()
    parts = tmp_path / "vectors"
    parts.mkdir()
    pq.write_table(table.slice(0, 200), parts / "part-00000.parquet", row_group_size=128)
    pq.write_table(table.slice(200), parts / "part-00001.parquet", row_group_size=128)
    (parts / "README.md").write_text("notes kept beside the table\n")
    options = ScoreOptions(queries=str(QUERIES), index=f"{parts}/", top_k=3, chunk_rows=50)
    ranked = rank(model.engine, model.tokenizer, open_inputs(options).queries, open_inputs(options).table, options)
    queries, ranking = sample_ranking
    assert ranked.doc_ids == ranking.doc_ids and ranked.documents == 300
    np.testing.assert_allclose(ranked.scores, ranking.scores, atol=1e-5)


def test_a_trec_run_from_a_table_refuses_an_id_holding_whitespace(sample_table: Path, tmp_path: Path,
                                                                   model: Embedder) -> None:
    import lancedb

    table = lancedb.connect(str(sample_table.parent)).open_table("vectors").to_arrow()
    ids = table.column("id").to_pylist()
    ids[5] = "doc 5"
    spaced = tmp_path / "spaced.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("id"), "id", pa.array(ids)), spaced)
    options = ScoreOptions(queries=str(QUERIES), index=str(spaced), format="trec")
    inputs = open_inputs(options)
    with pytest.raises(UserError, match="document id 'doc 5' holds whitespace, which a TREC run cannot"):
        rank(model.engine, model.tokenizer, inputs.queries, inputs.table, options)


def test_score_against_a_table_embeds_queries_with_the_tables_settings(tmp_path: Path, minilm_dir: Path) -> None:
    # A table indexed with --dim and --max-length, scored with no flags but the model: the queries
    # are embedded as its documents were, so the run equals one made in process with those settings.
    table = tmp_path / "small.lance"
    built = subprocess.run([sys.executable, "-m", "embedctl.cli", "index", str(CORPUS), "--out", str(table), "--model",
                            str(minilm_dir), "--dim", "128", "--max-length", "64", "-q"], env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    result = embedctl_score(QUERIES, "--index", table, "--model", minilm_dir, "--top-k", "3", "--out", "run.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    options = ScoreOptions(queries=str(QUERIES), index=str(table), top_k=3)
    inputs = open_inputs(options)
    same = embedctl.load(str(minilm_dir), device="cpu", dim=128, max_length=64)
    expected = rank(same.engine, same.tokenizer, inputs.queries, inputs.table, options)
    assert [[r["doc_id"] for r in rows if r["query_id"] == q] for q in expected.query_ids] == expected.doc_ids
    # The documents themselves with the same flags give the same run; a flag against the table is refused.
    from_files = embedctl_score(QUERIES, CORPUS, "--model", minilm_dir, "--dim", "128", "--max-length", "64", "--top-k", "3",
                                cwd=tmp_path)
    assert from_files.returncode == 0, from_files.stderr
    assert [json.loads(line)["doc_id"] for line in from_files.stdout.splitlines()] == [r["doc_id"] for r in rows]
    conflict = embedctl_score(QUERIES, "--index", table, "--model", minilm_dir, "--dim", "64", cwd=tmp_path)
    assert_one_error_line(conflict, "was built with dim 128 but the query model has 64", "settings it was built with")


def test_score_against_a_table_of_another_model_names_that_model(sample_table: Path, tmp_path: Path) -> None:
    other = save_random_model(tmp_path / "other", pooling="mean")
    _good_queries(tmp_path)
    result = embedctl_score("queries.jsonl", "--index", sample_table, "--model", other, cwd=tmp_path)
    assert_one_error_line(result, f"--index {sample_table} was built with the model", f"not {other};",
                          "pass the --model it was built with")


def _sample_docs() -> list[dict]:
    first = pq.read_table(CORPUS / "part-000.parquet").to_pylist()
    return first + [json.loads(line) for line in (CORPUS / "part-001.jsonl").read_text().splitlines()]


# The command line: real subprocesses


def embedctl_score(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli("score", *args, cwd=cwd)


def _good_queries(tmp: Path) -> None:
    write_jsonl(tmp / "queries.jsonl", [{"id": "q1", "text": "A good line."}])


def _duplicate_query_ids(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "queries.jsonl", [{"id": "q1", "text": "one"}, {"id": "q1", "text": "two"}])
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl"], ["queries.jsonl line 2", "duplicate query id 'q1'", "unique"]


def _duplicate_doc_ids(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    # a blank repeat, too, leaves unclear which row the id means (it used to be skipped as blank, unnoticed)
    write_jsonl(tmp / "docs.jsonl", [*good_rows("a"), {"id": "a0", "text": "  "}])
    return ["queries.jsonl", "docs.jsonl"], ["docs.jsonl line 3", "duplicate document id 'a0'", "unique"]


def _no_queries(tmp: Path) -> tuple[list, list[str]]:
    (tmp / "queries.jsonl").write_text("")
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl"], ["queries.jsonl holds no queries", "at least one query"]


def _no_documents(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", [{"id": "a", "text": " "}, {"id": "b", "text": None}])
    return ["queries.jsonl", "docs.jsonl"], ["docs.jsonl holds no documents with text", "non-empty text"]


def _top_k_zero(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl", "--top-k", "0"], ["--top-k 0", "at least 1"]


def _existing_out(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "run.jsonl").write_text("an earlier run\n")
    return ["queries.jsonl", "docs.jsonl"], ["run.jsonl already exists", "--overwrite"]


def _whitespace_id_in_trec(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "queries.jsonl", [{"id": "q 1", "text": "A good line."}])
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl", "--format", "trec"], ["queries.jsonl line 1", "'q 1'", "--format jsonl"]


def _whitespace_in_a_file_name_made_id(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "my docs.jsonl", [{"text": "A good line."}])
    return ["queries.jsonl", "my docs.jsonl", "--format", "trec"], [
        "id 'my docs.jsonl:1' holds whitespace", "made from the file's name", "pass --id-col"]


def _no_docs_and_no_index(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl"], ["no documents", "--index"]


def _qrels_for_unknown_queries(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "qrels.txt").write_text("q1 0 a0 1\nq7 0 a1 1\n")
    return ["queries.jsonl", "docs.jsonl", "--qrels", "qrels.txt"], ["qrels.txt judges 1 query not in the query set", "'q7'"]


def _reranker_is_not_a_cross_encoder(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl", "--reranker", minilm_path()], ["is not a cross-encoder", "an embedding model"]


def _rerank_depth_below_top_k(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl", "--reranker", "x", "--rerank-depth", "5"], ["--rerank-depth 5 is below --top-k 10"]


def _tokenizer_processes_negative(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl", "--tokenizer-processes", "-1"], ["--tokenizer-processes -1", "give 0"]


def _table_without_index(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl", CORPUS, "--table", "vectors"], ["--table vectors", "there is no --index"]


def _table_without_index_or_docs(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl", "--table", "vectors"], ["--table vectors", "there is no --index"]


def _table_of_a_parquet_index(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl", "--index", "vectors.parquet", "--table", "vectors"], ["is a Parquet table", "drop --table"]


def _table_of_a_lance_table(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl", "--index", "vectors.lance", "--table", "x"], ["--index vectors.lance names a LanceDB table",
                                                                         "drop --table"]


def _table_not_in_the_database(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    (tmp / "db").mkdir()
    return ["queries.jsonl", "--index", "db", "--table", "nope"], ["cannot open table 'nope' of --index db", "not found"]


def _table_of_a_missing_database(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    return ["queries.jsonl", "--index", "typo", "--table", "vectors"], ["--index typo does not exist", "the LanceDB database that holds table 'vectors'"]


def _database_without_table(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    (tmp / "db" / "vectors.lance").mkdir(parents=True)
    return ["queries.jsonl", "--index", "db"], ["--index db is a LanceDB database (tables: vectors); pass --table NAME"]


def _qrels_with_relevance(tmp: Path, relevance: str) -> list:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    (tmp / "qrels.jsonl").write_text(f'{{"query_id": "q1", "doc_id": "a0", "relevance": {relevance}}}\n')
    return ["queries.jsonl", "docs.jsonl", "--qrels", "qrels.jsonl"]


def _qrels_relevance_a_fraction(tmp: Path) -> tuple[list, list[str]]:
    # int() made 0.5 a 0: a relevant document judged irrelevant, without a word
    return _qrels_with_relevance(tmp, "0.5"), ["qrels.jsonl line 1", "integer relevance", "fix the line"]


def _qrels_relevance_infinite(tmp: Path) -> tuple[list, list[str]]:
    # 1e400 reads as float infinity, which int() refused with an OverflowError traceback
    return _qrels_with_relevance(tmp, "1e400"), ["qrels.jsonl line 1", "integer relevance", "fix the line"]


BAD_INPUTS = [_duplicate_query_ids, _duplicate_doc_ids, _no_queries, _no_documents, _top_k_zero, _existing_out,
              _whitespace_id_in_trec, _whitespace_in_a_file_name_made_id, _no_docs_and_no_index, _qrels_for_unknown_queries, _reranker_is_not_a_cross_encoder,
              _rerank_depth_below_top_k, _tokenizer_processes_negative, _qrels_relevance_a_fraction, _qrels_relevance_infinite, _table_without_index,
              _table_without_index_or_docs, _table_of_a_parquet_index, _table_of_a_lance_table, _table_not_in_the_database, _table_of_a_missing_database,
              _database_without_table]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, list[str], subprocess.CompletedProcess]]:
    """Every bad-input case and one good TREC run (over an old run file, with --overwrite), one per core."""
    jobs = {}
    for case in BAD_INPUTS:
        tmp = tmp_path_factory.mktemp(case.__name__.strip("_"))
        args, phrases = case(tmp)
        jobs[case.__name__] = (tmp, snapshot(tmp), phrases, [*args, "--out", "run.jsonl"])
    good = tmp_path_factory.mktemp("trec")
    (good / "run.trec").write_text("an earlier run\n")
    jobs["trec"] = (good, {}, [], [QUERIES, CORPUS, "--format", "trec", "--top-k", "5", "--out", "run.trec", "--overwrite"])
    reranked = tmp_path_factory.mktemp("reranked")
    cross_encoder = save_random_model(reranked / "reranker", "BertForSequenceClassification", num_labels=1)
    jobs["reranked"] = (reranked, {}, [], [QUERIES, CORPUS, "--reranker", cross_encoder, "--rerank-depth", "20", "--top-k", "10",
                                           "--qrels", SAMPLE / "qrels.txt", "--report", "report.json", "--out", "run.jsonl",
                                           "--tokenizer-processes", "1"])
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda job: embedctl_score(*job[3], cwd=job[0]), jobs.values())
        return {name: (*job[:3], result) for (name, job), result in zip(jobs.items(), results)}


@pytest.mark.parametrize("case", [case.__name__ for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(cli_runs: dict, case: str) -> None:
    directory, before, phrases, result = cli_runs[case]
    assert_one_error_line(result, *phrases)
    assert result.stdout == ""
    assert snapshot(directory) == before


def test_reranked_run_with_metrics_and_report(cli_runs: dict) -> None:
    directory, _, _, result = cli_runs["reranked"]
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (directory / "run.jsonl").read_text().splitlines()]
    assert len(rows) == 50 * 10 and all((r["rank"] == 1) == (i % 10 == 0) for i, r in enumerate(rows))
    report = json.loads((directory / "report.json").read_text())
    assert report["reranked_pairs"] == 50 * 20 and report["metrics"]["queries_scored"] == 50
    # Metrics of the written run, recomputed here from the sample qrels.
    wanted = {row["id"]: row["doc_id"] for row in map(json.loads, QUERIES.read_text().splitlines())}
    hits = {q: [r["doc_id"] for r in rows if r["query_id"] == q] for q in wanted}
    assert report["metrics"]["recall@10"] == pytest.approx(np.mean([wanted[q] in hits[q] for q in wanted]), abs=1e-6)
    assert f"Recall@10 {report['metrics']['recall@10']:.4f}" in result.stderr and "nDCG@10" in result.stderr
    # Each query's figures, from its one relevant document's rank in the run file (ten hits a query) as trec_eval
    # reads it, equal scores (the random reranker gives some) by doc id from the last; their means are the
    # reported ones. The terminal shows the means only.
    per_query = report["metrics"]["per_query"]
    assert list(per_query) == list(wanted) and "per_query" not in result.stderr
    for q, figures in per_query.items():
        ranked = trec_eval_order({r["doc_id"]: r["score"] for r in rows if r["query_id"] == q})
        rank_ = ranked.index(wanted[q]) + 1 if wanted[q] in ranked else None
        assert figures == pytest.approx({"ndcg@10": 1 / np.log2(rank_ + 1) if rank_ else 0.0,
                                         "mrr@10": 1 / rank_ if rank_ else 0.0, "recall@10": float(bool(rank_))}, abs=1e-6)
    for name in ("ndcg@10", "mrr@10", "recall@10"):
        assert np.mean([figures[name] for figures in per_query.values()]) == pytest.approx(report["metrics"][name], abs=1e-6)


def test_a_terminal_sees_a_bar_per_phase_unless_quiet(tmp_path: Path, cross_encoder: Path) -> None:
    args = ["score", QUERIES, CORPUS, "--reranker", cross_encoder, "--top-k", "3", "--out", "run.jsonl"]
    code, shown = run_cli_in_terminal(*args, cwd=tmp_path)
    assert code == 0, shown
    assert "ranking" in shown and "documents" in shown and "reranking" in shown and "queries" in shown
    assert "50 queries x 300 documents" in shown  # the summary line, after the bars
    (tmp_path / "run.jsonl").unlink()
    code, shown = run_cli_in_terminal(*args, "--quiet", cwd=tmp_path)
    assert code == 0 and shown == "", shown


def test_a_blank_row_sharing_a_ranked_id_does_not_replace_its_text_for_the_reranker(tmp_path: Path) -> None:
    # With --index the documents are ranked from the table; DOCS only gives the reranker their texts, and its
    # ids were never checked (DOCS alone refuses the repeated id: _duplicate_doc_ids).
    _good_queries(tmp_path)
    reranker = save_random_model(tmp_path / "reranker", "BertForSequenceClassification", num_labels=1, type_vocab_size=2)
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    write_jsonl(tmp_path / "with_blank.jsonl", [*good_rows("a"), {"id": "a0", "text": "  "}])
    built = run_cli("index", "docs.jsonl", "--out", "docs.parquet", "-q", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    runs = [embedctl_score("queries.jsonl", "docs.jsonl", "--reranker", reranker, "--top-k", "2", cwd=tmp_path),
            embedctl_score("queries.jsonl", "with_blank.jsonl", "--index", "docs.parquet", "--reranker", reranker,
                           "--top-k", "2", cwd=tmp_path)]
    assert [run.returncode for run in runs] == [0, 0], runs[1].stderr
    assert "1 query x 2 documents, top 2, 2 pairs reranked in" in runs[1].stderr
    assert runs[1].stdout == runs[0].stdout  # a0 reranked by its own text, not by the blank row's


def test_judged_documents_outside_the_ranked_set_warn_in_one_line_and_score_as_trec_eval(tmp_path: Path) -> None:
    _good_queries(tmp_path)
    write_jsonl(tmp_path / "docs.jsonl", good_rows("a"))
    (tmp_path / "qrels.txt").write_text("q1 0 a0 1\nq1 0 gone9 1\nq1 0 gone1 0\nq1 0 gone5 2\n")
    result = embedctl_score("queries.jsonl", "docs.jsonl", "--qrels", "qrels.txt", "--report", "report.json",
                            "--out", "run.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [warning] = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    for phrase in ["--qrels qrels.txt judges 3 documents not among the documents ranked",
                   "'gone1', 'gone5', 'gone9'", "check the documents and --id-col"]:
        assert phrase in warning
    # Relevant: a0 (1), which the run ranks, and gone9 (1) and gone5 (2), which it cannot: never found.
    rank_a0 = [row["doc_id"] for row in map(json.loads, (tmp_path / "run.jsonl").read_text().splitlines())].index("a0") + 1
    metrics = json.loads((tmp_path / "report.json").read_text())["metrics"]
    ideal = 2 + 1 / np.log2(3) + 1 / np.log2(4)
    assert metrics["ndcg@10"] == pytest.approx(1 / np.log2(rank_a0 + 1) / ideal, abs=1e-6)
    assert metrics["mrr@10"] == pytest.approx(1 / rank_a0, abs=1e-6)
    assert metrics["recall@10"] == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["judged_docs_missing"] == 3


def test_the_command_leaves_out_own_ids_when_asked_and_warns_when_they_count_against_the_run(tmp_path: Path) -> None:
    _arguments(tmp_path)
    common = ["queries.jsonl", "corpus.jsonl", "--qrels", "qrels.txt", "--top-k", "3"]
    with ThreadPoolExecutor(2) as pool:
        kept, dropped = pool.map(lambda args: embedctl_score(*common, *args, cwd=tmp_path),
                                 [["--out", "kept.jsonl", "--report", "kept.json"],
                                  ["--ignore-identical-ids", "--out", "dropped.jsonl", "--report", "dropped.json"]])
    assert (kept.returncode, dropped.returncode) == (0, 0), kept.stderr + dropped.stderr
    runs = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("kept", "dropped")}
    assert [row["doc_id"] for row in runs["kept"] if row["rank"] == 1][:3] == ["a1", "a2", "a3"]
    [warning] = [line for line in kept.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith("warning: --qrels qrels.txt does not judge relevant the document of their own id that 3 "
                              "judged queries rank;") and warning.endswith("pass --ignore-identical-ids to score as they do")
    assert "warning" not in dropped.stderr and "3 own-id hits dropped -> dropped.jsonl" in dropped.stderr
    assert len(runs["dropped"]) == 4 * 3 and all(row["query_id"] != row["doc_id"] for row in runs["dropped"])
    report = json.loads((tmp_path / "dropped.json").read_text())
    assert report["own_ids_dropped"] == 3 and report["metrics"]["own_ids_ranked"] == 0
    found = {q: any(row["query_id"] == q and row["doc_id"] == doc for row in runs["dropped"])
             for q, doc in ARGUMENT_QRELS.items()}
    recall = {q: figures["recall@3"] for q, figures in report["metrics"]["per_query"].items()}
    assert recall == {q: float(was_found) for q, was_found in found.items()}


def test_trec_run_file(cli_runs: dict, sample_ranking: tuple[Queries, Ranking]) -> None:
    directory, _, _, result = cli_runs["trec"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in directory.iterdir()) == ["run.trec"]  # the old run replaced, no temporary left
    rows = [line.split(" ") for line in (directory / "run.trec").read_text().splitlines()]
    queries, ranking = sample_ranking
    assert [r[0] for r in rows] == [q for q in queries.ids for _ in range(5)]
    assert {(r[1], r[5]) for r in rows} == {("Q0", "embedctl")}
    assert [int(r[3]) for r in rows] == list(range(1, 6)) * len(queries.ids)
    scores = np.array([float(r[4]) for r in rows]).reshape(len(queries.ids), 5)
    assert (np.diff(scores, axis=1) <= 0).all()
    # The top 3 of a top-5 run are the top-3 ranking computed in this process.
    assert [[r[2] for r in rows[i * 5: i * 5 + 3]] for i in range(len(queries.ids))] == ranking.doc_ids
    np.testing.assert_allclose(scores[:, :3], ranking.scores, atol=2e-6)


def test_a_reader_that_leaves_early_ends_the_run_quietly() -> None:
    """`embedctl score ... | head -1`: the pipe closes while the run is written to stdout."""
    process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "score", str(QUERIES), str(CORPUS), "--top-k", "50",
                                "-q"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read()
    assert (process.wait(300), stderr) == (0, "")


def test_a_query_counts_as_reranked_once_its_last_pair_is_scored() -> None:
    heard = []
    scored = score._queries_scored(lambda done, tokens, total: heard.append((done, tokens, total)), 10, [3, 0, 3, 2], 14)
    scored(2)
    assert heard == []  # the first query's third pair is not scored yet
    scored(3)
    assert heard == [(12, 0, 14)]  # the first query, and the second, which has no pairs
    scored(7)
    assert heard[-1] == (13, 0, 14)
    scored(8)
    assert heard[-1] == (14, 0, 14) and len(heard) == 3
