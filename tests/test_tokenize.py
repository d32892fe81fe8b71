"""TextTokenizer's shortcuts must give exactly the library's ids for the whole text or pair.

It cuts long texts before tokenizing them, normalizes ASCII texts itself, and tokenizes pairs'
documents in pieces. Checked for the three tokenizer families embedctl meets: WordPiece (BERT,
MiniLM: the real all-MiniLM-L6-v2 tokenizer), byte-level BPE (Qwen3) and Unigram with Metaspace and
NFKC (XLM-R); the last two are trained here on the sample corpus, as no such tokenizer ships offline.
"""

from __future__ import annotations

import base64
import itertools
import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.checkpoint import resolve_model
from pipelines import tokenize
from pipelines.tokenize import CUT_CHARS_PER_TOKEN, TextTokenizer, ascii_normalizer, encode_cut, more_tokens_than

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
    # ASCII only, so normalized here: control characters, every kind of line break, capitals, and the
    # special tokens' texts in both cases (which the library matches before normalizing).
    ascii_words = ["Word", "x", "[CLS]", "[mask]", "[SEP]x", "a\x00b", "c\x0bd", "e\x7f", "\r\n", "TAB\tX", "(a,b)", "don't"]
    for _ in range(30):
        pieces, size = [], 0
        while size < limit * 1.5:
            piece = rng.choice(ascii_words) + rng.choice([" ", "  ", "\n", "", " " * rng.randint(3, 40)])
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


def cjk_texts(max_length: int) -> list[str]:
    """Chinese and Japanese with few spaces or none: BERT-style tokenizers cut them between two Chinese
    characters, never before a combining mark or beside kana, digits or Latin letters."""
    rng = random.Random(0)
    pieces = ["东京", "大学", "は", "の", "。", "、", "日本語", "东\u0301", "ｶﾀｶﾅ", "𠀋", "豈", "abc", "１２", "한국"]
    texts = []
    for _ in range(20):
        text = ""
        while len(text) < max_length * CUT_CHARS_PER_TOKEN * 1.5:
            text += rng.choice(pieces) + rng.choice(["", "", "", "", " ", "\n"])
        texts.append(text)
    return texts


def punctuated_texts(max_length: int) -> list[str]:
    """Texts without spaces, cut at punctuation marks (cut_points): beside letters, digits, kana and
    Chinese characters that a space-splitting pattern ends a piece with, and beside those it does not
    (an underscore, a combining mark, U+0958 क़ which NFC splits, an unassigned code point, symbols, other marks)."""
    rng = random.Random(1)
    pieces = ["abc", "x", "Q", "42", "东京", "は", "カナ", "\u00e9", "q\u0303", "\u0958", "_", "'s", "'S", ",", ".", "，", "。",
              "、", "!?", "(", ")", "<", ">", "|", "+", "/", "=", "²", "Ⅻ", "ﬁ", "Σ", "\ufada", "\u0301", "—", "...",
              "[SEP]", "[", "]"]
    texts = []
    for _ in range(24):
        text = ""
        while len(text) < max_length * CUT_CHARS_PER_TOKEN * 1.5:
            text += rng.choice(pieces)
        texts.append(text)
    return texts


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


# Qwen2's and Qwen3's pre-tokenizer pattern, as their tokenizer.json spells it.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def trained(kind: str, directory: Path) -> Path:
    """A tokenizer of the family `kind` trained on the sample corpus: bpe (GPT-2's byte-level BPE),
    qwen (Qwen3's: NFC, its Split pattern, then byte-level), bpe-whole (BPE with no pre-tokenizer,
    which merges across spaces: nothing may be cut or split in pieces), bpe-whitespace (BPE after the
    Whitespace pre-tokenizer) or unigram (XLM-R's)."""
    path = directory / f"{kind}.json"
    if path.exists():
        return path
    if kind in ("bpe", "qwen", "bpe-whole", "bpe-whitespace"):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        if kind == "bpe":
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        elif kind == "bpe-whitespace":  # the Whitespace pre-tokenizer's \w+|[^\w\s]+
            tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        elif kind == "qwen":
            tokenizer.normalizer = normalizers.NFC()
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=800, unk_token="<unk>", special_tokens=["<unk>"])
    tokenizer.train_from_iterator(corpus_texts() + punctuated_texts(128), trainer)  # merges across its marks too
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A:0 $B:1")  # as cross-encoders have
    tokenizer.save(str(path))
    return path


def whole_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """The library's own encoder for the same file: the reference every result must equal."""
    whole = Tokenizer.from_file(str(path))
    whole.no_padding()
    whole.enable_truncation(max_length)
    return whole


@pytest.mark.parametrize("kind", ["wordpiece", "wordpiece-library", "bpe", "qwen", "bpe-whole", "unigram"])
@pytest.mark.parametrize("max_length", [16, 128])
@pytest.mark.parametrize("chars_per_token", [2, 3, 4, CUT_CHARS_PER_TOKEN])
def test_cut_texts_give_the_whole_texts_tokens(tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                               max_length: int, chars_per_token: int) -> None:
    """Tighter cuts than the real one (2-4 characters per token, about what prose has) put the cut
    right at the last kept token in many texts, where a wrong cut would change it."""
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", chars_per_token)
    path = tokenizer_path(kind, tokenizers_dir)
    texts = corpus_texts() + awkward_texts(max_length) + cjk_texts(max_length) + punctuated_texts(max_length)
    expected = whole_tokenizer(path, max_length).encode_batch_fast(texts)

    encoded = TextTokenizer(path, max_length, by_words=by_words(kind)).encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected]
    assert sum(len(text.strip()) > max_length * chars_per_token for text in texts) > 50  # many were cut


@pytest.mark.parametrize("kind", ["wordpiece", "wordpiece-library", "bpe", "qwen", "bpe-whole", "unigram"])
@pytest.mark.parametrize("chars_per_token", [2, 3, 4, CUT_CHARS_PER_TOKEN])
@pytest.mark.parametrize("cores", [10_000, 1], ids=["pieces", "tokenizer-pairs"])
def test_pairs_with_cut_documents_give_the_whole_pairs_tokens(tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              kind: str, chars_per_token: int, cores: int) -> None:
    """Short queries (documents cut), queries near half the room, and long queries (both sides
    truncated: encoded whole), each against every document; with fewer pairs than cores the pairs are
    put together here from pieces, with more the tokenizer encodes (query, cut) pairs."""
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", chars_per_token)
    monkeypatch.setattr(tokenize, "CORES", cores)
    path = tokenizer_path(kind, tokenizers_dir)
    max_length = 64
    docs = corpus_texts()[:80] + awkward_texts(max_length) + punctuated_texts(max_length)
    # Half the room is 30 tokens with WordPiece's three special tokens, 32 without any: queries just
    # under and over it, where cutting the document against a query that is too long changes the result.
    queries = ["how do I read a file", *(" ".join(["word"] * n) for n in (29, 30, 31, 32, 33, 36, 45)), docs[0][:2000]]
    pairs = [(query, doc) for query in queries for doc in docs]
    expected = whole_tokenizer(path, max_length).encode_batch_fast(pairs)

    tokenizer = TextTokenizer(path, max_length, by_words=by_words(kind))
    encoded = tokenizer.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert [types.tolist() for types in encoded.type_ids] == [e.type_ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected]
    assert sum(len(doc.strip()) > max_length * chars_per_token for doc in docs) > 50  # many were cut


def test_more_pairs_than_cores_tokenize_only_their_documents_cuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short query against long ASCII documents, one pair per core and more: the tokenizer encodes
    (query, cut) pairs, widening the cuts of code that has more than five characters per token, and
    never a whole document; the ids are the whole pairs' ids."""
    monkeypatch.setattr(tokenize, "CORES", 1)
    path, max_length, query = resolve_model(None).tokenizer_file, 64, "how do I read a file"
    docs = [text for text in corpus_texts() if text.isascii() and len(text) > 4 * max_length * CUT_CHARS_PER_TOKEN][:12]
    expected = whole_tokenizer(path, max_length).encode_batch_fast([(query, doc) for doc in docs])
    tokenizer = TextTokenizer(path, max_length, by_words=False)  # the library's route, which words would bypass
    tokenizer._bare_pieces  # noqa: B018 - makes the copy that counts the query's tokens, before the wrapping below
    tokenizer.tokenizer, tokenizer._bare = CountingTokenizer(tokenizer.tokenizer), CountingTokenizer(tokenizer._bare)

    encoded = tokenizer.encode_pairs([query] * len(docs), docs)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [True] * len(docs) == [bool(e.overflowing) for e in expected]
    assert len(docs) == 12 and tokenizer.tokenizer.calls == []
    first, *widened = tokenizer._bare.calls
    assert len(first) == len(docs) and widened  # some cuts were too short and were widened
    assert max(itertools.chain(*tokenizer._bare.calls)) < len(query) + min(len(doc.strip()) for doc in docs)


class CountingTokenizer:
    """Passes every call to the real tokenizer and keeps the lengths of the texts (or pairs) it encoded."""

    def __init__(self, real: Tokenizer) -> None:
        self.real, self.calls = real, []

    def encode_batch_fast(self, texts: list, **options: bool) -> list:
        self.calls.append([len(text) if isinstance(text, str) else sum(map(len, text)) for text in texts])
        return self.real.encode_batch_fast(texts, **options)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


@pytest.mark.parametrize("by_words", [True, False])
def test_long_chinese_texts_are_cut_between_chinese_characters(by_words: bool) -> None:
    """Chinese has no spaces to cut at: the library sees only a cut of each long text, and gives its
    whole text's first tokens."""
    path, max_length = resolve_model(None).tokenizer_file, 64
    texts = ["东京大学的研究" * 2000, "日本語の文章です。" * 2000, "中文 " + "数据" * 3000]
    expected = whole_tokenizer(path, max_length).encode_batch_fast(texts)
    tokenizer = TextTokenizer(path, max_length, by_words=by_words)
    tokenizer.tokenizer = CountingTokenizer(tokenizer.tokenizer)

    encoded = tokenizer.encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected] and all(encoded.truncated)
    assert max(itertools.chain.from_iterable(tokenizer.tokenizer.calls)) <= max_length * CUT_CHARS_PER_TOKEN


def test_the_characters_the_library_keeps_in_words_are_no_cut_point(tmp_path: Path) -> None:
    # U+2B820-U+2B91F lie inside Extension E but outside tokenizers' list of Chinese characters: a run of them is
    # one word, and a word of more than 100 characters is one [UNK], which a cut inside it would break into pieces
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    vocab |= {"\U0002b820": len(vocab), "##\U0002b821": len(vocab) + 1}
    tokenizer.model = models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100)
    tokenizer.save(str(tmp_path / "extension-e.json"))
    texts = ["\U0002b820" + "\U0002b821" * 150, "东京" + "\U0002b820\U0002b821" * 60]
    expected = whole_tokenizer(tmp_path / "extension-e.json", 8).encode_batch_fast(texts)
    for by_words in (True, False):
        encoded = TextTokenizer(tmp_path / "extension-e.json", 8, by_words=by_words).encode(texts)
        assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]


def test_chinese_characters_are_no_cut_point_where_they_need_not_be_words_of_their_own(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    assert TextTokenizer(resolve_model(None).tokenizer_file, 64)._cut_points.search("东京")
    tokenizer.normalizer = normalizers.BertNormalizer(handle_chinese_chars=False)
    tokenizer.save(str(tmp_path / "no-chinese.json"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.add_tokens(["东京"])
    tokenizer.save(str(tmp_path / "added.json"))
    for name in ("no-chinese.json", "added.json"):
        text = "东京大学的研究" * 200
        expected = whole_tokenizer(tmp_path / name, 64).encode(text).ids

        cut = TextTokenizer(tmp_path / name, 64)

        assert not cut._cut_points.search("东京") and cut.encode([text]).ids[0].tolist() == expected


@pytest.mark.parametrize("kind", ["wordpiece", "wordpiece-library", "qwen"])
def test_a_long_text_is_read_from_its_head_unless_that_holds_too_few_tokens(tokenizers_dir: Path, kind: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents of 30,000 characters are read no further than their heads; one whose head has fewer
    tokens than the room (long runs of spaces) is read again whole; both give the whole texts' ids."""
    path, max_length = tokenizer_path(kind, tokenizers_dir), 64
    corpus = " ".join(corpus_texts())
    docs = [corpus[start:start + 30_000].strip() for start in range(0, 10_000, 1_000)]
    sparse = ("word" + " " * 30) * 1_000  # 34 characters a token: the head holds too few
    expected = whole_tokenizer(path, max_length).encode_batch_fast(docs + [sparse])
    tokenizer = TextTokenizer(path, max_length, by_words=by_words(kind))
    read: list[int] = []
    bare_text = tokenizer._bare_text
    monkeypatch.setattr(tokenizer, "_bare_text", lambda text: read.append(len(text)) or bare_text(text))

    encoded = tokenizer.encode(docs + [sparse])

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected] and all(encoded.truncated)
    assert max(read[:len(docs)]) <= max_length * tokenize.HEAD_CHARS_PER_TOKEN < min(map(len, docs))
    assert len(sparse) in read  # read whole the second time


@pytest.mark.parametrize("kind", ["wordpiece-library", "bpe", "qwen", "bpe-whitespace", "unigram"])
def test_every_cut_point_starts_a_piece_of_the_whole_text(tokenizers_dir: Path, kind: str) -> None:
    """The text before each point cut_points finds is split into the whole text's first pieces (what
    any vocabulary then merges within), and tokenizes as its first tokens, here and in texts whose
    pieces the trained vocabularies merge across (')' ',' into '),')."""
    path = tokenizer_path(kind, tokenizers_dir)
    tokenizer = TextTokenizer(path, 64)
    whole = whole_tokenizer(path, 64)
    whole.no_truncation()

    def pieces(text: str) -> list[str]:
        normal = whole.normalizer.normalize_str(text) if whole.normalizer else text
        return [piece for piece, _ in whole.pre_tokenizer.pre_tokenize_str(normal)]

    points = 0
    for text in punctuated_texts(32) + cjk_texts(16):
        expected, expected_pieces = whole.encode(text, add_special_tokens=False).ids, pieces(text)
        reversed_text = text[::-1]
        for found in (tokenizer._cut_points.finditer(reversed_text) if tokenizer._cut_points else ()):
            head = text[:len(text) - 1 - found.start()]
            ids, head_pieces = whole.encode(head, add_special_tokens=False).ids, pieces(head)
            context = (head[-10:], text[len(head):len(head) + 10])
            assert head_pieces == expected_pieces[:len(head_pieces)] and ids == expected[:len(ids)], context
            points += 1
    assert points > 300 if kind != "unigram" else points == 0, points  # Metaspace splits at spaces only


@pytest.mark.parametrize("kind", ["wordpiece-library", "bpe", "qwen"])
def test_long_texts_without_spaces_are_cut_at_punctuation(tokenizers_dir: Path, kind: str) -> None:
    """Base64, minified JSON and Chinese prose have no spaces to cut at: the library sees only a cut of
    each, ending before a punctuation mark, and gives the whole text's first tokens."""
    path, max_length = tokenizer_path(kind, tokenizers_dir), 64
    texts = [base64.b64encode(random.Random(0).randbytes(60_000)).decode(),
             json.dumps([{"id": i, "tags": ["a", "b"]} for i in range(3_000)], separators=(",", ":")),
             "这是一个很长的中文句子，没有空格。" * 3_000]
    expected = whole_tokenizer(path, max_length).encode_batch_fast(texts)
    tokenizer = TextTokenizer(path, max_length, by_words=by_words(kind))
    tokenizer.tokenizer = CountingTokenizer(tokenizer.tokenizer)
    tokenizer._bare = CountingTokenizer(tokenizer._bare)

    encoded = tokenizer.encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected] and all(encoded.truncated)
    calls = tokenizer.tokenizer.calls + tokenizer._bare.calls
    assert max(itertools.chain.from_iterable(calls)) <= max_length * CUT_CHARS_PER_TOKEN * 2


@pytest.mark.parametrize("kind", ["wordpiece", "qwen", "unigram"])
def test_spaces_and_newlines_around_a_text_are_tokenized_as_they_are(tokenizers_dir: Path, kind: str) -> None:
    """As sentence-transformers (since v6) and text-embeddings-inference give them to the model: for a
    byte-level tokenizer (Qwen3's) they are tokens of their own, for WordPiece they are nothing."""
    path = tokenizer_path(kind, tokenizers_dir)
    texts = ["hello world", " hello world", "hello world ", "\nhello world\n", "  query: where  ", "\t"]
    pairs = [(" a query", "a document\n"), ("a query ", " a document")]
    whole = whole_tokenizer(path, 128)
    tokenizer = TextTokenizer(path, 128, by_words=by_words(kind))

    assert [ids.tolist() for ids in tokenizer.encode(texts).ids] == [e.ids for e in whole.encode_batch_fast(texts)]
    assert [ids.tolist() for ids in tokenizer.encode_pairs(*zip(*pairs)).ids] == [
        e.ids for e in whole.encode_batch_fast(pairs)]
    if kind != "unigram":  # Metaspace folds some of them together, as the library does (checked above)
        distinct = {tuple(ids.tolist()) for ids in tokenizer.encode(texts[:4]).ids}
        assert len(distinct) == (1 if kind == "wordpiece" else 4)


def test_a_cut_that_falls_short_is_widened_until_it_overflows() -> None:
    """'international ' is one WordPiece token per 14 characters: cuts at 5 and 10 characters per token
    hold too few tokens, the cut at 20 overflows, so the text is encoded three times, never whole."""
    path = resolve_model(None).tokenizer_file
    counting = CountingTokenizer(whole_tokenizer(path, 16))
    text = "international " * 40

    encoded = encode_cut(counting, [text.strip()], 16)

    assert encoded[0].ids == whole_tokenizer(path, 16).encode(text.strip()).ids
    assert len(counting.calls) == 3 and counting.calls[-1][0] < len(text.strip())


def normalizer_spec(normalizer: normalizers.Normalizer) -> dict:
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    return json.loads(tokenizer.to_str())["normalizer"]


@pytest.mark.parametrize("normalizer", [
    *(normalizers.BertNormalizer(clean_text=clean, lowercase=lower, strip_accents=accents, handle_chinese_chars=chinese)
      for clean in (True, False) for lower in (True, False) for accents in (None, True, False) for chinese in (True, False)),
    normalizers.Lowercase(), normalizers.NFC(), normalizers.NFKC(), normalizers.NFD(), normalizers.NFKD(),
    normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.BertNormalizer()]),
], ids=repr)
def test_ascii_normalization_equals_the_library_on_every_ascii_character(normalizer: normalizers.Normalizer) -> None:
    every = "".join(map(chr, range(128)))
    texts = [every, every[::-1], *(f"Ab{c}Cd {c}" for c in every), "  Mixed CASE\ttext\r\n[CLS] x\x00y  "]

    normalize = ascii_normalizer(normalizer_spec(normalizer))

    assert [normalize(text) for text in texts] == [normalizer.normalize_str(text) for text in texts]


@pytest.mark.parametrize("normalizer", [normalizers.Replace("a", "b"), normalizers.Prepend("x"), normalizers.Strip(),
                                        normalizers.Sequence([normalizers.NFC(), normalizers.Replace("a", "b")])], ids=repr)
def test_a_normalizer_whose_ascii_effect_is_not_known_here_is_left_to_the_library(normalizer: normalizers.Normalizer) -> None:
    assert ascii_normalizer(normalizer_spec(normalizer)) is None


def test_a_tokenizer_that_prepends_to_every_input_gives_the_librarys_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-style tokenizers put a marker in front of the whole input: no text may skip that normalizer,
    and no document may be split into pieces that would each get the marker."""
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 7)
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("zz "), normalizers.Lowercase()])
    path = tmp_path / "prepend.json"
    tokenizer.save(str(path))
    docs = corpus_texts()[:50]
    expected_pairs = whole_tokenizer(path, 128).encode_batch_fast([("a query", doc) for doc in docs])
    expected_texts = whole_tokenizer(path, 128).encode_batch_fast(docs)

    encoded_pairs = TextTokenizer(path, 128).encode_pairs(["a query"] * len(docs), docs)
    encoded_texts = TextTokenizer(path, 128).encode(docs)

    assert [ids.tolist() for ids in encoded_pairs.ids] == [e.ids for e in expected_pairs]
    assert [ids.tolist() for ids in encoded_texts.ids] == [e.ids for e in expected_texts]


@pytest.mark.parametrize("kind", ["wordpiece", "wordpiece-library", "wordpiece-bert-processing", "bpe", "qwen",
                                  "bpe-whole", "unigram"])
@pytest.mark.parametrize("piece_chars", [7, tokenize.MIN_PIECE_CHARS])
def test_pairs_put_together_from_pieces_give_the_whole_pairs_tokens(tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   kind: str, piece_chars: int) -> None:
    """Pieces of 7 characters split a document at nearly every suitable space; the tokenizer itself
    encodes only the pairs this cannot put together (long queries, special tokens' texts, non-ASCII
    texts for a tokenizer with a normalizer, every pair for one without a pre-tokenizer)."""
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", piece_chars)
    monkeypatch.setattr(tokenize, "CORES", 10_000)  # as many pieces as the minimum allows
    path = tokenizer_path(kind, tokenizers_dir)
    max_length = 128
    docs = corpus_texts()[:60] + awkward_texts(max_length)
    # The last two queries need the whole pair encoded: one holds [CLS] (for WordPiece), one is long.
    queries = ["how to read a file", "Which CLASS\treads tokens?", "x", "y z", "[CLS] as text", docs[-1][:900]] * len(docs)
    pairs = list(zip(queries, docs))
    expected = whole_tokenizer(path, max_length).encode_batch_fast(pairs)
    tokenizer = TextTokenizer(path, max_length, by_words=by_words(kind))
    tokenizer._bare_pieces  # noqa: B018 - makes the copy for pieces from the real tokenizer, before it is wrapped below
    # Whole pairs go to the tokenizer, or to its copy without the normalizer when they are ASCII.
    whole = tokenizer.tokenizer, tokenizer._bare = CountingTokenizer(tokenizer.tokenizer), CountingTokenizer(tokenizer._bare)

    encoded = tokenizer.encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert [types.tolist() for types in encoded.type_ids] == [e.type_ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected]
    assert sum(encoded.truncated) > 20
    encoded_whole = sum(len(call) for counting in whole for call in counting.calls)
    if kind == "bpe-whole":  # merges across spaces: no document may be split
        assert encoded_whole == len(pairs)
    else:  # at least the long query's and the [CLS] query's pairs, but not the most
        assert len(pairs) // 6 <= encoded_whole <= len(pairs) * 3 // 4


def by_words(kind: str) -> bool:
    """Whether a test tokenizer of this kind splits texts into words (pipelines/wordpiece.py): the
    "-library" kinds are BERT-style ones that go through the library instead, as the index's threads do."""
    return not kind.endswith("-library")


def tokenizer_path(kind: str, directory: Path) -> Path:
    kind = kind.removesuffix("-library")
    if kind == "wordpiece":
        return resolve_model(None).tokenizer_file
    if kind == "wordpiece-bert-processing":
        path = directory / "bert-processing.json"
        tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
        tokenizer.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
        tokenizer.save(str(path))
        return path
    return trained(kind, directory)


def test_an_added_token_the_normalizer_would_remove_still_sends_its_texts_whole(tmp_path: Path) -> None:
    """A control character added as a token (matched before normalization) is gone from the normal
    form, so only the raw text shows it: such a text must still go to the tokenizer."""
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    tokenizer.add_tokens([AddedToken("\x01", normalized=False)])
    path = tmp_path / "control-token.json"
    tokenizer.save(str(path))
    texts = ["a\x01b c", "plain text"]

    encoded = TextTokenizer(path, 32).encode(texts)

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in whole_tokenizer(path, 32).encode_batch_fast(texts)]


@pytest.mark.parametrize("by_words", [True, False])
@pytest.mark.parametrize("change", ["added token with a space", "normalizer that joins words"])
def test_no_cut_splits_what_the_whole_text_tokenizes_as_one(tmp_path: Path, change: str, by_words: bool) -> None:
    """A long text is cut at a space before it is tokenized; not where an added token holds a space, nor where the
    normalizer matches across one (Replace(" ", "") makes the whole text one word, past 100 characters one [UNK])."""
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    if change == "added token with a space":
        tokenizer.add_tokens([AddedToken("zzyzx qwerty", normalized=False)])
        text = "a      " * 7 + "zzyzx qwerty" + " b" * 100
    else:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(" ", ""), normalizers.Lowercase()])
        text = "a a a new york" + " b" * 100
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    encoded = TextTokenizer(path, 12, by_words=by_words).encode([text])

    whole = whole_tokenizer(path, 12).encode(text)
    assert (encoded.ids[0].tolist(), encoded.truncated[0]) == (whole.ids, bool(whole.overflowing))


def test_a_tokenizer_without_a_post_processor_gives_a_pairs_second_text_type_1(tmp_path: Path) -> None:
    """As encode and encode_batch give it (and so sentence-transformers' CrossEncoder); encode_batch_fast leaves it 0."""
    tokenizer = Tokenizer.from_file(str(resolve_model(None).tokenizer_file))
    tokenizer.post_processor = None
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    encoded = TextTokenizer(path, 12).encode_pairs(["hello there", "a"], ["world peace", "b " * 20])

    library = whole_tokenizer(path, 12).encode_batch([("hello there", "world peace"), ("a", "b " * 20)])
    assert [types.tolist() for types in encoded.type_ids] == [e.type_ids for e in library]
    assert encoded.type_ids[0].tolist() == [0, 0, 1, 1]


def test_a_pair_whose_document_ends_in_what_the_model_drops_is_truncated_as_the_library_says(tmp_path: Path,
                                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A BPE without an unknown token drops characters it cannot encode: a cut of the document with
    exactly the room's tokens may then be all the document has, and the pair was not truncated."""
    monkeypatch.setattr(tokenize, "CORES", 10_000)
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", 2)
    tokenizer = Tokenizer(models.BPE({"a": 0, "b": 1, "[CLS]": 2, "[SEP]": 3}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path = tmp_path / "drops.json"
    tokenizer.save(str(path))
    pairs = [("a", "b b b b " + "~" * 20), ("a", "b b b b b " + "~" * 20), ("a", "b b b")]
    expected = whole_tokenizer(path, 8).encode_batch_fast(pairs)

    encoded = TextTokenizer(path, 8).encode_pairs([a for a, _ in pairs], [b for _, b in pairs])

    assert [ids.tolist() for ids in encoded.ids] == [e.ids for e in expected]
    assert encoded.truncated == [bool(e.overflowing) for e in expected] == [False, True, False]


def roberta_processed(directory: Path) -> Path:
    """The trained BPE tokenizer with <s> and </s> around a text by RobertaProcessing, as RoBERTa and XLM-R have."""
    tokenizer = Tokenizer.from_file(str(trained("bpe", directory)))
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", tokenizer.token_to_id("</s>")),
                                                            ("<s>", tokenizer.token_to_id("<s>")))
    tokenizer.save(str(directory / "roberta.json"))
    return directory / "roberta.json"


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "roberta"])
def test_token_ids_are_cut_as_their_text_is(tokenizers_dir: Path, kind: str) -> None:
    # Ids as /tokenize gives them (the template's [SEP] or </s> last) keep that end when cut; ids without
    # it (a template without specials, or raw ids) are cut where the limit falls.
    path = {"wordpiece": lambda: resolve_model(None).tokenizer_file, "bpe": lambda: trained("bpe", tokenizers_dir),
            "roberta": lambda: roberta_processed(tokenizers_dir)}[kind]()
    tokenizer = TextTokenizer(path, 16)
    text = " ".join(corpus_texts()[:3])
    whole = Tokenizer.from_file(str(path)).encode(text).ids
    assert len(whole) > 16
    assert tokenizer.cut_ids(whole, 16).tolist() == tokenizer.encode([text]).ids[0].tolist()
    assert tokenizer.cut_ids(whole[:10], 16).tolist() == whole[:10]
    if kind != "bpe":
        assert tokenizer.cut_ids(whole[1:-1], 16).tolist() == whole[1:17]


class _Recording:
    """A tokenizer that passes every call on and counts the characters it was given to tokenize."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.chars = tokenizer, 0

    def num_special_tokens_to_add(self, pair: bool) -> int:
        return self.tokenizer.num_special_tokens_to_add(pair)

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = True) -> list:
        self.chars += sum(map(len, texts))
        return self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "qwen", "bpe-whole", "unigram"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_more_tokens_than_counts_as_the_whole_texts_do_and_stops_soon_after_the_limit(
        tokenizers_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, add_special_tokens: bool) -> None:
    """/tokenize's guard: long texts counted in pieces cut at spaces, a few thousand characters at a time,
    give exactly the whole texts' count; and past the limit, the rest of the input is never tokenized."""
    monkeypatch.setattr(tokenize, "COUNT_CHARS", 2_000)
    path = tokenizer_path(kind, tokenizers_dir)
    whole = Tokenizer.from_file(str(path))
    whole.no_truncation()
    whole.no_padding()  # MiniLM's file pads to 128
    cut = TextTokenizer(path, 16).cuts_at_spaces
    assert cut == (kind != "bpe-whole")
    texts = [" ".join(corpus_texts()[start:start + 40]) for start in range(0, 200, 40)] + cjk_texts(128) + awkward_texts(128)
    exact = sum(len(encoding.ids) for encoding in whole.encode_batch_fast(texts, add_special_tokens=add_special_tokens))
    assert max(map(len, texts)) > 5 * 2_000  # texts of many pieces
    assert not more_tokens_than(whole, texts, exact, cut, add_special_tokens)
    assert more_tokens_than(whole, texts, exact - 1, cut, add_special_tokens)
    if cut:  # a limit passed early in a long input: a piece group or two past it are tokenized, not the rest
        recording = _Recording(whole)
        assert more_tokens_than(recording, texts * 20, 1_000, cut, add_special_tokens)
        assert recording.chars < 3 * (2_000 + max(map(len, texts))) < sum(map(len, texts * 20)) / 10


def test_encode_from_left_keeps_the_end_of_a_text_and_of_a_pairs_longer_text(minilm_dir: Path) -> None:
    """TEI's truncation_direction "Left": the start is cut, the special tokens stay; in a pair, longest first."""
    tokenizer = TextTokenizer(minilm_dir / "tokenizer.json", 16)
    text = " ".join(f"item {i}" for i in range(20))
    library = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    library.no_padding()  # the file pads to 128 and cuts there
    library.no_truncation()
    words, query = (library.encode(part, add_special_tokens=False).ids for part in (text, "a query"))
    left = tokenizer.encode_from_left([text, "  short  "])
    assert [ids.tolist() for ids in left.ids] == [[101, *words[-14:], 102], tokenizer.encode(["short"]).ids[0].tolist()]
    assert left.truncated == [True, False] and left.type_ids is None
    pair = tokenizer.encode_from_left(["a query"], [text])
    room = 16 - 3 - len(query)  # the query, shorter, is kept whole
    assert pair.ids[0].tolist() == [101, *query, 102, *words[-room:], 102] and pair.truncated == [True]
    assert pair.type_ids[0].tolist() == [0] * (len(query) + 2) + [1] * (room + 1)
