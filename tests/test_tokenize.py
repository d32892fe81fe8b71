"""TextTokenizer cuts long texts before tokenizing them: the ids must be exactly the uncut text's.

Checked for the three tokenizer families embedctl meets: WordPiece (BERT, MiniLM: the real
all-MiniLM-L6-v2 tokenizer), byte-level BPE (Qwen3) and Unigram with Metaspace (XLM-R); the last two
are trained here on the sample corpus, as no such tokenizer ships offline.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engine.checkpoint import resolve_model
from pipelines import tokenize
from pipelines.tokenize import CUT_CHARS_PER_TOKEN, TextTokenizer

CORPUS = sorted(Path("sample_data/corpus").glob("*.parquet"))


def corpus_texts() -> list[str]:
    return [text for path in CORPUS for text in pq.read_table(path).column("text").to_pylist() if text]


def awkward_texts(max_length: int) -> list[str]:
    """Texts whose cut falls on every kind of boundary: inside long words, after runs of spaces and
    newlines, before punctuation, in text without spaces, and texts sparse in tokens (long space runs)."""
    rng = random.Random(0)
    limit = max_length * CUT_CHARS_PER_TOKEN
    words = ["antidisestablishmentarianism", "x", "naïve", "东京都", "don't", "(a,b)", "e=mc²", "\t", "🙂", "GPU-bound"]
    texts = []
    for _ in range(60):
        pieces, size = [], 0
        while size < limit * 1.5:
            piece = rng.choice(words) + rng.choice([" ", "  ", "\n", "\n\n", "", " " * rng.randint(3, 40)])
            pieces.append(piece)
            size += len(piece)
        texts.append("".join(pieces))
    texts.append("a" * (limit * 2))  # no space at all: not cut
    texts.append(("word" + " " * 30) * (limit // 10))  # one token per 34 characters: the cut text fits
    texts.append(" ".join(["tok"] * (max_length - 3)) + " " * (limit) + "tail")  # fits only whole
    # 151 characters a WordPiece token (a word past 100 characters is one [UNK]): cut again and again.
    texts.append(("x" * 150 + " ") * (2 * max_length))
    texts.append(" ".join(["y" * 120] * (max_length // 2) + ["z"] * max_length))  # cut again and again, then whole
    return texts


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


def trained(kind: str, directory: Path) -> Path:
    path = directory / f"{kind}.json"
    if path.exists():
        return path
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=800, unk_token="<unk>", special_tokens=["<unk>"])
    tokenizer.train_from_iterator(corpus_texts(), trainer)
    tokenizer.save(str(path))
    return path


def whole_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """The library's own encoder for the same file: the reference every result must equal."""
    whole = Tokenizer.from_file(str(path))
    whole.no_padding()
    whole.enable_truncation(max_length)
    return whole


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
@pytest.mark.parametrize("max_length", [16, 128])
@pytest.mark.parametrize("chars_per_token", [2, 3, 4, CUT_CHARS_PER_TOKEN])
def test_cut_texts_give_the_whole_texts_tokens(tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                               max_length: int, chars_per_token: int) -> None:
    """Tighter cuts than the real one (2-4 characters per token, about what prose has) put the cut
    right at the last kept token in many texts, where a wrong cut would change it."""
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", chars_per_token)
    path = resolve_model(None).tokenizer_file if kind == "wordpiece" else trained(kind, tokenizers_dir)
    texts = corpus_texts() + awkward_texts(max_length)
    expected = whole_tokenizer(path, max_length).encode_batch_fast([text.strip() for text in texts])

    encoded = TextTokenizer(path, max_length).encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected]
    assert sum(len(text.strip()) > max_length * chars_per_token for text in texts) > 50  # many were cut


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
@pytest.mark.parametrize("chars_per_token", [2, 3, 4, CUT_CHARS_PER_TOKEN])
def test_pairs_with_cut_documents_give_the_whole_pairs_tokens(tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              kind: str, chars_per_token: int) -> None:
    """Short queries (documents cut), queries near half the room, and long queries (both sides
    truncated: encoded whole), each against every document."""
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", chars_per_token)
    path = resolve_model(None).tokenizer_file if kind == "wordpiece" else trained(kind, tokenizers_dir)
    max_length = 64
    docs = corpus_texts()[:80] + awkward_texts(max_length)
    # Half the room is 30 tokens with WordPiece's three special tokens, 32 without any: queries just
    # under and over it, where cutting the document against a query that is too long changes the result.
    queries = ["how do I read a file", *(" ".join(["word"] * n) for n in (29, 30, 31, 32, 33, 36, 45)), docs[0][:2000]]
    pairs = [(query, doc) for query in queries for doc in docs]
    expected = whole_tokenizer(path, max_length).encode_batch_fast([(a.strip(), b.strip()) for a, b in pairs])

    encoded = TextTokenizer(path, max_length).encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert [types.tolist() for types in encoded.type_ids] == [e.type_ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected]
    assert sum(len(doc.strip()) > max_length * chars_per_token for doc in docs) > 50  # many were cut


class CountingTokenizer:
    """Passes every encode_batch_fast to the real tokenizer and keeps the lengths of the texts it got."""

    def __init__(self, real: Tokenizer) -> None:
        self.real, self.calls = real, []

    def encode_batch_fast(self, texts: list[str]) -> list:
        self.calls.append([len(text) for text in texts])
        return self.real.encode_batch_fast(texts)


def test_a_cut_that_falls_short_is_widened_until_it_overflows() -> None:
    """'international ' is one WordPiece token per 14 characters: cuts at 5 and 10 characters per token
    hold too few tokens, the cut at 20 overflows, so the text is encoded three times, never whole."""
    path = resolve_model(None).tokenizer_file
    tokenizer = TextTokenizer(path, 16)
    counting = tokenizer.tokenizer = CountingTokenizer(tokenizer.tokenizer)
    text = "international " * 40

    encoded = tokenizer.encode([text])

    assert encoded.ids[0].tolist() == whole_tokenizer(path, 16).encode(text.strip()).ids
    assert encoded.truncated == [True]
    assert len(counting.calls) == 3 and counting.calls[-1][0] < len(text.strip())
