"""The engine on the CPU: equal to the reference implementations, whatever the packing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import embedctl
from engine import Engine, EngineConfig, PackedBatch, Packer, UserError
from engine.checkpoint import files_digest, weights_digest
from engine.graphs import all_buckets, all_shapes, bucket_for, slots_for
from engine.pooling import pool
from tests.models import add_token_past_the_table, save_dense_model, save_random_model

TEXTS = [
    "hello world",
    "A vector database stores embeddings and finds nearest neighbours. " * 40,  # truncated at 256 tokens
    "",
    "   \n\t ",
    "Ünïcödé façade — naïve café, 日本語のテキスト, русский текст, emoji 🚀✨",
    "short",
    "The quick brown fox jumps over the lazy dog.",
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> embedctl.Embedder:
    return embedctl.load(str(minilm_dir), device="cpu")


def test_minilm_matches_sentence_transformers(minilm: embedctl.Embedder, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)
    ours = minilm.embed(TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    assert cosine(ours, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_any_packing_gives_the_same_vectors(minilm: embedctl.Embedder) -> None:
    ids = minilm.tokenizer.encode(TEXTS * 3).ids
    alone = np.concatenate([minilm.engine.step(PackedBatch.of([seq])).result() for seq in ids])
    rng = np.random.default_rng(0)
    for _ in range(3):
        order = rng.permutation(len(ids))
        cuts = np.sort(rng.choice(np.arange(1, len(ids)), size=4, replace=False))
        packed = np.empty_like(alone)
        for part in np.split(order, cuts):
            packed[part] = minilm.engine.step(PackedBatch.of([ids[i] for i in part])).result()
        np.testing.assert_allclose(packed, alone, atol=2e-5)


@pytest.mark.parametrize("model_class", ["BertModel", "XLMRobertaModel"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_random_weights_match_transformers(tmp_path, model_class: str, pooling: str) -> None:
    import transformers

    path = save_random_model(tmp_path / "model", model_class, pooling=pooling)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    reference_model = getattr(transformers, model_class).from_pretrained(path).eval()
    sequences = [[101, 2023, 2003, 102], [101] + list(range(2000, 2050)) + [102], [101, 102]]
    ours = engine.embed(sequences)
    for seq, vector in zip(sequences, ours):
        with torch.no_grad():
            hidden = reference_model(torch.tensor([seq])).last_hidden_state[0]
        expected = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        np.testing.assert_allclose(vector, expected.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_class", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_matches_transformers_alone_and_packed(tmp_path, model_class: str, num_labels: int) -> None:
    import transformers

    path = save_random_model(tmp_path / "model", model_class, num_labels=num_labels, type_vocab_size=2)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    tokenizer = embedctl.load(str(path), device="cpu").tokenizer
    queries = ["how do I read a csv file", "what is a vector database", "short"]
    docs = ["Use pyarrow.csv.read_csv to load it into a table.", "A store of embeddings. " * 60, "x"]
    pairs = tokenizer.encode_pairs(queries, docs)
    assert pairs.truncated == [False, True, False] and pairs.type_ids[0][-1] == 1 and pairs.type_ids[0][0] == 0
    packed = engine.embed(pairs.ids, pairs.type_ids)
    alone = np.concatenate([engine.embed([ids], [types]) for ids, types in zip(pairs.ids, pairs.type_ids)])
    reference = getattr(transformers, model_class).from_pretrained(path).eval()
    with torch.no_grad():
        logits = torch.cat([reference(input_ids=torch.from_numpy(ids).long()[None],
                                      token_type_ids=torch.from_numpy(types).long()[None]).logits
                            for ids, types in zip(pairs.ids, pairs.type_ids)])
    expected = torch.sigmoid(logits) if num_labels == 1 else logits
    assert packed.shape == (3, num_labels) and engine.settings()["labels"] == str(num_labels)
    np.testing.assert_allclose(packed, expected.numpy(), atol=1e-5)
    np.testing.assert_allclose(packed, alone, atol=1e-6)
    # step() gives the logits themselves, which activate() turns into the scores embed() gives
    raw = engine.step(PackedBatch.of(pairs.ids, token_type_ids=pairs.type_ids)).result()
    np.testing.assert_allclose(raw, logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(engine.activate(raw), packed, atol=1e-7)


def test_cross_encoder_refuses_vector_options(tmp_path) -> None:
    path = save_random_model(tmp_path / "model", "BertForSequenceClassification", num_labels=1)
    with pytest.raises(UserError, match="cross-encoder.*drop --dim"):
        Engine.load(str(path), EngineConfig(device="cpu", dim=8))


def test_max_length_past_the_models_positions_is_refused(minilm_dir) -> None:
    with pytest.raises(UserError, match="--max-length 513 is past the 512 positions .* pick at most 512"):
        Engine.load(str(minilm_dir), EngineConfig(device="cpu", max_length=513))
    assert Engine.load(str(minilm_dir), EngineConfig(device="cpu", max_length=512)).max_length == 512


def test_dim_truncates_then_renormalises(minilm_dir) -> None:
    full = embedctl.load(str(minilm_dir), device="cpu", normalize=False).embed(TEXTS[:2])
    short = embedctl.load(str(minilm_dir), device="cpu", dim=128).embed(TEXTS[:2])
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)


def test_missing_weight_is_an_error_not_a_random_init(random_bert) -> None:
    weights = load_file(random_bert / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, random_bert / "model.safetensors")
    with pytest.raises(UserError, match="missing.*encoder.layer.1.output.dense.weight"):
        Engine.load(str(random_bert))


def test_layer_norms_named_gamma_and_beta_load_as_transformers_loads_them(random_bert) -> None:
    expected = Engine.load(str(random_bert), EngineConfig(device="cpu")).embed([[101, 2023, 2003, 102]])
    weights = load_file(random_bert / "model.safetensors")
    renamed = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor
               for name, tensor in weights.items()}
    assert renamed.keys() != weights.keys()
    save_file(renamed, random_bert / "model.safetensors")
    np.testing.assert_array_equal(Engine.load(str(random_bert), EngineConfig(device="cpu")).embed([[101, 2023, 2003, 102]]),
                                  expected)


def test_unknown_weight_is_an_error(random_bert) -> None:
    weights = load_file(random_bert / "model.safetensors")
    weights["encoder.layer.9.extra.weight"] = torch.zeros(2)
    save_file(weights, random_bert / "model.safetensors")
    with pytest.raises(UserError, match="unexpected"):
        Engine.load(str(random_bert))


def test_an_added_token_past_the_embedding_table_loads_but_a_batch_holding_it_is_refused(random_bert) -> None:
    add_token_past_the_table(random_bert)
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu"))
    assert engine.ids_past_table and engine.embed([[101, 7592, 102]]).shape == (1, engine.dim)
    message = "a sequence holds token id 30522, outside the 30522 rows of the model's embedding table"
    with pytest.raises(UserError, match=message):
        engine.embed([[101, 30522, 102]])
    with pytest.raises(UserError, match=message):
        engine.step(PackedBatch.of([[101, 30522, 102]]))


def test_ids_outside_the_table_are_refused_by_embed_for_any_model(random_bert) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu"))
    assert not engine.ids_past_table  # step() leaves the check to its callers, which tokenized the texts
    for bad in (30522, -1):
        with pytest.raises(UserError, match=f"a sequence holds token id {bad}, outside the 30522 rows"):
            engine.embed([[101, bad, 102]])


def test_an_empty_model_name_is_refused_rather_than_taken_for_the_default() -> None:
    with pytest.raises(UserError, match="--model '' names no model; leave --model out for the default"):
        Engine.load("", EngineConfig(device="cpu"))


def test_model_directory_missing_files(random_bert) -> None:
    (random_bert / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"missing tokenizer\.json"):
        Engine.load(str(random_bert))


def test_too_long_sequence_is_refused(random_bert) -> None:
    engine = Engine.load(str(random_bert), EngineConfig(device="cpu"))
    with pytest.raises(UserError, match="longer than the model's max length"):
        engine.embed([[101] * 200])


def test_packer_is_first_come_first_served_under_both_limits() -> None:
    packer = Packer(max_batch_tokens=10, max_seqs=3)
    batches = [b for n, length in enumerate([4, 4, 4, 1, 1, 1, 1, 10]) if (b := packer.add([7] * length, n))]
    batches.append(packer.flush())
    assert [b.tags for b in batches] == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert all(b.num_tokens <= 10 and b.num_seqs <= 3 for b in batches)
    with pytest.raises(ValueError):
        packer.add([7] * 11, "too long")


def test_padded_layout_puts_padding_in_a_spare_sequence() -> None:
    batch = PackedBatch.of([[5, 6, 7], [8, 9]])
    out = np.full(4 * 8 + 4 + 1, -1, dtype=np.int32)
    batch.write_inputs(out, tokens=8, slots=4)
    ids, positions, types, seq_ids = out[:32].reshape(4, 8)
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert types.tolist() == [0] * 8
    assert seq_ids.tolist() == [0, 0, 0, 1, 1, 4, 4, 4]
    assert out[32:].tolist() == [0, 3, 5, 5, 5]
    # A lone sequence after a larger batch in the same buffer: every entry is rewritten.
    PackedBatch.of([[1] * 2000, [2] * 3000]).write_inputs(out := np.full(4 * 5120 + 3, -1, dtype=np.int32), 5120, 2)
    PackedBatch.of([[7, 8, 9]], token_type_ids=[[0, 1, 1]]).write_inputs(out, tokens=4, slots=1)
    assert out[:18].tolist() == [7, 8, 9, 0, 0, 1, 2, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 3]
    # No padding at all, and positions past 1,024.
    lengths = [1500, 700, 1]
    batch = PackedBatch.of([np.arange(n) + 10 for n in lengths])
    batch.write_inputs(out := np.full(4 * 2201 + 4, -1, dtype=np.int32), tokens=2201, slots=3)
    ids, positions, types, seq_ids = out[: 4 * 2201].reshape(4, 2201)
    assert positions.tolist() == [i for n in lengths for i in range(n)]
    assert seq_ids.tolist() == [s for s, n in enumerate(lengths) for _ in range(n)]
    assert ids.tolist() == (positions + 10).tolist() and not types.any()
    assert out[4 * 2201:].tolist() == [0, 1500, 2200, 2201]


def test_collection_stays_off_until_the_last_capture_ends_and_as_it_was_after() -> None:
    import gc

    from engine.graphs import _no_collection

    assert gc.isenabled()
    with _no_collection:
        with _no_collection:  # a second capture, on another thread, overlapping the first
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a caller who turned collection off keeps it off
    try:
        with _no_collection:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pooling_ignores_padding_tokens_and_empty_slots() -> None:
    hidden = torch.randn(8, 3)
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3])
    cu_seqlens = torch.tensor([0, 3, 5, 5], dtype=torch.int32)
    mean = pool(hidden, seq_ids, cu_seqlens, "mean")
    torch.testing.assert_close(mean[:2], torch.stack([hidden[:3].mean(0), hidden[3:5].mean(0)]))
    torch.testing.assert_close(pool(hidden, seq_ids, cu_seqlens, "cls")[:2], hidden[[0, 3]])
    torch.testing.assert_close(pool(hidden, seq_ids, cu_seqlens, "last")[:2], hidden[[2, 4]])


def test_buckets_step_by_64_then_256() -> None:
    assert [bucket_for(n) for n in (1, 64, 65, 1024, 1025, 1280, 1281)] == [64, 64, 128, 1024, 1280, 1280, 1536]
    buckets = all_buckets(2048)
    assert buckets[:3] == [64, 128, 192] and buckets[15] == 1024 and buckets[-4:] == [1280, 1536, 1792, 2048]


def test_every_possible_batch_has_a_graph_shape_for_warmup() -> None:
    shapes = set(all_shapes(max_tokens=4096, max_seqs=64, max_seqlen=256))
    rng = np.random.default_rng(0)
    for _ in range(2000):
        lengths = rng.integers(1, 257, size=rng.integers(1, 65))
        lengths = lengths[np.cumsum(lengths) <= 4096]
        if len(lengths):
            tokens = bucket_for(int(lengths.sum()))
            slots = slots_for(len(lengths), tokens, 64)
            assert slots >= len(lengths) and (tokens, slots) in shapes
    assert slots_for(1, 64, 512) == 1 and slots_for(3, 64, 512) == 4 and slots_for(70, 16384, 512) == 128
    assert slots_for(100, 64, 512) == 64 and slots_for(600, 16384, 512) == 512


def test_backend_choice_follows_the_device_and_refuses_what_cannot_run(monkeypatch) -> None:
    from engine import attention
    from engine.attention import choose_backend, few_sequences_backend

    cuda = torch.device("cuda")
    assert choose_backend("auto", torch.device("cpu"), 32) == "sdpa"
    for flashinfer, triton in [(True, True), (True, False), (False, True), (False, False)]:
        monkeypatch.setattr(attention, "flashinfer_available", lambda: flashinfer)
        monkeypatch.setattr(attention, "triton_available", lambda: triton)
        fallback = "triton" if triton else "varlen"
        assert choose_backend("auto", cuda, 32) == fallback  # FlashInfer has no head_dim 32
        assert choose_backend("auto", cuda, 64) == ("flashinfer" if flashinfer else fallback)
        assert choose_backend("auto", cuda, 128) == ("flashinfer" if flashinfer else fallback)
        assert choose_backend("auto", cuda, 80) == "varlen"
        assert choose_backend("auto", cuda, 256) == ("flashinfer" if flashinfer else "varlen")
        # Graphs of a few sequences: Triton only where auto chose FlashInfer for a bidirectional head_dim 64 model.
        few = "triton" if triton else "flashinfer"
        assert few_sequences_backend("auto", "flashinfer", 64, causal=False) == few
        assert few_sequences_backend("auto", "flashinfer", 64, causal=True) == "flashinfer"
        assert few_sequences_backend("auto", "flashinfer", 128, causal=False) == "flashinfer"
        assert few_sequences_backend("flashinfer", "flashinfer", 64, causal=False) == "flashinfer"
        assert few_sequences_backend("auto", "varlen", 64, causal=False) == "varlen"
    monkeypatch.undo()
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        choose_backend("varlen", torch.device("cpu"), 64)
    with pytest.raises(UserError, match="sdpa is the CPU backend"):
        choose_backend("sdpa", torch.device("cuda"), 64)
    with pytest.raises(UserError, match="head_dim 32"):
        choose_backend("flashinfer", torch.device("cuda"), 32)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        choose_backend("triton", torch.device("cpu"), 32)
    with pytest.raises(UserError, match="runs head_dim 32, 64 or 128, not 80"):
        choose_backend("triton", torch.device("cuda"), 80)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(UserError, match="dtype"):
        EngineConfig(dtype="int4")
    with pytest.raises(UserError, match="attention"):
        EngineConfig(attention="magic")
    for device in ("gpu", "cuda:01", "cuda:", "CUDA", "cuda:1 ", "cuda:99999999999999999999"):
        with pytest.raises(UserError, match=f"--device {re.escape(device)} is not a device embedctl runs on"):
            EngineConfig(device=device)
    for device in ("cpu", "cpu:0", "cuda", "cuda:0", "cuda:12"):  # each one torch.device reads
        assert str(torch.device(EngineConfig(device=device).device)) == device


def test_weights_digest_is_remembered_by_path_size_and_mtime(random_bert, tmp_path, monkeypatch) -> None:
    """Every index run records the weights' sha256; hashing a big model on each cron run would cost
    seconds, so the digest is cached per file path, size and modification time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = random_bert / "model.safetensors"
    original = weights.read_bytes()
    assert weights_digest(random_bert) == hashlib.sha256(original).hexdigest()

    changed = original[:-1] + bytes([original[-1] ^ 1])
    stat = weights.stat()
    weights.write_bytes(changed)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_digest(random_bert) == hashlib.sha256(original).hexdigest()  # same path, size, time: not re-read

    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weights_digest(random_bert) == hashlib.sha256(changed).hexdigest()
    (tmp_path / "cache" / "embedctl" / "weights-sha256.json").write_text("[not a cache")
    assert weights_digest(random_bert) == hashlib.sha256(changed).hexdigest()  # a broken cache is rebuilt


def test_files_digest_follows_what_the_model_computes_not_who_saved_it(random_bert) -> None:
    """An index table records it; a model re-saved by a newer transformers must still match its table."""
    before = files_digest(random_bert)
    config = json.loads((random_bert / "config.json").read_text())
    config |= {"transformers_version": "9.9.9", "torch_dtype": "bfloat16", "_name_or_path": "/elsewhere"}
    (random_bert / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=4))
    (random_bert / "tokenizer_config.json").write_text('{"model_max_length": 512, "clean_up_tokenization_spaces": true}')
    assert files_digest(random_bert) == before
    _edit_json(random_bert / "config.json", hidden_act="relu")
    assert files_digest(random_bert) != before
    _edit_json(random_bert / "config.json", hidden_act=config["hidden_act"])
    assert files_digest(random_bert) == before
    tokenizer = json.loads((random_bert / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = not tokenizer["normalizer"]["lowercase"]
    (random_bert / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert files_digest(random_bert) != before


@pytest.mark.parametrize(("options", "message"), [
    ({"device": "cpu", "attention": "flashinfer"}, "needs a CUDA GPU; use --attention sdpa on the CPU"),
    ({"device": "cpu", "attention": "triton"}, "needs a CUDA GPU; use --attention sdpa on the CPU"),
    ({"device": "cuda", "dtype": "fp32"}, "--dtype fp32 runs on the CPU only"),
    ({"device": "cuda:1", "dtype": "float32"}, "--dtype fp32 runs on the CPU only"),
])
def test_options_that_cannot_run_together_are_refused_before_any_model_loads(options: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        EngineConfig(**options)


@pytest.mark.parametrize(("options", "message"), [
    ({"dim": 2.5}, "dim must be a whole number, not 2.5"),  # loaded, then failed in embed() on a slice
    ({"dim": "256"}, "dim must be a whole number, not '256'"),
    ({"max_length": True}, "max_length must be a whole number, not True"),
    ({"normalize": "no"}, "normalize must be True or False or None, not 'no'"),  # was taken as true
    ({"cuda_graphs": 0}, "cuda_graphs must be True or False, not 0"),
    ({"device": 0}, "device must be a string, not 0"),
])
def test_python_options_of_the_wrong_type_are_refused_at_load(options: dict, message: str) -> None:
    with pytest.raises(embedctl.UserError, match=message):
        embedctl.load(**options)
    assert EngineConfig(dim=np.int64(256)).dim == 256  # numpy's integers are whole numbers too


@pytest.mark.parametrize(("options", "message"), [
    ({"device": "cpu", "attention": "triton"}, "attention backend 'triton' needs a CUDA GPU; use attention='sdpa' on "
                                               "the CPU"),
    ({"device": "cuda", "dtype": "fp32"}, "dtype='fp32' runs on the CPU only: .* pass dtype='bf16' .* or device='cpu'"),
    ({"device": "cpu", "dim": 1000}, "dim=1000 is larger than the model's 384 dimensions; pick at most 384"),
    ({"device": "cpu", "max_batch_tokens": 16}, "max_batch_tokens=16 is smaller than the max length 256; raise it or "
                                                "lower max_length"),
    ({"device": "cpu", "lanes": 0}, "^lanes must be at least 1, not 0"),
    # a device list (index's --device cuda:0,cuda:1) or a name torch does not know, quoted whole
    ({"device": "cuda:0,cuda:1"}, "^device='cuda:0,cuda:1' is not a device embedctl runs on; use cpu, cuda or cuda:N"),
    ({"device": "gpu"}, "^device='gpu' is not a device embedctl runs on"),
])
def test_load_names_the_fix_as_its_own_arguments_not_as_command_line_flags(options: dict, message: str) -> None:
    with pytest.raises(embedctl.UserError, match=message) as error:
        embedctl.load(**options)
    assert "--" not in str(error.value)


def test_an_unknown_option_of_load_is_a_user_error_that_suggests_the_name() -> None:
    with pytest.raises(embedctl.UserError, match="load\\(\\) has no option 'dims'; did you mean 'dim'\\?"):
        embedctl.load(dims=256)
    with pytest.raises(embedctl.UserError, match="load\\(\\) has no option 'foo'; it takes device, dtype,"):
        embedctl.load(foo=1)


def test_embed_from_threads_at_once_equals_one_call_at_a_time(minilm: embedctl.Embedder) -> None:
    # A shared attention plan let one thread's batch be cut at another's sequence bounds (max error 0.3-0.5).
    batches = [TEXTS[i::4] + [text * (i + 1) for text in TEXTS[:3]] for i in range(4)] * 3
    alone = [minilm.embed(batch) for batch in batches]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(minilm.embed, batches))
    for one, other in zip(alone, together):
        np.testing.assert_array_equal(other, one)


def test_load_takes_a_path_and_embed_names_what_it_was_given_instead_of_texts(minilm_dir, minilm) -> None:
    assert embedctl.load(minilm_dir, device="cpu").dim == 384  # a pathlib.Path: 'PosixPath' has no 'strip' before
    for given, name in ((b"hi", "bytes"), (None, "NoneType"), (5, "int")):
        with pytest.raises(TypeError, match=f"embed\\(\\) takes a list of texts, not {name}"):
            minilm.embed(given)
    with pytest.raises(TypeError, match="load\\(\\) takes a model directory or hub id as a string or path, not int"):
        embedctl.load(5)
    # A lone surrogate, as json.loads makes of an unpaired "\\ud800" escape: one line naming the text, not a
    # TypeError from inside the tokenizer.
    with pytest.raises(UserError, match=r"^texts\[1\] holds a lone surrogate .* remove it"):
        minilm.embed(["fine", json.loads('"a\\ud800b"'), "also fine"])


def test_a_cross_encoder_embeds_nothing_having_no_vectors(tmp_path) -> None:
    """Its one score per text alone came back as a [n, 1] "vector"."""
    path = save_random_model(tmp_path / "ce", "BertForSequenceClassification", num_labels=1)
    reranker = embedctl.load(str(path), device="cpu")
    for embed in (reranker.embed, reranker.embed_query, reranker.embed_document):
        with pytest.raises(UserError, match="is a cross-encoder: it scores query-document pairs and has no vectors"):
            embed(["a query", "a document"])


def test_a_model_saved_by_sentence_transformers_6_loads_as_it_reads_it(random_bert, tmp_path) -> None:
    """sentence-transformers v6 writes pooling_mode as a name, and its max length only as the tokenizer's
    model_max_length (here 32, under the 128 positions); a long text is cut there."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    tokenizer_config = json.loads((random_bert / "tokenizer_config.json").read_text())
    (random_bert / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 32}))
    saved = tmp_path / "st6"
    modules = [models.Transformer(str(random_bert)), models.Pooling(64, pooling_mode="cls"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(saved))
    reference = SentenceTransformer(str(saved), device="cpu")
    ours = embedctl.load(str(saved), device="cpu")
    assert ours.engine.max_length == reference.max_seq_length == 32 and ours.engine.pooling == "cls"
    np.testing.assert_allclose(ours.embed(TEXTS[:2]), reference.encode(TEXTS[:2]), atol=1e-5)


@pytest.mark.parametrize(("activation", "pooling"), [(torch.nn.Tanh(), "cls"), (torch.nn.GELU(), "mean")])
def test_dense_modules_after_the_pooling_are_applied_as_sentence_transformers_does(
        random_bert, tmp_path, activation: torch.nn.Module, pooling: str) -> None:
    from sentence_transformers import SentenceTransformer

    save_dense_model(random_bert, tmp_path / "dense", activation, pooling)
    expected = SentenceTransformer(str(tmp_path / "dense"), device="cpu").encode(TEXTS[:3])
    ours = embedctl.load(str(tmp_path / "dense"), device="cpu")
    assert ours.dim == 32 and expected.shape == (3, 32)
    np.testing.assert_allclose(ours.embed(TEXTS[:3]), expected, atol=1e-5)
    short = embedctl.load(str(tmp_path / "dense"), device="cpu", dim=16).embed(TEXTS[:3])  # Matryoshka cut after Dense
    np.testing.assert_allclose(short, expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1, keepdims=True),
                               atol=1e-5)
    digest = ours.engine.spec.weights_sha256
    dense_file = next((tmp_path / "dense").glob("*Dense*/model.safetensors"))
    dense_file.write_bytes(dense_file.read_bytes()[:-4] + b"\0\0\0\0")
    assert Engine.load(str(tmp_path / "dense"), EngineConfig(device="cpu")).spec.weights_sha256 != digest


def test_a_dense_module_writing_elsewhere_and_the_old_subfolder_layout_are_one_line(random_bert, tmp_path) -> None:
    save_dense_model(random_bert, tmp_path / "dense", torch.nn.Tanh())
    dense_config = next((tmp_path / "dense").glob("*Dense*/config.json"))
    _edit_json(dense_config, module_output_name="token_embeddings")
    with pytest.raises(UserError, match="cannot run this Dense module: its output is not the sentence embedding"):
        Engine.load(str(tmp_path / "dense"), EngineConfig(device="cpu"))

    # sentence-transformers before v2 kept the Hugging Face files in 0_Transformer/ (0_BERT/ before that)
    inner = random_bert / "0_Transformer"
    inner.mkdir()
    for file in [*random_bert.glob("*.json"), random_bert / "model.safetensors", random_bert / "vocab.txt"]:
        if file.name != "modules.json" and file.exists():
            file.rename(inner / file.name)
    modules = json.loads((random_bert / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (random_bert / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UserError, match="its Transformer module is in 0_Transformer/ .* save the model again"):
        Engine.load(str(random_bert), EngineConfig(device="cpu"))


@pytest.mark.parametrize("layout", ["config.json before v4", "config_sentence_transformers.json since v6"])
def test_a_cross_encoders_recorded_activation_is_applied_as_sentence_transformers_does(tmp_path, layout: str) -> None:
    from sentence_transformers import CrossEncoder

    path = save_random_model(tmp_path / "model", "BertForSequenceClassification", num_labels=1, type_vocab_size=2,
                             initializer_range=0.3)
    if layout.startswith("config.json"):  # as cross-encoder/ms-marco-MiniLM-L-6-v2 records it
        _edit_json(path / "config.json", sbert_ce_default_activation_function="torch.nn.modules.linear.Identity")
    else:
        CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Identity()).save(str(tmp_path / "saved"))
        path = tmp_path / "saved"
        assert "Identity" in json.loads((path / "config_sentence_transformers.json").read_text())["activation_fn"]
    queries, docs = ["what is a cat", "rice"], ["a cat is an animal", "boil water"]
    expected = CrossEncoder(str(path), device="cpu").predict(list(zip(queries, docs)))
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    pairs = embedctl.load(str(path), device="cpu").tokenizer.encode_pairs(queries, docs)
    assert not engine.sigmoid and engine.settings()["activation"] == "identity"
    np.testing.assert_allclose(engine.embed(pairs.ids, pairs.type_ids)[:, 0], expected, atol=1e-5)
    assert ((expected < 0) | (expected > 1)).any()  # raw logits: a sigmoid would have squashed them

    (path / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "torch.nn.Tanh"}))
    with pytest.raises(UserError, match="records the score activation 'torch.nn.Tanh'; embedctl applies a sigmoid or none"):
        Engine.load(str(path), EngineConfig(device="cpu"))


def _edit_json(path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "modules.json").write_text(json.dumps(json.loads((d / "modules.json").read_text()) + [
        {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}])),
     "modules.json holds a LayerNorm module, which embedctl does not run"),
    (lambda d: _edit_json(d / "1_Pooling" / "config.json", pooling_mode_max_tokens=True),
     "pooling by max \\+ mean is not supported"),
    (lambda d: _edit_json(d / "1_Pooling" / "config.json", pooling_mode=["cls", "lasttoken"]),
     "pooling by cls \\+ lasttoken is not supported"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text("[]"), "holds a JSON list, not an object"),
    (lambda d: (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "abc"})),
     "the max length 'abc' is not a whole number of tokens"),
    (lambda d: (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": ["query: "]})),
     "prompts must map names to texts"),
    (lambda d: (d / "modules.json").write_text(json.dumps(json.loads((d / "modules.json").read_text()) + [
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}])),
     "normalises the vector before a Dense module, which embedctl does not do"),
    (lambda d: ((d / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True})),
                _edit_json(d / "tokenizer.json", normalizer={"type": "BertNormalizer", "lowercase": False})),
     "do_lower_case true lowercases texts that tokenizer.json does not"),
    (lambda d: _edit_json(d / "tokenizer_config.json", truncation_side="left"),
     "truncation_side left keeps the end of a long text, which embedctl does not do"),
    (lambda d: _edit_json(d / "tokenizer.json", truncation={"direction": "Left", "max_length": 128,
                                                            "strategy": "LongestFirst", "stride": 0}),
     "tokenizer.json: truncation direction Left keeps the end of a long text, as transformers follows it"),
    (lambda d: (d / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 1.5})),
     "truncate_dim 1.5 is not a whole number of dimensions"),
])
def test_sentence_transformers_files_it_cannot_follow_are_refused_in_one_line(random_bert, edit, message: str) -> None:
    edit(random_bert)
    with pytest.raises(UserError, match=message):
        Engine.load(str(random_bert), EngineConfig(device="cpu"))


def test_tokenizer_config_s_truncation_side_wins_over_tokenizer_json_s_direction(random_bert) -> None:
    """As transformers takes them: tokenizer.json's direction is only the default for truncation_side."""
    _edit_json(random_bert / "tokenizer.json", truncation={"direction": "Left", "max_length": 128,
                                                           "strategy": "LongestFirst", "stride": 0})
    _edit_json(random_bert / "tokenizer_config.json", truncation_side="right")
    assert Engine.load(str(random_bert), EngineConfig(device="cpu")).max_length > 0


def _config_without(d, key: str) -> None:
    config = json.loads((d / "config.json").read_text())
    del config[key]
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:3000]),
     "model.safetensors is not a readable checkpoint \\(Error while deserializing header"),
    (lambda d: ((d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"not a pickle")),
     "pytorch_model.bin is not a readable checkpoint"),
    (lambda d: ((d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors"),
                (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                    "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))),
     "model-00002-of-00002.safetensors is not a readable checkpoint"),
    (lambda d: _config_without(d, "hidden_size"), "config.json has no 'hidden_size', which this model needs"),
    (lambda d: _edit_json(d / "config.json", num_hidden_layers="two"), "config.json holds a value of the wrong kind"),
    (lambda d: _edit_json(d / "config.json", vocab_size=1000),
     "tokenizer.json gives words 30522 ids but config.json's vocab_size is 1000"),
    (lambda d: _edit_json(d / "tokenizer.json", post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"[SEP]": {"id": "[SEP]", "ids": [40000], "tokens": ["[SEP]"]}}}),
     "tokenizer.json gives every text the token id 40000 but config.json's vocab_size is 30522"),
])
def test_model_files_that_do_not_hold_together_are_one_line_not_a_traceback(random_bert, edit, message: str) -> None:
    edit(random_bert)
    with pytest.raises(UserError, match=message):
        Engine.load(str(random_bert), EngineConfig(device="cpu"))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_prompt_its_pooling_leaves_out_is_refused_rather_than_pooled(random_bert, pooling: str) -> None:
    """sentence-transformers pools without the prompt's tokens: for CLS pooling the first token after it."""
    from pipelines.tokenize import resolve_prompt

    modes = {"mean": "mean", "cls": "CLS token"}
    _edit_json(random_bert / "1_Pooling" / "config.json", include_prompt=False, pooling_mode_mean_tokens=pooling == "mean",
               pooling_mode_cls_token=pooling == "cls")
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: "}}))
    files = Engine.load(str(random_bert), EngineConfig(device="cpu")).files
    with pytest.raises(UserError, match=f"leaves its prompt 'query: ' out of its {modes[pooling]} pooling .*--query-prompt ''"):
        resolve_prompt(files, "query", None, None)
    assert resolve_prompt(files, "query", "", None) == "" and resolve_prompt(files, "document", None, None) == ""


def test_truncate_dim_is_the_default_dim_as_sentence_transformers_reads_it(random_bert) -> None:
    """Its vectors are cut to truncate_dim; ours are normalised after the cut, sentence-transformers' before it."""
    from sentence_transformers import SentenceTransformer

    modules = json.loads((random_bert / "modules.json").read_text())
    (random_bert / "modules.json").write_text(json.dumps(modules + [
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 16}))
    expected = SentenceTransformer(str(random_bert), device="cpu").encode(TEXTS[:3])
    ours = embedctl.load(str(random_bert), device="cpu")
    vectors = ours.embed(TEXTS[:3])
    assert ours.dim == 16 and vectors.shape == expected.shape == (3, 16)
    np.testing.assert_allclose(vectors, expected / np.linalg.norm(expected, axis=1, keepdims=True), atol=1e-5)
    assert embedctl.load(str(random_bert), device="cpu", dim=32).dim == 32  # --dim wins
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 4096}))
    with pytest.raises(UserError, match="its truncate_dim 4096 .* is larger than its 64 dimensions"):
        embedctl.load(str(random_bert), device="cpu")


def test_a_causal_lm_without_sentence_transformers_files_pools_its_last_token_as_they_would(tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    from tests.test_qwen3 import save_random_qwen3

    for causal in (True, False):
        path = save_random_qwen3(tmp_path / f"causal-{causal}", "Qwen3ForCausalLM", causal=causal)
        for name in ("modules.json", "config_sentence_transformers.json"):
            (path / name).unlink(missing_ok=True)
        shutil.rmtree(path / "1_Pooling")
        expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS[:3])
        ours = embedctl.load(str(path), device="cpu")
        assert ours.engine.pooling == ("last" if causal else "mean")
        np.testing.assert_allclose(ours.embed(TEXTS[:3]), expected, atol=1e-4)


def test_the_python_api_puts_prompts_first_as_sentence_transformers_and_the_pipelines_do(random_bert) -> None:
    from sentence_transformers import SentenceTransformer

    (random_bert / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "document": "passage: ", "topic": "topic: "}, "default_prompt_name": "topic"}))
    reference, ours = SentenceTransformer(str(random_bert), device="cpu"), embedctl.load(str(random_bert), device="cpu")
    texts = TEXTS[:2]
    np.testing.assert_allclose(ours.embed(texts), reference.encode(texts), atol=1e-5)  # the default prompt
    np.testing.assert_allclose(ours.embed_query(texts), reference.encode_query(texts), atol=1e-5)
    np.testing.assert_allclose(ours.embed_document(texts), reference.encode_document(texts), atol=1e-5)
    np.testing.assert_allclose(ours.embed(texts, prompt_name="query"), reference.encode(texts, prompt_name="query"),
                               atol=1e-5)
    np.testing.assert_allclose(ours.embed(texts, prompt=""), reference.encode(texts, prompt=""), atol=1e-5)
    assert not np.allclose(ours.embed(texts), ours.embed(texts, prompt=""), atol=1e-3)
    # A model whose config names neither: sentence-transformers 6 gives every model the names query and document,
    # empty unless set, so prompt_name="query" puts nothing first (it used to be refused here).
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"topic": "topic: "}}))
    reference, ours = SentenceTransformer(str(random_bert), device="cpu"), embedctl.load(str(random_bert), device="cpu")
    for name in ("query", "document"):
        np.testing.assert_allclose(ours.embed(texts, prompt_name=name), reference.encode(texts, prompt_name=name),
                                   atol=1e-5)
        np.testing.assert_allclose(ours.embed(texts, prompt_name=name), ours.embed(texts, prompt=""), atol=1e-6)
    # Its default prompt is what plain encode() puts first, and encode_query / encode_document never do.
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"topic": "topic: "}, "default_prompt_name": "topic"}))
    reference, ours = SentenceTransformer(str(random_bert), device="cpu"), embedctl.load(str(random_bert), device="cpu")
    np.testing.assert_allclose(ours.embed(texts), reference.encode(texts), atol=1e-5)
    np.testing.assert_allclose(ours.embed_query(texts), reference.encode_query(texts), atol=1e-5)
    np.testing.assert_allclose(ours.embed_document(texts), reference.encode_document(texts), atol=1e-5)
    np.testing.assert_allclose(ours.embed_query(texts), ours.embed(texts, prompt=""), atol=1e-6)
    assert not np.allclose(ours.embed(texts), ours.embed_query(texts), atol=1e-3)


def test_embed_query_and_embed_document_take_a_prompt_as_encode_query_and_encode_document_do(random_bert) -> None:
    """As --query-prompt / --doc-prompt (and their names) on the command line; a model's prompt that its pooling
    leaves out is refused with advice (prompt='') that these methods can now follow."""
    from sentence_transformers import SentenceTransformer

    (random_bert / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "short": "q: "}}))
    reference, ours = SentenceTransformer(str(random_bert), device="cpu"), embedctl.load(str(random_bert), device="cpu")
    texts = TEXTS[:2]
    for method, st_method in ((ours.embed_query, reference.encode_query), (ours.embed_document, reference.encode_document)):
        np.testing.assert_allclose(method(texts, prompt="x: "), st_method(texts, prompt="x: "), atol=1e-5)
        np.testing.assert_allclose(method(texts, prompt_name="short"), st_method(texts, prompt_name="short"), atol=1e-5)
    np.testing.assert_allclose(ours.embed_query(texts, prompt=""), ours.embed(texts), atol=1e-6)
    _edit_json(random_bert / "1_Pooling" / "config.json", include_prompt=False)
    left_out = embedctl.load(str(random_bert), device="cpu")
    with pytest.raises(UserError, match="prompt='' in Python"):
        left_out.embed_query(texts)
    np.testing.assert_allclose(left_out.embed_query(texts, prompt=""), ours.embed(texts), atol=1e-6)


def test_a_model_with_a_passage_prompt_puts_it_before_documents(random_bert) -> None:
    """The name some models give their document prompt (E5's "passage: "): embedctl index and embed_document use
    it, as sentence-transformers' encode_document means to (it looks for document, passage, corpus), though 6.3
    finds its own empty document prompt first."""
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}}))
    ours = embedctl.load(str(random_bert), device="cpu")
    np.testing.assert_allclose(ours.embed_document(TEXTS[:2]), ours.embed(TEXTS[:2], prompt="passage: "), atol=1e-6)


@pytest.mark.parametrize("prompt, error, message", [
    (5, TypeError, "^prompt is int, not a string$"), (b"q: ", TypeError, "^prompt is bytes, not a string$"),
    ("\ud800 ", UserError, r"^the prompt holds a lone surrogate .* remove it")])
def test_a_bad_prompt_is_one_clear_error_even_for_no_texts(random_bert, prompt, error, message) -> None:
    ours = embedctl.load(str(random_bert), device="cpu")
    for texts in (["a"], []):
        with pytest.raises(error, match=message):
            ours.embed(texts, prompt=prompt)
    with pytest.raises(TypeError, match="^prompt_name is int, not a string$"):
        ours.embed_query(["a"], prompt_name=1)


def test_a_default_prompt_name_that_names_no_prompt_is_refused_at_load_as_sentence_transformers_does(random_bert):
    (random_bert / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: "}, "default_prompt_name": "nope"}))
    with pytest.raises(UserError, match=r"config_sentence_transformers.json: default_prompt_name 'nope' names no "
                                        r"prompt \(it has: query\); repair or replace the model's files$"):
        embedctl.load(str(random_bert), device="cpu")
    _edit_json(random_bert / "config_sentence_transformers.json", default_prompt_name="document")  # every model's
    assert embedctl.load(str(random_bert), device="cpu").embed(["a"]).shape == (1, 64)


def test_the_package_lists_its_lazy_names() -> None:
    assert {"load", "Embedder", "UserError"} <= set(dir(embedctl))
