"""`embedctl serve`: the engine behind HTTP, on uvicorn, with FastAPI for everything but the hot path.

    POST /v1/embeddings  OpenAI-compatible (texts or token ids; float or base64; dimensions; usage);
                         POST /embeddings too, OpenAI's path without /v1 that some clients and proxies call
    POST /embed          text-embeddings-inference-compatible (inputs, normalize, truncate, prompt_name, dimensions)
    POST /rerank         query + texts (TEI reply) or documents (Cohere-style reply), sorted by score;
                         POST /v1/rerank /v2/rerank too, where Cohere's and Jina's clients post
    POST /similarity     TEI's: the cosine of a source sentence's vector with each other sentence's, in order
    POST / /invocations  the model's own task, as TEI routes it: /rerank for a cross-encoder, else /embed
                         (/invocations is SageMaker's path for it)
    POST /tokenize /decode   TEI's: the tokens of texts, the texts of token ids
    GET  /info           TEI's description of the model and the server's limits
    GET  /health /ping / 200 once warmed up, else 503 in TEI's error shape, with Retry-After unless the warm-up
                         failed (/ping is SageMaker's health check, GET / TEI's too)
    GET  /metrics /v1/models /v1/models/{id} /docs (and /models, /models/{id}: /v1/models without /v1)

The app uvicorn runs is _Front, a plain ASGI callable: it checks the API key and the body size,
records the metrics, and serves the POST endpoints itself, from the raw body (validated by the
pydantic models in one pass over the JSON) to reply bytes (orjson, numpy arrays included).
Everything else, lifespan and /docs included, goes to a FastAPI app, which also describes the POST
endpoints in the OpenAPI schema. FastAPI's routing, dependency and serialisation layers cost
several times what the request itself costs on the CPU, and the server runs on one event loop.

Errors come in the shape of the API a route belongs to, which is what that API's clients parse:
TEI's {"error", "error_type"} on TEI's routes (TEI_PATHS), OpenAI's {"error": {"message", "type",
"param", "code"}} everywhere else (_error_reply), its param naming the request field at fault where
there is one (input, input[1], dimensions, model).

A request is tokenized on the event loop when it is short and the engine idle, spread over the worker
processes of a TokenizerPool when it holds many texts (beside a GPU, where the pool has workers:
their GIL is not the loop's; each worker's part is queued as it comes back), else in a thread pool
(the tokenizer releases the GIL for its own work, so requests tokenize in parallel). Its sequences
join the engine.scheduler queue that every client shares, and the loop awaits an asyncio future that
the scheduler thread resolves through _Wakeups, so no request ever blocks the loop on the engine. The
engine is loaded without normalisation: vectors are cut to `dimensions` and normalised here, per
request, which is what lets /embed honour `normalize: false`. Texts get the model's prompts as
`embedctl index` (documents) and `embedctl score` (queries) give them, so that the vectors agree.
/rerank scores by the bi-encoder's similarity (the model's own, as score ranks by: cosine unless its
config names dot, euclidean or manhattan), or with the model itself when it is a cross-encoder (which
then has no vectors); /similarity by cosine always, as TEI's does.

The engine is loaded with its CUDA graph warm-up unless --no-warmup: every batch shape (of sequences up
to 512 tokens) is captured before the port answers, because a shape captured under traffic stalls every
request in flight. On the H200 that took MiniLM's p99 at 16 clients from 21.7 to 9.8 ms and from 25.6
to 11.5 ms for 2.5 and 3.9 s more start-up (bench/results/gpu-2026-11-30-run62-serve-warmup-ab, run63).
The port is taken from the start (a taken port fails before the model loads) but listens only once the
capture is done, as TEI's and vLLM's open theirs once ready: a probe meanwhile is refused at once rather than
held on a port that does not answer.

Not here: batching (engine.scheduler), the model (engine), tokenization rules (pipelines.tokenize).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import difflib
import functools
import gc
import importlib.metadata
import logging
import logging.config
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import numpy as np
import orjson
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenizers import Encoding
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from embedctl.http_limits import LimitedHttpToolsProtocol
from engine import Engine, EngineConfig, UserError
from engine.batch import PackedBatch
from engine.errors import short_reason
from engine.scheduler import QueueFull, Scheduler, SchedulerClosed
from pipelines.similarity import pair_scores_of, similarity_of
from pipelines.tokenize import COUNT_CHARS, Encoded, TextTokenizer, more_tokens_than, resolve_prompt
from pipelines.tokenize_pool import TokenizerPool, check_processes, default_processes

log = logging.getLogger("embedctl.serve")

try:
    VERSION = importlib.metadata.version("embedctl")
except importlib.metadata.PackageNotFoundError:  # a checkout run in place, not installed (the GPU machine's)
    VERSION = "0+unknown"
T = TypeVar("T")


API_KEY_ENV = "EMBEDCTL_API_KEY"
DRAIN_SECONDS = 30  # how long Ctrl-C / SIGTERM waits for requests in flight before cutting them off
RETRY_AFTER_SECONDS = 1
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}  # on 429 and 503, as clients that retry read it
# Requests with at most this many characters are tokenized on the event loop: a short query takes
# about 20 us, less than the hop to the pool and back, which also costs the loop CPU of its own.
INLINE_CHARS = 512
WARMUP_RUNS = 3  # a CUDA graph bucket runs eagerly on its first hit, is captured on the second, replays after
TOKENIZER_THREADS = min(8, os.cpu_count() or 1)
# Requests with at least this many texts are tokenized in the worker processes, when there are any: a
# few texts cost less than the trip through the pipe. Such a request is split into a chunk per worker,
# none under half this many texts, so that its texts are tokenized side by side.
WORKER_TEXTS = 16
HEALTH_PATHS = ("/health", "/ping")  # /ping: SageMaker's health check, which TEI answers too
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/openapi.json")
# Answered without a key: health checks (load balancers, SageMaker) send none, and a browser opening /docs sends
# none either (its Authorize button then takes the key for the requests tried from the page). GET / is TEI's
# health check too, and the default probe of some load balancers; POST / is the model's task and needs the key.
OPEN_PATHS = frozenset({*HEALTH_PATHS, *DOCS_PATHS})
OPEN_GETS = frozenset({*OPEN_PATHS, "/"})
EMBEDDINGS_PATHS = ("/v1/embeddings", "/embeddings")  # OpenAI's, and the same without /v1, as TEI serves it
# TEI's, then Cohere's and Jina's (their clients, and LiteLLM's, post to /v1/rerank; Cohere's v2 client to /v2/rerank)
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
MODELS_PATHS = ("/v1/models", "/models")  # OpenAI's, and the same without /v1, as /embeddings is
TASK_PATHS = ("/", "/invocations")  # the model's own task, as TEI routes it; /invocations is SageMaker's
# How alike (difflib's ratio) an unknown field's name and an endpoint's field must be for the one to be taken
# for a misspelling of the other: normalise/normalize 0.89, truncation/truncate 0.78, top_k/top_n 0.8, but
# options and parameters (Hugging Face's Inference API) close to none.
MISSPELT_CUTOFF = 0.75
# Routes of TEI's API, which answer errors in its shape and with its statuses; the others answer in OpenAI's.
TEI_PATHS = frozenset({*TASK_PATHS, *HEALTH_PATHS, "/embed", "/rerank", "/similarity", "/tokenize", "/decode", "/info"})
ENDPOINTS = (*EMBEDDINGS_PATHS, "/embed", *RERANK_PATHS, "/similarity", *TASK_PATHS, "/tokenize", "/decode", "/info",
             *HEALTH_PATHS, "/metrics", *MODELS_PATHS, "/docs", "/openapi.json")
# Seconds: from a short query on a GPU to a request of thousands of texts on a CPU, which takes a minute
LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(1 << n) for n in range(4, 17))  # 16 ... 65,536 tokens per engine batch
# OpenAI's error types: invalid_request_error for a request it refuses, a wrong key (code invalid_api_key) and an
# unknown model (code model_not_found) included; "requests" for a rate limit (code rate_limit_exceeded); server_error
# for its own failures. Clients that branch on them find them where OpenAI puts them.
OPENAI_ERROR_TYPES = {429: "requests", 500: "server_error", 503: "server_error"}
OPENAI_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}
# OpenAI's API has neither 422 nor 424: it answers any invalid request with 400 and its own failure with 500.
OPENAI_STATUS = {422: 400, 424: 500}
TeiErrorType = Literal["Validation", "Empty", "Overloaded", "Backend", "Unhealthy"]
# TEI's error_type for a status that has one of its own (an engine failure is TEI's 424; anything else that
# fails, 500, is a Backend error too); any other refusal is a "Validation", TEI's name for a request it will not
# serve as sent.
TEI_ERROR_TYPES: dict[int, TeiErrorType] = {424: "Backend", 429: "Overloaded", 500: "Backend", 503: "Unhealthy"}
TEI_POOLING = {"last": "last_token"}  # TEI's names for pooling modes, where they differ from embedctl's
# What each refusal means, as /openapi.json describes it.
REFUSALS = {
    400: "Malformed JSON, or an empty input; on /v1/embeddings, any invalid request, and more inputs than "
         "--max-client-batch (as OpenAI answers more than 2,048)",
    401: "A missing or wrong API key (with --api-key)",
    404: "No such model (a request's `model` naming another: code model_not_found, as OpenAI answers it)",
    408: "The request body did not arrive whole within a minute",
    413: "More inputs than --max-client-batch (on /v1/embeddings: 400), a body larger than --max-request-bytes, or "
         "more tokens than /tokenize answers at once",
    415: "A body declared as anything but JSON, or compressed",
    422: "An invalid request: a wrong type, an unknown field, a token id outside the vocabulary, an input longer "
         "than the max length with truncate: false",
    424: "The engine failed on the request",
    429: "The queue is full (--max-queue); retry after Retry-After",
    500: "The server failed on the request (on /v1/embeddings, the engine too)",
    503: "The server is shutting down; retry after Retry-After",
}
NOT_READY = ("Not ready: the model is warming up or the engine fails (retry after Retry-After; see the server log), "
             "or its warm-up failed (no Retry-After: only a restart helps)")
CUT_OFF = "the server is shutting down and cut this request off; send it again"
CLIENT_GONE = 499  # the metrics' status for a request whose client disconnected before its reply
# Requests with bodies this large are watched for their client going away while they run, so that an
# abandoned one stops holding the queue; for smaller ones (a query: milliseconds) the watch would cost
# more than it saves, and their client's leaving is only noticed when the reply is ready (_gone).
WATCH_BYTES = 16 << 10
# Seconds a request's body may take to arrive before it is refused with a 408: a client that stalls mid-body
# would otherwise hold its connection, and a shutdown's drain, for ever. One deadline for the whole body, not
# one per part: asyncio.wait_for around each receive() cost 15.5 us a request on Python 3.11, one
# asyncio.timeout 4.7 (60 s takes a 4 MB body at 70 KB/s).
BODY_TIMEOUT_SECONDS = 60
# The most tokens /tokenize answers per request: each is an object of the reply (about 70 bytes of JSON and
# 500 of Python while it is built), so that 4 MB of text, 2M tokens, had the server at 2.3 GB.
TOKENIZE_MAX_TOKENS = 1 << 17
JSON_HEADER = (b"content-type", b"application/json")
BODY_PROBLEMS = ("missing", "model_type", "model_attributes_type", "dict_type")  # the body is no JSON object


@dataclass(frozen=True)
class ServeLimits:
    """Admission limits; every one is a flag of `embedctl serve`."""

    max_client_batch: int = 2048  # inputs per request (texts, token-id lists, or rerank texts): OpenAI's limit
    max_request_bytes: int = 4 << 20  # request body size
    max_queue: int = 8192  # sequences admitted and not yet answered, over all clients

    def __post_init__(self) -> None:
        for name in ("max_client_batch", "max_request_bytes", "max_queue"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        # A bi-encoder's /rerank queues its query beside its texts: one sequence more than the items counted.
        if self.max_client_batch >= self.max_queue:
            raise UserError(f"--max-queue {self.max_queue} must be larger than --max-client-batch {self.max_client_batch} "
                            "(a full-size /rerank queues its query too), or such a request could never be admitted; "
                            "raise --max-queue or lower --max-client-batch")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    limits: ServeLimits = ServeLimits()
    access_log: bool = False
    tokenizer_processes: int | None = None  # None: default_processes
    # Put before every text of /v1/embeddings and /embed, and before /rerank's query; None: the model's
    # document and query prompts, as index and score put them; "": none, as TEI.
    doc_prompt: str | None = None
    query_prompt: str | None = None
    cors_allow_origins: tuple[str, ...] = ()  # web pages (scheme://host[:port], or "*") whose scripts may call
    served_model_name: str | None = None  # the model's name in requests and replies; None: its path or hub id

    def __post_init__(self) -> None:
        check_processes(self.tokenizer_processes)
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise UserError("--served-model-name is empty; give the name clients send as model, or leave it out to "
                            "serve under the model's path")
        if self.api_key is not None and not self.api_key.strip():
            # An unset variable in `--api-key "$KEY"` must not serve without authentication.
            raise UserError("--api-key (or EMBEDCTL_API_KEY) is empty; give the key clients must send, or leave both "
                            "out to serve without one")


class ApiError(HTTPException):
    """A request the server refuses; detail is the whole message, naming the problem and the fix.

    error_type is TEI's kind of error, which TEI's routes answer beside the message (by default the
    one TEI gives an error of this status); an empty input is TEI's "Empty", with status 400.
    param is the request field the refusal is about (input, input[1], dimensions), which OpenAI's error
    names as its param; None when it is about no one field.
    """

    def __init__(self, status_code: int, detail: str, headers: dict[str, str] | None = None,
                 error_type: TeiErrorType | None = None, openai_status: int | None = None,
                 openai_code: str | None = None, param: str | None = None) -> None:
        super().__init__(status_code, detail, headers)
        self.error_type = error_type or TEI_ERROR_TYPES.get(status_code, "Validation")
        # OpenAI's routes answer with its status for this refusal where it differs (OPENAI_STATUS by default),
        # and its error code where it gives one.
        self.openai_status = openai_status or OPENAI_STATUS.get(status_code, status_code)
        self.openai_code = openai_code
        self.param = param


class _FieldError(ValueError):
    """A check of a whole request body that finds one field at fault: pydantic gives such a check's error no
    location, so the field travels here, to be the OpenAI error's param (_param_of)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Requests and replies. Fields are strict (no "yes" for true, no "5" for 5). OpenAI's route refuses
# unknown fields, as OpenAI does; TEI's routes ignore them, as TEI does, but for near-misses of their own.

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _TeiRequest(BaseModel):
    """A request to one of TEI's routes. A field the endpoint does not have is ignored, as TEI ignores it
    (clients of Hugging Face's Inference API send `parameters` and `options`), unless its name is close to one
    the endpoint has: a misspelt option (normalise, top_k, text) is refused rather than silently not applied."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_near_misses(cls, data: Any) -> Any:
        # Before the fields are checked, so that a misspelt required field (OpenAI's `input` on /embed) is named.
        # TEI's fields of its other endpoints (add_special_tokens on /decode) are TEI's to ignore, not typos.
        if isinstance(data, dict):
            for name in data:
                if name in cls.model_fields or name in TEI_FIELDS:
                    continue
                close = difflib.get_close_matches(name, cls.model_fields, n=1, cutoff=MISSPELT_CUTOFF)
                if close:
                    raise _FieldError(name, f"{name}: is not a field of this endpoint; did you mean {close[0]}?")
        return data


class EmbeddingsRequest(_Strict):
    input: Union[str, list[str], list[int], list[list[int]]] = Field(
        description="A text, a list of texts, one token-id list, or a list of token-id lists (the model's own ids, "
                    "special tokens included)")
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: int | None = Field(default=None, ge=1, description="Keep the first N components (Matryoshka)")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        return _texts_or_token_ids(value)


class _Prompted(_TeiRequest):
    """TEI's prompt option: /embed's and /tokenize's."""

    prompt_name: str | None = Field(default=None, description="A prompt of the model's sentence-transformers "
                                    "config to put before every input (default: its document prompt, as index uses)")


class EmbedRequest(_Prompted):
    inputs: Union[str, list[str], list[int], list[list[int]], list[Union[str, list[int]]]] = Field(
        description="A text, a list of texts, one token-id list, a list of token-id lists (the model's own ids, "
                    "special tokens included, which get no prompt), or a list of texts and token-id lists")
    normalize: bool = True
    truncate: bool | None = Field(default=None, description="null or true: cut over-long inputs; false: refuse them")
    truncation_direction: Literal["right", "Right", "left", "Left"] = Field(
        default="right", description="Where an over-long text is cut: right keeps its start, left its end")
    dimensions: int | None = Field(default=None, ge=1)

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_shape(cls, value: Any) -> Any:
        # as TEI's: a batch may hold texts and token-id lists side by side
        if isinstance(value, str) or _token_ids(value) or (
                isinstance(value, list) and all(isinstance(item, str) or _list_of(item, int) for item in value)):
            return value
        raise ValueError("must be a string, a list of token ids, or a list of texts and token-id lists")


class TokenizeRequest(_Prompted):
    inputs: Union[str, list[str]]
    add_special_tokens: bool = True

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_shape(cls, value: Any) -> Any:
        # one message instead of pydantic's per-branch ones ("inputs.str: ...; inputs.list[str].0: ...")
        if isinstance(value, str) or _list_of(value, str):
            return value
        hint = " (token ids go to POST /decode, which gives their text)" if _list_of(value, int) else ""
        raise ValueError(f"must be a string or a list of strings{hint}")


class DecodeRequest(_TeiRequest):
    ids: Union[list[int], list[list[int]]] = Field(description="One token-id list, or a list of them")
    skip_special_tokens: bool = True

    @field_validator("ids", mode="before")
    @classmethod
    def _ids_shape(cls, value: Any) -> Any:
        if _token_ids(value):
            return value
        raise ValueError("must be a list of token ids or a list of token-id lists")


class RerankDocument(BaseModel):
    """A document as Cohere's v1 and Jina's APIs also take one."""

    text: str


class RerankRequest(_TeiRequest):
    query: str
    texts: list[str] | None = Field(default=None, description="Documents; the reply is TEI's list of {index, score}")
    documents: list[str | RerankDocument] | None = Field(
        default=None, description="Documents, as texts or {text} objects; the reply is Cohere's {results: [...]}")
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    return_text: bool = Field(default=False, description="TEI's name for return_documents")
    raw_scores: bool = Field(default=False, description="TEI's field: a cross-encoder's logits instead of their "
                                                         "sigmoid; a bi-encoder's similarities are raw already")
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _documents_shape(cls, data: Any) -> Any:
        # One message for a document of neither form, instead of pydantic's one per branch of the union, which
        # named the branches by their Python types (documents.0.RerankDocument.text).
        documents = data.get("documents") if isinstance(data, dict) else None
        for i, document in enumerate(documents if isinstance(documents, list) else ()):
            if not (isinstance(document, str) or isinstance(document, dict) and isinstance(document.get("text"), str)):
                raise _FieldError(f"documents[{i}]", f'documents[{i}]: must be a text or an object {{"text": text}}')
        return data

    @model_validator(mode="after")
    def _one_list(self) -> RerankRequest:
        if (self.texts is None) == (self.documents is None):
            raise ValueError("send the documents as either `texts` or `documents`, exactly one of them")
        return self


class SimilarityInputs(_TeiRequest):
    source_sentence: str = Field(description="The text the others are compared with")
    sentences: list[str] = Field(description="The texts to compare with it; the reply has a score for each, in order")


class SimilarityParameters(_TeiRequest):
    truncate: bool | None = Field(default=None, description="null or true: cut over-long texts; false: refuse them")
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"
    prompt_name: str | None = Field(default=None, description="A prompt of the model's sentence-transformers config "
                                    "to put before every text (default: its document prompt, as /embed puts)")


class SimilarityRequest(_TeiRequest):
    """TEI's /similarity request: its options go in `parameters`, as TEI (and Hugging Face's sentence-similarity
    task) reads them."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_shape(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return value
        raise ValueError('must be an object {"source_sentence": text, "sentences": [texts to compare with it]}')

    @model_validator(mode="before")
    @classmethod
    def _options_in_parameters(cls, data: Any) -> Any:
        # An option beside `inputs` is one TEI ignores: refused, as a misspelt one is, rather than silently not applied.
        if isinstance(data, dict):
            for name in data:
                close = difflib.get_close_matches(name, SimilarityParameters.model_fields, n=1, cutoff=MISSPELT_CUTOFF)
                if close:
                    raise _FieldError(name, f"{name}: goes inside parameters on this endpoint, as TEI reads it: "
                                            f'{{"parameters": {{"{close[0]}": ...}}}}')
        return data


TEI_FIELDS = frozenset().union(*(model.model_fields for model in (EmbedRequest, TokenizeRequest, DecodeRequest,
                                                                    RerankRequest, SimilarityRequest)))


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class RankedText(BaseModel):
    index: int
    score: float
    text: str | None = None


EMBED_REPLY = list[list[float]]
RERANK_REPLY = Union[list[RankedText], dict[str, Any]]


class Token(BaseModel):
    id: int
    text: str = Field(description="The token's part of the input; a special token's own text")
    special: bool
    start: int | None = Field(description="Offset of the token's first byte in the UTF-8 input with its prompt, "
                                          "as TEI counts; null for a special token")
    stop: int | None = Field(description="Offset past its last byte; null for a special token")


class Pooling(BaseModel):
    pooling: str


class EmbeddingModel(BaseModel):
    embedding: Pooling


class Labels(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class RerankerModel(BaseModel):
    reranker: Labels


class Info(BaseModel):
    """TEI's GET /info."""

    model_id: str
    model_sha: str | None = Field(description="Always null: embedctl loads no particular revision")
    model_dtype: str
    served_model_name: str
    model_type: Union[EmbeddingModel, RerankerModel]
    max_concurrent_requests: int = Field(description="Sequences admitted and not yet answered (--max-queue)")
    max_input_length: int = Field(description="Tokens per input; longer ones are cut, or refused with truncate: false")
    max_batch_tokens: int
    max_batch_requests: int | None = Field(description="Sequences per engine batch (--max-seqs)")
    max_client_batch_size: int = Field(description="Inputs per request (--max-client-batch)")
    auto_truncate: bool = Field(description="Whether an input with truncate: null is cut (as it always is here)")
    tokenization_workers: int = Field(description="Threads and worker processes that tokenize requests")
    version: str
    sha: str | None = Field(default=None, description="TEI's build commit; always null here")
    docker_label: str | None = Field(default=None, description="TEI's image label; always null here")


class Health(BaseModel):
    """GET /health's, /ping's and /'s reply once the model is warmed up."""

    status: Literal["ok"] = "ok"


class TeiError(BaseModel):
    """TEI's error shape, which its routes answer."""

    error: str
    error_type: TeiErrorType


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error shape, which every route outside TEI's answers."""

    error: OpenAIErrorDetail


def _list_of(value: Any, kind: type) -> bool:
    # bool is an int subclass; true/false are never token ids
    return isinstance(value, list) and all(isinstance(item, kind) and not isinstance(item, bool) for item in value)


def _token_ids(value: Any) -> bool:
    """Whether value is one token-id list or a list of them."""
    return _list_of(value, int) or (isinstance(value, list) and all(_list_of(item, int) for item in value))


def _texts_or_token_ids(value: Any) -> Any:
    """Inputs as the OpenAI API takes them; else one message, instead of pydantic's one per branch."""
    if isinstance(value, str) or _list_of(value, str) or _token_ids(value):
        return value
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _encoded(rows: list[tuple[np.ndarray, bool]]) -> Encoded:
    """(ids, truncated) of each input as one Encoded."""
    return Encoded(ids=[ids for ids, _ in rows], truncated=[truncated for _, truncated in rows])


def _id_lists(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """One token-id list, or a list of them, as a list of them."""
    return [ids] if ids and isinstance(ids[0], int) else ids


def create_app(engine: Engine, tokenizer: TextTokenizer, limits: ServeLimits = ServeLimits(),
               api_key: str | None = None, normalize: bool | None = None,
               tokenizer_processes: int | None = None, prompts: Mapping[str, str | None] | None = None,
               served_model_name: str | None = None) -> _Front:
    """The HTTP app over a loaded engine. Serving it (uvicorn) starts the scheduler and the warm-up.

    engine must be loaded with normalize=False: vectors are normalised per request here.
    normalize is what /v1/embeddings does (None: as the model's sentence-transformers files say).
    tokenizer_processes: worker processes for large requests (None: default_processes for the device).
    prompts: the text put before documents and queries, by role ("document", "query"); a role left out or
    None takes the model's prompt for it.
    served_model_name: the name requests give as model and replies carry (None: the model's path or hub id).
    """
    if engine.normalize:
        raise UserError("create_app needs an engine loaded with normalize=False; the server normalises per request")
    if engine.num_labels > 1:
        raise UserError(f"{engine.files.name} is a cross-encoder with {engine.num_labels} labels; "
                        "serve an embedding model or a one-score cross-encoder")
    if tokenizer_processes is None:
        tokenizer_processes = default_processes(engine.device.type == "cuda")
    service = _Service(engine, tokenizer, limits, engine.files.normalize if normalize is None else normalize,
                       tokenizer_processes, prompts or {}, served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.start(asyncio.get_running_loop())
        warm_up = asyncio.create_task(service.warm_up())
        yield
        warm_up.cancel()
        await asyncio.get_running_loop().run_in_executor(None, service.stop)

    # redirect_slashes off: POST /embed/ got a bodiless 307 that clients do not follow; now a JSON 404.
    app = FastAPI(title="embedctl", version=VERSION, lifespan=lifespan, redirect_slashes=False,
                  # not the model's name, which may be a local path: /docs needs no key (GET /info names it)
                  description="Embeddings and ranking with one model (GET /info names it).")
    app.add_exception_handler(HTTPException, _http_error)
    inference_errors = _error_responses(TeiError, 400, 401, 404, 408, 413, 415, 422, 424, 429, 500, 503)
    tokenizer_errors = _error_responses(TeiError, 400, 401, 408, 413, 415, 422, 500)

    # _Front serves the POST endpoints; FastAPI only describes them in /docs and answers 405 to other methods.
    async def embeddings(body: EmbeddingsRequest) -> None:
        """OpenAI-compatible embeddings. Over-long inputs are truncated to the model's max length."""

    openai_errors = _error_responses(OpenAIError, 400, 401, 404, 408, 413, 415, 429, 500, 503)
    for path in EMBEDDINGS_PATHS:
        app.add_api_route(path, embeddings, methods=["POST"], response_model=EmbeddingsResponse, responses=openai_errors)

    @app.post("/embed", response_model=EMBED_REPLY, responses=inference_errors)
    async def embed(body: EmbedRequest) -> None:
        """text-embeddings-inference-compatible embeddings: one vector per input, in order."""

    @app.post("/similarity", response_model=list[float], responses=inference_errors)
    async def similarity(body: SimilarityRequest) -> None:
        """TEI's sentence similarity: the cosine of each sentence's vector with the source sentence's, in order."""

    async def rerank(body: RerankRequest) -> None:
        """Documents sorted by relevance to the query, best first (ties in input order)."""

    for path in RERANK_PATHS:
        app.add_api_route(path, rerank, methods=["POST"], response_model=RERANK_REPLY,
                          responses=inference_errors if path in TEI_PATHS else openai_errors)

    # As TEI routes it: POST / (and SageMaker's /invocations) is the model's own task, ranking for a
    # cross-encoder, else vectors.
    main_task = "/rerank" if engine.num_labels else "/embed"
    stub, reply = {"/embed": (embed, EMBED_REPLY), "/rerank": (rerank, RERANK_REPLY)}[main_task]
    for path in TASK_PATHS:
        app.add_api_route(path, stub, methods=["POST"], response_model=reply, responses=inference_errors,
                          summary=f"The model's own task: POST {main_task}")

    @app.post("/tokenize", response_model=list[list[Token]], responses=tokenizer_errors)
    async def tokenize(body: TokenizeRequest) -> None:
        """The tokens /embed embeds for each input, with its prompt in front, not truncated."""

    @app.post("/decode", response_model=list[str], responses=tokenizer_errors)
    async def decode(body: DecodeRequest) -> None:
        """The text of each token-id list (a list of one text for one list)."""

    @app.get("/info", response_model=Info, responses=_error_responses(TeiError, 401))
    async def info() -> Info:
        """TEI's description of the model and of this server's limits."""
        return service.info()

    async def health() -> Health:
        """200 once the model is warmed up; 503 before, when the warm-up failed, or while the engine fails (TEI's
        error shape)."""
        if service.warm_error is not None:
            # No Retry-After: the warm-up is not run again, so this server answers 503 until it is restarted.
            raise ApiError(503, f"the warm-up failed: {service.warm_error}")
        if not service.ready:
            raise ApiError(503, f"the model is warming up; retry after {RETRY_AFTER_SECONDS} s", headers=RETRY_AFTER)
        if not await service.healthy():
            # Retry-After: each check runs a text through the engine again, and answers 200 once one goes through.
            raise ApiError(503, f"the engine fails ({service.engine_failure}); see the server log; retry after "
                                f"{RETRY_AFTER_SECONDS} s", headers=RETRY_AFTER)
        return Health()

    for path in (*HEALTH_PATHS, "/"):
        app.add_api_route(path, health, methods=["GET"], response_model=Health, include_in_schema=path != "/",
                          responses={**_error_responses(TeiError), 503: {"model": TeiError, "description": NOT_READY}})

    @app.get("/metrics", responses=_error_responses(OpenAIError, 401))
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(service.metrics.render(service), media_type="text/plain; version=0.0.4")

    def described() -> dict:
        return {"id": service.name, "object": "model", "created": service.started, "owned_by": "embedctl"}

    async def models() -> dict:
        return {"object": "list", "data": [described()]}

    async def model(model: str) -> dict:
        """The served model, by its name or its last path part (what openai's models.retrieve asks for)."""
        if model not in service.names:
            raise ApiError(404, f"no model {model!r} here; this server serves {service.name!r} (see GET /v1/models)",
                           openai_code="model_not_found")
        return described()

    for path in MODELS_PATHS:
        app.add_api_route(path, models, methods=["GET"], responses=_error_responses(OpenAIError, 401))
        app.add_api_route(path + "/{model:path}", model, methods=["GET"], responses=_error_responses(OpenAIError, 401, 404))

    # Every GET answers HEAD too, as TEI's routes do: load balancers and uptime checks often probe with HEAD.
    for route in [route for route in app.routes if isinstance(route, APIRoute) and route.methods == {"GET"}]:
        app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False)

    routes: dict[str, tuple[type[BaseModel], Handler]] = {
        "/embed": (EmbedRequest, service.embed), "/similarity": (SimilarityRequest, service.sentence_similarity),
        "/tokenize": (TokenizeRequest, service.tokens), "/decode": (DecodeRequest, service.decode)}
    routes |= dict.fromkeys(RERANK_PATHS, (RerankRequest, service.rerank))
    routes |= dict.fromkeys(TASK_PATHS, routes[main_task])
    routes |= dict.fromkeys(EMBEDDINGS_PATHS, (EmbeddingsRequest, service.embeddings))
    return _Front(app, routes, api_key, limits.max_request_bytes, service.metrics,
                  close=functools.partial(service.stop, force=True))


def serve(model: str | None, config: EngineConfig, options: ServeOptions) -> None:
    """Load the model, bind, and serve until Ctrl-C or SIGTERM, which drain requests in flight first."""
    try:  # before loading the model, so a taken port fails at once
        sock = _bind(options.host, options.port)
    except (OSError, OverflowError) as error:  # OverflowError: a port past 65535
        reason = getattr(error, "strerror", None) or str(error)
        raise UserError(f"cannot listen on {options.host}:{options.port} ({reason}); "
                        "pick another --port or --host") from None
    logging.config.dictConfig(log_config())  # now, not once uvicorn.Config exists: the lines of the load need it
    server_log = logging.getLogger("uvicorn.error")  # where uvicorn's own start-up lines go
    capture = config.warmup and config.cuda_graphs and config.torch_device().type == "cuda"
    shown_host = f"[{options.host}]" if ":" in options.host else options.host  # an IPv6 address, as a URL writes it
    server_log.info("%s:%d is held; loading the model%s; it listens once that is done", shown_host,
                    sock.getsockname()[1], " and capturing its CUDA graphs (--no-warmup starts sooner)" if capture else "")
    engine = Engine.load(model, replace(config, normalize=False))
    tokenizer = TextTokenizer(engine.files.tokenizer_file, engine.max_length)
    app = create_app(engine, tokenizer, options.limits, options.api_key, config.normalize, options.tokenizer_processes,
                     {"document": options.doc_prompt, "query": options.query_prompt}, options.served_model_name)
    server = uvicorn.Server(uvicorn.Config(with_cors(app, options.cors_allow_origins), access_log=options.access_log,
                                           log_config=log_config(), timeout_graceful_shutdown=DRAIN_SECONDS,
                                           use_colors=log_colors(), http=LimitedHttpToolsProtocol))
    server_log.info("embedctl serve: %s%s on %s, dim %d, max length %d, at http://%s:%d (docs at /docs)",
                    engine.files.name, f" as {options.served_model_name!r}" if options.served_model_name else "",
                    engine.device, engine.dim, engine.max_length, shown_host, sock.getsockname()[1])
    if engine.stats.captures:
        server_log.info("warm-up: %d CUDA graphs captured in %.1f s, one per shape of batch whose sequences are at most "
                        "512 tokens, so that such requests never wait for a capture", engine.stats.captures,
                        engine.stats.capture_seconds)
    _freeze_startup_objects()
    try:
        try:  # here, not left to uvicorn (uvloop drops a failed listen without a word): two servers started at
            # once both bind a port with SO_REUSEADDR, and the second to listen is the one to fail
            sock.listen(server.config.backlog)
        except OSError as error:
            raise UserError(f"cannot listen on {options.host}:{options.port} ({error.strerror}): another server took "
                            "it while the model loaded; pick another --port") from None
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has drained: a clean stop, exit 0
        pass
    finally:
        # A second Ctrl-C quits without the app's shutdown; its scheduler thread, still inside a step, and
        # its workers then met the interpreter's exit and aborted the process (SIGABRT).
        app.close()


def _freeze_startup_objects() -> None:
    """Leave what the model load made (some 200,000 objects: torch, the model, the web stack) out of the
    garbage collector's full passes, which otherwise walk them all while every request waits: a pass of
    256-478 ms while clients sent, in each of two runs of bench.serve_overhead on the 2-core development box,
    against about 1 ms with them frozen (bench/results/cpu-2026-12-07-serve-gc-freeze). They live as long as
    the server does, so nothing is lost by never collecting them. Only the command does this: an app made in
    a test's process must stay collectable with everything made before it."""
    gc.collect()  # the load's own garbage, once, rather than frozen
    gc.freeze()


def log_config() -> dict:
    """uvicorn's log set-up, with our own loggers writing through its handler, so that an engine failure is an
    ERROR: line like uvicorn's (Python's fallback handler printed it bare, and nothing below WARNING)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["default"]["use_colors"] = log_colors()
    for package in ("embedctl", "engine", "pipelines"):
        config["loggers"][package] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def log_colors() -> bool | None:
    """uvicorn's use_colors: never where NO_COLOR is set (no-color.org, as the progress bars of index and score
    follow it), else None: on a terminal only."""
    return False if os.environ.get("NO_COLOR") else None


def with_cors(app: _Front, origins: Sequence[str]) -> ASGIApp:
    """The app, or with origins, behind Starlette's CORS middleware, as TEI's --cors-allow-origin puts it: a
    browser's preflight (OPTIONS, which carries no key) is answered before the app's API key is asked for, and
    replies to those origins say that their scripts may read them."""
    if not origins:
        return app
    return CORSMiddleware(app, allow_origins=list(origins), allow_methods=["GET", "HEAD", "POST"], allow_headers=["*"],
                          expose_headers=["Retry-After"])


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host (a name, an IPv4 or an IPv6 address) and port, not yet listening: serve() listens on
    it once the model is loaded. "::" takes IPv4 too where it can; a name with IPv4 and IPv6 addresses
    (localhost) binds IPv4. The options are socket.create_server's, which would listen at once."""
    families = [info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)]
    family = socket.AF_INET if socket.AF_INET in families else families[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by the last run
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if socket.has_dualstack_ipv6() else 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _log_worker_death(pid: int, how: str) -> None:
    log.warning("tokenizer worker process %d %s; the requests it held failed, and this process tokenizes requests "
                "from now on", pid, how)


def _refusal(error: QueueFull | SchedulerClosed) -> ApiError:
    """The scheduler's refusal as the API's: 429 for a full queue, 503 while shutting down."""
    if isinstance(error, QueueFull):
        return ApiError(429, f"the server is busy: {error}; retry after {RETRY_AFTER_SECONDS} s", headers=RETRY_AFTER)
    return _shutting_down("the server is shutting down; retry against another instance")


def _shutting_down(message: str) -> ApiError:
    # Retry-After: a retry goes, through the load balancer, to another instance or to this one restarted; the
    # request itself was fine.
    return ApiError(503, message, headers=RETRY_AFTER)


class _Service:
    """What the endpoints share: the engine, the tokenizer pool, the scheduler, the metrics."""

    def __init__(self, engine: Engine, tokenizer: TextTokenizer, limits: ServeLimits, normalize: bool,
                 tokenizer_processes: int, prompts: Mapping[str, str | None], served_model_name: str | None) -> None:
        self.engine, self.tokenizer, self.limits, self.normalize = engine, tokenizer, limits, normalize
        self.tokenizer_processes = tokenizer_processes
        self.name = served_model_name or engine.files.name
        self.names = {self.name, Path(self.name).name}
        self.similarity = "cosine" if engine.num_labels else similarity_of(engine.files)  # a bi-encoder's, for /rerank
        # /tokenize shows whole inputs, as TEI's does; the tokenizer of /embed stops at the max length.
        self.untruncated = copy.deepcopy(tokenizer.tokenizer)
        self.untruncated.no_truncation()
        # By default what index and score put before documents and queries, so that the vectors agree with theirs.
        self.prompts = {role: resolve_prompt(engine.files, role, prompts.get(role), None) for role in ("document", "query")}
        self.started = int(time.time())
        self.metrics = _Metrics()
        self.scheduler: Scheduler | None = None
        self.stopped = False
        self.pool: ThreadPoolExecutor | None = None
        self.workers: TokenizerPool | None = None
        self.wakeups: _Wakeups | None = None
        self.ready = False
        self.warm_error: str | None = None
        # The last batch's engine error, until a batch goes through: /health then answers 503, as TEI's does, so
        # that a load balancer or an orchestrator's probe stops sending work to a device that fell over.
        self.engine_failure: str | None = None
        self.failure_logged: BaseException | None = None  # a failed batch's error, logged once for all its requests

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="embedctl-tokenize")
        self.workers = TokenizerPool(self.tokenizer, self.tokenizer_processes, on_death=_log_worker_death)
        self.wakeups = _Wakeups(loop)
        self.scheduler = Scheduler(self.engine, self.limits.max_queue, on_batch=self.metrics.observe_batch)

    def stop(self, force: bool = False) -> None:
        """Stop the scheduler thread, the tokenizer workers and threads, once; before they were started, nothing.
        force (a forced quit): requests not yet in a batch are dropped instead of answered."""
        if self.scheduler is None or self.stopped:
            return
        self.stopped = True
        self.scheduler.close(drop_waiting=force)
        self.workers.close()  # first: it ends a warm-up still waiting in the pool for the workers
        self.pool.shutdown(cancel_futures=force)

    async def warm_up(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, self.workers.wait_for_workers)
            for _ in range(WARMUP_RUNS):
                await self.run_texts(["warm up"], "input", truncate=True)
        except Exception as error:  # noqa: BLE001 - reported by /health instead of killing the server
            log.exception("warm-up failed")
            self.warm_error = short_reason(error)
            return
        self.ready = True

    # The endpoints: a validated request in, the reply's JSON bytes out, or an ApiError.

    async def embeddings(self, body: EmbeddingsRequest) -> bytes:
        self.check_model(body.model)
        self.check_vectors(body.dimensions)
        vectors, tokens = await self.run_input(body.input)
        vectors = self.finish(vectors, body.dimensions, self.normalize)
        if body.encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
            rows: Sequence[Any] = [base64.b64encode(row).decode() for row in vectors.astype("<f4", copy=False)]
        else:
            rows = vectors
        return _dumps({"object": "list",
                       "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
                       "model": self.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def embed(self, body: EmbedRequest) -> bytes:
        self.check_vectors(body.dimensions)
        truncate, from_left = body.truncate is not False, body.truncation_direction.lower() == "left"
        inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if all(isinstance(item, str) for item in inputs):
            vectors, _ = await self.run_texts(inputs, "inputs", truncate, self.prompt(body.prompt_name), from_left)
        elif body.prompt_name is not None:
            raise ApiError(422, "prompt_name applies to texts, not token ids; put the prompt's ids in front of "
                                "each list, or send texts", param="prompt_name")
        elif from_left:
            raise ApiError(422, "truncation_direction left applies to texts, not token ids; cut the lists to the "
                                f"model's max length of {self.engine.max_length} yourself, or send texts",
                           param="truncation_direction")
        elif any(isinstance(item, str) for item in inputs):
            vectors = await self.run_mixed(inputs, "inputs", truncate, self.prompt(None))
        else:
            vectors, _ = await self.run_ids(_id_lists(body.inputs), "inputs", truncate)
        return _dumps(self.finish(vectors, body.dimensions, body.normalize))

    async def rerank(self, body: RerankRequest) -> bytes:
        self.check_model(body.model)
        cohere = body.documents is not None
        texts = [document if isinstance(document, str) else document.text for document in body.documents] if cohere \
            else body.texts
        field, from_left = "documents" if cohere else "texts", body.truncation_direction.lower() == "left"
        scores, tokens = await self.scores(body.query, texts, body.truncate is not False, field, from_left,
                                           body.raw_scores)
        order = np.argsort(-scores, kind="stable")[: body.top_n]
        with_text = body.return_documents or body.return_text
        if cohere:
            results = [{"index": int(i), "relevance_score": float(scores[i]),
                        **({"document": {"text": texts[i]}} if with_text else {})} for i in order]
            return _dumps({"model": self.name, "results": results, "usage": {"total_tokens": tokens}})
        return _dumps([{"index": int(i), "score": float(scores[i]), **({"text": texts[i]} if with_text else {})}
                       for i in order])

    async def sentence_similarity(self, body: SimilarityRequest) -> bytes:
        """TEI's /similarity: the cosine of each sentence's vector with the source sentence's, in order, as TEI's
        is cosine whatever similarity the model names (/rerank's); every text gets the same prompt, as on /embed."""
        self.check_vectors(None)
        options = body.parameters or SimilarityParameters()
        prompt = self.prompt(options.prompt_name)
        scores, _ = await self.similarities(
            body.inputs.source_sentence, body.inputs.sentences, "cosine", options.truncate is not False,
            ("inputs.source_sentence", "inputs.sentences"), (prompt, prompt),
            options.truncation_direction.lower() == "left")
        return _dumps(scores)

    async def tokens(self, body: TokenizeRequest) -> bytes:
        """/tokenize: the tokens /embed would embed for each input, past the max length too."""
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        self.check_texts(texts, "inputs")
        prompt = self.prompt(body.prompt_name)

        def token_lists(prompted: list[str]) -> list[list[dict[str, Any]]]:
            too_many = ApiError(413, f"inputs hold more than {TOKENIZE_MAX_TOKENS:,} tokens, the most /tokenize answers "
                                     "per request; send less text per request", param="inputs")
            # A long request is counted first, in pieces: tokenized whole, 4 MB of text took 1.2 GB and 15 s of a
            # tokenizer thread before its refusal, and the memory stayed with the process.
            if sum(map(len, prompted)) > COUNT_CHARS and more_tokens_than(
                    self.untruncated, prompted, TOKENIZE_MAX_TOKENS, self.tokenizer.cuts_at_spaces,
                    body.add_special_tokens):
                raise too_many
            encodings = self.untruncated.encode_batch(prompted, add_special_tokens=body.add_special_tokens)
            if sum(len(encoding.ids) for encoding in encodings) > TOKENIZE_MAX_TOKENS:
                raise too_many
            return [_tokens(encoding, text) for encoding, text in zip(encodings, prompted)]

        return _dumps(await self.tokenize(token_lists, [prompt + text for text in texts]))

    async def decode(self, body: DecodeRequest) -> bytes:
        sequences = _id_lists(body.ids)
        self.check_token_ids(sequences, "ids")
        return _dumps(await self.tokenize(functools.partial(self.tokenizer.tokenizer.decode_batch,
                                                            skip_special_tokens=body.skip_special_tokens), sequences))

    def info(self) -> Info:
        """GET /info's reply (FastAPI serves it)."""
        config, pooling = self.engine.files.config, self.engine.pooling
        if self.engine.num_labels:
            model_type: EmbeddingModel | RerankerModel = RerankerModel(reranker=Labels(
                id2label=config.get("id2label", {}), label2id=config.get("label2id", {})))
        else:
            model_type = EmbeddingModel(embedding=Pooling(pooling=TEI_POOLING.get(pooling, pooling)))
        return Info(model_id=self.engine.files.name, model_sha=None, model_dtype=str(self.engine.dtype).removeprefix("torch."),
                    served_model_name=self.name, model_type=model_type, max_concurrent_requests=self.limits.max_queue,
                    max_input_length=self.engine.max_length, max_batch_tokens=self.engine.max_batch_tokens,
                    max_batch_requests=self.engine.config.max_seqs, max_client_batch_size=self.limits.max_client_batch,
                    # truncate: null cuts, as under TEI's --auto-truncate; the threads and the worker
                    # processes tokenize requests side by side
                    auto_truncate=True, tokenization_workers=TOKENIZER_THREADS + self.tokenizer_processes,
                    version=VERSION)

    def prompt(self, name: str | None) -> str:
        """What goes before /embed's and /tokenize's inputs: the prompt of that name, else the document prompt."""
        if name is None:
            return self.prompts["document"]
        try:
            return resolve_prompt(self.engine.files, "document", None, name)
        except UserError as error:
            raise ApiError(422, f"prompt_name: {error}", param="prompt_name") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:  # 404 "model_not_found", as OpenAI answers
            raise ApiError(404, f"unknown model {model!r}; this server serves {self.name!r} (see GET /v1/models)",
                           openai_code="model_not_found", param="model")

    def check_vectors(self, dimensions: int | None) -> None:
        if self.engine.num_labels:
            raise ApiError(422, f"{self.name} is a cross-encoder: it scores query-document pairs and has no vectors; "
                                "call POST /rerank")
        if dimensions is not None and dimensions > self.engine.dim:
            raise ApiError(422, f"dimensions {_clipped(dimensions)} is more than the model's {self.engine.dim}; "
                                f"ask for at most {self.engine.dim}", param="dimensions")

    async def run_input(self, value: str | list[str] | list[int] | list[list[int]]) -> tuple[np.ndarray, int]:
        """OpenAI `input`'s rows and token count: texts are tokenized and truncated; token ids are checked
        and truncated."""
        if isinstance(value, str):
            value = [value]
        if value and isinstance(value[0], str):
            return await self.run_texts(value, "input", True, self.prompts["document"])
        return await self.run_ids(_id_lists(value), "input", True)

    async def run_ids(self, sequences: list[list[int]], field: str, truncate: bool) -> tuple[np.ndarray, int]:
        """Check the token-id lists; the rows and token count of each, cut at the max length as a text is."""
        self.check_token_ids(sequences, field)
        encoded = _encoded([self.cut(ids) for ids in sequences])
        self.check_encoded(encoded, field=field, truncate=truncate)
        return await self.rows(self.submit(encoded)), _token_count(encoded)

    async def run_texts(self, texts: Sequence[str], field: str, truncate: bool, prompt: str = "",
                        from_left: bool = False) -> tuple[np.ndarray, int]:
        """Check the texts; the rows and token count of each with the prompt in front of it, an over-long one
        losing its end (or with from_left its start)."""
        self.check_texts(texts, field)
        return await self.tokenize_and_run([prompt + text for text in texts] if prompt else texts,
                                           functools.partial(self.check_encoded, field=field, truncate=truncate),
                                           encode=self.tokenizer.encode_from_left if from_left else None)

    async def run_mixed(self, inputs: list[str | list[int]], field: str, truncate: bool, prompt: str) -> np.ndarray:
        """TEI's batch of texts and token-id lists side by side: a row for each in the request's order, the
        texts tokenized with the prompt in front, the lists checked and cut at the max length."""
        self.check_count(len(inputs), field)
        for i, item in enumerate(inputs):
            (self.check_text if isinstance(item, str) else self.check_ids)(item, f"{field}[{i}]")
        texts = await self.tokenize(self.tokenizer.encode, [prompt + item for item in inputs if isinstance(item, str)])
        tokenized = iter(zip(texts.ids, texts.truncated))
        encoded = _encoded([next(tokenized) if isinstance(item, str) else self.cut(item) for item in inputs])
        self.check_encoded(encoded, field=field, truncate=truncate)
        return await self.rows(self.submit(encoded))

    def cut(self, ids: list[int]) -> tuple[np.ndarray, bool]:
        """A token-id list cut at the max length as a text is, and whether it was."""
        return self.tokenizer.cut_ids(ids, self.engine.max_length), len(ids) > self.engine.max_length

    async def tokenize_and_run(self, texts: Sequence[str], check: Callable[[Encoded, int], None],
                               seconds: Sequence[str] | None = None,
                               encode: Callable[..., Encoded] | None = None) -> tuple[np.ndarray, int]:
        """The engine's rows for the texts, or for the pairs (texts[i], seconds[i]), and their token count.
        check(encoded, first) sees each tokenized part (first: the index of its first text) before it is queued.
        encode: another tokenization than TextTokenizer.encode / encode_pairs (encode_from_left), in this
        process's thread pool, for requests rare enough not to need the workers.

        A request of many texts is spread over the worker processes when there are workers, else
        tokenized as tokenize() decides. A spread request's parts join the engine's queue one by one as
        they come back, in order, so the device embeds the first while the workers finish the others
        (bench/results/gpu-2026-12-01-run96-serve-parts-ab, 4 processes x 100 documents in two interleaved
        rounds: 6.51 / 6.26M tok/s against 6.41 / 5.69M when the parts were joined first; two parts per
        worker instead of one lost, 5.81 / 4.44M).
        The queue must have room for the whole request before the first part is queued; a part refused
        all the same (check, or a queue that other requests filled meanwhile) fails the request, and
        the parts queued before it are cancelled (those already in a batch run, unread).
        """
        if encode is not None or len(texts) < WORKER_TEXTS or not self.workers.in_workers:
            inputs = (texts,) if seconds is None else (texts, seconds)
            if encode is not None:  # in the pool always: its first call copies the whole tokenizer
                encoded = await asyncio.get_running_loop().run_in_executor(self.pool, encode, *inputs)
            else:
                encode = self.tokenizer.encode if seconds is None else self.tokenizer.encode_pairs
                encoded = await self.tokenize(encode, *inputs)
            check(encoded, 0)
            return await self.rows(self.submit(encoded)), _token_count(encoded)
        try:
            self.scheduler.check_room(len(texts))
        except (QueueFull, SchedulerClosed) as error:
            raise _refusal(error) from None
        parts = [asyncio.wrap_future(part) for part in self.workers.submit_spread(texts, WORKER_TEXTS // 2, seconds)]
        queued: list[asyncio.Future] = []
        first = tokens = 0
        try:
            for part in parts:
                encoded = await part
                check(encoded, first)
                queued.append(self.submit(encoded))
                first, tokens = first + len(encoded.ids), tokens + _token_count(encoded)
            return np.concatenate([await self.rows(future) for future in queued]), tokens
        finally:
            for future in (*parts, *queued):  # done ones are left as they are
                future.cancel()

    async def tokenize(self, work: Callable[..., T], *inputs: Sequence[Sized]) -> T:
        """work(*inputs) on the loop when the inputs (texts, or token-id lists) are short and the engine
        is idle, else in the pool.

        The tokenizer releases the GIL while it works; a busy scheduler thread takes it, and the loop
        then waits to get it back for longer than the hop to the pool would have cost.
        """
        if self.scheduler.stats.depth == 0 and sum(len(item) for group in inputs for item in group) <= INLINE_CHARS:
            return work(*inputs)
        return await asyncio.get_running_loop().run_in_executor(self.pool, work, *inputs)

    def check_texts(self, texts: Sequence[str], field: str) -> None:
        self.check_count(len(texts), field)
        for i, text in enumerate(texts):
            self.check_text(text, f"{field}[{i}]")

    def check_token_ids(self, sequences: list[list[int]], field: str) -> None:
        self.check_count(len(sequences), field)
        for i, ids in enumerate(sequences):
            self.check_ids(ids, f"{field}[{i}]")

    @staticmethod
    def check_text(text: str, name: str) -> None:
        # The empty string alone, as OpenAI refuses it in a batch: a blank text is embedded, as TEI embeds it, and
        # clients that work around OpenAI's refusal send " " instead of "".
        if not text:
            raise _empty(f"{name} is an empty string; send at least one character", name)

    def check_ids(self, ids: list[int], name: str) -> None:
        if not ids:
            raise _empty(f"{name} is an empty token-id list; send at least one token id", name)
        if min(ids) < 0 or max(ids) >= self.engine.vocab_size:
            raise ApiError(422, f"{name} holds a token id outside the model's vocabulary "
                                f"0..{self.engine.vocab_size - 1}; send ids from this model's tokenizer", param=name)

    def check_count(self, count: int, field: str) -> None:
        if count == 0:
            raise _empty(f"{field} is empty; send at least one item", field)
        if count > self.limits.max_client_batch:
            # OpenAI refuses more than 2,048 inputs with 400, and clients split on it
            raise ApiError(413, f"{count} items in one request is more than this server's --max-client-batch "
                                f"{self.limits.max_client_batch}; split them over several requests",
                           openai_status=400, param=field)

    def check_encoded(self, encoded: Encoded, first: int = 0, *, field: str, truncate: bool,
                      paired: bool = False) -> None:
        """A 422 for the first sequence that is truncated when truncate is false, or that holds a token past
        the model's embedding table; `first` is the index of encoded's first. With paired, each sequence is
        the query with a text, too long together (either may be short alone)."""
        if not truncate and any(encoded.truncated):
            i = first + encoded.truncated.index(True)
            what, fix = (f"the query with {field}[{i}]", "shorten them") if paired else (f"{field}[{i}]", "shorten it")
            raise ApiError(422, f"{what} is longer than the model's max length of {self.engine.max_length} tokens "
                                f"and truncate is false; {fix} or send truncate: true",
                           param=None if paired else f"{field}[{i}]")
        if self.engine.ids_past_table:
            self.check_in_table(encoded, lambda i: f"{field}[{first + i}]")

    def check_in_table(self, encoded: Encoded, name: Callable[[int], str]) -> None:
        """A 422, not a failed batch that would fail other clients' requests with it, for a text holding a
        token that the tokenizer adds past the embedding table (Qwen3-Embedding-4B's <think>)."""
        named: list[str] = []  # past_table names the one text it refuses, which is the error's param too

        def name_of(i: int) -> str:
            named.append(name(i))
            return named[-1]

        if why := encoded.past_table(self.engine.vocab_size, name_of):
            raise ApiError(422, why, param=named[-1])

    async def scores(self, query: str, texts: Sequence[str], truncate: bool, field: str,
                     from_left: bool = False, raw: bool = False) -> tuple[np.ndarray, int]:
        """Relevance of each text to the query, and the tokens it took: cross-encoder scores (with raw, its
        logits) or the bi-encoder's similarities. An over-long input loses its end, or with from_left its start."""
        if not self.engine.num_labels:
            return await self.similarities(query, texts, self.similarity, truncate, ("query", field),
                                           (self.prompts["query"], self.prompts["document"]), from_left)
        self.check_text(query, "query")
        self.check_texts(texts, field)
        if self.engine.ids_past_table:  # named here: every pair holds the query
            self.check_in_table(self.tokenizer.encode([query]), lambda _: "query")
        check_pairs = functools.partial(self.check_encoded, field=field, truncate=truncate, paired=True)
        rows, tokens = await self.tokenize_and_run([query] * len(texts), check_pairs, texts,
                                                   self.tokenizer.encode_from_left if from_left else None)
        return rows[:, 0] if raw else self.engine.activate(rows[:, 0]), tokens

    async def similarities(self, query: str, texts: Sequence[str], similarity: str, truncate: bool,
                           names: tuple[str, str], prompts: tuple[str, str],
                           from_left: bool = False) -> tuple[np.ndarray, int]:
        """The named similarity (SIMILARITIES) of each text's vector to the query's, and the tokens they took.
        names: what errors call the query and the texts' field; prompts: what goes before the query and before
        each text. An over-long input loses its end, or with from_left its start."""
        query_name, field = names
        self.check_text(query, query_name)
        self.check_texts(texts, field)
        check_texts = functools.partial(self.check_encoded, field=field, truncate=truncate)

        def check_query_then_texts(encoded: Encoded, first: int) -> None:
            if first == 0:  # the query is text 0, so with truncate false a long query is named before any text
                if not truncate and encoded.truncated[0]:
                    raise ApiError(422, f"{query_name} is longer than the model's max length of "
                                        f"{self.engine.max_length} tokens and truncate is false; shorten it or send "
                                        "truncate: true", param=query_name)
                if self.engine.ids_past_table:
                    self.check_in_table(Encoded(encoded.ids[:1], encoded.truncated[:1]), lambda _: query_name)
                encoded, first = Encoded(encoded.ids[1:], encoded.truncated[1:]), 1
            check_texts(encoded, first - 1)

        query_prompt, text_prompt = prompts
        rows, tokens = await self.tokenize_and_run([query_prompt + query, *(text_prompt + text for text in texts)],
                                                   check_query_then_texts,
                                                   encode=self.tokenizer.encode_from_left if from_left else None)
        vectors = torch.from_numpy(self.finish(rows, None, self.normalize))
        return pair_scores_of(similarity, vectors[:1], vectors[1:])[0].numpy(), tokens

    def submit(self, encoded: Encoded) -> asyncio.Future:
        """Queue the sequences for the engine; the future settles on the loop with their rows, or the error.
        Cancelling the future (its request cut off: a client gone, a shutdown past its drain time, a part of
        the request refused) takes the sequences still waiting out of the queue."""
        future = self.wakeups.loop.create_future()
        try:
            ticket = self.scheduler.submit(encoded.ids, lambda outcome: self.wakeups.settle(future, outcome),
                                           encoded.type_ids)
        except (QueueFull, SchedulerClosed) as error:
            raise _refusal(error) from None
        future.add_done_callback(lambda settled: self.scheduler.cancel(ticket) if settled.cancelled() else None)
        return future

    async def rows(self, future: asyncio.Future) -> np.ndarray:
        """A submitted future's rows, awaited without blocking the loop."""
        outcome = await future
        if isinstance(outcome, BaseException):
            if outcome is not self.failure_logged:  # every request of the batch gets the one error
                self.failure_logged = outcome
                log.error("engine step failed", exc_info=outcome)
            self.engine_failure = short_reason(outcome)
            raise ApiError(424, f"the engine failed on this request ({short_reason(outcome)}); see the server log")
        self.engine_failure = None
        return outcome

    async def healthy(self) -> bool:
        """Whether the engine answers: after a failed batch, one short text through the queue, as TEI's health
        check runs a forward pass once its backend has failed; otherwise nothing is run."""
        if self.engine_failure is None:
            return True
        try:
            await self.run_texts(["health check"], "input", truncate=True)
        except ApiError:
            return False
        return self.engine_failure is None

    def finish(self, vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
        """Matryoshka cut, then L2 normalisation (as torch's F.normalize does, with its epsilon)."""
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors)  # orjson writes C-contiguous arrays only


class _Wakeups:
    """Resolves the loop's futures from the scheduler thread.

    Each call_soon_threadsafe wakes the loop and costs it a callback; the scheduler answers a whole
    batch of requests at once, so their outcomes are queued here and the loop is woken once for all.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._queued: list[tuple[asyncio.Future, np.ndarray | BaseException]] = []

    def settle(self, future: asyncio.Future, outcome: np.ndarray | BaseException) -> None:
        """Called from any thread: future gets outcome on the loop's next turn."""
        with self._lock:
            self._queued.append((future, outcome))
            first = len(self._queued) == 1
        if first:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
        for future, outcome in queued:
            if not future.done():  # the request awaiting it was cancelled
                future.set_result(outcome)


def _token_count(encoded: Encoded) -> int:
    return sum(len(ids) for ids in encoded.ids)


def _dumps(payload: Any) -> bytes:
    # numpy arrays are written from their buffer, float32 in its shortest exact form
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _tokens(encoding: Encoding, text: str) -> list[dict[str, Any]]:
    """TEI's token objects for the encoding of text. A token's start and stop count UTF-8 bytes of the
    text, as TEI's do (its strings are Rust's); the library counts characters."""
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    utf8_lengths = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    byte_at = np.concatenate(([0], np.cumsum(utf8_lengths)))  # character offset -> byte offset
    tokens = []
    for token_id, token, special, (start, stop) in zip(encoding.ids, encoding.tokens, encoding.special_tokens_mask,
                                                       encoding.offsets):
        if special:
            tokens.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
        else:
            tokens.append({"id": token_id, "text": text[start:stop], "special": False,
                           "start": int(byte_at[start]), "stop": int(byte_at[stop])})
    return tokens


# Errors: each route answers in the shape of its API, which that API's clients parse.

def _error_reply(path: str, error: ApiError) -> tuple[int, bytes]:
    """The status and JSON body refusing a request to path: TEI's on TEI's routes, OpenAI's elsewhere."""
    if path in TEI_PATHS:
        return error.status_code, orjson.dumps({"error": error.detail, "error_type": error.error_type})
    status = error.openai_status
    return status, orjson.dumps({"error": {"message": error.detail,
                                           "type": OPENAI_ERROR_TYPES.get(status, "invalid_request_error"),
                                           "param": error.param,
                                           "code": error.openai_code or OPENAI_CODES.get(status)}})


def _empty(message: str, param: str) -> ApiError:
    return ApiError(400, message, error_type="Empty", param=param)


def _error_responses(shape: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's refusals as its OpenAPI operation lists them: each status with what it means, in the
    route's error shape. The "default" entry also keeps FastAPI from listing its own 422 body, which
    this server never answers."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": shape, "description": REFUSALS[status]} for status in statuses}
    responses["default"] = {"model": shape, "description": "Any other refusal (such as 405: not that method)"}
    return responses


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Refusals of the routes FastAPI serves, in their API's shape; FastAPI's own reworded: no such
    endpoint, or not that method."""
    if not isinstance(error, ApiError):  # ours say what they mean already
        message = error.detail
        if error.status_code == 404:
            message = "no such endpoint; see /docs for the ones this server has"
        elif error.status_code == 405:
            message = "this endpoint does not take that method; see /docs"
        error = ApiError(error.status_code, message, error.headers)
    status, body = _error_reply(request.scope["path"], error)
    return Response(body, status, error.headers, media_type="application/json")


def _invalid(error: ValidationError) -> ApiError:
    """A request body that does not fit its endpoint's model, as one message naming up to three problems."""
    problems = error.errors(include_url=False)
    if problems[0]["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({problems[0]['ctx']['error']}); send a JSON object")
    parts = []
    for problem in problems[:3]:
        where = _location(problem["loc"]) or "body"
        message = problem["msg"].removeprefix("Value error, ")
        if where == "body" and problem["type"] == "value_error":  # a check of the whole request, which names its fields
            parts.append(message)
            continue
        if problem["type"] == "extra_forbidden":
            message = "is not a field of this endpoint; see /docs for the ones it reads"
        elif where == "body" and problem["type"] in BODY_PROBLEMS:
            message = "must be a JSON object with this endpoint's fields; see /docs"
        parts.append(f"{where}: {message}")
    fields = {_param_of(problem) for problem in problems}
    return ApiError(422, "; ".join(parts), param=fields.pop() if len(fields) == 1 else None)


def _location(parts: Sequence[str | int]) -> str:
    """A field's place in the request as our own messages name it: inputs.sentences[1], not pydantic's
    inputs.sentences.1."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts).lstrip(".")


def _param_of(problem: Mapping[str, Any]) -> str | None:
    """The request field a validation problem is about, as OpenAI's param names one: the top-level field and
    the item of it (input, input[1], documents[0]), not pydantic's names for the branches of a union; None for
    the body as a whole."""
    location = problem["loc"]
    if not location:
        return getattr(problem.get("ctx", {}).get("error"), "field", None)
    path = str(location[0])
    for part in location[1:]:
        if not isinstance(part, int):
            break
        path += f"[{part}]"
    return path


Handler = Callable[[Any], Awaitable[bytes]]


class _Front:
    """The ASGI app uvicorn runs: API key, body size and metrics for every request; the POST endpoints
    served here, straight from body bytes to reply bytes; the rest handed to FastAPI."""

    def __init__(self, api: FastAPI, routes: dict[str, tuple[type[BaseModel], Handler]], api_key: str | None,
                 max_bytes: int, metrics: _Metrics, close: Callable[[], None]) -> None:
        self.api = api
        # Stops the service's threads and worker processes if the app's shutdown did not (a forced quit).
        self.close = close
        self.routes = routes
        # As a client's key is read: a key from a secret file ends with a newline that no client sends.
        self.api_key = api_key.strip().encode() if api_key else None
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._lifespan(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]
        status = 500
        try:
            refusal = self._refusal(scope)
            route = self.routes.get(path) if scope["method"] == "POST" else None
            if refusal is not None:
                status = await _refuse(send, path, refusal)
            elif route is not None:
                status = await self._serve(path, *route, receive, send)
            else:
                async def send_status(message: Message) -> None:
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                    await send(message)

                await self.api(scope, receive, send_status)
        finally:
            self.metrics.observe_request(path, status, time.perf_counter() - started)
            if status == CLIENT_GONE:
                _log_access(scope, status)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's lifespan, but for a forced quit (a second Ctrl-C), which cancels it while it waits for the
        shutdown message: serve() closes the service itself then, and starlette's report of the cancellation
        as a failed shutdown, which uvicorn logged as an ERROR with a traceback, is dropped."""
        cancelled = False

        async def receive_until_cancelled() -> Message:
            nonlocal cancelled
            try:
                return await receive()
            except asyncio.CancelledError:
                cancelled = True
                raise

        async def send_until_cancelled(message: Message) -> None:
            if not cancelled:
                await send(message)

        try:
            await self.api(scope, receive_until_cancelled, send_until_cancelled)
        except asyncio.CancelledError:
            if not cancelled:
                raise

    async def _serve(self, path: str, model: type[BaseModel], handler: Handler, receive: Receive, send: Send) -> int:
        try:
            try:
                body = await self._body(receive)
            except asyncio.CancelledError:  # a shutdown's drain ran out while the body was still arriving
                return await _refuse(send, path, _shutting_down(CUT_OFF))
            if body is None:
                return CLIENT_GONE
            try:
                request = model.model_validate_json(body)
            except ValidationError as error:
                raise _invalid(error) from None
            try:
                reply = await (_unless_gone(handler(request), receive) if len(body) >= WATCH_BYTES else handler(request))
            except asyncio.CancelledError:  # a shutdown cut it off (its time to drain ran out, or a forced quit)
                return await _refuse(send, path, _shutting_down(CUT_OFF))
            return CLIENT_GONE if reply is None or _gone(receive) else await _reply(send, 200, reply)
        except ApiError as error:
            return await _refuse(send, path, error)
        except Exception:  # noqa: BLE001 - one broken request gets a 500; the server goes on
            log.exception("request failed")
            return await _refuse(send, path, ApiError(500, "the server failed on this request; see the server log"))

    async def _body(self, receive: Receive) -> bytes | None:
        """The whole request body; 413 once it grows past the limit; None if the client went away."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_SECONDS):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        raise ApiError(413, self._too_large())
                    if not message.get("more_body", False):
                        return b"".join(chunks)  # the one chunk itself when there is only one
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive whole within {BODY_TIMEOUT_SECONDS} s; send it "
                                "whole, as its Content-Length says") from None

    def _refusal(self, scope: Scope) -> ApiError | None:
        """What refuses the request before its body is read: a missing or wrong key, a too-large
        Content-Length, a POST whose declared Content-Type is not JSON or whose body is compressed."""
        headers = dict(scope["headers"])
        if self.api_key is not None and not _open(scope) and not self._authorized(
                [value for name, value in scope["headers"] if name == b"authorization"]):
            return ApiError(401, "missing or wrong API key; send one header 'Authorization: Bearer <key>'",
                            {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return ApiError(413, self._too_large())
        if scope["method"] != "POST" or scope["path"] not in self.routes:
            return None
        content_type = headers.get(b"content-type")
        # As TEI does (FastAPI refuses too, with a 422): a declared type must be JSON; none, or an empty
        # one, is read as JSON. A web page can send a text/plain POST to a loopback server without
        # asking first; it cannot send JSON so.
        if content_type and not _is_json(content_type):
            return ApiError(415, f"Content-Type {content_type.decode('latin-1')!r} is not JSON; "
                                 "send the body with the header 'Content-Type: application/json'")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"identity", b""):
            # Read as it is, a compressed body was "not valid JSON", and a declared one that is not, taken as JSON.
            return ApiError(415, f"Content-Encoding {encoding.decode('latin-1')!r} is not taken; send the body "
                                 "uncompressed")
        return None

    def _authorized(self, headers: list[bytes]) -> bool:
        """One Authorization header, with this server's key: with two, which one a proxy reads is anyone's guess."""
        if len(headers) != 1:
            return False
        scheme, _, key = headers[0].strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110, 11.1): some clients send "bearer KEY".
        return scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.api_key)

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's --max-request-bytes {self.max_bytes}; "
                "send fewer or shorter inputs per request")


def _open(scope: Scope) -> bool:
    """Whether a request is answered without the API key (OPEN_PATHS, OPEN_GETS)."""
    open_paths = OPEN_GETS if scope["method"] in ("GET", "HEAD") else OPEN_PATHS
    return scope["path"] in open_paths


def _clipped(number: int) -> str:
    """A number as an error message shows it: a client's 400-digit one cut short."""
    text = str(number)
    return text if len(text) <= 20 else f"{text[:12]}... ({len(text)} digits)"


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _gone(receive: Receive) -> bool:
    """Whether the client has disconnected, as far as the server has seen: read from uvicorn's request cycle,
    whose receive() this is, at no cost; for a request too small to be watched (_unless_gone), so that /metrics
    counts an abandoned one as 499 and not 200 (its reply would go nowhere). False under another server."""
    return getattr(getattr(receive, "__self__", None), "disconnected", False) is True


async def _unless_gone(work: Awaitable[bytes], receive: Receive) -> bytes | None:
    """work's reply, or None as soon as the client disconnects, work then cancelled."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":  # the body is read: nothing else should come
            pass

    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, so asyncio logs nothing
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # it unwinds: its futures cancelled, and with them its sequences still queued
    return None


async def _reply(send: Send, status: int, content: bytes, headers: dict[str, str] | None = None) -> int:
    """A JSON response, in two ASGI messages; returns the status for the metrics."""
    raw = [JSON_HEADER, (b"content-length", str(len(content)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})
    return status


def _log_access(scope: Scope, status: int) -> None:
    """uvicorn's access-log line for a request it writes none for: one answered with nothing, its client gone,
    which uvicorn logs only when a reply starts (nginx logs such a request as 499). As uvicorn decides, the line
    is written when --access-log gave its logger a handler."""
    access = logging.getLogger("uvicorn.access")
    if access.hasHandlers():
        access.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"], get_path_with_query_string(scope),
                    scope["http_version"], status)


async def _refuse(send: Send, path: str, error: ApiError) -> int:
    status, body = _error_reply(path, error)
    return await _reply(send, status, body, error.headers)


class _Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, total = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        label_block = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{label_block} {self.sum}", f"{name}_count{label_block} {total}"]
        return out


class _Metrics:
    """Counters and histograms in the Prometheus text format, without a client library."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # batches are observed on the scheduler thread, requests on the loop
        self.latency: dict[tuple[str, int], _Histogram] = {}  # by (endpoint, status); its counts are requests_total
        self.batch_tokens = _Histogram(TOKEN_BUCKETS)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # unknown paths must not grow the label set
        with self.lock:
            self.latency.setdefault((endpoint, status), _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_batch(self, batch: PackedBatch) -> None:
        with self.lock:
            self.batch_tokens.observe(batch.num_tokens)

    def render(self, service: _Service) -> str:
        graphs = service.engine.stats
        depth = service.scheduler.stats.depth if service.scheduler is not None else 0
        lines = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        with self.lock:
            family("embedctl_requests_total", "counter",
                   "HTTP requests by endpoint and status; 499: the client left before its reply.",
                   [f'embedctl_requests_total{{endpoint="{e}",status="{s}"}} {sum(h.counts)}'
                    for (e, s), h in sorted(self.latency.items())])
            family("embedctl_request_duration_seconds", "histogram",
                   "Time from request to response, by endpoint and status.",
                   [line for (e, s), h in sorted(self.latency.items())
                    for line in h.lines("embedctl_request_duration_seconds", f'endpoint="{e}",status="{s}"')])
            family("embedctl_batch_tokens", "histogram", "Tokens per engine batch.",
                   self.batch_tokens.lines("embedctl_batch_tokens"))
        family("embedctl_queue_depth", "gauge", "Sequences admitted and not yet answered.", [f"embedctl_queue_depth {depth}"])
        family("embedctl_ready", "gauge", "1 once warm-up has finished, 0 again while the engine fails.",
               [f"embedctl_ready {int(service.ready and service.engine_failure is None)}"])
        for name, value, help_text in (("graph_captures", graphs.captures, "CUDA graphs captured."),
                                       ("graph_replays", graphs.replays, "Batches run by replaying a CUDA graph."),
                                       ("eager_runs", graphs.eager_runs, "Batches run eagerly on the GPU (a bucket's first hit).")):
            family(f"embedctl_{name}_total", "counter", help_text, [f"embedctl_{name}_total {value}"])
        return "\n".join(lines) + "\n"
