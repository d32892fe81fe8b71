"""Relevance judgements (qrels) and the retrieval metrics of a run against them.

Qrels come as a TREC qrels file (`query_id iteration doc_id relevance` per line), as BEIR's qrels TSV
(`query-id corpus-id score`, its header line too) or as JSONL rows {"query_id", "doc_id", "relevance"},
under BEIR's and MTEB's key names too ("query-id", "corpus-id", "score"); a row without a grade is a
relevant pair (relevance 1) only when it holds nothing but the two ids, so that a grade under a key of
another name is refused rather than read as relevant. Metrics follow trec_eval's definitions: nDCG@10 with linear
gains (relevance / log2(rank + 1), ideal order from the judgements), MRR@10 (reciprocal rank of the
first relevant document in the top 10) and Recall@k (relevant documents found in the run's top k over
all relevant ones); a document is relevant when its relevance is above 0. Averages are over the
queries the qrels judge, as trec_eval's and pytrec_eval's (and so BEIR's and MTEB's): one whose judgements are
all 0 or below scores 0 on each metric; queries the qrels do not name are counted, not scored. Each judged
query's own figures are kept too, as `trec_eval -q` prints them. Hits of equal score are taken in trec_eval's
order (trec_order), so that a run file given to trec_eval scores as printed, when it holds ten hits a
query: nDCG@10 and MRR@10 look ten deep whatever the run file keeps, and the summary says so when it
keeps fewer.
Judged documents that are not among the documents ranked are normal (judgements pool many systems'
runs over a larger corpus): they are scored as trec_eval scores them, the relevant ones as never found,
and counted apart so that the caller can warn, since with a wrong id column almost none are found.
So are judged queries that rank a document of their own id that the qrels do not judge relevant: where
queries are also documents (ArguAna, Quora), BEIR and MTEB drop that document (`--ignore-identical-ids`).

It reads no runs from files and computes no statistical tests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import fsspec

from engine.errors import UserError, short_reason
from pipelines.progress import plural
from pipelines.readers import id_text

CUTOFF = 10
# A JSONL judgement's keys: ours first, then BEIR's and MTEB's.
QUERY_KEYS, DOC_KEYS, GRADE_KEYS = ("query_id", "query-id"), ("doc_id", "corpus-id"), ("relevance", "score")
BEIR_HEADER = ["query-id", "corpus-id", "score"]
EXAMPLES = 3  # judged documents missing from the ranked set named in the warning

Qrels = dict[str, dict[str, int]]  # query id -> doc id -> relevance


@dataclass(frozen=True)
class Metrics:
    ndcg_at_10: float
    mrr_at_10: float
    recall_at_k: float
    k: int
    queries_scored: int
    queries_unjudged: int
    docs_missing: int  # judged documents that are not among the documents ranked
    docs_missing_examples: tuple[str, ...]  # the first few of them, sorted
    own_ids_ranked: int  # judged queries that rank a document of their own id, which their qrels do not judge relevant
    per_query: dict[str, tuple[float, float, float]]  # each judged query's (nDCG@10, MRR@10, Recall@k), in run order

    def summary(self) -> str:
        return (f"nDCG@10 {self.ndcg_at_10:.4f}, MRR@10 {self.mrr_at_10:.4f}, Recall@{self.k} {self.recall_at_k:.4f} "
                f"over {plural(self.queries_scored, 'judged query', 'judged queries')} "
                f"({self.queries_unjudged:,} without judgements)"
                + (f"; nDCG@10 and MRR@10 look {CUTOFF} hits deep, past the {self.k} a query the run file holds"
                   if self.k < CUTOFF else ""))

    def warnings(self) -> list[str]:
        """What to tell the user about the qrels and the run, each to follow the words `--qrels FILE`."""
        warnings = []
        if self.docs_missing:
            examples = ", ".join(map(repr, self.docs_missing_examples))
            warnings.append(f"judges {plural(self.docs_missing, 'document')} not among the documents ranked (e.g. "
                            f"{examples}); scored as trec_eval does, the relevant ones as not found; if that is most of "
                            "them, check the documents and --id-col")
        if self.own_ids_ranked:
            warnings.append(f"does not judge relevant the document of their own id that "
                            f"{plural(self.own_ids_ranked, 'judged query ranks', 'judged queries rank')}; BEIR drops "
                            "such a document, as MTEB does for ArguAna and Quora, where queries are also documents: "
                            "pass --ignore-identical-ids to score as they do")
        return warnings

    def to_dict(self) -> dict[str, object]:
        return {**self._named(self.ndcg_at_10, self.mrr_at_10, self.recall_at_k),
                "queries_scored": self.queries_scored, "queries_unjudged": self.queries_unjudged,
                "judged_docs_missing": self.docs_missing, "own_ids_ranked": self.own_ids_ranked,
                "per_query": {query_id: self._named(*figures) for query_id, figures in self.per_query.items()}}

    def _named(self, ndcg: float, mrr: float, recall: float) -> dict[str, float]:
        return {"ndcg@10": round(ndcg, 6), "mrr@10": round(mrr, 6), f"recall@{self.k}": round(recall, 6)}


def read_qrels(path: str, query_ids: Sequence[str]) -> Qrels:
    """The judgements in path; a query the run does not have is an error (a wrong file or id column)."""
    try:
        # -sig: a byte order mark is not part of line 1; infer: qrels.txt.gz is read as the corpus's .jsonl.gz are
        with fsspec.open(path, "rt", encoding="utf-8-sig", compression="infer") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError:
        raise UserError(f"cannot read --qrels {path}: it is not UTF-8 text; give a TREC qrels or JSONL qrels file "
                        "(plain or gzip-compressed as .gz)") from None
    except (OSError, ValueError, EOFError) as error:
        raise UserError(f"cannot read --qrels {path} ({short_reason(error)}); check the path") from None
    qrels: Qrels = {}
    first_lines: dict[tuple[str, str], int] = {}
    beir = bool(lines) and lines[0].split() == BEIR_HEADER
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if (judgement := _parse(path, number, line, beir)) is None:
            continue
        query_id, doc_id, relevance = judgement
        judged = qrels.setdefault(query_id, {})
        if judged.get(doc_id, relevance) != relevance:
            # trec_eval refuses any repeated judgement; one repeated as it was changes nothing and passes here.
            raise UserError(f"--qrels {path} line {number}: query {query_id!r} document {doc_id!r} is judged "
                            f"{relevance} here and {judged[doc_id]} on line {first_lines[query_id, doc_id]}; "
                            "keep one judgement per pair")
        judged[doc_id] = relevance
        first_lines.setdefault((query_id, doc_id), number)
    if not qrels:
        raise UserError(f"--qrels {path} holds no judgements; give a TREC qrels or JSONL qrels file")
    known = set(query_ids)
    unknown = [query_id for query_id in qrels if query_id not in known]
    if unknown:
        raise UserError(f"--qrels {path} judges {plural(len(unknown), 'query', 'queries')} not in the query set "
                        f"(first: {unknown[0]!r}); use the qrels of these queries or check --query-id-col")
    return qrels


def trec_order(doc_ids: Sequence[str], scores: Sequence[float]) -> list[str]:
    """A query's hits as trec_eval reads them from a run file, whose rank column it ignores: by score, high
    first, and equal scores (duplicate documents) by doc id from the last, as its strcmp orders them."""
    by_id = sorted(zip(doc_ids, scores), key=lambda hit: hit[0], reverse=True)
    return [doc_id for doc_id, _ in sorted(by_id, key=lambda hit: -hit[1])]


def evaluate(query_ids: Sequence[str], doc_ids: Sequence[Sequence[str]], qrels: Qrels, k: int,
             documents: Iterable[str], written: Sequence[Sequence[str]] | None = None) -> Metrics:
    """Metrics of a run: doc_ids[q] is query q's ranked list, best first (trec_order), out of documents
    (every id ranked). Recall@k counts written[q], the hits the run file holds (by default doc_ids[q][:k]):
    where equal scores straddle rank k, trec_order may put another of them in the first k."""
    written = written if written is not None else [ranked[:k] for ranked in doc_ids]
    per_query: dict[str, tuple[float, float, float]] = {}
    own_ids_ranked = 0
    for query_id, ranked, kept in zip(query_ids, doc_ids, written):
        judged = qrels.get(query_id)
        if judged is None:
            continue
        relevant = {doc for doc, relevance in judged.items() if relevance > 0}
        gains = [max(judged.get(doc, 0), 0) for doc in ranked[:CUTOFF]]
        ideal = sorted((relevance for relevance in judged.values() if relevance > 0), reverse=True)[:CUTOFF]
        first = next((rank for rank, doc in enumerate(ranked[:CUTOFF], start=1) if doc in relevant), None)
        per_query[query_id] = (_dcg(gains) / _dcg(ideal) if ideal else 0.0, 1.0 / first if first else 0.0,
                               len(relevant.intersection(kept)) / len(relevant) if relevant else 0.0)
        if query_id not in relevant and query_id in {*ranked[:CUTOFF], *kept}:
            own_ids_ranked += 1
    ndcg, mrr, recall = (_mean(figures) for figures in zip(*per_query.values())) if per_query else (0.0, 0.0, 0.0)
    missing = sorted({doc for judged in qrels.values() for doc in judged}.difference(documents))
    return Metrics(ndcg_at_10=ndcg, mrr_at_10=mrr, recall_at_k=recall, k=k, queries_scored=len(per_query),
                   queries_unjudged=len(query_ids) - len(per_query), docs_missing=len(missing),
                   docs_missing_examples=tuple(missing[:EXAMPLES]), own_ids_ranked=own_ids_ranked, per_query=per_query)


def _parse(path: str, number: int, line: str, beir: bool) -> tuple[str, str, int] | None:
    """Line `number`'s judgement, or None for BEIR's header line. beir: the file starts with that header, so its
    lines have BEIR's three fields; else TREC's four (a TREC line missing its doc id must not pass for BEIR's)."""
    if line.lstrip().startswith("{"):
        return _parse_json(path, number, line)
    fields = line.split()
    if beir and number == 1:
        return None
    if len(fields) != (3 if beir else 4) or not _is_int(fields[-1]):
        expected = ("'query-id corpus-id score', as its BEIR header says," if beir
                    else "'query_id iteration doc_id relevance' (TREC)")
        raise UserError(f"--qrels {path} line {number}: expected {expected} with an integer relevance, got "
                        f"{line.strip()[:80]!r}; fix the line")
    return fields[0], fields[-2], int(fields[-1])


def _parse_json(path: str, number: int, line: str) -> tuple[str, str, int]:
    try:
        row = json.loads(line)
        query_key, doc_key, grade_key = (_key(row, keys) for keys in (QUERY_KEYS, DOC_KEYS, GRADE_KEYS))
        query_id, doc_id = _json_id(row[query_key]), _json_id(row[doc_key])
        relevance = _json_relevance(row[grade_key]) if grade_key is not None else None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--qrels {path} line {number}: not a JSON object with query_id, doc_id and an integer "
                        "relevance; fix the line") from None
    if relevance is None:
        others = sorted(set(row).difference({query_key, doc_key}))
        if others:
            raise UserError(f"--qrels {path} line {number}: no relevance key (its keys: {', '.join(row)}); name the "
                            "grade relevance (or score), or keep only query_id and doc_id for a relevant pair")
        relevance = 1
    return query_id, doc_id, relevance


def _key(row: dict, names: tuple[str, ...]) -> str | None:
    """The first of names that row holds (ours before BEIR's), or None."""
    return next((name for name in names if name in row), None)


def _json_id(value: object) -> str:
    """A JSON id as the corpus readers read one (pipelines.readers.id_text): 10.0 is document "10" there,
    so it must be here. A value that names no row raises: an object or list (TypeError), a boolean or
    NaN (id_text's ValueError)."""
    if not isinstance(value, (str, int, float)):
        raise TypeError(value)
    return id_text(value)


def _json_relevance(value: object) -> int:
    """An integer relevance, as a JSON number without a fraction (1 or 1.0) or a string of digits.

    int() alone would turn 0.5 into 0 (a relevant document judged irrelevant) and true into 1.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _is_int(value):
        return int(value)
    raise ValueError(f"relevance {value!r} is not an integer")


def _is_int(text: str) -> bool:
    """An optional minus and ASCII digits, which int() reads (str.isdigit also passes "²", which it does not)."""
    digits = text.removeprefix("-")
    return digits.isascii() and digits.isdigit()


def _dcg(gains: Sequence[int]) -> float:
    return sum(gain / math.log2(rank + 1) for rank, gain in enumerate(gains, start=1))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
