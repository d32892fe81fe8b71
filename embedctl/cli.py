"""The `embedctl` command line: Typer options turned into configs, then handed to pipelines.

No logic lives here beyond that. Problems the user can fix end as one line on stderr with exit
code 2; an interrupt ends with 130. Both leave any existing output untouched.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from embedctl.progress import index_progress
from engine import Engine, EngineConfig, UserError
from pipelines.index import IndexOptions, open_corpus, run_index
from pipelines.score import ScoreOptions, open_inputs, run_score, write_run
from pipelines.tokenize import TextTokenizer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Fast text embeddings: index corpora into vector tables, rank documents for queries.")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


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


@app.callback()
def _commands() -> None:
    """Fast text embeddings: index corpora into vector tables, rank documents for queries."""


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model directory or hub id (default: all-MiniLM-L6-v2, offline).")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N (default: cuda when present).")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU).")]


@app.command()
def index(
    source: Annotated[str, typer.Argument(help="A Parquet/JSONL file, a directory, a glob or an fsspec URL.")],
    out: Annotated[str, typer.Option("--out", "-o", help="vectors.lance, a LanceDB URI (with --table), out.parquet or a directory/.")],
    table: Annotated[Optional[str], typer.Option(help="Table name when --out is a LanceDB URI.")] = None,
    model: ModelOpt = None,
    text_col: Annotated[str, typer.Option(help="Column holding the text.")] = "text",
    id_col: Annotated[str, typer.Option(help="Column holding the id; when absent, ids are file:row.")] = "id",
    keep: Annotated[Optional[list[str]], typer.Option(help="Carry this input column into the output (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output (at the end, atomically).")] = False,
    append: Annotated[bool, typer.Option(help="Add rows to an existing output made with the same model settings.")] = False,
    on_long: Annotated[OnLong, typer.Option(help="Texts over the max length: truncate (recorded per row) or error.")] = OnLong.truncate,
    on_empty: Annotated[OnEmpty, typer.Option(help="Null or blank texts: skip (counted) or error.")] = OnEmpty.skip,
    on_duplicate: Annotated[OnDuplicate, typer.Option(help="Repeated ids: error, or skip all but the first.")] = OnDuplicate.error,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Token budget per engine step (default: 16384 on GPU, 2048 on CPU).")] = None,
    max_seqs: Annotated[int, typer.Option(help="Sequences per engine step.")] = 512,
    max_length: Annotated[Optional[int], typer.Option(help="Truncate at this many tokens (default: the model's).")] = None,
    dim: Annotated[Optional[int], typer.Option(help="Keep the first N dimensions (Matryoshka), re-normalised when normalising.")] = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="L2-normalise (default: as the model says).")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    attention: Annotated[str, typer.Option(help="auto, sdpa, varlen or flashinfer.")] = "auto",
    eager: Annotated[bool, typer.Option(help="Run without CUDA graphs.")] = False,
    fuse: Annotated[bool, typer.Option("--compile/--no-compile", help="Fuse residual+LayerNorm with torch.compile on a GPU.")] = True,
    warmup: Annotated[bool, typer.Option(help="Capture every CUDA graph bucket before starting.")] = False,
    report: Annotated[Optional[Path], typer.Option(help="Write the run's summary as JSON to this file.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print settings and graph counters.")] = False,
) -> None:
    """Embed every row of SOURCE and write the vectors to --out."""
    if overwrite and append:
        _fail("--overwrite and --append contradict each other; pass one of them", report)

    def run() -> None:
        _check_report_path(report)
        config = EngineConfig(device=device, dtype=dtype, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                              cuda_graphs=not eager, compile=fuse, warmup=warmup, attention=attention, normalize=normalize,
                              dim=dim, max_length=max_length)
        options = IndexOptions(source=source, out=out, table=table, text_col=text_col, id_col=id_col,
                               keep=tuple(keep or ()), mode="overwrite" if overwrite else "append" if append else "create",
                               on_long=on_long.value, on_empty=on_empty.value, on_duplicate=on_duplicate.value)
        corpus = open_corpus(options)  # a wrong path or a bad file should not wait for a model to load
        engine, tokenizer = _load(model, config)
        if verbose:
            typer.echo(f"model {engine.files.name} on {engine.device} ({engine.dtype}), attention {engine.attention}, "
                       f"dim {engine.dim}, max length {engine.max_length}, pooling {engine.pooling}", err=True)
        with index_progress(enabled=not quiet and sys.stderr.isatty()) as progress:
            result = run_index(engine, tokenizer, options, progress, corpus)
        if not quiet:
            typer.echo(result.summary(), err=True)
        if verbose:
            typer.echo(f"graphs: {result.graphs}", err=True)
        if report is not None:
            _write_report(report, result.to_json())

    _guarded(run, report)


@app.command()
def score(
    queries: Annotated[str, typer.Argument(help="Queries: a Parquet/JSONL file, a directory, a glob or an fsspec URL.")],
    docs: Annotated[Optional[str], typer.Argument(help="Documents to rank, read like QUERIES (with --index: only their texts, for --reranker).")] = None,
    index: Annotated[Optional[str], typer.Option(help="Rank the vectors of a table built by `embedctl index` (x.lance, x.parquet, dir/).")] = None,
    top_k: Annotated[int, typer.Option(help="Documents kept per query.")] = 10,
    reranker: Annotated[Optional[str], typer.Option(help="Cross-encoder model that rescores each query's top hits.")] = None,
    rerank_depth: Annotated[Optional[int], typer.Option(help="Hits per query the reranker rescores (default: --top-k).")] = None,
    qrels: Annotated[Optional[str], typer.Option(help="TREC or JSONL relevance judgements: print nDCG@10, MRR@10, Recall@k.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Write the run to this file (default: stdout).")] = None,
    run_format: Annotated[RunFormat, typer.Option("--format", help="jsonl rows {query_id, doc_id, rank, score}, or a TREC run.")] = RunFormat.jsonl,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --out (at the end, atomically).")] = False,
    model: ModelOpt = None,
    text_col: Annotated[str, typer.Option(help="Column holding the text, in queries and documents.")] = "text",
    id_col: Annotated[str, typer.Option(help="Column holding the id, in queries and documents; when absent, ids are file:row.")] = "id",
    query_prompt: Annotated[str, typer.Option(help="Text put before every query, e.g. 'query: '.")] = "",
    doc_prompt: Annotated[str, typer.Option(help="Text put before every document, e.g. 'passage: '.")] = "",
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Token budget per engine step (default: 16384 on GPU, 2048 on CPU).")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    report: Annotated[Optional[Path], typer.Option(help="Write the summary and metrics as JSON to this file.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary line.")] = False,
) -> None:
    """Rank documents for every query in QUERIES by cosine (bi-encoder), optionally rerank, and write the top-k."""

    def run() -> None:
        _check_report_path(report)
        options = ScoreOptions(queries=queries, docs=docs, index=index, reranker=reranker, rerank_depth=rerank_depth,
                               qrels=qrels, out=out, top_k=top_k, format=run_format.value, overwrite=overwrite,
                               text_col=text_col, id_col=id_col, query_prompt=query_prompt, doc_prompt=doc_prompt)
        inputs = open_inputs(options)  # bad inputs should not wait for a model to load
        config = EngineConfig(device=device, dtype=dtype, max_batch_tokens=max_batch_tokens)
        engine, tokenizer = _load(model, config)
        ranking, metrics = run_score(engine, tokenizer, inputs, options,
                                     reranker=_load(reranker, config) if reranker is not None else None)
        write_run(ranking, options)
        if not quiet:
            typer.echo(ranking.summary(out), err=True)
        if metrics is not None:
            typer.echo(metrics.summary(), err=True)
        if report is not None:
            _write_report(report, json.dumps({**ranking.to_dict(), "metrics": metrics.to_dict() if metrics else None}, indent=2))

    _guarded(run, report)


def _load(model: str | None, config: EngineConfig) -> tuple[Engine, TextTokenizer]:
    engine = Engine.load(model, config)
    return engine, TextTokenizer(engine.files.tokenizer_file, engine.max_length)


def _guarded(run: Callable[[], None], report: Path | None) -> None:
    """Run a command; user errors and interrupts become one line and an exit code."""
    try:
        run()
    except UserError as error:
        _fail(str(error), report)
    except torch.OutOfMemoryError:
        _fail("the GPU ran out of memory; lower --max-batch-tokens or --max-seqs and run again", report)
    except KeyboardInterrupt:
        typer.echo("interrupted; no output was changed", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _fail(message: str, report: Path | None) -> None:
    typer.echo(f"error: {message}", err=True)
    if report is not None:
        try:
            _write_report(report, json.dumps({"error": message}))
        except UserError:
            pass  # the error line above is the message that matters; the report cannot add to it
    raise typer.Exit(EXIT_USER_ERROR)


def _check_report_path(report: Path | None) -> None:
    """Refuse a --report path that cannot be written before the run, not after it."""
    if report is not None and not report.parent.is_dir():
        raise UserError(f"--report {report}: the directory {report.parent} does not exist; "
                        "create it or pick another path")


def _write_report(report: Path, text: str) -> None:
    try:
        report.write_text(text + "\n")
    except OSError as error:
        raise UserError(f"cannot write the report {report} ({error.strerror}); pick a writable --report path") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
