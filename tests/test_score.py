"""`embedctl score` (bi-encoder): the streaming top-k, the ranking on sample_data, and the command line.

Oracles: numpy's stable argsort over the full score matrix for the top-k; for the pipeline, vectors
from the Python API (embedctl.load().embed) ranked by numpy; for the command, the files it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import embedctl
from embedctl.api import Embedder
from pipelines import score
from pipelines.score import Queries, Ranking, RunningTopK, ScoreOptions, open_inputs, rank, write_run
from pipelines.readers import Chunk
from tests.files import snapshot, write_jsonl
from tests.files import ENV, assert_one_error_line, good_rows

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
    queries, docs = open_inputs(options)
    return queries, rank(model.engine, model.tokenizer, queries, docs, options)


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


def test_jsonl_rows_to_stdout(sample_ranking: tuple[Queries, Ranking], capsys: pytest.CaptureFixture) -> None:
    queries, ranking = sample_ranking
    write_run(ranking, ScoreOptions(queries=str(QUERIES), docs=str(CORPUS)))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"query_id": q, "doc_id": d, "rank": r, "score": round(float(s), 6)}
                    for q, hits, scores in zip(queries.ids, ranking.doc_ids, ranking.scores)
                    for r, (d, s) in enumerate(zip(hits, scores), start=1)]


# The command line: real subprocesses


def embedctl_score(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedctl.cli", "score", *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def _good_queries(tmp: Path) -> None:
    write_jsonl(tmp / "queries.jsonl", [{"id": "q1", "text": "A good line."}])


def _duplicate_query_ids(tmp: Path) -> tuple[list, list[str]]:
    write_jsonl(tmp / "queries.jsonl", [{"id": "q1", "text": "one"}, {"id": "q1", "text": "two"}])
    write_jsonl(tmp / "docs.jsonl", good_rows("a"))
    return ["queries.jsonl", "docs.jsonl"], ["queries.jsonl line 2", "duplicate query id 'q1'", "unique"]


def _duplicate_doc_ids(tmp: Path) -> tuple[list, list[str]]:
    _good_queries(tmp)
    write_jsonl(tmp / "docs.jsonl", [*good_rows("a"), {"id": "a0", "text": "again"}])
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


BAD_INPUTS = [_duplicate_query_ids, _duplicate_doc_ids, _no_queries, _no_documents, _top_k_zero, _existing_out,
              _whitespace_id_in_trec]


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
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda job: embedctl_score(*job[3], cwd=job[0]), jobs.values())
        return {name: (*job[:3], result) for (name, job), result in zip(jobs.items(), results)}


@pytest.mark.parametrize("case", [case.__name__ for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(cli_runs: dict, case: str) -> None:
    directory, before, phrases, result = cli_runs[case]
    assert_one_error_line(result, *phrases)
    assert result.stdout == ""
    assert snapshot(directory) == before


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
