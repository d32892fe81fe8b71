"""The `embedctl` command line: Typer options turned into configs, then handed to pipelines.

No logic lives here beyond that. Problems the user can fix end as one line on stderr with exit
code 2; an interrupt ends with 130. Both leave any existing output untouched. Each command imports
what only it needs when it runs, and `index` loads its model only once a row needs embedding: an
up-to-date re-index from cron never imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional, TextIO

import typer

from embedctl.progress import progress_bars
from engine import EngineConfig, ModelSpec, UserError
from engine.config import DEVICE_NAME
from engine.checkpoint import resolve_model
from pipelines.index import IndexModel, IndexOptions, IndexReport, lock_output, open_corpus, run_index
from pipelines.lock import OutputLocked
from pipelines.readers import glob_base, glob_reads, is_glob
from pipelines.writers import commits_in_groups, output_exists

if TYPE_CHECKING:
    from engine import Engine
    from pipelines.tokenize import TextTokenizer

# rich_markup_mode=None: click's plain help. Typer's rich help table squeezes the option-name column
# until, at 80 columns, long names are cut ("--tokenizer-pr…"); click's keeps every name whole at any width.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Fast text embeddings: index corpora into vector tables, rank documents for queries.")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a process that SIGTERM ended
EXIT_LOCKED = 75  # sysexits' EX_TEMPFAIL: another run holds the output; try again later


class OnLong(str, Enum):
    truncate = "truncate"
    error = "error"


class OnEmpty(str, Enum):
    skip = "skip"
    error = "error"


class OnDuplicate(str, Enum):
    error = "error"
    skip = "skip"


class RunFormat(str, Enum):
    jsonl = "jsonl"
    trec = "trec"


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"embedctl {version('embedctl')}")
        except PackageNotFoundError:  # a checkout run in place, not installed
            typer.echo("embedctl (not installed: run from a checkout)")
        raise typer.Exit()


@app.callback()
def _commands(
    _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                           help="Print the version and exit.")] = False,
) -> None:
    """Fast text embeddings: index corpora into vector tables, rank documents for queries."""


def _one_device(device: str | None) -> str | None:
    """score's and serve's --device: one device; a list is index's alone (_devices)."""
    if device is not None and "," in device:
        raise typer.BadParameter(f"{device} lists several devices; this command runs on one (cpu, cuda or cuda:N): "
                                 "only index spreads its work over several GPUs")
    return device


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model directory or hub id (default: all-MiniLM-L6-v2, offline).")]
DeviceOpt = Annotated[Optional[str], typer.Option(callback=_one_device, help="cpu, cuda or cuda:N (default: cuda when present).")]
IndexDeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N, or several GPUs as cuda:0,cuda:1, each running a copy of the model (default: cuda when present).")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU).")]
# The engine's options, the same for every command that loads a model.
BatchTokensOpt = Annotated[Optional[int], typer.Option(help="Token budget per engine step (default: 16384 on GPU, 2048 on CPU, raised to the model's max length).")]
MaxSeqsOpt = Annotated[int, typer.Option(help="Sequences per engine step.")]
LanesOpt = Annotated[int, typer.Option(help="CUDA streams that batches in flight run on at once (GPU only).")]
MaxLengthOpt = Annotated[Optional[int], typer.Option(help="Truncate at this many tokens, at most the model's positions (default: the model's max length).")]
DimOpt = Annotated[Optional[int], typer.Option(help="Keep the first N dimensions (Matryoshka), re-normalised when normalising.")]
AttentionOpt = Annotated[str, typer.Option(help="auto, sdpa, varlen, flashinfer or triton.")]
EagerOpt = Annotated[bool, typer.Option(help="Run without CUDA graphs.")]
_COMPILE_HELP = "Fused kernels on a GPU (norms via torch.compile, GELU in the GEMM epilogue, Qwen3's Triton and FlashInfer steps); --no-compile runs plain torch ops."
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help=_COMPILE_HELP)]
# serve reads every option from EMBEDCTL_<OPTION> too, where click would name this one by its parameter, fuse
ServeCompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", envvar="EMBEDCTL_COMPILE", help=_COMPILE_HELP)]


@app.command()
def index(
    sources: Annotated[list[str], typer.Argument(metavar="SOURCE", help="Parquet/JSONL files, directories, globs or fsspec URLs: one, or several read as one corpus.")],
    out: Annotated[str, typer.Option("--out", "-o", help="vectors.lance, a LanceDB URI (with --table), out.parquet or a directory/.")],
    table: Annotated[Optional[str], typer.Option(help="Table name when --out is a LanceDB URI.")] = None,
    model: ModelOpt = None,
    text_col: Annotated[str, typer.Option(help="Column holding the text.")] = "text",
    id_col: Annotated[str, typer.Option(help="Column holding the id; when absent, ids are file:row.")] = "id",
    keep: Annotated[Optional[list[str]], typer.Option(metavar="COL", help="Carry this input column into the output (repeat for more: --keep a --keep b).")] = None,
    rebuild: Annotated[bool, typer.Option(help="Re-embed every row and replace --out at the end, atomically (to change the model or its settings).")] = False,
    prune: Annotated[bool, typer.Option(help="Delete rows whose ids are no longer in SOURCE (refused when SOURCE holds no rows at all).")] = False,
    commit_rows: Annotated[int, typer.Option(help="Commit every N embedded rows: a killed run loses what it embedded since its last commit, and the same command resumes.")] = 10_000,
    optimize: Annotated[bool, typer.Option(help="Tidy the output at the end: a LanceDB table's fragments under 10,000 rows compacted once there are 10, rows added to its indexes once 100,000 lack them, the files of versions replaced over 7 days ago removed; a Parquet directory's parts under 10,000 rows merged once there are 10.")] = True,
    doc_prompt: Annotated[Optional[str], typer.Option(help="Text put before every document, e.g. 'passage: ' (default: the model's 'document' prompt, if any).")] = None,
    doc_prompt_name: Annotated[Optional[str], typer.Option(help="Name of a prompt in the model's sentence-transformers config, for documents.")] = None,
    overwrite: Annotated[bool, typer.Option(hidden=True)] = False,
    append: Annotated[bool, typer.Option(hidden=True)] = False,
    on_long: Annotated[OnLong, typer.Option(help="Texts over the max length: truncate (recorded per row) or error.")] = OnLong.truncate,
    on_empty: Annotated[OnEmpty, typer.Option(help="Null or blank texts: skip (counted; an older vector of the id is deleted) or error.")] = OnEmpty.skip,
    on_duplicate: Annotated[OnDuplicate, typer.Option(help="Repeated ids: error, or skip all but the first.")] = OnDuplicate.error,
    max_batch_tokens: BatchTokensOpt = None,
    max_seqs: MaxSeqsOpt = 512,
    lanes: LanesOpt = EngineConfig.lanes,
    max_length: MaxLengthOpt = None,
    dim: DimOpt = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="L2-normalise (default: as the model says).")] = None,
    device: IndexDeviceOpt = None,
    dtype: DtypeOpt = None,
    attention: AttentionOpt = "auto",
    eager: EagerOpt = False,
    fuse: CompileOpt = True,
    warmup: Annotated[bool, typer.Option(help="Capture before starting the CUDA graph of every batch shape whose sequences are at most 512 tokens; other shapes are still captured on their second hit.")] = False,
    tokenizer_processes: Annotated[Optional[int], typer.Option(help="Tokenize in N worker processes, 0 in this one (default: one per 4 cores when the model runs on a GPU, there are at least 8 cores and SOURCE has 20,000 rows or an unknown count, else 0).")] = None,
    report: Annotated[Optional[Path], typer.Option(help="Write the run's summary as JSON to this file ('-': stdout).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print settings and graph counters.")] = False,
) -> None:
    """Embed the rows of SOURCE that --out lacks or holds with another text, and write them to --out.

    The first run builds --out; the same command run again updates it and resumes a killed run.

    Several SOURCEs (docs/*.jsonl as the shell expands it) are read in the order given, as the one glob that matched
    them all would read them: ids made for files without an id column (FILE:ROW) and key=value folders are named
    below the folder common to them.

    Exit codes: 0 done; 2 a problem with the input, the options or the existing output (one line on stderr); 75 another run holds --out; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM).
    """
    sources = [_home(source) for source in sources]
    out, model, report = _output_path(_home(out)), _home(model), _home(report)
    if overwrite or append:  # the flags of earlier versions: say what replaced them
        _fail(f"--{'overwrite' if overwrite else 'append'} is gone: running again into an existing output updates "
              "it (new rows added, changed rows re-embedded); drop the flag, or pass --rebuild to replace the output",
              report)
    if quiet and verbose:
        _fail("--quiet leaves out the summary that --verbose adds to; give one of them", report)

    def run() -> None:
        _check_report_path(report)
        devices = _devices(device)
        config = EngineConfig(device=devices[0], dtype=dtype, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                              cuda_graphs=not eager, compile=fuse, warmup=warmup, attention=attention, normalize=normalize,
                              dim=dim, max_length=max_length, lanes=lanes)
        options = IndexOptions(source=tuple(sources), out=out, table=table, text_col=text_col, id_col=id_col,
                               keep=tuple(keep or ()), prompt=doc_prompt, prompt_name=doc_prompt_name, rebuild=rebuild, prune=prune,
                               commit_rows=commit_rows, optimize=optimize, on_long=on_long.value, on_empty=on_empty.value,
                               on_duplicate=on_duplicate.value, tokenizer_processes=tokenizer_processes)
        corpus = open_corpus(options)  # a wrong path or a bad file should not wait for a model to load
        spec = ModelSpec.of(resolve_model(model), config)

        def load_engines(spec: ModelSpec) -> list[Engine]:
            from engine import Engine

            engines = [Engine.load(spec, replace(config, device=name)) for name in devices]
            if verbose and sys.stderr is not None:  # closed (2>&-): print would fall back to stdout
                for engine in engines:
                    # print, not typer.echo: under a live bar rich puts what sys.stderr is given on a line above it
                    print(f"model {spec.files.name} on {engine.device} ({engine.dtype}), attention "
                          f"{engine.attention_label}, dim {spec.dim}, max length {spec.max_length}, "
                          f"pooling {spec.pooling}", file=sys.stderr)
            return engines

        index_model = IndexModel(spec, load_engines, on_gpu=lambda: config.torch_device().type == "cuda")
        keeps_commits = commits_in_groups(out, table)  # what a Ctrl-C leaves: committed groups, or the output as it was
        existed = keeps_commits or output_exists(out)
        so_far = IndexReport(output=out, model=spec.files.name)
        try:
            with lock_output(options):  # taken before the model loads: a refused run returns at once
                with progress_bars(enabled=not quiet and _on_terminal(sys.stderr)) as bars:
                    result = run_index(index_model, options, bars("embedding", "rows") if bars else None, corpus,
                                       so_far)
        except OutputLocked as error:  # not written to --report: the run that holds the lock owns it
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(EXIT_LOCKED) from None
        except KeyboardInterrupt as stop:  # committed groups stay: they are what the next run resumes from
            after = (f"the same command resumes from the last commit to {out}" if keeps_commits
                     else f"{out} is as it was before this run" if existed else f"{out} was not written")
            _interrupted(stop, after, report, {"rows_read": so_far.rows_read, "rows_committed": so_far.rows_committed})
        if not quiet:
            typer.echo(result.summary(), err=True)
        if verbose:
            typer.echo(f"graphs: {result.graphs}", err=True)
        if report is not None:
            _write_report(report, result.to_json())

    table_folder = f"{out.rstrip('/')}/{table}.lance" if table is not None and out.strip("/") else out
    _check_paths(report, sources, table_folder)
    _guarded(run, report)


def _devices(device: str | None) -> list[str | None]:
    """index's --device: one device, or a comma list of GPUs that each run a copy of the model."""
    if device is None or "," not in device:
        return [device]
    names = [name.strip() for name in device.split(",")]
    if not all(names):
        raise UserError(f"--device {device!r} has an empty entry; list GPUs as cuda:0,cuda:1")
    if not all(name.startswith("cuda") and DEVICE_NAME.fullmatch(name) for name in names):
        raise UserError(f"--device {device}: a list names GPUs only, as cuda:0,cuda:1; give cpu alone")
    if len({"cuda:0" if name == "cuda" else name for name in names}) < len(names):
        raise UserError(f"--device {device} names a GPU twice; list each once")
    return names


@app.command()
def score(
    queries: Annotated[str, typer.Argument(metavar="QUERIES", help="Queries: a Parquet/JSONL file, a directory, a glob or an fsspec URL.")],
    docs: Annotated[Optional[str], typer.Argument(metavar="DOCS", help="Documents to rank, read like QUERIES (with --index: only their texts, for --reranker).")] = None,
    index: Annotated[Optional[str], typer.Option(help="Rank the vectors of a table built by `embedctl index` (x.lance, x.parquet, dir/, or a LanceDB URI with --table).")] = None,
    table: Annotated[Optional[str], typer.Option(help="Table name when --index is a LanceDB URI.")] = None,
    top_k: Annotated[int, typer.Option(help="Documents kept per query.")] = 10,
    reranker: Annotated[Optional[str], typer.Option(help="Cross-encoder model that rescores each query's top hits.")] = None,
    rerank_depth: Annotated[Optional[int], typer.Option(help="Hits per query the reranker rescores (default: --top-k).")] = None,
    qrels: Annotated[Optional[str], typer.Option(help="TREC or JSONL relevance judgements: print nDCG@10, MRR@10, Recall@k (each query's too in --report).")] = None,
    ignore_identical_ids: Annotated[bool, typer.Option("--ignore-identical-ids/--keep-identical-ids", help="Leave out of a query's hits the document with the query's own id, keeping --top-k hits, as BEIR does (and MTEB for ArguAna and Quora, where queries are also documents).")] = False,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Write the run to this file (default, or '-': stdout).")] = None,
    run_format: Annotated[RunFormat, typer.Option("--format", help="jsonl rows {query_id, doc_id, rank, score}, or a TREC run.")] = RunFormat.jsonl,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out (at the end, atomically).")] = False,
    model: ModelOpt = None,
    text_col: Annotated[str, typer.Option(help="Column holding the text, in documents (and queries, unless --query-text-col).")] = "text",
    id_col: Annotated[str, typer.Option(help="Column holding the id, in documents (and queries, unless --query-id-col); when absent, ids are file:row.")] = "id",
    query_text_col: Annotated[Optional[str], typer.Option(help="Column holding the queries' text, where it differs from the documents' (default: --text-col).")] = None,
    query_id_col: Annotated[Optional[str], typer.Option(help="Column holding the queries' ids (default: --id-col).")] = None,
    query_prompt: Annotated[Optional[str], typer.Option(help="Text put before every query, e.g. 'query: ' (default: the model's 'query' prompt, if any).")] = None,
    doc_prompt: Annotated[Optional[str], typer.Option(help="Text put before every document, e.g. 'passage: ' (default: the model's 'document' prompt, if any).")] = None,
    query_prompt_name: Annotated[Optional[str], typer.Option(help="Name of a prompt in the model's sentence-transformers config, for queries.")] = None,
    doc_prompt_name: Annotated[Optional[str], typer.Option(help="Name of a prompt in the model's sentence-transformers config, for documents.")] = None,
    max_length: MaxLengthOpt = None,
    dim: DimOpt = None,
    max_batch_tokens: BatchTokensOpt = None,
    max_seqs: MaxSeqsOpt = 512,
    lanes: LanesOpt = EngineConfig.lanes,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    attention: AttentionOpt = "auto",
    eager: EagerOpt = False,
    fuse: CompileOpt = True,
    tokenizer_processes: Annotated[Optional[int], typer.Option(help="Tokenize the reranker's pairs in N worker processes when there are 16 or more, 0 in this one (default: one per 2 cores when the reranker runs on a GPU and there are at least 8 cores, else 0).")] = None,
    report: Annotated[Optional[Path], typer.Option(help="Write the summary and metrics, each judged query's under per_query, as JSON to this file ('-': stdout, with --out FILE).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")] = False,
) -> None:
    """Rank documents for every query in QUERIES by the model's similarity (bi-encoder; cosine unless its
    config names another), optionally rerank, and write the top-k.

    With --index, the queries take the table's dim and max length unless given here."""
    from pipelines.score import ScoreOptions, open_inputs, run_score, write_run

    out = None if out == "-" else out  # the usual name for stdout, not a file named "-"
    queries, docs, index, qrels, out, report = map(_home, (queries, docs, index, qrels, out, report))
    model, reranker = _home(model), _home(reranker)

    def run() -> None:
        _check_report_path(report)
        if out is None and sys.stdout is None:  # started with stdout closed (>&-)
            raise UserError("standard output is closed, and the run goes there without --out; give --out FILE")
        options = ScoreOptions(queries=queries, docs=docs, index=index, table=table, reranker=reranker, rerank_depth=rerank_depth,
                               qrels=qrels, out=out, top_k=top_k, format=run_format.value, overwrite=overwrite,
                               text_col=text_col, id_col=id_col, query_text_col=query_text_col,
                               query_id_col=query_id_col, query_prompt=query_prompt, doc_prompt=doc_prompt,
                               query_prompt_name=query_prompt_name, doc_prompt_name=doc_prompt_name,
                               ignore_identical_ids=ignore_identical_ids, tokenizer_processes=tokenizer_processes)
        inputs = open_inputs(options)  # bad inputs should not wait for a model to load
        config = EngineConfig(device=device, dtype=dtype, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                              cuda_graphs=not eager, compile=fuse, attention=attention, lanes=lanes)  # the reranker's
        query_config = replace(config, max_length=max_length, dim=dim)
        if inputs.table is not None:  # queries embedded as the table's documents were (dim, max length, ...)
            query_config = inputs.table.query_config(ModelSpec.of(resolve_model(model), query_config), query_config)
        engine, tokenizer = _load(model, query_config)
        rescorer = _load(reranker, config) if reranker is not None else None
        with progress_bars(enabled=not quiet and _on_terminal(sys.stderr)) as bars:
            ranking, metrics = run_score(engine, tokenizer, inputs, options, rescorer, bars)
        write_run(ranking, options)
        if not quiet:
            typer.echo(ranking.summary(out), err=True)
        if metrics is not None:
            for warning in metrics.warnings():
                typer.echo(f"warning: --qrels {qrels} {warning}", err=True)
            typer.echo(metrics.summary(), err=True)
        if report is not None:
            _write_report(report, json.dumps({**ranking.to_dict(), "metrics": metrics.to_dict() if metrics else None}, indent=2))

    if report is not None and _to_stdout(report) and (out is None or _is_stdout(out)):
        _fail("--report - would mix the report into the run on standard output; give --out FILE for the run, or a "
              "file for --report", None)
    _check_paths(report, [path for path in (queries, docs, index, qrels) if path], out)
    _guarded(run, report)


# Every serve option also from the environment, EMBEDCTL_ and its name (EMBEDCTL_PORT, EMBEDCTL_MAX_BATCH_TOKENS), as
# TEI's launcher takes its options in a container spec; a flag given on the command line wins.
@app.command(context_settings={"auto_envvar_prefix": "EMBEDCTL"})
def serve(
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).")] = "127.0.0.1",
    model: ModelOpt = None,
    api_key: Annotated[Optional[str], typer.Option(help="Require 'Authorization: Bearer KEY' on everything but the health checks "
                                                        "(/health, /ping, GET /) and the docs (/docs, /openapi.json).")] = None,
    max_batch_tokens: BatchTokensOpt = None,
    max_seqs: MaxSeqsOpt = 512,
    # One lane: every extra lane captures its own graph of each shape while requests wait, and under
    # load that cost more than the overlap gained (bench/results/gpu-2026-11-30-run46-serve-lanes).
    lanes: LanesOpt = 1,
    max_client_batch: Annotated[int, typer.Option(help="Inputs per request; more get 413 (400 on /v1/embeddings, as OpenAI answers).")] = 2048,
    max_request_bytes: Annotated[int, typer.Option(help="Request body size; larger gets 413.")] = 4 << 20,
    max_queue: Annotated[int, typer.Option(help="Sequences admitted and not yet answered, over all clients; past it 429.")] = 8192,
    max_length: MaxLengthOpt = None,
    dim: DimOpt = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="L2-normalise /v1/embeddings vectors (default: as the model says).")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    attention: AttentionOpt = "auto",
    eager: EagerOpt = False,
    fuse: ServeCompileOpt = True,
    # On by default: a graph captured under traffic stalls every request in flight, which made the
    # serving p99 several times its p50 (bench/results/gpu-2026-11-30-run62-serve-warmup-ab).
    warmup: Annotated[bool, typer.Option(help="Capture the CUDA graph of every batch shape (of sequences up to 512 tokens) before serving, so that no request waits for a capture; --no-warmup starts sooner.")] = True,
    access_log: Annotated[bool, typer.Option(help="Log one line per request.")] = False,
    tokenizer_processes: Annotated[Optional[int], typer.Option(help="Tokenize requests of many texts in N worker processes, 0 in the server process (default: one per 4 cores when the model runs on a GPU and there are at least 8 cores, else 0).")] = None,
    doc_prompt: Annotated[Optional[str], typer.Option(help="Text put before every text of /v1/embeddings and /embed (default: the model's 'document' prompt, if any, as index puts it; '' for none, as TEI).")] = None,
    query_prompt: Annotated[Optional[str], typer.Option(help="Text put before /rerank's query (default: the model's 'query' prompt, if any, as score puts it; '' for none).")] = None,
    cors_allow_origin: Annotated[Optional[list[str]], typer.Option(metavar="ORIGIN", help="A web page origin (https://app.example.com, or '*') whose scripts may call the server from a browser; repeatable.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model's name in requests (their 'model') and replies, e.g. an alias a proxy routes by (default: the model's path or hub id).")] = None,
) -> None:
    """Serve embeddings and ranking over HTTP: OpenAI /v1/embeddings, TEI /embed and /rerank, /health, /metrics."""
    from embedctl.serve import ServeLimits, ServeOptions, serve as run_server  # fastapi loads only for this command

    def run() -> None:
        config = EngineConfig(device=device, dtype=dtype, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                              cuda_graphs=not eager, compile=fuse, warmup=warmup, attention=attention,
                              normalize=normalize, dim=dim, max_length=max_length, lanes=lanes)
        limits = ServeLimits(max_client_batch=max_client_batch, max_request_bytes=max_request_bytes, max_queue=max_queue)
        run_server(model, config, ServeOptions(host=host, port=port, api_key=_set(api_key, "EMBEDCTL_API_KEY"),
                                               limits=limits, access_log=access_log,
                                               tokenizer_processes=tokenizer_processes,
                                               doc_prompt=_set(doc_prompt, "EMBEDCTL_DOC_PROMPT"),
                                               query_prompt=_set(query_prompt, "EMBEDCTL_QUERY_PROMPT"),
                                               cors_allow_origins=tuple(cors_allow_origin or ()),
                                               served_model_name=served_model_name))

    _guarded(run, None, stopped="the server stopped")


def _set(value: str | None, variable: str) -> str | None:
    """A serve option, or its environment variable's value where that is set but empty: click takes an empty one
    for an unset one, and an empty EMBEDCTL_API_KEY would leave a server meant to be guarded open, an empty
    EMBEDCTL_DOC_PROMPT (no prompt, as --doc-prompt '') give the model's prompt."""
    return os.environ[variable] if value is None and os.environ.get(variable) == "" else value


def _load(model: str | None, config: EngineConfig) -> tuple[Engine, TextTokenizer]:
    from engine import Engine
    from pipelines.tokenize import TextTokenizer

    engine = Engine.load(model, config)
    return engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (systemd, timeout, kill), handled the way Ctrl-C is."""


def _terminate(signum: int, frame: object) -> NoReturn:
    raise _Terminated


def _guarded(run: Callable[[], None], report: Path | None, stopped: str = "no output was changed") -> None:
    """Run a command; user errors, Ctrl-C and SIGTERM become one line and an exit code (`stopped` says what
    an interruption leaves)."""
    # For the command's length only, and only where Python allows it (the main thread: not so for a
    # caller that runs the CLI in a thread). embedctl serve's uvicorn puts its own in place once it starts.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        run()
    except UserError as error:
        _fail(str(error), report)
    except Exception as error:
        if not _out_of_memory(error):
            raise
        _fail("the GPU ran out of memory; lower --max-batch-tokens or --max-seqs and run again", report)
    except KeyboardInterrupt as stop:
        _interrupted(stop, stopped, report)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupted(stop: KeyboardInterrupt, after: str, report: Path | None,
                 progress: dict[str, int] | None = None) -> NoReturn:
    """After Ctrl-C (exit code 130) or SIGTERM (143), once the output is cleaned up: say so, in the
    report too, so that a monitor does not read the last run's report as this one's; with progress
    (index's rows read and committed), how far the run got.

    os._exit, not sys.exit: when Ctrl-C lands while an import runs code from a string (the model
    loads mid-run, and dataclasses build their methods so), CPython flags the KeyboardInterrupt as
    unhandled however it was handled, and at exit kills the process by SIGINT instead of returning 130
    (2 of 30 interrupted index runs). By now the pipeline's threads are joined, the store is aborted
    and the lock released: nothing is left for the interpreter's exit to do.
    """
    terminated = isinstance(stop, _Terminated)
    message = f"{'terminated' if terminated else 'interrupted'}; {after}"
    typer.echo(message, err=True)
    if report is not None:
        try:
            _write_report(report, json.dumps({"error": message, **(progress or {})}))
        except UserError:
            pass  # the line above is the message that matters
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _out_of_memory(error: Exception) -> bool:
    torch = sys.modules.get("torch")  # not imported means no model ran, so no GPU memory was used
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _fail(message: str, report: Path | None) -> None:
    typer.echo(f"error: {message}", err=True)
    if report is not None:
        try:
            _write_report(report, json.dumps({"error": message}))
        except UserError:
            pass  # the error line above is the message that matters; the report cannot add to it
    raise typer.Exit(EXIT_USER_ERROR)


def _check_paths(report: Path | None, inputs: list[str], out: str | None) -> None:
    """Before anything is read or written, refuse (one error line, no report written) an output that is,
    holds or lies inside an input file or folder, that holds what a glob reads, or that a later run's glob
    would read (a Parquet output it matches: a Lance output holds no corpus files); and a --report that
    is or lies inside an input or the output, or that a glob would read."""
    for source in inputs:
        if not source.strip():
            _fail("an input path is empty; give a file, a directory or a glob of corpus files", None)
    there = _local(out) if out is not None and out.strip("/") else None  # '' and / name no output: refused later
    for source in inputs:
        globbed = is_glob(source)
        here = _local(glob_base(source) if globbed else source)
        if here is None or there is None:
            continue
        folder = out.endswith("/") or os.path.isdir(there)
        if _within(here, there) or (_glob_reads(source, there, folder) if globbed else _within(there, here)):
            _fail(f"--out {out} and the input {source} overlap, so the output would overwrite or be read as "
                  "input; write the output outside the input", None)
    if report is not None and not _to_stdout(report):
        written = os.path.realpath(report)
        for path in (*inputs, *([out] if out is not None else [])):
            if (local := _local(path)) is None:
                continue
            globbed = path != out and is_glob(path)  # an output is a path, never a glob
            if globbed and _glob_reads(path, written):
                _fail(f"--report {report} would be read as input by {path} on a later run; give the report a path "
                      "the glob does not match", None)
            if not globbed and _within(written, local):
                _fail(f"--report {report} would overwrite {path}, which this run reads or writes; give the report "
                      "a path of its own", None)


def _glob_reads(source: str, path: str, folder: bool = False) -> bool:
    """Whether the glob source would read, on a later run, what is written at the local real path: a file, or
    with folder a folder of Parquet parts, through any of its parts. A Lance output holds no corpus files."""
    if path.endswith(".lance"):
        return False
    base = glob_base(source)
    pattern = _local(base).rstrip("/") + "/" + source[len(base):]
    return glob_reads(pattern, f"{path}/part-00000.parquet" if folder else path)


def _home(path: str | Path | None) -> str | Path | None:
    """A local path with a leading ~ expanded, as a shell would have done had it not been quoted: the
    readers, writers and lock file must all see one path. URLs and None pass unchanged."""
    if path is None or "://" in str(path):
        return path
    return type(path)(os.path.expanduser(path)) if isinstance(path, Path) else os.path.expanduser(path)


def _output_path(out: str) -> str:
    """A local --out with its "." and ".." parts taken out (x/../y.lance is y.lance), as a shell's cd takes
    them: the lock file, the writers and the overlap checks see one path, and no folder x is made to
    reach y.lance through it. URLs, and an out that names nothing (refused later), pass unchanged."""
    if "://" in out or not out.strip("/"):
        return out
    return os.path.normpath(out) + ("/" if out.endswith("/") else "")


def _on_terminal(stream: TextIO | None) -> bool:
    """Whether a stream is a terminal; a stream the process was started without (2>&-) is None, and is not."""
    return stream is not None and stream.isatty()


def _local(path: str) -> str | None:
    """The real path of a local path or file:// URL; None for a remote URL."""
    if "://" in path and not path.startswith("file://"):
        return None
    return os.path.realpath(path.removeprefix("file://").rstrip("/") or ".")


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_report_path(report: Path | None) -> None:
    """Refuse a --report path that cannot be written before the run, not after it. Nothing is written to
    find out: a run that fails later writes its error there, and a run refused here leaves no empty file."""
    if report is None:
        return
    if _to_stdout(report):
        if sys.stdout is None:  # started with stdout closed (>&-): the report would be lost without a word
            raise UserError("standard output is closed, and --report - writes there; give --report FILE")
        return
    if not report.parent.is_dir():
        raise UserError(f"--report {report}: the directory {report.parent} does not exist; "
                        "create it or pick another path")
    if report.is_dir():
        raise UserError(f"--report {report} is a directory; give the report a file name")
    if not os.access(report if report.exists() else report.parent, os.W_OK):
        where = "it is read-only" if report.exists() else f"the directory {report.parent} is read-only"
        raise UserError(f"cannot write the report {report} ({where}); pick a writable --report path")


def _to_stdout(report: Path) -> bool:
    return str(report) == "-"  # the usual name for standard output, as --out - is score's


def _is_stdout(path: str) -> bool:
    """Whether a path names the file that standard output writes to (/dev/stdout, /dev/fd/1, or the file it is
    redirected to)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except OSError:  # no such file yet, or stdout closed
        return False


def _write_report(report: Path, text: str) -> None:
    try:
        if _to_stdout(report):
            typer.echo(text)
            return
        report.write_text(text + "\n")
    except OSError as error:
        raise UserError(f"cannot write the report {report} ({error.strerror}); pick a writable --report path") from None


def main() -> None:
    """The console script. With standalone_mode off, click hands its own errors (an unknown option, a missing
    argument, a bad choice) to this function instead of printing a usage box, so they end as one line too."""
    try:
        code = app(prog_name="embedctl", standalone_mode=False)  # a command's exit code, None when it returns
    except typer.TyperException as error:  # the base of the click errors in the click that typer bundles
        typer.echo(_click_error(error, sys.argv[1:]), err=True)
        code = error.exit_code
    sys.exit(code)


def _click_error(error: typer.TyperException, args: list[str]) -> str:
    """What to print for a click error: one line, or for bare `embedctl` its help."""
    if type(error).__name__ == "NoArgsIsHelpError":  # by name, as typer does: the class is private
        return error.format_message()  # the help text
    message = " ".join(error.format_message().splitlines()).rstrip(".")
    ctx = getattr(error, "ctx", None)  # usage errors know their command, but for an option's missing value
    if ctx is not None:
        command_path = ctx.command_path
    else:  # the parser found it before any context: the command is the first argument, if it names one
        command = next((arg for arg in args if not arg.startswith("-")), None)
        commands = {info.name or info.callback.__name__ for info in app.registered_commands}
        command_path = "embedctl" + (f" {command}" if command in commands else "")
    if message.startswith("Got unexpected extra argument") and command_path == "embedctl score":
        # most often a glob the shell expanded into a file each
        message += ("; QUERIES and DOCS are one path each: quote a glob ('docs/*.jsonl') so that the shell passes it "
                    "whole, or give the folder")
    return f"error: {message} (see {command_path} --help)"


if __name__ == "__main__":
    main()
