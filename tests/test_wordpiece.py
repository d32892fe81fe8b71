"""WordPieceWords must give exactly the library's ids for normalized ASCII text, and TextTokenizer must
use it for such texts and pairs (the real all-MiniLM-L6-v2 tokenizer, and variants of it)."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

from engine.checkpoint import resolve_model
from pipelines import wordpiece
from pipelines.tokenize import TextTokenizer, ascii_normalizer
from pipelines.wordpiece import WordPieceWords, spec_of
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


def random_texts(count: int, characters: list[str], lengths: tuple[int, ...] = (1, 3, 8, 101, 150)) -> list[str]:
    """The characters, between letters and digits in words of these lengths (by default some past
    WordPiece's 100)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    texts = []
    for _ in range(count):
        pieces = [rng.choice(characters) if rng.random() < 0.3 else "".join(rng.choices(letters, k=rng.choice(lengths)))
                  for _ in range(rng.randint(0, 60))]
        texts.append("".join(pieces))
    return texts


EVERY_ASCII = [chr(code) for code in range(128)]
# Accents and combining marks, CJK, Unicode punctuation and spaces, characters that lowercase or
# decompose to ASCII (Kelvin sign, Greek question mark) or to two characters, invisible ones.
OTHERS = ["é", "É", "ñ", "ü", "\u0301", "\u0323", "东京", "—", "–", "…", "«", "\u00a0", "\u3000", "\u2028", "\u0085",
          "\u200b", "\u212a", "\u037e", "ß", "İ", "ﬁ", "😀", "Σ", "ς", "\ufffd", "¹", "\u00ad"]
NORMALIZERS = [normalizers.BertNormalizer(), normalizers.BertNormalizer(lowercase=False),
               normalizers.BertNormalizer(strip_accents=False), normalizers.BertNormalizer(clean_text=False),
               normalizers.BertNormalizer(handle_chinese_chars=False), normalizers.Lowercase(), None]


def words_and_library(normalizer: normalizers.Normalizer | None, path: Path) -> tuple[WordPieceWords, Tokenizer]:
    tokenizer = Tokenizer.from_file(str(variant(normalizer, path)))
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    return words, tokenizer


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=repr)
def test_words_give_the_librarys_ids_on_every_ascii_character(tmp_path: Path, normalizer: normalizers.Normalizer | None) -> None:
    """Without clean_text, control characters stay: some split words (\\x0b, \\x0c), others are
    part of them (\\x1c-\\x1f, which Python, unlike the library, counts as whitespace)."""
    words, library = words_and_library(normalizer, tmp_path / "tokenizer.json")
    normalize = ascii_normalizer(spec_of(library.normalizer))
    texts = [text for text in random_texts(300, EVERY_ASCII) + corpus_texts() if text.isascii()]

    expected = [encoding.ids for encoding in library.encode_batch_fast(texts, add_special_tokens=False)]

    assert [words.ids(normalize(text), 1 << 30) for text in texts] == expected
    assert sum(len(ids) for ids in expected) > 20_000


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=repr)
def test_raw_words_give_the_librarys_ids_on_texts_that_are_not_ascii(tmp_path: Path,
                                                                     normalizer: normalizers.Normalizer | None) -> None:
    """Pieces between ASCII spaces and punctuation normalize apart as they do in the whole text; a
    text holding an ASCII control character, or a piece past LONG_PIECE that is not ASCII, is left
    to the library (None)."""
    words, library = words_and_library(normalizer, tmp_path / "tokenizer.json")
    printable = [c for c in EVERY_ASCII if c.isprintable()] + ["\t", "\n", "\r"]
    short = (1, 3, 8)  # so that many texts hold no piece long enough to go to the library
    texts = (random_texts(600, printable + OTHERS * 4, short) + random_texts(200, EVERY_ASCII + OTHERS * 4, short)
             + random_texts(100, printable + OTHERS * 4) + corpus_texts())
    texts = [text for text in texts if not text.isascii()]

    expected = [encoding.ids for encoding in library.encode_batch_fast(texts, add_special_tokens=False)]

    found = [words.raw_ids(text, 1 << 30) for text in texts]
    controls = [any(c in text for c in EVERY_ASCII if not c.isprintable() and c not in "\t\n\r") for text in texts]
    long_pieces = [any(len(piece) > wordpiece.LONG_PIECE and not piece.isascii()
                       for piece in wordpiece._WORDS.findall(text)) for text in texts]
    refused = [control or long for control, long in zip(controls, long_pieces)]
    assert [ids is None for ids in found] == refused
    assert [ids for ids in found if ids is not None] == [ids for ids, no in zip(expected, refused) if not no]
    assert refused.count(False) > 200 and controls.count(True) > 20 and long_pieces.count(True) > 20


@pytest.mark.parametrize("change", ["nfkc", "normalized added token"])
def test_raw_texts_are_left_to_the_library_where_pieces_could_normalize_differently(tmp_path: Path, change: str) -> None:
    tokenizer = minilm()
    if change == "nfkc":  # composes across characters
        tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    else:
        tokenizer.add_tokens([AddedToken("a-b", normalized=True)])
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))

    assert words.raw_ids("naïve", 10) is None and words.ids("naive", 10) == tokenizer.encode("naive", add_special_tokens=False).ids


@pytest.mark.parametrize("chars_per_id", [1, 2, wordpiece.CHARS_PER_ID])
def test_a_limit_gives_at_least_that_many_of_the_texts_first_ids(monkeypatch: pytest.MonkeyPatch, chars_per_id: int) -> None:
    """Texts are split into words a slice at a time; slices sized at one or two characters per id
    end far short of the limit, so most texts take several."""
    monkeypatch.setattr(wordpiece, "CHARS_PER_ID", chars_per_id)
    tokenizer = minilm()
    normalize = ascii_normalizer(spec_of(tokenizer.normalizer))
    words = WordPieceWords.of(tokenizer, normalize)
    texts = corpus_texts() + random_texts(50, EVERY_ASCII + OTHERS)
    whole = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    for limit in (1, 7, 64, 300):
        for text, expected in zip(texts, whole):
            ids = words.ids(normalize(text), limit) if text.isascii() else words.raw_ids(text, limit)
            if ids is not None:
                assert ids == expected[:len(ids)] and len(ids) >= min(limit, len(expected))


def test_texts_split_at_spaces_only_where_python_and_bert_agree_on_them() -> None:
    """Texts are cut into chunks by str.split() unless they hold a character it splits at besides
    ASCII whitespace: those are every such character Python knows."""
    others = {chr(code) for code in range(0x110000) if chr(code).isspace()} - set("\t\n\x0b\x0c\r ")
    assert others == {chr(code) for code in range(0x110000) if wordpiece._OTHER_SPACES.fullmatch(chr(code))}


@pytest.mark.parametrize("space", [" ", "\n", "\t"])
def test_a_limit_stops_the_split_near_it_in_a_long_text(space: str) -> None:
    """The last slices ask for a few ids, fewer characters than a word here: each still ends at the
    next whitespace rather than at the text's end."""
    tokenizer = minilm()
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    text = space.join(["internationalization"] * 5_000)
    per_word = len(tokenizer.encode("internationalization", add_special_tokens=False).ids)

    for limit in (1, 2, 509):
        assert limit <= len(words.ids(text, limit)) < limit + per_word


@pytest.mark.parametrize("kind", ["base64", "minified JSON"])
def test_a_text_without_whitespace_is_split_only_near_the_limit(kind: str) -> None:
    """No whitespace to end a slice at: a slice ends after a punctuation mark instead, so the words of
    a megabyte of base64 or JSON are looked up only as far as the limit."""
    tokenizer = minilm()
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    learned = []
    model = words._model
    words._model = type("Counting", (), {"tokenize": lambda _, word: learned.append(word) or model.tokenize(word)})()
    rng = random.Random(0)
    text = (base64.b64encode(rng.randbytes(750_000)).decode() if kind == "base64" else
            json.dumps([{"id": i, "name": f"item{i}", "tags": ["a", "b"]} for i in range(20_000)], separators=(",", ":")))

    ids = words.ids(text.lower(), 300)

    assert ids == tokenizer.encode(text, add_special_tokens=False).ids[:len(ids)] and len(ids) >= 300
    assert sum(map(len, learned)) < 300 * wordpiece.CHARS_PER_ID * 2  # of 1,000,000 characters


def test_stretches_between_spaces_are_cached_and_long_pieces_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stretch seen once is found whole the next time, none of its words looked up again; a piece
    longer than LONG_PIECE is tokenized each time instead of held."""
    tokenizer = minilm()
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    long_piece = "x" * (wordpiece.LONG_PIECE + 1)
    text = f"read(path, mode) -> bytes: {long_piece} opens it"
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert words.ids(text, 100) == expected
    stretches, learned = [], []
    learn_stretch, learn = words._learn_stretch, words._learn
    monkeypatch.setattr(words, "_learn_stretch",
                        lambda stretch, **kwargs: stretches.append(stretch) or learn_stretch(stretch, **kwargs))
    monkeypatch.setattr(words, "_learn", lambda word: learned.append(word) or learn(word))

    assert words.ids(text, 100) == expected
    assert stretches == learned == [long_piece]


def test_a_text_with_a_long_piece_that_is_not_ascii_goes_to_the_library() -> None:
    tokenizer = minilm()
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    paragraph = "东京" * (wordpiece.LONG_PIECE // 2) + "。"

    assert words.raw_ids(f"café {paragraph}", 4) is None
    shorter = f"café {paragraph[:-2]}"
    found = words.raw_ids(shorter, 4)
    assert found is not None and len(found) >= 4
    assert found == tokenizer.encode(shorter, add_special_tokens=False).ids[:len(found)]


def test_the_cache_starts_again_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wordpiece, "MAX_CACHED", 8)
    tokenizer = minilm()
    words = WordPieceWords.of(tokenizer, ascii_normalizer(spec_of(tokenizer.normalizer)))
    texts = [text for text in corpus_texts()[:40] if text.isascii()]

    assert [words.ids(text.lower(), 1 << 30) for text in texts] == [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    assert 0 < len(words._cache) <= 8


@pytest.mark.parametrize("kind", ["bpe", "qwen", "unigram", "whitespace"])
def test_only_bert_style_wordpiece_tokenizers_split_into_words_here(tokenizers_dir: Path, kind: str) -> None:
    if kind == "whitespace":  # WordPiece, but words split as \w+|[^\w\s]+, which keeps runs of punctuation
        tokenizer = minilm()
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_path(kind, tokenizers_dir)))
        tokenizer.no_truncation()
    assert WordPieceWords.of(tokenizer, str) is None
    assert WordPieceWords.of(minilm(), str) is not None


def test_ascii_texts_and_pairs_skip_the_library_and_give_its_ids() -> None:
    """Texts, and pairs whose query has at most half of the room, never reach the library; those holding
    a special token's text, non-ASCII ones holding an ASCII control character and long queries do,
    and all give its ids."""
    path, max_length = resolve_model(None).tokenizer_file, 48
    texts = corpus_texts()[:200] + ["naïve café", "naïve\x0bcafé", "the [SEP] token as text", "\t Tabs\tand\x0bCAPITALS \n", ""]
    queries = ["How do I read a FILE?", "x", " ".join(["word"] * 30)]
    pairs = [(query, text) for query in queries for text in texts]
    for_texts, for_pairs = TextTokenizer(path, max_length), TextTokenizer(path, max_length)
    for tokenizer in (for_texts, for_pairs):
        tokenizer._bare_pieces  # noqa: B018 - copied from the real tokenizer, before it is wrapped below
        tokenizer.tokenizer, tokenizer._bare = CountingTokenizer(tokenizer.tokenizer), CountingTokenizer(tokenizer._bare)

    encoded = for_texts.encode(texts)
    encoded_pairs = for_pairs.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    expected = whole_tokenizer(path, max_length).encode_batch_fast(texts)
    expected_pairs = whole_tokenizer(path, max_length).encode_batch_fast(pairs)
    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected] and any(encoded.truncated)
    assert [ids.tolist() for ids in encoded_pairs.ids] == [e.ids for e in expected_pairs]
    assert [types.tolist() for types in encoded_pairs.type_ids] == [e.type_ids for e in expected_pairs]
    assert encoded_pairs.truncated == [bool(e.overflowing) for e in expected_pairs] and any(encoded_pairs.truncated)
    library_texts = [text for text in texts if "[SEP]" in text or (not text.isascii() and "\x0b" in text)]
    library_pairs = [(a, b) for a, b in pairs if b in library_texts or a == queries[-1]]
    assert for_texts._bare.calls == [] and len(for_texts.tokenizer.calls[0]) == len(library_texts) > 0
    assert sum(len(call) for counting in (for_pairs.tokenizer, for_pairs._bare) for call in counting.calls) == len(library_pairs)
    assert 0 < len(library_pairs) < len(pairs) // 2 and any(not text.isascii() for text in texts if text not in library_texts)


def test_a_tokenizer_not_by_words_leaves_every_text_to_the_library() -> None:
    """What index's threads use: the library, which releases the GIL while it works."""
    path, texts = resolve_model(None).tokenizer_file, [text for text in corpus_texts()[:50] if text.isascii()]
    tokenizer = TextTokenizer(path, 48, by_words=False)
    tokenizer._bare = CountingTokenizer(tokenizer._bare)

    encoded = tokenizer.encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in whole_tokenizer(path, 48).encode_batch_fast(texts)]
    assert len(tokenizer._bare.calls[0]) == len(texts) > 40
