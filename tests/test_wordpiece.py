"""WordPieceWords must give exactly the library's ids for normalized ASCII text, and TextTokenizer must
use it for such texts and pairs (the real all-MiniLM-L6-v2 tokenizer, and variants of it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from engine.checkpoint import resolve_model
from pipelines import wordpiece
from pipelines.tokenize import TextTokenizer, _spec, ascii_normalizer
from pipelines.wordpiece import WordPieceWords
from tests.test_tokenize import CountingTokenizer, corpus_texts, tokenizer_path, whole_tokenizer


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


def minilm() -> Tokenizer:
    """The real tokenizer, without the padding and truncation its file asks for."""
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def variant(normalizer: normalizers.Normalizer | None, path: Path) -> Path:
    tokenizer = minilm()
    tokenizer.normalizer = normalizer
    tokenizer.save(str(path))
    return path


def random_ascii_texts(count: int) -> list[str]:
    """Every ASCII character, in words of every length (past WordPiece's 100 characters too)."""
    rng = random.Random(0)
    every = [chr(code) for code in range(128)]
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    texts = []
    for _ in range(count):
        pieces = [rng.choice(every) if rng.random() < 0.3 else "".join(rng.choices(letters, k=rng.choice([1, 3, 8, 101, 150])))
                  for _ in range(rng.randint(0, 60))]
        texts.append("".join(pieces))
    return texts


@pytest.mark.parametrize("normalizer", [normalizers.BertNormalizer(), normalizers.BertNormalizer(lowercase=False),
                                        normalizers.BertNormalizer(clean_text=False), None], ids=repr)
def test_words_give_the_librarys_ids_on_every_ascii_character(tmp_path: Path, normalizer: normalizers.Normalizer | None) -> None:
    """Without clean_text, control characters stay: some split words (\\x0b, \\x0c), others are
    part of them (\\x1c-\\x1f, which Python, unlike the library, counts as whitespace)."""
    tokenizer = Tokenizer.from_file(str(variant(normalizer, tmp_path / "tokenizer.json")))
    normalize = ascii_normalizer(_spec(tokenizer.normalizer))
    texts = [normalize(text) for text in random_ascii_texts(300) + corpus_texts() if text.isascii()]
    tokenizer.normalizer = None  # the texts are in normal form already
    words = WordPieceWords.of(tokenizer)

    expected = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    assert [words.ids(text, 1 << 30) for text in texts] == expected
    assert sum(len(ids) for ids in expected) > 20_000


@pytest.mark.parametrize("chars_per_id", [1, 2, wordpiece.CHARS_PER_ID])
def test_a_limit_gives_at_least_that_many_of_the_texts_first_ids(monkeypatch: pytest.MonkeyPatch, chars_per_id: int) -> None:
    """Texts are split into words a slice at a time; slices sized at one or two characters per id
    end far short of the limit, so most texts take several."""
    monkeypatch.setattr(wordpiece, "CHARS_PER_ID", chars_per_id)
    tokenizer = minilm()
    normalize = ascii_normalizer(_spec(tokenizer.normalizer))
    texts = [normalize(text) for text in corpus_texts() + random_ascii_texts(50) if text.isascii()]
    tokenizer.normalizer = None
    words = WordPieceWords.of(tokenizer)
    whole = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    for limit in (1, 7, 64, 300):
        for text, expected in zip(texts, whole):
            ids = words.ids(text, limit)
            assert ids == expected[:len(ids)] and len(ids) >= min(limit, len(expected))


def test_the_cache_starts_again_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wordpiece, "MAX_WORDS", 8)
    tokenizer = minilm()
    tokenizer.normalizer = None
    words = WordPieceWords.of(tokenizer)
    texts = [text.lower() for text in corpus_texts()[:40] if text.isascii()]

    assert [words.ids(text, 1 << 30) for text in texts] == [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    assert 0 < len(words._cache) <= 8


@pytest.mark.parametrize("kind", ["bpe", "qwen", "unigram", "whitespace"])
def test_only_bert_style_wordpiece_tokenizers_split_into_words_here(tokenizers_dir: Path, kind: str) -> None:
    if kind == "whitespace":  # WordPiece, but words split as \w+|[^\w\s]+, which keeps runs of punctuation
        tokenizer = minilm()
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_path(kind, tokenizers_dir)))
        tokenizer.no_truncation()
    assert WordPieceWords.of(tokenizer) is None
    assert WordPieceWords.of(minilm()) is not None


def test_ascii_texts_and_pairs_skip_the_library_and_give_its_ids() -> None:
    """ASCII texts, and ASCII pairs whose query has at most half of the room, never reach the library;
    non-ASCII ones, those holding a special token's text and long queries do, and all give its ids."""
    path, max_length = resolve_model(None).tokenizer_file, 48
    texts = corpus_texts()[:200] + ["naïve café", "the [SEP] token as text", "\t Tabs\tand CAPITALS \n", ""]
    queries = ["How do I read a FILE?", "x", " ".join(["word"] * 30)]
    pairs = [(query, text) for query in queries for text in texts]
    for_texts, for_pairs = TextTokenizer(path, max_length), TextTokenizer(path, max_length)
    for tokenizer in (for_texts, for_pairs):
        tokenizer._bare_pieces  # noqa: B018 - copied from the real tokenizer, before it is wrapped below
        tokenizer.tokenizer, tokenizer._bare = CountingTokenizer(tokenizer.tokenizer), CountingTokenizer(tokenizer._bare)

    encoded = for_texts.encode(texts)
    encoded_pairs = for_pairs.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    expected = whole_tokenizer(path, max_length).encode_batch_fast([text.strip() for text in texts])
    expected_pairs = whole_tokenizer(path, max_length).encode_batch_fast([(a.strip(), b.strip()) for a, b in pairs])
    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected] and any(encoded.truncated)
    assert [ids.tolist() for ids in encoded_pairs.ids] == [e.ids for e in expected_pairs]
    assert [types.tolist() for types in encoded_pairs.type_ids] == [e.type_ids for e in expected_pairs]
    assert encoded_pairs.truncated == [bool(e.overflowing) for e in expected_pairs] and any(encoded_pairs.truncated)
    library_texts = [text for text in texts if not text.isascii() or "[SEP]" in text]
    library_pairs = [(a, b) for a, b in pairs if b in library_texts or a == queries[-1]]
    assert for_texts._bare.calls == [] and len(for_texts.tokenizer.calls[0]) == len(library_texts) > 0
    assert sum(len(call) for counting in (for_pairs.tokenizer, for_pairs._bare) for call in counting.calls) == len(library_pairs)
    assert 0 < len(library_pairs) < len(pairs) // 2
