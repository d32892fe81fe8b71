"""Regenerates the sample corpus in this directory from the benchmark corpus of docstrings.

It picks about 300 prose-like docstrings (mostly words, little code) and writes them as one corpus
in two shards of the two input formats, corpus/part-000.parquet and corpus/part-001.jsonl, so that
`embedctl index sample_data/corpus` reads both; and queries.jsonl: 50 queries, each the first
sentence of one of those documents.
The choice is seeded, so running it again gives the same files. It is not part of embedctl.

    python sample_data/make_sample.py [/work/shared/corpus/docstrings.parquet]
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CORPUS = "/work/shared/corpus/docstrings.parquet"
HERE = Path(__file__).resolve().parent
SEED = 20240601
# How many documents of each length band: mostly medium, a few short, a few long enough to truncate.
BANDS = {"short": 15, "medium": 265, "long": 20}
QUERIES = 50

CODE = re.compile(r">>>|::|[{}=_`\[\]<>|#*$\\]")
LICENSE = re.compile(r"(?i)copyright|licen[sc]e")
FIRST_SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.S)


def prose_share(text: str) -> float:
    """The share of characters in lines that read as prose: four or more words, at most one code sign."""
    lines = text.splitlines()
    prose = [
        line
        for line in lines
        if len(CODE.findall(line)) <= 1
        and len(re.findall(r"[A-Za-z]{2,}", line)) >= 4
        and not re.match(r"\s*-{3,}|\s*\w+ : ", line)  # numpydoc rulers and "name : type" lines
    ]
    return sum(map(len, prose)) / max(1, sum(map(len, lines)))


def band(text: str) -> str | None:
    if LICENSE.search(text):
        return None
    code = len(CODE.findall(text)) / len(text)
    share = prose_share(text)
    # Long docstrings always carry some structure, so they pass a looser bar.
    if len(text) > 2000:
        return "long" if share >= 0.75 and code < 0.02 else None
    if share < 0.85 or code >= 0.01:
        return None
    if len(text) >= 200:
        return "medium"
    return "short" if len(text) >= 100 else None


def first_sentence(text: str) -> str | None:
    match = FIRST_SENTENCE.match(text.split("\n\n")[0])
    if not match:
        return None
    sentence = " ".join(match.group(1).split())
    return sentence if 6 <= len(sentence.split()) <= 30 else None


def main(corpus: str) -> None:
    rows = pq.read_table(corpus, columns=["id", "text", "source"]).to_pylist()
    rng = random.Random(SEED)
    by_band: dict[str, list[dict]] = {name: [] for name in BANDS}
    for row in rows:
        name = band(row["text"])
        if name:
            by_band[name].append(row)
    docs = sorted((row for name, n in BANDS.items() for row in rng.sample(by_band[name], n)), key=lambda r: r["id"])

    half = len(docs) // 2
    (HERE / "corpus").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(docs[:half]), HERE / "corpus" / "part-000.parquet", compression="zstd")
    with open(HERE / "corpus" / "part-001.jsonl", "w", encoding="utf-8") as out:
        for row in docs[half:]:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")

    sentences = {}
    for row in docs:
        sentence = first_sentence(row["text"])
        if sentence and sentence not in sentences.values():
            sentences[row["id"]] = sentence
    picked = sorted(rng.sample(sorted(sentences), QUERIES))
    with open(HERE / "queries.jsonl", "w", encoding="utf-8") as out:
        for n, doc_id in enumerate(picked, 1):
            query = {"id": f"q{n}", "text": sentences[doc_id], "doc_id": doc_id}
            out.write(json.dumps(query, ensure_ascii=False) + "\n")
    with open(HERE / "qrels.txt", "w", encoding="utf-8") as out:
        out.writelines(f"q{n} 0 {doc_id} 1\n" for n, doc_id in enumerate(picked, 1))
    print(f"{len(docs)} documents, {len(picked)} queries written to {HERE}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else CORPUS)
