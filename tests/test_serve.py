"""`embedctl serve`: the real server on a loopback port, called with httpx and the official openai and
huggingface_hub (InferenceClient, TEI's) clients.

Oracles: `embedctl index` output for the same texts (vectors and token counts); numpy for the
Matryoshka cut, normalisation and cosine ranking; transformers' own BertForSequenceClassification
for cross-encoder scores; Engine.embed for the scheduler. The main server is `embedctl serve` in a
subprocess with small limits so that every refusal can be reached; the cross-encoder server is the
same app under uvicorn in a thread. Nothing here mocks the server, the engine or the tokenizer.
"""

from __future__ import annotations

import copy
import gzip
import importlib.metadata
import json
import logging
import logging.config
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import httpx
import huggingface_hub
import numpy as np
import openai
import pyarrow.parquet as pq
import pytest
import torch
import typer.main
import uvicorn
from tokenizers import Tokenizer
from typer.testing import CliRunner

from embedctl import serve as serve_module
from embedctl.cli import app as cli
from embedctl.http_limits import LimitedHttpToolsProtocol
from embedctl.serve import CLIENT_GONE, WATCH_BYTES, ServeLimits, create_app
from engine import Engine, EngineConfig, UserError
from engine.batch import PackedBatch
from engine.lazy import LazyTensor
from engine.scheduler import QueueFull, Scheduler
from pipelines.tokenize import TextTokenizer
from tests.files import ENV, assert_one_error_line, child_processes, write_jsonl
from tests.models import add_token_past_the_table, save_random_model

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"
KEY = "test-key"
LIMITS = dict(max_batch_tokens=512, max_client_batch=32, max_queue=40, max_request_bytes=65536)
SOAK_SECONDS = 30
SOAK_CLIENTS = 8
RSS_GROWTH_LIMIT = 24 << 20
# The scheduler's tests run on the CPU engine, and on the GPU engine (its LazyTensor steps) where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# glibc raises its mmap threshold each time a large block is freed, so a server that frees activations
# of many sizes grows its heap for about a minute before levelling off (measured on MiniLM: 450 -> 510
# MiB over 60 s, then flat). A fixed threshold removes that warm-up, so 30 s can tell a leak from it.
SERVER_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
TEI_ROUTES = {"/", "/invocations", "/embed", "/rerank", "/similarity", "/tokenize", "/decode", "/info", "/health",
              "/ping"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def refusal(reply: httpx.Response) -> tuple[str, str]:
    """(message, type) of an error reply, checked to be in the shape its route's API answers: TEI's
    {"error", "error_type"} on TEI's routes, OpenAI's {"error": {"message", "type", "param", "code"}} elsewhere."""
    body = reply.json()
    if reply.request.url.path in TEI_ROUTES:
        assert set(body) == {"error", "error_type"}, body
        return body["error"], body["error_type"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"], body["error"]["type"]


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path) -> None:
        self.process, self.url, self.log = process, f"http://127.0.0.1:{port}", log

    def client(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=120)


def start_server(minilm_dir: Path, log: Path, *options: str, device: str = "cpu",
                 env: dict[str, str] | None = None) -> Server:
    """`embedctl serve` in a subprocess (env: variables added to its environment), returned once /health says 200."""
    port = free_port()
    command = [sys.executable, "-m", "embedctl.cli", "serve", "--port", str(port), "--device", device,
               "--model", str(minilm_dir), *options]
    with log.open("w") as sink:
        process = subprocess.Popen(command, env={**SERVER_ENV, **(env or {})}, stdout=sink, stderr=subprocess.STDOUT)
    server = Server(process, port, log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"embedctl serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"embedctl serve was not healthy within 180 s:\n{log.read_text()}")


def stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(60)


@pytest.fixture(scope="module")
def server(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    limits = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    # Two tokenizer processes, which the CPU would not start by default: requests of many texts are
    # spread over them and put back together in order.
    server = start_server(minilm_dir, tmp_path_factory.mktemp("serve") / "server.log", "--api-key", KEY,
                          "--tokenizer-processes", "2", "--access-log", *limits, env={"PYTHONUNBUFFERED": "1"})
    yield server
    stop(server)


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Sample documents of 22 to 256+ tokens (two are cut at the max length) and one query first."""
    query = json.loads((SAMPLE / "queries.jsonl").read_text().splitlines()[0])["text"]
    rows = [json.loads(line) for line in (SAMPLE / "corpus" / "part-001.jsonl").read_text().splitlines()[:30]]
    return [query] + [row["text"] for row in rows]


@pytest.fixture(scope="module")
def indexed(texts: list[str], minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, np.ndarray]:
    """(vectors, n_tokens) of `texts` as `embedctl index` writes them, in text order."""
    directory = tmp_path_factory.mktemp("index")
    source = write_jsonl(directory / "texts.jsonl", [{"id": f"{i:03d}", "text": text} for i, text in enumerate(texts)])
    result = CliRunner().invoke(cli, ["index", str(source), "--out", str(directory / "out.parquet"),
                                      "--model", str(minilm_dir), "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(directory / "out.parquet").sort_by("id")
    return np.array(table["vector"].to_pylist(), dtype=np.float32), np.array(table["n_tokens"].to_pylist())


# Vectors


def test_openai_client_gets_the_vectors_of_embedctl_index(server: Server, client: httpx.Client, texts, indexed) -> None:
    vectors, n_tokens = indexed
    batches_before = metric(client, "embedctl_batch_tokens_count")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    name = api.models.list().data[0].id
    assert api.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError, match="no model 'text-embedding-3-small' here") as absent:
        api.models.retrieve("text-embedding-3-small")
    assert absent.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="unknown model 'text-embedding-3-small'") as unknown:
        api.embeddings.create(model="text-embedding-3-small", input="x")  # as OpenAI answers an unknown model
    assert unknown.value.code == "model_not_found"
    as_base64 = api.embeddings.create(model=name, input=texts)  # the client asks for base64 by default
    as_float = api.embeddings.create(model=name, input=texts, encoding_format="float")
    one = api.embeddings.create(model=name, input=texts[3], encoding_format="float")
    for reply in (as_base64, as_float):
        assert [item.index for item in reply.data] == list(range(len(texts)))
        np.testing.assert_allclose(np.array([item.embedding for item in reply.data]), vectors, atol=1e-5)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == n_tokens.sum()
        assert reply.model == name
    # JSON floats are float32 in their shortest form: they read back as exactly the base64 bytes
    np.testing.assert_array_equal(np.array([item.embedding for item in as_float.data], dtype=np.float32),
                                  np.array([item.embedding for item in as_base64.data], dtype=np.float32))
    np.testing.assert_allclose(one.data[0].embedding, vectors[3], atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="input\\[1\\] is an empty string"):  # OpenAI's API refuses it so
        api.embeddings.create(model=name, input=["fine", ""])
    # 31 texts of up to 256 tokens under a 512-token budget: each request was split over many batches
    assert metric(client, "embedctl_batch_tokens_count") - batches_before >= 2 * n_tokens.sum() / LIMITS["max_batch_tokens"]


def test_token_ids_give_the_vectors_of_their_texts(client: httpx.Client, texts, indexed, minilm_dir: Path) -> None:
    ids = [ids.tolist() for ids in TextTokenizer(minilm_dir / "tokenizer.json", 256).encode(texts[:3]).ids]
    many = client.post("/v1/embeddings", json={"input": ids})
    single = client.post("/v1/embeddings", json={"input": ids[1]})
    tei_many, tei_single = (client.post("/embed", json={"inputs": value}) for value in (ids, ids[1]))  # TEI takes ids too
    # and, as TEI does, texts and token-id lists side by side, each row in its place
    tei_mixed = client.post("/embed", json={"inputs": [texts[0], ids[1], texts[2]]})
    assert many.status_code == single.status_code == tei_many.status_code == tei_single.status_code == 200, many.text
    assert tei_mixed.status_code == 200, tei_mixed.text
    np.testing.assert_allclose(tei_mixed.json(), indexed[0][:3], atol=1e-5)
    np.testing.assert_allclose([item["embedding"] for item in many.json()["data"]], indexed[0][:3], atol=1e-5)
    np.testing.assert_allclose(single.json()["data"][0]["embedding"], indexed[0][1], atol=1e-5)
    np.testing.assert_allclose(tei_many.json(), indexed[0][:3], atol=1e-5)
    np.testing.assert_allclose(tei_single.json(), indexed[0][1:2], atol=1e-5)
    assert many.json()["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


def test_a_blank_text_is_embedded_as_its_tokens_are_and_ranked(client: httpx.Client) -> None:
    """TEI embeds a text of spaces, and clients that work around OpenAI's refusal of "" send " ": MiniLM's
    tokenizer makes it [CLS] [SEP], whose vector it gets on every route."""
    ids = client.post("/tokenize", json={"inputs": " \n\t"}).json()[0]
    assert [token["id"] for token in ids] == [101, 102]
    as_ids = np.array(client.post("/embed", json={"inputs": [[101, 102]]}).json())
    for path, body in (("/embed", {"inputs": ["a cat", " \n\t"]}), ("/v1/embeddings", {"input": ["a cat", "  "]})):
        reply = client.post(path, json=body)
        assert reply.status_code == 200, reply.text
        rows = reply.json() if path == "/embed" else [item["embedding"] for item in reply.json()["data"]]
        np.testing.assert_allclose(rows[1], as_ids[0], atol=1e-5)
    ranked = client.post("/rerank", json={"query": " ", "texts": ["a cat", " "]})
    assert ranked.status_code == 200 and ranked.json()[0] == {"index": 1, "score": pytest.approx(1.0, abs=1e-5)}


def test_token_ids_past_the_max_length_are_cut_as_their_text_is(client: httpx.Client) -> None:
    # /tokenize's ids of a long text end with [SEP]; cut to the max length they keep it, as the text does.
    ids = [token["id"] for token in client.post("/tokenize", json={"inputs": LONG}).json()[0]]
    assert len(ids) > 256 and ids[-1] == 102
    by_ids, by_text = (client.post("/v1/embeddings", json={"input": value}).json()["data"][0]["embedding"]
                       for value in ([ids], LONG))
    np.testing.assert_allclose(by_ids, by_text, atol=1e-5)


def test_truncation_direction_left_keeps_the_end_of_a_long_text(client: httpx.Client) -> None:
    """TEI's truncation_direction "Left": the library's own truncation from the start, special tokens kept."""
    long = " ".join(f"item {i}" for i in range(300))
    whole = [token["id"] for token in client.post("/tokenize", json={"inputs": long}).json()[0]]
    limit = client.get("/info").json()["max_input_length"]
    assert len(whole) > limit and (whole[0], whole[-1]) == (101, 102)
    end_kept = [whole[0], *whole[len(whole) - limit + 1:]]  # [CLS], then the text's last tokens and [SEP]
    left, by_ids, right = (client.post("/embed", json=body).json() for body in (
        {"inputs": long, "truncation_direction": "Left"}, {"inputs": end_kept}, {"inputs": long}))
    np.testing.assert_allclose(left, by_ids, atol=1e-5)
    assert not np.allclose(left, right, atol=1e-2)
    refused = client.post("/embed", json={"inputs": long, "truncation_direction": "left", "truncate": False})
    assert refused.status_code == 422 and "inputs[0] is longer" in refusal(refused)[0]


def test_dimensions_cut_then_renormalise_and_embed_can_return_raw_vectors(client: httpx.Client, texts, indexed) -> None:
    vectors = indexed[0][:4]
    short = client.post("/v1/embeddings", json={"input": texts[:4], "dimensions": 64}).json()
    np.testing.assert_allclose([item["embedding"] for item in short["data"]], unit(vectors[:, :64]), atol=1e-5)
    tei = client.post("/embed", json={"inputs": texts[:4]}).json()
    np.testing.assert_allclose(tei, vectors, atol=1e-5)
    raw = np.array(client.post("/embed", json={"inputs": texts[:4], "normalize": False}).json())
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1, atol=1e-2)  # MiniLM's mean-pooled vectors are not unit
    np.testing.assert_allclose(unit(raw), vectors, atol=1e-5)
    raw_short = np.array(client.post("/embed", json={"inputs": texts[:3], "normalize": False, "dimensions": 32}).json())
    np.testing.assert_allclose(raw_short, raw[:3, :32], atol=1e-5)


def test_rerank_sorts_documents_by_cosine(client: httpx.Client, texts, indexed) -> None:
    vectors = indexed[0]
    query, docs = texts[0], texts[1:9]
    cosines = vectors[1:9] @ vectors[0]
    order = np.argsort(-cosines, kind="stable")
    tei = client.post("/rerank", json={"query": query, "texts": docs, "return_text": True}).json()
    assert [hit["index"] for hit in tei] == order.tolist()
    np.testing.assert_allclose([hit["score"] for hit in tei], cosines[order], atol=1e-5)
    assert [hit["text"] for hit in tei] == [docs[i] for i in order]
    cohere = client.post("/rerank", json={"query": query, "documents": docs, "top_n": 3, "return_documents": True}).json()
    assert [hit["index"] for hit in cohere["results"]] == order[:3].tolist()
    np.testing.assert_allclose([hit["relevance_score"] for hit in cohere["results"]], cosines[order[:3]], atol=1e-5)
    assert cohere["results"][0]["document"] == {"text": docs[order[0]]}
    assert cohere["usage"]["total_tokens"] == indexed[1][:9].sum()
    # Cohere's and Jina's paths, where their clients post, with documents as {text} objects too (Cohere's v1, Jina)
    objects = [{"text": doc} for doc in docs]
    for path, documents in (("/v1/rerank", objects), ("/v2/rerank", docs), ("/rerank", [*docs[:4], *objects[4:]])):
        again = client.post(path, json={"query": query, "documents": documents, "top_n": 3, "return_documents": True})
        assert again.json() == cohere, path
    refused = client.post("/v1/rerank", json={"query": query, "documents": [{"body": docs[0]}]})
    assert refused.status_code == 400 and refusal(refused)[1] == "invalid_request_error"  # in OpenAI's shape


def test_similarity_is_the_cosine_of_the_embed_vectors_of_its_sentences(server: Server, client: httpx.Client,
                                                                       texts) -> None:
    """TEI's /similarity, in the order of its sentences: 20 of them and the source, spread over the two tokenizer
    workers, as /embed's 21 texts are."""
    source, sentences = texts[0], texts[1:21]
    inputs = {"source_sentence": source, "sentences": sentences}
    vectors = np.array(client.post("/embed", json={"inputs": [source, *sentences], "normalize": False}).json())
    cosines = unit(vectors[1:]) @ unit(vectors[0])
    reply = client.post("/similarity", json={"inputs": inputs})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json(), cosines, atol=1e-5)
    # Hugging Face's client for the sentence-similarity task, given the route's URL, as it calls a TEI endpoint
    hf = huggingface_hub.InferenceClient(model=server.url + "/similarity", token=KEY)
    np.testing.assert_allclose(hf.sentence_similarity(source, sentences), cosines, atol=1e-5)
    # TEI's options, in `parameters`, as /embed applies them
    long = " ".join(f"item {i}" for i in range(300))
    left = np.array(client.post("/embed", json={"inputs": [long, texts[1]], "normalize": False,
                                                "truncation_direction": "Left"}).json())
    from_left = client.post("/similarity", json={"inputs": {"source_sentence": long, "sentences": [texts[1]]},
                                                 "parameters": {"truncation_direction": "Left", "truncate": None}})
    assert from_left.status_code == 200, from_left.text
    np.testing.assert_allclose(from_left.json(), unit(left[1:]) @ unit(left[0]), atol=1e-5)
    for long_one, named in (({"source_sentence": LONG, "sentences": ["a"]}, "inputs.source_sentence is longer"),
                            ({"source_sentence": "a", "sentences": ["b", LONG]}, "inputs.sentences[1] is longer")):
        refused = client.post("/similarity", json={"inputs": long_one, "parameters": {"truncate": False}})
        assert refused.status_code == 422 and named in refusal(refused)[0]
        assert client.post("/similarity", json={"inputs": long_one, "parameters": None}).status_code == 200


# TEI's other routes


def test_hugging_face_client_at_the_root_gets_embed_vectors_and_reads_errors(server: Server, texts, indexed) -> None:
    # InferenceClient posts to the URL it is given, the root: TEI answers there with the model's own task.
    hf = huggingface_hub.InferenceClient(model=server.url, token=KEY)
    np.testing.assert_allclose(hf.feature_extraction(texts[3]), indexed[0][3:4], atol=1e-5)
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        hf.feature_extraction("")
    # the client reads the message out of TEI's error shape (not out of OpenAI's)
    assert refused.value.server_message == "inputs[0] is an empty string; send at least one character"


def test_tei_routes_ignore_fields_they_do_not_have_as_tei_does(client: httpx.Client, texts, indexed) -> None:
    # Clients of Hugging Face's Inference API send `options` and `parameters` beside `inputs`; TEI ignores them.
    inference_api = {"options": {"wait_for_model": True, "use_cache": False}, "parameters": {}}
    reply = client.post("/embed", json={"inputs": texts[:2], **inference_api})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json(), indexed[0][:2], atol=1e-5)
    ranked = client.post("/rerank", json={"query": texts[1], "texts": texts[:3], "top_n": 1, **inference_api})
    assert ranked.status_code == 200 and ranked.json()[0]["index"] == 1, ranked.text
    # a field of another TEI endpoint is no misspelling of this one's (add_special_tokens, skip_special_tokens)
    decoded = client.post("/decode", json={"ids": [101, 7592, 102], "add_special_tokens": False})
    assert decoded.status_code == 200 and decoded.json() == ["hello"], decoded.text


def test_sagemaker_invocations_and_openai_embeddings_without_v1_answer_as_their_routes(
        server: Server, client: httpx.Client, texts, indexed, minilm_dir: Path) -> None:
    vectors, n_tokens = indexed
    # SageMaker posts the model's task to /invocations, as TEI serves it: /embed for an embedding model
    invoked = client.post("/invocations", json={"inputs": texts[:4], "normalize": False})
    assert invoked.status_code == 200, invoked.text
    assert invoked.json() == client.post("/embed", json={"inputs": texts[:4], "normalize": False}).json()
    np.testing.assert_allclose(unit(np.array(invoked.json())), vectors[:4], atol=1e-5)
    # OpenAI's client given the server's root as its base URL posts to /embeddings
    api = openai.OpenAI(base_url=server.url, api_key=KEY)
    reply = api.embeddings.create(model=str(minilm_dir), input=texts[:4], encoding_format="float")
    np.testing.assert_allclose(np.array([item.embedding for item in reply.data]), vectors[:4], atol=1e-5)
    assert reply.usage.prompt_tokens == n_tokens[:4].sum() and reply.model == str(minilm_dir)
    with pytest.raises(openai.BadRequestError, match="input\\[1\\] is an empty string"):  # OpenAI's shape, as on /v1
        api.embeddings.create(model=str(minilm_dir), input=["fine", ""])


def test_info_describes_the_model_and_the_server_limits(client: httpx.Client, minilm_dir: Path) -> None:
    assert client.get("/info").json() == {
        "model_id": str(minilm_dir), "model_sha": None, "model_dtype": "float32", "served_model_name": str(minilm_dir),
        "model_type": {"embedding": {"pooling": "mean"}},
        "max_concurrent_requests": LIMITS["max_queue"], "max_input_length": 256,
        "max_batch_tokens": LIMITS["max_batch_tokens"], "max_batch_requests": EngineConfig().max_seqs,
        "max_client_batch_size": LIMITS["max_client_batch"], "auto_truncate": True,
        # the server's tokenizer threads, and the two worker processes the fixture asks for
        "tokenization_workers": min(8, os.cpu_count() or 1) + 2,
        "version": importlib.metadata.version("embedctl"), "sha": None, "docker_label": None}


def test_tokenize_gives_the_tokens_embed_embeds_with_tei_byte_offsets(client: httpx.Client, texts,
                                                                      minilm_dir: Path) -> None:
    # Offsets count UTF-8 bytes of the text as sent, as TEI's do: "é" and "ö" take two each, the spaces one.
    assert client.post("/tokenize", json={"inputs": "  Héllo wörld!"}).json() == [[
        {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
        {"id": 7592, "text": "Héllo", "special": False, "start": 2, "stop": 8},
        {"id": 2088, "text": "wörld", "special": False, "start": 9, "stop": 15},
        {"id": 999, "text": "!", "special": False, "start": 15, "stop": 16},
        {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}]]
    library = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    library.no_truncation()
    library.no_padding()
    plain = client.post("/tokenize", json={"inputs": [*texts[1:6], LONG], "add_special_tokens": False}).json()
    for text, tokens in zip([*texts[1:6], LONG], plain):
        assert [token["id"] for token in tokens] == library.encode(text, add_special_tokens=False).ids
        assert all(text.encode()[token["start"]:token["stop"]].decode() == token["text"] for token in tokens)
    assert len(plain[-1]) == 400  # not cut at the max length, as TEI's /tokenize does not cut
    # /embed embeds the first of them: the max length of 256 holds [CLS], 254 words and [SEP]
    whole = [token["id"] for token in client.post("/tokenize", json={"inputs": LONG}).json()[0]]
    assert TextTokenizer(minilm_dir / "tokenizer.json", 256).encode([LONG]).ids[0].tolist() == whole[:255] + [102]


def test_decode_gives_the_text_of_token_ids(client: httpx.Client) -> None:
    ids = [101, 7592, 2088, 999, 102]
    assert client.post("/decode", json={"ids": ids}).json() == ["hello world!"]  # a list for one list, as TEI's
    assert client.post("/decode", json={"ids": [ids, [2088]], "skip_special_tokens": False}).json() == [
        "[CLS] hello world! [SEP]", "world"]


def test_health_models_metrics_and_docs(server: Server, client: httpx.Client, minilm_dir: Path) -> None:
    for path in ("/health", "/ping", "/"):  # /ping: SageMaker's health check, GET /: TEI's; none needs a key
        assert httpx.get(server.url + path).json() == {"status": "ok"}
        assert httpx.head(server.url + path).status_code == 200
    for path in ("/docs", "/openapi.json"):  # a browser sends no key; Swagger's Authorize button takes it for the rest
        assert httpx.get(server.url + path).status_code == 200
    assert [model["id"] for model in client.get("/v1/models").json()["data"]] == [str(minilm_dir)]
    # without /v1 too, as /embeddings: a client given the server's root as its base URL lists models there
    assert client.get("/models").json() == client.get("/v1/models").json()
    assert client.get(f"/models/{minilm_dir.name}").json() == client.get(f"/v1/models/{minilm_dir}").json()
    for path in ("/info", "/metrics", "/v1/models", f"/v1/models/{minilm_dir}"):  # every GET answers HEAD, as TEI's
        assert (client.head(path).status_code, client.head(path).content) == (200, b"")
    assert httpx.head(server.url + "/metrics").status_code == 401  # with the key its GET needs
    text = client.get("/metrics").text
    for family in ("embedctl_requests_total", "embedctl_request_duration_seconds_bucket", "embedctl_queue_depth",
                   "embedctl_batch_tokens_sum", "embedctl_graph_captures_total", "embedctl_graph_replays_total"):
        assert family in text
    assert re.search(r'embedctl_requests_total\{endpoint="/v1/models",status="200"\} [1-9]', text)
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    assert {"/v1/embeddings", "/embeddings", "/embed", "/rerank", "/v1/rerank", "/v2/rerank", "/similarity", "/",
            "/invocations", "/tokenize", "/decode", "/info", "/health", "/ping", "/metrics", "/v1/models",
            "/models"} <= set(paths)
    for path in ("/v1/embeddings", "/embeddings", "/embed", "/rerank", "/similarity", "/", "/invocations", "/tokenize",
                 "/decode"):
        assert "requestBody" in paths[path]["post"]  # served outside FastAPI, described by it

    def described(path: str) -> tuple[dict, dict]:
        """A POST route's request body and responses, less the reply's title, which FastAPI names after the path."""
        operation = copy.deepcopy(paths[path]["post"])
        operation["responses"]["200"]["content"]["application/json"]["schema"].pop("title", None)
        return operation["requestBody"], operation["responses"]

    assert described("/") == described("/invocations") == described("/embed")
    assert described("/embeddings") == described("/v1/embeddings")
    assert client.get("/docs").status_code == 200

    def error_shape(path: str, method: str, status: str) -> str:
        return paths[path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"].rsplit("/")[-1]

    # Each route documents its refusals in the shape it answers them, and no FastAPI 422 it never answers.
    tei_refusals = {"/embed": "400 404 413 415 422 424 429 503", "/rerank": "400 404 413 415 422 424 429 503",
                    "/similarity": "400 413 415 422 424 429 503",
                    "/": "400 404 413 415 422 424 429 503", "/invocations": "400 404 413 415 422 424 429 503",
                    "/tokenize": "400 413 415 422", "/decode": "400 413 415 422"}
    for path, statuses in tei_refusals.items():
        assert {error_shape(path, "post", status) for status in statuses.split()} == {"TeiError"}
    assert error_shape("/info", "get", "401") == "TeiError"
    for path in ("/health", "/ping"):
        responses = paths[path]["get"]["responses"]
        assert error_shape(path, "get", "503") == "TeiError" and "warming up" in responses["503"]["description"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Health")
        assert "401" not in responses  # no key needed
    for path in ("/v1/embeddings", "/v1/rerank", "/v2/rerank"):
        assert {error_shape(path, "post", status) for status in "400 401 404 413 415 429 500 503".split()} == {
            "OpenAIError"}
        assert "422" not in paths[path]["post"]["responses"]
    assert described("/v1/rerank")[0] == described("/rerank")[0]
    assert error_shape("/v1/models/{model}", "get", "404") == "OpenAIError"
    schemas = schema["components"]["schemas"]
    assert set(schemas["TeiError"]["properties"]) == {"error", "error_type"}
    assert set(schemas["OpenAIErrorDetail"]["properties"]) == {"message", "type", "param", "code"}


# Refusals: each answers its status and a message that names the problem, in the error shape of its
# route's API with that API's type for it, and the server goes on serving.

LONG = "word " * 400
ERRORS = [
    ("no key", "/v1/embeddings", {"input": "x"}, None, 401, "invalid_request_error", "Authorization: Bearer"),
    ("wrong key", "/v1/models", None, "nope", 401, "invalid_request_error", "API key"),
    ("no key on a TEI route", "/info", None, None, 401, "Validation", "Authorization: Bearer"),
    ("malformed JSON", "/v1/embeddings", b'{"input": [', KEY, 400, "invalid_request_error", "not valid JSON"),
    ("malformed JSON on a TEI route", "/embed", b'{"inputs": [', KEY, 400, "Validation", "not valid JSON"),
    ("not an object", "/embed", b"[1, 2]", KEY, 422, "Validation", "JSON object"),
    ("wrong input type", "/v1/embeddings", {"input": 5}, KEY, 400, "invalid_request_error", "input: must be a string"),
    ("mixed input", "/v1/embeddings", {"input": ["a", 1]}, KEY, 400, "invalid_request_error", "list of token ids"),
    ("null inputs", "/embed", {"inputs": None}, KEY, 422, "Validation",
     "inputs: must be a string, a list of token ids, or a list of texts and token-id lists"),
    ("a number among texts", "/embed", {"inputs": ["a", 101]}, KEY, 422, "Validation", "list of texts and token-id lists"),
    ("an empty text among token ids", "/embed", {"inputs": [[101, 102], ""]}, KEY, 400, "Empty",
     "inputs[1] is an empty string"),
    ("an empty list among texts", "/embed", {"inputs": ["a", []]}, KEY, 400, "Empty",
     "inputs[1] is an empty token-id list"),
    ("texts and token ids with a prompt", "/embed", {"inputs": ["a", [101, 102]], "prompt_name": "query"}, KEY, 422,
     "Validation", "prompt_name applies to texts, not token ids"),
    ("token ids with a prompt", "/embed", {"inputs": [101, 102], "prompt_name": "query"}, KEY, 422, "Validation",
     "prompt_name applies to texts, not token ids"),
    ("token ids cut from the left", "/embed", {"inputs": [101, 102], "truncation_direction": "Left"}, KEY, 422,
     "Validation", "truncation_direction left applies to texts"),
    ("long token ids, truncate false", "/embed", {"inputs": [[101] + [2773] * 300 + [102]], "truncate": False}, KEY, 422,
     "Validation", "inputs[0] is longer than the model's max length of 256 tokens"),
    ("token ids to /tokenize", "/tokenize", {"inputs": [101, 102]}, KEY, 422, "Validation", "token ids go to POST /decode"),
    ("texts to /decode", "/decode", {"ids": ["hello"]}, KEY, 422, "Validation", "ids: must be a list of token ids"),
    ("wrong flag type", "/embed", {"inputs": "x", "normalize": "yes"}, KEY, 422, "Validation", "normalize"),
    ("misspelt field", "/embed", {"inputs": "x", "normalise": False}, KEY, 422, "Validation",
     "normalise: is not a field of this endpoint; did you mean normalize?"),
    ("misspelt rerank field", "/rerank", {"query": "q", "texts": ["a"], "top_k": 1}, KEY, 422, "Validation",
     "top_k: is not a field of this endpoint; did you mean top_n?"),
    ("unknown field for OpenAI", "/v1/embeddings", {"input": "x", "options": {}}, KEY, 400, "invalid_request_error",
     "options: is not a field of this endpoint"),
    ("no key on the root's task", "/", {"inputs": "x"}, None, 401, "Validation", "Authorization: Bearer"),
    ("missing field", "/rerank", {"texts": ["a"]}, KEY, 422, "Validation", "query"),
    ("empty input", "/v1/embeddings", {"input": []}, KEY, 400, "invalid_request_error", "input is empty"),
    ("empty inputs", "/embed", {"inputs": []}, KEY, 400, "Empty", "inputs is empty"),
    ("empty texts", "/rerank", {"query": "q", "texts": []}, KEY, 400, "Empty", "texts is empty"),
    ("empty text", "/embed", {"inputs": ["fine", ""]}, KEY, 400, "Empty", "inputs[1] is an empty string"),
    ("empty text to /tokenize", "/tokenize", {"inputs": ""}, KEY, 400, "Empty", "inputs[0] is an empty string"),
    ("empty token list", "/v1/embeddings", {"input": [[101, 102], []]}, KEY, 400, "invalid_request_error",
     "input[1] is an empty token-id list"),
    ("no ids", "/decode", {"ids": []}, KEY, 400, "Empty", "ids is empty"),
    ("empty id list", "/decode", {"ids": [[101], []]}, KEY, 400, "Empty", "ids[1] is an empty token-id list"),
    ("token id out of range", "/v1/embeddings", {"input": [101, 10 ** 6]}, KEY, 400, "invalid_request_error",
     "outside the model's vocabulary"),
    ("negative id to /decode", "/decode", {"ids": [101, -1]}, KEY, 422, "Validation", "outside the model's vocabulary 0..30521"),
    ("unknown model", "/v1/embeddings", {"input": "x", "model": "gpt-4"}, KEY, 404, "invalid_request_error",
     "unknown model 'gpt-4'"),
    ("unknown model to rerank", "/rerank", {"query": "q", "texts": ["a"], "model": "gpt-4"}, KEY, 404, "Validation",
     "unknown model 'gpt-4'"),
    ("unknown format", "/v1/embeddings", {"input": "x", "encoding_format": "xml"}, KEY, 400, "invalid_request_error",
     "encoding_format"),
    ("too many dimensions", "/v1/embeddings", {"input": "x", "dimensions": 385}, KEY, 400, "invalid_request_error",
     "at most 384"),
    ("zero dimensions", "/embed", {"inputs": "x", "dimensions": 0}, KEY, 422, "Validation", "dimensions"),
    ("too many inputs", "/embed", {"inputs": ["x"] * 33}, KEY, 413, "Validation", "--max-client-batch 32"),
    # as OpenAI refuses more than 2,048 inputs: clients that split a batch on its 400 split on this one
    ("too many inputs for OpenAI", "/v1/embeddings", {"input": ["x"] * 33}, KEY, 400, "invalid_request_error",
     "--max-client-batch 32"),
    ("too many documents", "/rerank", {"query": "q", "documents": ["x"] * 33}, KEY, 413, "Validation",
     "--max-client-batch 32"),
    ("too many to tokenize", "/tokenize", {"inputs": ["x"] * 33}, KEY, 413, "Validation", "--max-client-batch 32"),
    ("too many to decode", "/decode", {"ids": [[101]] * 33}, KEY, 413, "Validation", "--max-client-batch 32"),
    ("body too large", "/embed", {"inputs": ["word " * 14000]}, KEY, 413, "Validation", "--max-request-bytes 65536"),
    ("body too large for OpenAI", "/v1/embeddings", {"input": ["word " * 14000]}, KEY, 413, "invalid_request_error",
     "--max-request-bytes 65536"),
    ("too long, no truncation", "/embed", {"inputs": ["short", LONG], "truncate": False}, KEY, 422, "Validation",
     "inputs[1] is longer than the model's max length of 256"),
    ("rerank too long", "/rerank", {"query": "q", "texts": [LONG], "truncate": False}, KEY, 422, "Validation",
     "texts[0] is longer"),
    # 20 texts: a chunk per tokenizer worker, each checked as it comes back
    ("too long in a later chunk", "/embed", {"inputs": ["short"] * 15 + [LONG] * 2 + ["short"] * 3, "truncate": False},
     KEY, 422, "Validation", "inputs[15] is longer"),
    ("rerank too long in a later chunk", "/rerank", {"query": "q", "texts": ["a"] * 15 + [LONG] + ["a"] * 4,
                                                     "truncate": False}, KEY, 422, "Validation", "texts[15] is longer"),
    ("texts and documents", "/rerank", {"query": "q", "texts": ["a"], "documents": ["b"]}, KEY, 422, "Validation",
     "exactly one"),
    ("no key on /similarity", "/similarity", {"inputs": {"source_sentence": "q", "sentences": ["a"]}}, None, 401,
     "Validation", "Authorization: Bearer"),
    ("no sentences", "/similarity", {"inputs": {"source_sentence": "q", "sentences": []}}, KEY, 400, "Empty",
     "inputs.sentences is empty; send at least one item"),
    ("empty source sentence", "/similarity", {"inputs": {"source_sentence": "", "sentences": ["a"]}}, KEY, 400, "Empty",
     "inputs.source_sentence is an empty string"),
    ("empty sentence", "/similarity", {"inputs": {"source_sentence": "q", "sentences": ["a", ""]}}, KEY, 400, "Empty",
     "inputs.sentences[1] is an empty string"),
    ("a number among sentences", "/similarity", {"inputs": {"source_sentence": "q", "sentences": ["a", 1]}}, KEY, 422,
     "Validation", "inputs.sentences[1]: Input should be a valid string"),
    ("a document of neither form", "/rerank", {"query": "q", "documents": ["a", {"body": "b"}]}, KEY, 422, "Validation",
     'documents[1]: must be a text or an object {"text": text}'),
    ("/embed's inputs to /similarity", "/similarity", {"inputs": ["q", "a"]}, KEY, 422, "Validation",
     'inputs: must be an object {"source_sentence": text, "sentences": [texts to compare with it]}'),
    ("misspelt sentences", "/similarity", {"inputs": {"source_sentence": "q", "sentence": ["a"]}}, KEY, 422,
     "Validation", "sentence: is not a field of this endpoint; did you mean sentences?"),
    ("too many sentences", "/similarity", {"inputs": {"source_sentence": "q", "sentences": ["x"] * 33}}, KEY, 413,
     "Validation", "33 items in one request is more than this server's --max-client-batch 32"),
    # TEI reads /similarity's options from `parameters` only, and would not apply one beside `inputs`
    ("an option beside inputs", "/similarity",
     {"inputs": {"source_sentence": "q", "sentences": ["a"]}, "truncate": False}, KEY, 422, "Validation",
     'truncate: goes inside parameters on this endpoint, as TEI reads it: {"parameters": {"truncate": ...}}'),
    ("an unknown prompt", "/similarity", {"inputs": {"source_sentence": "q", "sentences": ["a"]},
                                          "parameters": {"prompt_name": "classification"}}, KEY, 422, "Validation",
     "prompt_name: "),
    ("empty query", "/rerank", {"query": "", "texts": ["a"]}, KEY, 400, "Empty", "query is an empty string"),
    ("empty text to the root", "/", {"inputs": ""}, KEY, 400, "Empty", "inputs[0] is an empty string"),
    ("empty text to /invocations", "/invocations", {"inputs": ""}, KEY, 400, "Empty", "inputs[0] is an empty string"),
    ("no key on /invocations", "/invocations", {"inputs": "x"}, None, 401, "Validation", "Authorization: Bearer"),
    ("rerank body to /invocations", "/invocations", {"query": "q", "texts": ["a"]}, KEY, 422, "Validation",
     "inputs: Field required"),
    ("OpenAI's field on TEI's route", "/embed", {"input": "x"}, KEY, 422, "Validation",
     "input: is not a field of this endpoint; did you mean inputs?"),
    ("no key on /embeddings", "/embeddings", {"input": "x"}, None, 401, "invalid_request_error",
     "Authorization: Bearer"),
    ("too many dimensions on /embeddings", "/embeddings", {"input": "x", "dimensions": 385}, KEY, 400,
     "invalid_request_error", "at most 384"),
    ("wrong method for /ping", "/ping", {}, KEY, 405, "Validation", "does not take that method"),
    # an embedding model's POST / is /embed, which has no query
    ("rerank body to the root", "/", {"query": "q", "texts": ["a"]}, KEY, 422, "Validation", "inputs: Field required"),
    ("no such endpoint", "/v2/embeddings", {"input": "x"}, KEY, 404, "invalid_request_error", "no such endpoint"),
    ("wrong method", "/embed", None, KEY, 405, "Validation", "does not take that method"),
    ("wrong method for OpenAI", "/v1/embeddings", None, KEY, 405, "invalid_request_error", "does not take that method"),
    ("trailing slash", "/embed/", {"inputs": "x"}, KEY, 404, "invalid_request_error", "no such endpoint"),
    ("huge dimensions", "/v1/embeddings", {"input": "x", "dimensions": 10 ** 400}, KEY, 400, "invalid_request_error",
     "dimensions 100000000000... (401 digits) is more than the model's 384"),
]


def test_a_body_declared_as_not_json_gets_415_and_one_declared_as_nothing_is_read_as_json(server: Server, texts, indexed) -> None:
    body = json.dumps({"inputs": texts[5]}).encode()
    with server.client() as client:
        for path in ("/embed", "/invocations", "/embeddings"):
            refused = client.post(path, content=body, headers={"Content-Type": "text/plain"})
            assert refused.status_code == 415
            assert "'Content-Type: application/json'" in refusal(refused)[0]
        for declared in ({}, {"Content-Type": ""}, {"Content-Type": "application/json; charset=utf-8"}):
            reply = client.post("/embed", content=body, headers=declared)
            assert reply.status_code == 200, reply.text
            np.testing.assert_allclose(reply.json()[0], indexed[0][5], atol=1e-5)
        # A compressed body was read as it is ("not valid JSON"), and one declared compressed that is not, as JSON.
        for encoding, sent in (("gzip", gzip.compress(body)), ("br", body)):
            refused = client.post("/embed", content=sent, headers={"Content-Encoding": encoding})
            assert refused.status_code == 415 and refusal(refused)[0] == (
                f"Content-Encoding '{encoding}' is not taken; send the body uncompressed")
        assert client.post("/embed", content=body, headers={"Content-Encoding": "identity"}).status_code == 200
        # Only a POST's body is checked: other methods keep their own answers.
        assert client.get("/embed", headers={"Content-Type": "text/plain"}).status_code == 405
        assert client.get("/v1/models", headers={"Content-Type": "text/plain"}).status_code == 200


@pytest.mark.parametrize("path, body, key, status, kind, phrase", [case[1:] for case in ERRORS],
                         ids=[case[0] for case in ERRORS])
def test_bad_requests_get_their_status_and_message(server: Server, texts, indexed, path, body, key, status, kind,
                                                   phrase) -> None:
    with server.client(key) as client:
        if body is None:
            reply = client.get(path)
        elif isinstance(body, bytes):
            reply = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            reply = client.post(path, json=body)
    assert reply.status_code == status, reply.text
    message, error_type = refusal(reply)
    assert phrase in message and error_type == kind
    if status == 401 and path not in TEI_ROUTES:
        assert reply.json()["error"]["code"] == "invalid_api_key"  # OpenAI's code for it
    with server.client() as client:
        after = client.post("/embed", json={"inputs": texts[5]})
    assert after.status_code == 200
    np.testing.assert_allclose(after.json()[0], indexed[0][5], atol=1e-5)


def test_openai_errors_name_the_request_field_at_fault_as_their_param(server: Server, minilm_dir: Path) -> None:
    """OpenAI's error object names the parameter that caused the error; the official client reads it as .param."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    name = str(minilm_dir)
    for fields, error, param in [
            (dict(input=["fine", ""]), openai.BadRequestError, "input[1]"),
            (dict(input=[]), openai.BadRequestError, "input"),
            (dict(input=["x"] * 33), openai.BadRequestError, "input"),
            (dict(input=[[101, 102], [101, 10 ** 6]]), openai.BadRequestError, "input[1]"),
            (dict(input=5), openai.BadRequestError, "input"),
            (dict(input="x", dimensions=385), openai.BadRequestError, "dimensions"),
            (dict(input="x", dimensions=0), openai.BadRequestError, "dimensions"),
            (dict(input="x", encoding_format="xml"), openai.BadRequestError, "encoding_format"),
            (dict(input="x", extra_body={"options": {}}), openai.BadRequestError, "options"),
            (dict(input="x", model="gpt-4"), openai.NotFoundError, "model")]:
        with pytest.raises(error) as refused:
            api.embeddings.create(**{"model": name, **fields})
        assert refused.value.param == param, (fields, refused.value.body)
    with server.client() as client:
        replies = {
            "documents[0]": client.post("/v1/rerank", json={"query": "q", "documents": [{"body": "x"}]}),
            "top_k": client.post("/v1/rerank", json={"query": "q", "documents": ["a"], "top_k": 1}),
            "query": client.post("/v2/rerank", json={"query": "", "documents": ["a"]}),
            # about no one field: two fields wrong, the body as a whole, the key
            None: [client.post("/v1/embeddings", json={"input": 5, "dimensions": "3"}),
                   client.post("/v1/embeddings", content=b"[1]", headers={"Content-Type": "application/json"}),
                   client.post("/v1/rerank", json={"query": "q", "texts": ["a"], "documents": ["b"]}),
                   httpx.post(server.url + "/v1/embeddings", json={"input": "x"})]}
    for param, reply in replies.items():
        for each in reply if isinstance(reply, list) else [reply]:
            assert each.status_code in (400, 401) and each.json()["error"]["param"] == param, each.text


@pytest.mark.parametrize("header, status", [(f"bearer {KEY}", 200), (f"BEARER  {KEY}", 200), (f"Basic {KEY}", 401)])
def test_the_key_counts_under_the_bearer_scheme_in_any_case(server: Server, texts, indexed, header: str,
                                                             status: int) -> None:
    reply = httpx.post(server.url + "/embed", json={"inputs": texts[5]}, headers={"Authorization": header})
    assert reply.status_code == status, reply.text
    if status == 200:
        np.testing.assert_allclose(reply.json()[0], indexed[0][5], atol=1e-5)
    else:
        assert "Authorization: Bearer" in refusal(reply)[0]


def test_one_authorization_header_with_the_key_and_spaces_around_it_is_let_in(server: Server) -> None:
    port = int(server.url.rsplit(":", 1)[1])

    def status(*headers: bytes) -> bytes:
        body = b'{"inputs": "x"}'
        with socket.create_connection(("127.0.0.1", port)) as raw:  # httpx would not send a value's trailing space
            raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\n" + b"".join(h + b"\r\n" for h in headers) +
                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            return raw.recv(64).split(b" ")[1]

    key = KEY.encode()
    assert status(b"Authorization: Bearer " + key + b" ") == b"200"  # the space is no part of the value (RFC 9110)
    # With two, which one a proxy in front reads is anyone's guess: neither order is let in.
    assert status(b"Authorization: Bearer " + key, b"Authorization: Bearer wrong") == b"401"
    assert status(b"Authorization: Bearer wrong", b"Authorization: Bearer " + key) == b"401"


def test_a_body_that_stops_arriving_gets_408_and_the_server_serves_on(random_bert: Path, monkeypatch) -> None:
    monkeypatch.setattr(serve_module, "BODY_TIMEOUT_SECONDS", 0.5)
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    with serving(create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length))) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n" + b'{"inputs": "par')
            raw.settimeout(10)
            reply = raw.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == {
            "error": "the request body did not arrive whole within 0.5 s; send it whole, as its Content-Length says",
            "error_type": "Validation"}
        assert httpx.post(url + "/embed", json={"inputs": "still serving"}).status_code == 200


@pytest.mark.parametrize("count_chars", [1 << 16, 8], ids=["whole", "counted-in-pieces"])
def test_tokenize_refuses_more_tokens_than_it_answers_at_once(random_bert: Path, monkeypatch, count_chars: int) -> None:
    """Each token is an object of the reply: 4 MB of text, 2M tokens, took the server to 2.3 GB. A request of
    more than COUNT_CHARS characters is counted in pieces before it is tokenized whole (tokenize's tests
    check that count); here both ways give the same answers."""
    monkeypatch.setattr(serve_module, "TOKENIZE_MAX_TOKENS", 12)
    monkeypatch.setattr(serve_module, "COUNT_CHARS", count_chars)
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    with serving(create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length))) as url:
        fits = httpx.post(url + "/tokenize", json={"inputs": ["one two three", "four five six"]})
        refused = httpx.post(url + "/tokenize", json={"inputs": ["one two three four five", "six seven eight nine"]})
    assert fits.status_code == 200 and sum(map(len, fits.json())) == 10
    assert refused.status_code == 413 and refusal(refused) == (
        "inputs hold more than 12 tokens, the most /tokenize answers per request; send less text per request", "Validation")


def test_no_color_turns_off_the_colours_of_the_server_log(monkeypatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert serve_module.log_colors() is None  # uvicorn's own choice: colours on a terminal
    monkeypatch.setenv("NO_COLOR", "1")
    assert serve_module.log_colors() is False
    monkeypatch.setenv("NO_COLOR", "")  # set but empty means nothing (no-color.org)
    assert serve_module.log_colors() is None


def test_our_log_lines_come_out_as_uvicorns_with_their_level(monkeypatch, capsys) -> None:
    """An engine failure must be an ERROR: line that alerting finds, as uvicorn's are (Python's fallback handler
    printed it bare), and an INFO line must show at all."""
    monkeypatch.setenv("NO_COLOR", "1")
    loggers = {name: logging.getLogger(name) for name in ("embedctl", "engine", "pipelines")}
    saved = {name: (logger.handlers[:], logger.level, logger.propagate) for name, logger in loggers.items()}
    try:
        logging.config.dictConfig(serve_module.log_config())
        logging.getLogger("embedctl.serve").error("engine step failed")
        logging.getLogger("engine.scheduler").info("a line of the engine")
        logging.getLogger("pipelines.tokenize_pool").warning("a line of the pipelines")
        assert capsys.readouterr().err.splitlines() == [
            "ERROR:    engine step failed", "INFO:     a line of the engine", "WARNING:  a line of the pipelines"]
    finally:  # the other tests' caplog reads these loggers through the root
        for name, (handlers, level, propagate) in saved.items():
            loggers[name].handlers[:], loggers[name].level, loggers[name].propagate = handlers, level, propagate


def test_a_tokenizer_worker_that_dies_is_logged_and_the_server_goes_on(random_bert: Path, caplog) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    before = child_processes()
    with serving(create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length),
                            tokenizer_processes=1)) as url:
        [worker] = child_processes() - before
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any("tokenizer worker process" in record.getMessage() for record in caplog.records):
            assert time.monotonic() < deadline, "the worker's death was not logged"
            time.sleep(0.05)
        after = httpx.post(url + "/embed", json={"inputs": ["still", "serving"] * 8})  # 16 texts: the workers' share
    [record] = [record for record in caplog.records if "tokenizer worker process" in record.getMessage()]
    assert record.levelname == "WARNING" and record.getMessage() == (
        f"tokenizer worker process {worker} was killed by signal 9 (out of memory?); the requests it held failed, and "
        "this process tokenizes requests from now on")
    assert after.status_code == 200 and len(after.json()) == 16


def test_a_failed_batch_is_logged_once_for_all_its_requests(random_bert: Path, caplog) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    release = threading.Event()
    failing = failing_on(lambda batch: 29145 in batch.input_ids, engine.step)
    engine.step = lambda batch: (release.wait(30) if 29145 in batch.input_ids else None, failing(batch))[1]
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer)) as url, ThreadPoolExecutor(6) as pool:
        held = pool.submit(httpx.post, url + "/embed", json={"inputs": "zebra"}, timeout=60)  # its batch waits
        while "embedctl_queue_depth 1" not in httpx.get(url + "/metrics").text.splitlines():
            time.sleep(0.01)
        caplog.clear()
        together = [pool.submit(httpx.post, url + "/embed", json={"inputs": "zebra"}, timeout=60) for _ in range(5)]
        while "embedctl_queue_depth 6" not in httpx.get(url + "/metrics").text.splitlines():
            time.sleep(0.01)
        release.set()  # the five wait behind the first batch, so they go as one
        statuses = [reply.result().status_code for reply in [held, *together]]
    assert statuses == [424] * 6
    failures = [record for record in caplog.records if record.getMessage() == "engine step failed"]
    assert len(failures) == 2, [record.getMessage() for record in caplog.records]  # one a batch, not one a request


def test_cors_lets_a_listed_origins_scripts_call_with_the_key_and_no_other(random_bert: Path) -> None:
    """A browser asks first (a preflight, which carries no key), then sends the request with the key."""
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    app = create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length), api_key=KEY)
    page, stranger = "https://app.example.com", "https://evil.example.com"
    with serving(serve_module.with_cors(app, [page])) as url:
        asking = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        preflight = httpx.options(url + "/embed", headers={"Origin": page, **asking})
        refused = httpx.options(url + "/embed", headers={"Origin": stranger, **asking})
        called = httpx.post(url + "/embed", json={"inputs": "x"},
                            headers={"Origin": page, "Authorization": f"Bearer {KEY}"})
        keyless = httpx.post(url + "/embed", json={"inputs": "x"}, headers={"Origin": page})
        other = httpx.post(url + "/embed", json={"inputs": "x"}, headers={"Origin": stranger, "Authorization": f"Bearer {KEY}"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert called.status_code == 200 and called.headers["access-control-allow-origin"] == page
    assert keyless.status_code == 401  # the key is still asked for
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers  # its browser hides it
    assert serve_module.with_cors(app, []) is app


def test_a_key_read_from_a_secret_file_matches_the_key_clients_send(random_bert: Path) -> None:
    """A key from a file (a Kubernetes or Docker secret) ends with a newline; no client sends one."""
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    app = create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length), api_key=f" {KEY}\n")
    with serving(app) as url:
        called = httpx.post(url + "/embed", json={"inputs": "x"}, headers={"Authorization": f"Bearer {KEY}"})
        wrong = httpx.post(url + "/embed", json={"inputs": "x"}, headers={"Authorization": f"Bearer {KEY}x"})
    assert called.status_code == 200, called.text
    assert wrong.status_code == 401


def test_body_without_length_is_cut_off_at_the_limit(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # a generator body goes out chunked, with no Content-Length to check up front
        yield b'{"inputs": "'
        for _ in range(100):
            yield b"word " * 200
        yield b'"}'

    reply = client.post("/embed", content=chunks(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and "--max-request-bytes" in refusal(reply)[0]


def test_body_in_many_chunks_is_read_whole(client: httpx.Client, texts, indexed) -> None:
    body = json.dumps({"inputs": texts[1:4]}).encode()
    reply = client.post("/embed", content=(body[i: i + 100] for i in range(0, len(body), 100)),
                        headers={"Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json(), indexed[0][1:4], atol=1e-5)


def test_full_queue_gets_429_with_retry_after_then_serves_again(client: httpx.Client, server: Server) -> None:
    # 32 sequences of 256 tokens hold 32 of the queue's 40 places until their 16 batches are done
    slow: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: slow.update(reply=server.client().post("/embed", json={"inputs": [LONG] * 32})))
    worker.start()
    while metric(client, "embedctl_queue_depth") < 32:
        assert worker.is_alive(), "the long request finished before the queue could be seen holding it"
        time.sleep(0.002)
    refused = client.post("/embed", json={"inputs": ["a query"] * 10})
    # 16 texts, tokenized in two parts of 8: refused whole, before the first part could take the room left
    spread = client.post("/embed", json={"inputs": ["a query"] * 16})
    openai_style = client.post("/v1/embeddings", json={"input": ["a query"] * 10})
    worker.join()
    assert openai_style.status_code == 429 and openai_style.json()["error"]["code"] == "rate_limit_exceeded"
    assert refusal(openai_style)[1] == "requests"  # OpenAI's type for a rate limit
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    message, error_type = refusal(refused)
    assert "the queue holds 32 of at most 40 sequences" in message and error_type == "Overloaded"
    assert spread.status_code == 429 and "16 more do not fit" in refusal(spread)[0]
    assert slow["reply"].status_code == 200 and len(slow["reply"].json()) == 32
    assert client.post("/embed", json={"inputs": ["a query"] * 10}).status_code == 200


def requests_total(client: httpx.Client, endpoint: str, status: int) -> int:
    found = re.search(rf'^embedctl_requests_total{{endpoint="{endpoint}",status="{status}"}} (\d+)$',
                      client.get("/metrics").text, re.MULTILINE)
    return int(found.group(1)) if found else 0


def test_a_client_that_goes_away_takes_its_request_out_of_the_queue(server: Server, client: httpx.Client) -> None:
    body = json.dumps({"inputs": [LONG] * 32}).encode()
    assert len(body) >= WATCH_BYTES
    gone_before = requests_total(client, "/embed", CLIENT_GONE)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
                    b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while metric(client, "embedctl_queue_depth") == 0:
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.002)
    deadline = time.monotonic() + 30
    while requests_total(client, "/embed", CLIENT_GONE) == gone_before:
        assert time.monotonic() < deadline, "the server did not notice the client go"
        time.sleep(0.01)
    assert metric(client, "embedctl_queue_depth") == 0  # cancelled with the request, not left to run unread
    assert client.post("/embed", json={"inputs": "still serving"}).status_code == 200


def test_a_small_request_whose_client_gave_up_counts_as_499_not_200(server: Server, client: httpx.Client) -> None:
    """Too small to be watched while it waits (WATCH_BYTES), its client's leaving is seen when its reply is ready."""
    ok_before, gone_before = requests_total(client, "/embed", 200), requests_total(client, "/embed", CLIENT_GONE)
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(client.post, "/embed", json={"inputs": [LONG + str(i) for i in range(32)]})  # ~16k tokens
        deadline = time.monotonic() + 30
        while metric(client, "embedctl_queue_depth") == 0:
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.002)
        with pytest.raises(httpx.TimeoutException):
            client.post("/embed", json={"inputs": "a query that waits"}, timeout=0.2)
        assert ahead.result().status_code == 200
    deadline = time.monotonic() + 30
    while requests_total(client, "/embed", CLIENT_GONE) == gone_before:
        assert time.monotonic() < deadline, "the abandoned request was not counted as 499"
        time.sleep(0.01)
    assert requests_total(client, "/embed", 200) == ok_before + 1  # the one ahead only
    # The access log has its line too, as nginx logs a request whose client left (uvicorn logs a reply's start)
    assert re.search(r'^INFO: +127\.0\.0\.1:\d+ - "POST /embed HTTP/1\.1" 499 ?$', server.log.read_text(), re.MULTILINE)
    latency = re.search(r'^embedctl_request_duration_seconds_count{endpoint="/embed",status="499"} (\d+)$',
                        client.get("/metrics").text, re.MULTILINE)
    assert latency and int(latency.group(1)) >= 1  # the latency of requests that failed apart from the others'


def read_reply(raw: socket.socket) -> bytes:
    """What the server sent on a raw connection until it closed it."""
    raw.settimeout(10)
    received = b""
    while chunk := raw.recv(1 << 16):
        received += chunk
    return received


def test_a_head_too_large_is_431_without_a_key_and_the_server_goes_on(server: Server, client: httpx.Client) -> None:
    """httptools, under uvicorn, reads headers of any size: 200 MB of one grew the server by 300 MB."""
    port = int(server.url.rsplit(":", 1)[1])
    rss_before = rss_bytes(server.process.pid)
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\nX-Junk: ")
        try:
            for _ in range(64):  # 64 MiB at most: the server closes the connection long before
                raw.sendall(b"a" * (1 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_reply(raw)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), reply[:200]
    assert reply.endswith(b"the request line and headers are larger than 64 KiB")
    assert rss_bytes(server.process.pid) - rss_before < 32 << 20
    # a large head within the limit is read as any other (here: refused for its missing key, as it should be)
    refused = httpx.post(server.url + "/embed", json={"inputs": "hi"}, headers={"Cookie": "c=" + "x" * 40_000})
    assert refused.status_code == 401
    assert client.post("/embed", json={"inputs": "still serving"}).status_code == 200


@contextmanager
def body_length_server(head_timeout: float) -> Iterator[int]:
    """A server of LimitedHttpToolsProtocol (with head_timeout) whose app answers each request with the length of
    its body; yields its port."""

    class Limited(LimitedHttpToolsProtocol):
        pass

    Limited.head_timeout = head_timeout

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           http=Limited))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        thread.join()


def test_a_head_that_stops_coming_is_408_and_closed() -> None:
    """A client that sends half a head, or nothing at all, would hold its connection (and a drain) for ever."""
    with body_length_server(head_timeout=0.5) as port:
        replies = []
        for sent in (b"POST /embed HTTP/1.1\r\nHost: local", b""):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(sent)
                started = time.monotonic()
                replies.append((read_reply(raw), time.monotonic() - started))
        with socket.create_connection(("127.0.0.1", port)) as raw:  # two requests on one connection, each in time
            for last in (b"", b"Connection: close\r\n"):
                time.sleep(0.4)
                raw.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n" + last + b"\r\n")
            kept_alive = read_reply(raw)
    for reply, waited in replies:
        assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), reply
        assert reply.endswith(b"the request line and headers did not arrive within 0.5 s") and waited < 5
    assert kept_alive.count(b"HTTP/1.1 200 OK") == 2 and b"408" not in kept_alive


@pytest.mark.parametrize("writes", [1, 4])
def test_a_head_over_the_limit_is_431_also_when_it_ends_in_the_read_that_passes_it(writes: int) -> None:
    """The whole head counts, its last read too, in one write or several; empty lines before the request line
    are not taken for its end. One just under the limit is served."""
    body = b'{"input": "hi"}'

    def request(header_bytes: int) -> bytes:
        return (b"\r\n\r\nPOST /embed HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * header_bytes
                + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))

    with body_length_server(head_timeout=30) as port:
        replies = []
        for header_bytes in (70_000, 64_000):
            sent = request(header_bytes)
            step = -(-len(sent) // writes)  # rounded up
            with socket.create_connection(("127.0.0.1", port)) as raw:
                for start in range(0, len(sent), step):
                    raw.sendall(sent[start:start + step])
                    time.sleep(0.05)
                replies.append(read_reply(raw))
    assert replies[0].startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), replies[0][:200]
    assert replies[1].startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n%d\r\n" % len(body) in replies[1]


def test_large_bodies_are_not_taken_for_large_heads() -> None:
    """A body over the head limit arriving in the same reads as its head (a 100-document request), then another
    on the same connection: both read whole. The first form of the limit counted them and refused both (run157)."""
    body = b"x" * (300 << 10)
    with body_length_server(head_timeout=30) as port, socket.create_connection(("127.0.0.1", port)) as raw:
        for last in (b"", b"Connection: close\r\n"):
            raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n%s\r\n" % (len(body), last)
                        + body)
        replies = read_reply(raw)
    assert replies.count(b"HTTP/1.1 200 OK") == 2 and replies.count(b"\r\n%d\r\n" % len(body)) == 2, replies[:300]


def test_eight_clients_for_30_s_get_right_answers_and_memory_stays_flat(server: Server, texts, indexed) -> None:
    vectors = indexed[0]
    errors: list[str] = []
    done = threading.Event()
    counts = [0] * SOAK_CLIENTS

    def client_loop(number: int) -> None:
        rng = np.random.default_rng(number)
        with server.client() as client:
            while not done.is_set():
                picks = rng.choice(len(texts), size=rng.integers(1, 5), replace=False)
                kind = counts[number] % 3
                if kind == 0:
                    reply = client.post("/v1/embeddings", json={"input": [texts[i] for i in picks]})
                    got = [item["embedding"] for item in reply.json()["data"]] if reply.status_code == 200 else None
                elif kind == 1:
                    reply = client.post("/embed", json={"inputs": [texts[i] for i in picks]})
                    got = reply.json() if reply.status_code == 200 else None
                else:
                    reply = client.post("/rerank", json={"query": texts[picks[0]], "texts": [texts[i] for i in picks]})
                    got = None
                    if reply.status_code == 200 and reply.json()[0]["index"] != 0:  # the query itself must rank first
                        errors.append(f"rerank ranked {reply.json()[0]} above the query's own text")
                if reply.status_code != 200:
                    errors.append(f"{reply.status_code} {reply.text[:200]}")
                elif got is not None and not np.allclose(got, vectors[picks], atol=1e-5):
                    errors.append(f"client {number} got vectors for the wrong texts")
                counts[number] += 1

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(SOAK_CLIENTS)]
    for thread in threads:
        thread.start()
    samples, started = [], time.monotonic()
    while time.monotonic() - started < SOAK_SECONDS:
        samples.append((time.monotonic() - started, rss_bytes(server.process.pid)))
        time.sleep(0.5)
    done.set()
    for thread in threads:
        thread.join()
    assert errors == [] and min(counts) > 0
    settled = [rss for at, rss in samples if at >= SOAK_SECONDS / 3]  # after the first third, caches are warm
    assert settled[-1] - settled[0] < RSS_GROWTH_LIMIT, f"RSS grew {settled[0] >> 20} -> {settled[-1] >> 20} MiB"


# Shutdown


def test_sigterm_drains_the_request_in_flight_then_exits(minilm_dir: Path, tmp_path: Path) -> None:
    server = start_server(minilm_dir, tmp_path / "server.log", "--max-batch-tokens", "512")
    try:
        slow: dict[str, httpx.Response] = {}
        # 12 steps of one long text: queued long enough to be cut off, short enough to drain well within DRAIN_SECONDS
        # on a busy machine (24 took over 30 s in a CI run on 2 cores shared by other work)
        worker = threading.Thread(target=lambda: slow.update(reply=server.client().post("/embed", json={"inputs": [LONG] * 12})))
        worker.start()
        with server.client() as client:
            while metric(client, "embedctl_queue_depth") == 0:
                assert worker.is_alive(), "the long request finished before SIGTERM could be sent"
                time.sleep(0.002)
        server.process.send_signal(signal.SIGTERM)
        worker.join()
        assert server.process.wait(60) == 0  # a drained stop is a success for systemd and Kubernetes
        assert slow["reply"].status_code == 200 and len(slow["reply"].json()) == 12
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health")
        assert "Traceback" not in server.log.read_text()
    finally:
        stop(server)


def test_the_collector_leaves_the_objects_of_the_start_up_out_of_its_full_passes(random_bert: Path, tmp_path: Path) -> None:
    """What loading made (torch, the model, the web stack) is frozen (gc.freeze) before the server listens, so
    a full collection in the middle of requests walks what came after it, not some 200,000 objects. Seen
    from inside the real server's process: a sitecustomize writes the collector's counts as it exits."""
    probe, counts = tmp_path / "probe", tmp_path / "counts.json"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(
        "import atexit, gc, json\n"
        f"atexit.register(lambda: open({str(counts)!r}, 'w').write(json.dumps("
        "{'frozen': gc.get_freeze_count(), 'tracked': len(gc.get_objects())})))\n")
    server = start_server(random_bert, tmp_path / "server.log", env={"PYTHONPATH": os.pathsep.join(
        [str(probe), *filter(None, [os.environ.get("PYTHONPATH")])])})
    try:
        with server.client() as client:
            for _ in range(20):
                assert client.post("/embed", json={"inputs": ["a short query"]}).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
    finally:
        stop(server)
    seen = json.loads(counts.read_text())
    assert seen["frozen"] > 50_000 and seen["tracked"] < seen["frozen"] / 10, seen


def test_a_second_ctrl_c_quits_at_once_and_cleanly(minilm_dir: Path, tmp_path: Path) -> None:
    # uvicorn's forced quit skips the app's shutdown: the server stops its scheduler and workers itself,
    # drops what is still queued and answers the request in flight 503 (it aborted with SIGABRT before).
    server = start_server(minilm_dir, tmp_path / "server.log", "--max-batch-tokens", "512")
    try:
        body = json.dumps({"inputs": [LONG + str(i) for i in range(64)]}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw, httpx.Client(base_url=server.url) as probe:
            raw.sendall(b"POST /embed HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 30
            while metric(probe, "embedctl_queue_depth") == 0:
                assert time.monotonic() < deadline, "the request never reached the queue"
                time.sleep(0.002)
            server.process.send_signal(signal.SIGINT)
            time.sleep(0.3)
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(30) == 0
            reply = raw.recv(1 << 16).decode()
        assert reply.startswith("HTTP/1.1 503") and "the server is shutting down" in reply
        log = server.log.read_text()
        # not "terminate called" (the abort), nor the forced quit's cancelled lifespan logged as a failed shutdown
        assert "terminate called" not in log and "Traceback" not in log and "ERROR" not in log, log
    finally:
        stop(server)


def test_a_port_in_use_is_one_error_line(minilm_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_cli(minilm_dir, "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}")


def test_the_port_refuses_connections_until_the_model_is_loaded(minilm_dir: Path, tmp_path: Path) -> None:
    """As TEI's and vLLM's: a probe while the model loads is refused at once, not held on a port that does not
    answer (a health check would wait out its timeout); the port is held all along, so a second server fails."""
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "serve", "--device", "cpu", "--model",
                                    str(minilm_dir), "--port", str(port)], env=SERVER_ENV, stdout=sink,
                                   stderr=subprocess.STDOUT)
    try:
        _wait_until_held(process, log, port)
        accepted_while_loading, refused_while_taken = 0, 0
        deadline = time.monotonic() + 180
        while "at http://" not in log.read_text() and time.monotonic() < deadline:  # logged just before it serves
            assert process.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                accepted_while_loading += "at http://" not in log.read_text()
            except ConnectionRefusedError:
                refused_while_taken += _bound(port)
            time.sleep(0.05)
        assert accepted_while_loading == 0, log.read_text()
        assert refused_while_taken > 0  # the model loaded while the port was held but refused
        with httpx.Client(timeout=30) as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # 503 while its first request warms the tokenizer workers up
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.ConnectError:
                    pass
                time.sleep(0.05)
            else:
                raise AssertionError(log.read_text())
    finally:
        process.terminate()
        process.wait(60)


def test_a_server_that_listens_first_on_a_port_both_bound_leaves_the_other_one_error_line(minilm_dir: Path,
                                                                                          tmp_path: Path) -> None:
    """Two servers started at once both bind the port (SO_REUSEADDR lets sockets that do not listen yet share it):
    the one that loses the race to listen must fail, not run on without a socket."""
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "serve", "--device", "cpu", "--model",
                                    str(minilm_dir), "--port", str(port)], env=SERVER_ENV, stdout=sink,
                                   stderr=subprocess.STDOUT)
    with socket.socket() as first:
        _wait_until_held(process, log, port)
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind(("127.0.0.1", port))
        first.listen()
        process.wait(120)
    assert process.returncode == 2, log.read_text()
    assert log.read_text().strip().splitlines()[-1].startswith(
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): another server took it while the model "
        "loaded"), log.read_text()


def test_every_serve_option_can_come_from_the_environment(minilm_dir: Path, tmp_path: Path) -> None:
    """As TEI's launcher takes its options in a container spec: EMBEDCTL_ and the option's name."""
    port, log = free_port(), tmp_path / "server.log"
    env = SERVER_ENV | {"EMBEDCTL_PORT": str(port), "EMBEDCTL_DEVICE": "cpu", "EMBEDCTL_MODEL": str(minilm_dir),
                        "EMBEDCTL_MAX_CLIENT_BATCH": "3"}
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "serve"], env=env, stdout=sink,
                                   stderr=subprocess.STDOUT)
    try:
        deadline, info = time.monotonic() + 180, None
        while info is None and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()
            except httpx.TransportError:
                time.sleep(0.1)
        assert info is not None, log.read_text()
        assert (info["max_client_batch_size"], info["model_id"]) == (3, str(minilm_dir))
    finally:
        process.terminate()
        process.wait(60)


def test_each_serve_option_reads_the_environment_variable_of_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMBEDCTL_ and the option's name, as the README says: not the name of the Python parameter behind it."""
    command = typer.main.get_command(cli).commands["serve"]
    context = command.context_class(command, **command.context_settings)
    for option in command.params:
        name = "EMBEDCTL_" + next(flag for flag in option.opts if flag.startswith("--"))[2:].upper().replace("-", "_")
        monkeypatch.setenv(name, "from the environment")
        assert option.resolve_envvar_value(context) == "from the environment", (option.name, name)
        monkeypatch.delenv(name)


def _wait_until_held(process: subprocess.Popen, log: Path, port: int) -> None:
    """Until the server says it holds the port and loads its model (a probe of the port before that could take
    it from the server for an instant: a bind that fails the server's)."""
    deadline = time.monotonic() + 120
    while f"127.0.0.1:{port} is held; loading the model" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert _bound(port)


def _bound(port: int) -> bool:
    """Whether some socket holds the port (a bind of our own fails)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize(("flag", "value", "reason"), [("--port", "99999", "port must be 0-65535"),
                                                       ("--host", "no-such-host.invalid", "cannot listen on no-such-host")])
def test_an_address_that_cannot_exist_is_one_error_line(minilm_dir: Path, flag: str, value: str, reason: str) -> None:
    result = serve_cli(minilm_dir, flag, value)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and reason in result.stderr
    assert result.stderr.startswith("error: cannot listen on")


def test_an_empty_api_key_is_refused_rather_than_serving_without_one(minilm_dir: Path) -> None:
    # `--api-key "$KEY"` with KEY unset, in a unit file or a container spec, must not leave the server open.
    result = serve_cli(minilm_dir, "--api-key", "")
    assert_one_error_line(result, "--api-key (or EMBEDCTL_API_KEY) is empty")
    from_environment = serve_cli(minilm_dir, env=ENV | {"EMBEDCTL_API_KEY": ""})
    assert_one_error_line(from_environment, "--api-key (or EMBEDCTL_API_KEY) is empty")


def test_limits_that_could_never_admit_a_full_rerank_are_refused() -> None:
    # A bi-encoder's /rerank of max_client_batch texts queues max_client_batch + 1 sequences (the query too).
    with pytest.raises(UserError, match="--max-queue 4 must be larger than --max-client-batch 4"):
        ServeLimits(max_client_batch=4, max_queue=4)
    assert ServeLimits(max_client_batch=4, max_queue=5).max_queue == 5


def test_serve_listens_on_an_ipv6_address(minilm_dir: Path, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "embedctl.cli", "serve", "--device", "cpu", "--model",
                                    str(minilm_dir), "--host", "::1", "--port", str(port)],
                                   env=SERVER_ENV, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 180, None
        while status != 200 and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                status = httpx.get(f"http://[::1]:{port}/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
        assert status == 200, log.read_text()
        assert f"at http://[::1]:{port}" in log.read_text()
    finally:
        process.terminate()
        process.wait(60)


def failing_on(fails: Callable[[PackedBatch], bool], step: Callable[[PackedBatch], LazyTensor] | None = None
               ) -> Callable[[PackedBatch], LazyTensor]:
    """An engine step that raises as an out-of-range id in an embedding lookup does, for the batches `fails` picks."""
    def checked(batch: PackedBatch) -> LazyTensor:
        if fails(batch):
            raise IndexError("index 29145 is out of bounds for dimension 0 with size 5000")
        return step(batch)
    return checked


def serve_cli(model: Path, *args: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedctl.cli", "serve", "--device", "cpu", "--model", str(model), *args],
                          env=env, capture_output=True, text=True, timeout=120)


# Cross-encoder and the scheduler, in this process


@contextmanager
def serving(app, lifespan: Literal["auto", "off"] = "auto") -> Iterator[str]:
    """The app under uvicorn on a loopback port, in a thread; yields its URL once its warm-up is over
    (/health no longer answers 503 with Retry-After): healthy, or failed. With lifespan off the app is
    never started (no scheduler, no warm-up), as a server is before its warm-up; the URL comes once it listens."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def warming() -> bool:
        reply = httpx.get(url + "/health")
        return reply.status_code == 503 and "Retry-After" in reply.headers

    try:
        deadline = time.monotonic() + 60
        while not server.started or (lifespan != "off" and warming()):
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start and warm up in 60 s"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join()


def test_health_and_ping_before_the_warm_up_are_503_unhealthy_with_retry_after(random_bert: Path) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer, api_key=KEY), lifespan="off") as url:
        replies = {path: httpx.get(url + path) for path in ("/health", "/ping")}  # no key: health checks send none
        heads = [httpx.head(url + path) for path in ("/health", "/ping")]
    for reply in replies.values():
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
        assert refusal(reply) == ("the model is warming up; retry after 1 s", "Unhealthy")  # TEI's error shape
    assert [head.status_code for head in heads] == [503, 503]


def test_health_and_ping_after_a_failed_warm_up_are_503_unhealthy_with_the_reason(random_bert: Path) -> None:
    """An engine whose every step fails, as a device that fell over would."""
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    engine.step = failing_on(lambda batch: True)
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer, api_key=KEY)) as url:
        replies = [httpx.get(url + path) for path in ("/health", "/ping")]
    for reply in replies:
        message, error_type = refusal(reply)
        assert reply.status_code == 503 and "Retry-After" not in reply.headers  # retrying will not help
        assert message.startswith("the warm-up failed: ") and "out of bounds" in message
        assert error_type == "Unhealthy"


def test_a_token_past_the_embedding_table_fails_its_own_request_only(random_bert: Path) -> None:
    """Qwen3-Embedding-4B's <think>: a 422 for the request that holds it, not a failed batch that would fail
    the other clients' requests batched with it."""
    add_token_past_the_table(random_bert)
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu"))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    texts = ["a cat <think> sat", "a cat sat"] * 8
    with serving(create_app(engine, tokenizer)) as url, ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda text: httpx.post(url + "/embed", json={"inputs": ["fine", text]}), texts))
        query = httpx.post(url + "/rerank", json={"query": "<think> cat", "texts": ["a cat"]})
        document = httpx.post(url + "/v1/embeddings", json={"input": ["fine", "<think>"]})
    for answer in answers[::2]:
        assert answer.status_code == 422
        assert refusal(answer)[0] == ("inputs[1] holds token id 30522, which the tokenizer adds but the model's "
                                      "embedding table lacks; leave that token out of the text")
    assert all(answer.status_code == 200 for answer in answers[1::2])
    assert query.status_code == 422 and refusal(query)[0].startswith("query holds token id 30522")
    assert document.status_code == 400 and refusal(document)[0].startswith("input[1] holds token id 30522")
    assert document.json()["error"]["param"] == "input[1]"


def test_a_token_past_the_table_is_named_in_spread_requests_and_by_a_cross_encoder(tmp_path: Path) -> None:
    """The worker processes' parts name the text by its place in the whole request; a cross-encoder names
    the query, which every pair holds."""
    path = save_random_model(tmp_path / "cross-encoder", "BertForSequenceClassification", num_labels=1)
    add_token_past_the_table(path)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    texts = [f"document {i}" for i in range(40)]
    texts[37] = "document <think> 37"
    with serving(create_app(engine, tokenizer, tokenizer_processes=2)) as url:
        spread = httpx.post(url + "/rerank", json={"query": "a query", "texts": texts})
        query = httpx.post(url + "/rerank", json={"query": "<think> a query", "texts": texts[:2]})
        fine = httpx.post(url + "/rerank", json={"query": "a query", "texts": texts[:37]})
    assert spread.status_code == 422 and refusal(spread)[0].startswith("texts[37] holds token id 30522")
    assert query.status_code == 422 and refusal(query)[0].startswith("query holds token id 30522")
    assert fine.status_code == 200 and len(fine.json()) == 37


@pytest.mark.parametrize("similarity", ["dot", "manhattan"])
def test_rerank_with_a_bi_encoder_scores_by_the_model_s_similarity(tmp_path: Path, similarity: str) -> None:
    """As `embedctl score` ranks and sentence-transformers' model.similarity scores: here on a model without a
    Normalize module, where dot and manhattan order the documents otherwise than cosine."""
    from sentence_transformers import SentenceTransformer

    model_dir = save_random_model(tmp_path / "model", pooling="mean")
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": similarity}))
    documents = ["a cat sat on the mat", "dogs bark at night", "the stock market fell", "a cat", "cats and dogs"]
    peer = SentenceTransformer(str(model_dir), device="cpu")
    expected = peer.similarity(peer.encode(["where is the cat"]), peer.encode(documents))[0].numpy()
    engine = Engine.load(str(model_dir), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer)) as url:
        ranked = httpx.post(url + "/rerank", json={"query": "where is the cat", "texts": documents}).json()
        similarity_reply = httpx.post(url + "/similarity", json={"inputs": {"source_sentence": "where is the cat",
                                                                              "sentences": documents}}).json()
    assert [hit["index"] for hit in ranked] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([hit["score"] for hit in sorted(ranked, key=lambda hit: hit["index"])], expected,
                               rtol=1e-4, atol=1e-4)
    # /similarity is cosine whatever the model names, as TEI's is
    cosines = unit(peer.encode(documents)) @ unit(peer.encode(["where is the cat"]))[0]
    np.testing.assert_allclose(similarity_reply, cosines, rtol=1e-4, atol=1e-4)
    assert not np.allclose(similarity_reply, expected, atol=1e-2)


def test_rerank_with_a_cross_encoder_scores_pairs_with_the_model(tmp_path: Path) -> None:
    """Four texts, and the same 20 times over, which a server with tokenizer workers spreads over them."""
    import transformers

    path = save_random_model(tmp_path / "reranker", "BertForSequenceClassification", num_labels=1, type_vocab_size=2)
    engine = Engine.load(str(path), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    query, docs = "how do I read a csv file", ["Use pyarrow.csv.read_csv.", "A store of embeddings. " * 40, "csv", "x"]
    many = [f"{doc} {i}" for i in range(5) for doc in docs]
    pairs = tokenizer.encode_pairs([query] * len(docs), docs)
    reference = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = torch.tensor([reference(input_ids=torch.from_numpy(ids).long()[None],
                                         token_type_ids=torch.from_numpy(types).long()[None]).logits.item()
                               for ids, types in zip(pairs.ids, pairs.type_ids)])
    expected = torch.sigmoid(logits).numpy()
    order = np.argsort(-expected, kind="stable")
    config = json.loads((path / "config.json").read_text())
    with serving(create_app(engine, tokenizer)) as url:
        hits = httpx.post(url + "/rerank", json={"query": query, "texts": docs}).json()
        root = httpx.post(url + "/", json={"query": query, "texts": docs}).json()  # TEI's POST / ranks for a reranker
        invoked = httpx.post(url + "/invocations", json={"query": query, "texts": docs}).json()  # so does SageMaker's
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        raw = httpx.post(url + "/rerank", json={"query": query, "texts": docs, "raw_scores": True}).json()
        cut = httpx.post(url + "/rerank", json={"query": query, "texts": docs, "truncate": False})
        from_left = httpx.post(url + "/rerank", json={"query": query, "texts": docs, "truncation_direction": "Left"}).json()
        vectors = httpx.post(url + "/embed", json={"inputs": "x"})
        similarity = httpx.post(url + "/similarity", json={"inputs": {"source_sentence": "x", "sentences": ["y"]}})
        openai_vectors = httpx.post(url + "/v1/embeddings", json={"input": "x"})
        info = httpx.get(url + "/info").json()
    assert [hit["index"] for hit in hits] == order.tolist()
    np.testing.assert_allclose([hit["score"] for hit in hits], expected[order], atol=1e-5)
    assert root == invoked == hits
    # TEI's raw_scores: the logits, in the same order (the sigmoid keeps it)
    assert [hit["index"] for hit in raw] == order.tolist()
    np.testing.assert_allclose([hit["score"] for hit in raw], logits.numpy()[order], atol=1e-5)
    for path in ("/", "/invocations"):
        assert paths[path]["post"]["requestBody"] == paths["/rerank"]["post"]["requestBody"]
    assert cut.status_code == 422 and "the query with texts[1] is longer" in refusal(cut)[0]
    left_pairs = tokenizer.encode_from_left([query] * len(docs), docs)
    assert left_pairs.truncated == [False, True, False, False] and left_pairs.ids[1][-2] != pairs.ids[1][-2]
    with torch.no_grad():
        left_expected = [torch.sigmoid(reference(input_ids=torch.from_numpy(ids).long()[None],
                                                 token_type_ids=torch.from_numpy(types).long()[None]).logits).item()
                         for ids, types in zip(left_pairs.ids, left_pairs.type_ids)]
    np.testing.assert_allclose([hit["score"] for hit in from_left], [left_expected[hit["index"]] for hit in from_left],
                               atol=1e-5)
    assert {hit["index"] for hit in from_left} == set(range(len(docs)))
    assert vectors.status_code == 422 and "cross-encoder" in refusal(vectors)[0]
    assert similarity.status_code == 422 and "has no vectors; call POST /rerank" in refusal(similarity)[0]
    assert openai_vectors.status_code == 400 and "cross-encoder" in refusal(openai_vectors)[0]
    assert info["model_type"] == {"reranker": {"id2label": config["id2label"], "label2id": config["label2id"]}}
    with serving(create_app(engine, tokenizer, tokenizer_processes=2)) as url:
        spread = httpx.post(url + "/rerank", json={"query": query, "texts": many, "return_text": True}).json()
    many_pairs = tokenizer.encode_pairs([query] * len(many), many)
    with torch.no_grad():
        many_expected = [torch.sigmoid(reference(input_ids=torch.from_numpy(ids).long()[None],
                                                 token_type_ids=torch.from_numpy(types).long()[None]).logits).item()
                         for ids, types in zip(many_pairs.ids, many_pairs.type_ids)]
    assert sorted(hit["index"] for hit in spread) == list(range(len(many)))
    np.testing.assert_allclose([hit["score"] for hit in spread], [many_expected[hit["index"]] for hit in spread], atol=1e-5)
    assert all(hit["text"] == many[hit["index"]] for hit in spread)


@pytest.mark.gpu
def test_a_server_on_the_gpu_answers_as_the_cpu_engine_does(minilm_dir: Path, texts: list[str], tmp_path: Path) -> None:
    """On the GPU, with two tokenizer workers: 62 texts through the openai client, spread over the workers and
    queued part by part, and a cross-encoder's /rerank of 20 pairs, spread too, against the CPU engine."""
    def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    many = texts * 2
    tokenizer = TextTokenizer(minilm_dir / "tokenizer.json", 256)
    expected = Engine.load(str(minilm_dir), EngineConfig(device="cpu", max_length=256)).embed(tokenizer.encode(many).ids)
    gpu = Engine.load(str(minilm_dir), EngineConfig(device="cuda", max_length=256, normalize=False))
    with serving(create_app(gpu, tokenizer, tokenizer_processes=2)) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = api.embeddings.create(model=str(minilm_dir), input=many)
    assert [item.index for item in reply.data] == list(range(len(many)))
    assert cosine(np.array([item.embedding for item in reply.data]), expected).min() >= 0.999

    path = save_random_model(tmp_path / "reranker", "BertForSequenceClassification", num_labels=1, type_vocab_size=2)
    query, docs = "how do I read a csv file", [f"{text} {i}" for i in range(2) for text in texts[1:11]]
    reference = Engine.load(str(path), EngineConfig(device="cpu"))
    tokenizer = TextTokenizer(reference.files.tokenizer_file, reference.max_length)
    pairs = tokenizer.encode_pairs([query] * len(docs), docs)
    scores = reference.embed(pairs.ids, pairs.type_ids)[:, 0]
    reranker = Engine.load(str(path), EngineConfig(device="cuda", normalize=False))
    with serving(create_app(reranker, tokenizer, tokenizer_processes=2)) as url:
        hits = httpx.post(url + "/rerank", json={"query": query, "texts": docs}).json()
    assert sorted(hit["index"] for hit in hits) == list(range(len(docs)))
    np.testing.assert_allclose([hit["score"] for hit in hits], scores[[hit["index"] for hit in hits]], atol=0.01)


@pytest.mark.gpu
def test_the_command_on_the_gpu_says_it_captures_its_graphs_before_it_listens(minilm_dir: Path, texts: list[str],
                                                                             tmp_path: Path) -> None:
    """`embedctl serve --device cuda` as a person starts it: the lines that explain the wait, then vectors."""
    server = start_server(minilm_dir, tmp_path / "server.log", device="cuda")
    try:
        with server.client(key=None) as client:
            reply = client.post("/embed", json={"inputs": texts[:4]})
        log = server.log.read_text()
        held = log.index("is held; loading the model and capturing its CUDA graphs (--no-warmup starts sooner)")
        assert held < log.index("at http://127.0.0.1:") < log.index("warm-up: ") < log.index("startup complete"), log
        expected = Engine.load(str(minilm_dir), EngineConfig(device="cpu")).embed(
            TextTokenizer(minilm_dir / "tokenizer.json", 256).encode(texts[:4]).ids)
        assert reply.status_code == 200
        assert (np.array(reply.json()) * expected).sum(1).min() >= 0.999
    finally:
        stop(server)


def test_prompts_and_tei_fields_give_the_vectors_index_and_score_would(random_bert: Path) -> None:
    """A model with prompts: /v1/embeddings and /embed put its document prompt first, as `embedctl index`
    does, and /rerank its query prompt before the query, as `embedctl score` does; /embed takes TEI's
    prompt_name, truncation_direction and a null truncate, and /rerank TEI's raw_scores."""
    (random_bert / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "document": "passage: ", "clustering": "cluster: "}}))
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)

    def expected(*texts: str) -> np.ndarray:
        return unit(engine.embed(tokenizer.encode(list(texts)).ids))

    with serving(create_app(engine, tokenizer)) as url:
        openai_style = httpx.post(url + "/v1/embeddings", json={"input": ["hello there"]}).json()
        tei_style = httpx.post(url + "/embed", json={"inputs": "hello there", "truncate": None,
                                                     "truncation_direction": "Right"}).json()
        named = httpx.post(url + "/embed", json={"inputs": "hello there", "prompt_name": "clustering"}).json()
        ranked = httpx.post(url + "/rerank", json={"query": "a question", "texts": ["one", "two"],
                                                   "raw_scores": False}).json()
        unknown = httpx.post(url + "/embed", json={"inputs": "x", "prompt_name": "nope"})
        tokens = httpx.post(url + "/tokenize", json={"inputs": "hello there"}).json()[0]
        named_tokens = httpx.post(url + "/tokenize", json={"inputs": "hello there", "prompt_name": "clustering"}).json()[0]
    # This model has no Normalize module, so /v1/embeddings answers its raw vector.
    np.testing.assert_allclose(unit(np.array([openai_style["data"][0]["embedding"]])), expected("passage: hello there"),
                               atol=1e-5)
    np.testing.assert_allclose(tei_style, expected("passage: hello there"), atol=1e-5)
    np.testing.assert_allclose(named, expected("cluster: hello there"), atol=1e-5)
    query, one, two = expected("query: a question", "passage: one", "passage: two")
    assert {hit["index"]: hit["score"] for hit in ranked} == pytest.approx({0: float(one @ query), 1: float(two @ query)},
                                                                           abs=1e-5)
    message, error_type = refusal(unknown)
    assert unknown.status_code == 422 and "no prompt named 'nope'" in message and error_type == "Validation"
    # /tokenize shows what /embed embeds: the document prompt first, unless prompt_name names another
    assert [token["id"] for token in tokens] == tokenizer.encode(["passage: hello there"]).ids[0].tolist()
    assert [(token["text"], token["start"]) for token in named_tokens[1:-1]] == [
        ("cluster", 0), (":", 7), ("hello", 9), ("there", 15)]


def test_equal_texts_rank_equal_in_their_input_order(client: httpx.Client) -> None:
    """A matrix-vector product may give the last row another rounding; equal texts must score equal."""
    same = "Deep learning is a subset of machine learning that uses neural networks with many layers."
    ranked = client.post("/rerank", json={"query": "what is deep learning", "texts": [same, "cheese", same]}).json()
    assert [hit["index"] for hit in ranked] == [0, 2, 1] and ranked[0]["score"] == ranked[1]["score"]


def test_the_server_puts_the_prompts_it_is_given_or_none(random_bert: Path) -> None:
    """serve --doc-prompt '' embeds texts as TEI does, without the model's document prompt; --query-prompt
    replaces its query prompt before /rerank's query."""
    (random_bert / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "document": "passage: "}}))
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)

    def expected(*texts: str) -> np.ndarray:
        return unit(engine.embed(tokenizer.encode(list(texts)).ids))

    with serving(create_app(engine, tokenizer, prompts={"document": "", "query": "q: "})) as url:
        tei = httpx.post(url + "/embed", json={"inputs": "hello there"}).json()
        openai_style = httpx.post(url + "/v1/embeddings", json={"input": "hello there", "encoding_format": "float"})
        ranked = httpx.post(url + "/rerank", json={"query": "a question", "texts": ["one", "two"]}).json()
    np.testing.assert_allclose(tei, expected("hello there"), atol=1e-5)
    np.testing.assert_allclose(unit(np.array([openai_style.json()["data"][0]["embedding"]])), expected("hello there"),
                               atol=1e-5)
    query, one, two = expected("q: a question", "one", "two")
    assert {hit["index"]: hit["score"] for hit in ranked} == pytest.approx({0: float(one @ query), 1: float(two @ query)},
                                                                           abs=1e-5)


def test_a_served_model_name_is_the_models_name_in_requests_and_replies(random_bert: Path) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer, served_model_name="bert-prod")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        listed = [model.id for model in client.models.list()]
        embedded = client.embeddings.create(model="bert-prod", input="hello")
        with pytest.raises(openai.NotFoundError, match="this server serves 'bert-prod'"):
            client.embeddings.create(model=str(random_bert), input="hello")  # its path is no name of it now
        ranked = httpx.post(url + "/v1/rerank", json={"model": "bert-prod", "query": "q", "documents": ["a"]}).json()
        info = httpx.get(url + "/info").json()
    assert listed == ["bert-prod"] and embedded.model == "bert-prod" and ranked["model"] == "bert-prod"
    assert (info["model_id"], info["served_model_name"]) == (str(random_bert), "bert-prod")  # as TEI's /info
    with pytest.raises(UserError, match="--served-model-name is empty"):
        serve_module.ServeOptions(served_model_name=" ")


def test_an_engine_failure_is_tei_backend_error_and_openai_server_error(random_bert: Path) -> None:
    """An engine whose step fails on "zebra" (id 29145). TEI answers that 424 "Backend", OpenAI 500; the
    request's failure is its own, and the server goes on serving ("warm up" is ids 4010 and 2039)."""
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    engine.step = failing_on(lambda batch: 29145 in batch.input_ids, engine.step)
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer)) as url:
        tei = httpx.post(url + "/embed", json={"inputs": "zebra"})
        openai_style = httpx.post(url + "/v1/embeddings", json={"input": "zebra"})
        after = httpx.post(url + "/embed", json={"inputs": "warm up"})
    message, error_type = refusal(tei)
    assert tei.status_code == 424 and "the engine failed on this request" in message and error_type == "Backend"
    assert openai_style.status_code == 500 and refusal(openai_style)[1] == "server_error"
    assert after.status_code == 200
    np.testing.assert_allclose(after.json(), unit(engine.embed(tokenizer.encode(["warm up"]).ids)), atol=1e-5)


def test_health_is_503_while_the_engine_fails_and_200_once_it_answers_again(random_bert: Path) -> None:
    """As TEI's: a device that fell over after the warm-up takes the server out of a load balancer's rotation.
    /health then runs one short text itself, so that the server comes back without other traffic."""
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    broken = threading.Event()
    engine.step = failing_on(lambda batch: broken.is_set(), engine.step)
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    with serving(create_app(engine, tokenizer)) as url:
        before = httpx.get(url + "/health")
        broken.set()
        failed = httpx.post(url + "/embed", json={"inputs": "hello"})
        while_broken = [httpx.get(url + "/health"), httpx.get(url + "/health")]
        gauge_broken = httpx.get(url + "/metrics").text
        broken.clear()
        mended = httpx.get(url + "/health")
        gauge_mended = httpx.get(url + "/metrics").text
    assert before.status_code == 200 and failed.status_code == 424
    for reply in while_broken:
        message, error_type = refusal(reply)
        # with Retry-After, unlike a failed warm-up: each check tries the engine again, and may find it mended
        assert reply.status_code == 503 and error_type == "Unhealthy" and reply.headers["Retry-After"] == "1"
        assert message == ("the engine fails (index 29145 is out of bounds for dimension 0 with size 5000); see the "
                           "server log; retry after 1 s")
    assert "embedctl_ready 0" in gauge_broken.splitlines()
    assert mended.status_code == 200 and "embedctl_ready 1" in gauge_mended.splitlines()


@pytest.mark.parametrize("device", DEVICES)
def test_scheduler_answers_each_request_in_order_across_batches(random_bert: Path, device: str) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device=device, max_batch_tokens=64, max_length=32, normalize=False))
    rng = np.random.default_rng(0)
    requests = [[rng.integers(1000, 2000, size=rng.integers(1, 33)).astype(np.int32) for _ in range(rng.integers(1, 12))]
                for _ in range(24)]
    results: dict[int, np.ndarray | BaseException] = {}
    answered = threading.Event()
    batches: list[int] = []
    scheduler = Scheduler(engine, max_queue=1000, on_batch=lambda batch: batches.append(batch.num_tokens))

    def done(number: int):
        def store(outcome) -> None:
            results[number] = outcome
            if len(results) == len(requests):
                answered.set()
        return store

    submitters = [threading.Thread(target=lambda part=part: [scheduler.submit(requests[n], done(n)) for n in part])
                  for part in (range(0, 24, 3), range(1, 24, 3), range(2, 24, 3))]
    for thread in submitters:
        thread.start()
    for thread in submitters:
        thread.join()
    assert answered.wait(60)
    with pytest.raises(QueueFull, match="at most 1000 sequences"):
        scheduler.submit([np.array([101, 102], dtype=np.int32)] * 1001, done(-1))
    scheduler.close()
    for number, sequences in enumerate(requests):  # batched otherwise than alone: bf16 on the GPU rounds differently
        np.testing.assert_allclose(results[number], engine.embed(sequences), atol=1e-5 if device == "cpu" else 2e-2)
    assert max(batches) <= 64 and sum(batches) == sum(len(s) for r in requests for s in r)
    assert scheduler.stats.depth == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_cancelled_request_leaves_the_queue_and_is_never_answered(random_bert: Path, device: str) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device=device, max_batch_tokens=64, max_length=32))
    release, step = threading.Event(), engine.step
    engine.step = lambda batch: (release.wait(30), step(batch))[1]  # the first batch holds the thread
    scheduler = Scheduler(engine, max_queue=100)
    answers: dict[str, list] = {"first": [], "cancelled": [], "last": []}
    sequences = [np.arange(100, 130, dtype=np.int32)] * 2
    scheduler.submit(sequences, answers["first"].append)
    cancelled = scheduler.submit(sequences * 3, answers["cancelled"].append)
    scheduler.submit(sequences, answers["last"].append)
    assert scheduler.stats.depth == 10
    scheduler.cancel(cancelled)
    assert scheduler.stats.depth == 4  # at once, while the engine is still busy
    release.set()
    scheduler.close()
    assert len(answers["first"]) == len(answers["last"]) == 1 and answers["cancelled"] == []
    assert scheduler.stats.depth == 0 and scheduler.stats.sequences < 10  # the cancelled sequences never ran
    scheduler.cancel(cancelled)  # cancelling again, or an answered request, changes nothing
    assert scheduler.stats.depth == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_batch_answers_each_of_its_requests_once_with_the_error(random_bert: Path, device: str) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device=device, max_batch_tokens=64, max_length=32))
    step, failures = engine.step, [RuntimeError("the device fell over")]

    def failing_once(batch: PackedBatch) -> LazyTensor:
        if failures:
            raise failures.pop()
        return step(batch)

    engine.step = failing_once
    scheduler = Scheduler(engine, max_queue=100)
    answers: dict[str, list] = {"two": [], "one": []}
    sequence = np.arange(100, 110, dtype=np.int32)
    scheduler.submit([sequence, sequence], answers["two"].append)  # both in the first batch, which fails
    scheduler.submit([sequence], answers["one"].append)
    scheduler.close()
    assert [str(answer) for answer in answers["two"]] == ["the device fell over"]
    assert [str(answer) for answer in answers["one"]] == ["the device fell over"]
    assert scheduler.stats.depth == 0 and scheduler.stats.batches == 0
    after = Scheduler(engine, max_queue=100)
    answer: list = []
    after.submit([sequence], answer.append)
    after.close()
    assert len(answer) == 1 and answer[0].shape == (1, engine.dim)


@pytest.mark.parametrize("device", DEVICES)
def test_the_scheduler_keeps_serving_after_the_request_that_woke_it_was_cancelled(random_bert: Path, device: str) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device=device, max_batch_tokens=64, max_length=32))
    scheduler = Scheduler(engine, max_queue=100)
    answered = threading.Event()
    with scheduler._lock:  # the thread wakes for the request only once it is cancelled, and finds nothing to do
        scheduler.cancel(scheduler.submit([np.arange(100, 110, dtype=np.int32)], lambda _: None))
    time.sleep(0.5)  # time for the thread to take the lock and find the queue holding only the cancelled request
    scheduler.submit([np.arange(100, 110, dtype=np.int32)], lambda _: answered.set())
    assert answered.wait(30), "the scheduler thread stopped"
    scheduler.close()


def test_a_request_cut_off_by_a_shutdown_gets_503_in_its_routes_shape(random_bert: Path) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu", normalize=False))
    app = create_app(engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=0.5))
    thread = threading.Thread(target=server.run)
    thread.start()
    url, replies, release = f"http://127.0.0.1:{port}", {}, threading.Event()
    try:
        deadline = time.monotonic() + 60
        while not server.started or httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        step = engine.step
        engine.step = lambda batch: (release.wait(60), step(batch))[1]  # the request stays in flight
        client = threading.Thread(target=lambda: replies.update(
            openai=httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)))
        client.start()
        with httpx.Client(base_url=url) as probe:
            while metric(probe, "embedctl_queue_depth") == 0:
                assert time.monotonic() < deadline, "the request never reached the queue"
                time.sleep(0.005)
        server.should_exit = True
        client.join(30)
    finally:
        release.set()
        server.should_exit = True
        thread.join(60)
    reply = replies["openai"]
    message, error_type = refusal(reply)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert "the server is shutting down and cut this request off" in message and error_type == "server_error"


@pytest.mark.parametrize("device", DEVICES)
def test_scheduler_close_answers_everything_admitted(random_bert: Path, device: str) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device=device, max_batch_tokens=64, max_length=32))
    scheduler = Scheduler(engine, max_queue=100)
    outcomes: list[np.ndarray] = []
    for _ in range(10):
        scheduler.submit([np.arange(100, 130, dtype=np.int32)] * 5, outcomes.append)
    scheduler.close()
    assert len(outcomes) == 10 and all(o.shape == (5, engine.dim) for o in outcomes)
    with pytest.raises(Exception, match="shutting down"):
        scheduler.submit([np.array([101, 102], dtype=np.int32)], outcomes.append)
