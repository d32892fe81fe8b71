"""Qwen3 decoder embedders in the engine: equal to transformers' Qwen3Model, whatever the packing.

CPU tests use small random-weight configs; the tests marked gpu run a Qwen3-Embedding-0.6B-shaped
model in bf16 on a CUDA device against transformers in fp32 there (`pytest -m gpu tests/test_qwen3.py`).
save_random_qwen3() also builds the model for bench/gpu_qwen3.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, PackedBatch, UserError
from engine.attention import (AttentionLayout, FlashInferAttention, SdpaAttention, TritonAttention, VarlenAttention,
                              flashinfer_available)
from engine.graphs import GRAPH_MAX_TOKENS, SEQLEN_FLOOR, all_shapes, bucket_for, seqlen_for
from tests.models import TOKENIZER_FILES, minilm_path

SMALL_QWEN3 = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # head_dim != hidden / heads
                   max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
QWEN3_06B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken", "cls": "pooling_mode_cls_token"}

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="flashinfer-python is not installed")


def save_random_qwen3(directory: Path, model_class: str = "Qwen3Model", causal: bool = True, pooling: str = "last",
                      quantize: bool = False, seed: int = 0, device: str = "cpu", **overrides: object) -> Path:
    """A random-weight Qwen3 checkpoint in Hugging Face format with sentence-transformers files.

    RMSNorm weights start at one in transformers; they are drawn at random here so that a norm
    applied in the wrong place cannot go unnoticed. `causal=False` writes transformers' own
    `is_causal: false`. Tokenizer files are MiniLM's (token ids below 30,522 are all the tests use).
    """
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**SMALL_QWEN3, **overrides}, is_causal=causal)
    with torch.device(device):
        model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, directory / name)
    # MiniLM's tokenizer config caps inputs at 512 tokens; Qwen3's records 131,072
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 131072}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if quantize:  # as pplx-embed-v1 declares its int8 output
        modules.append({"idx": 2, "name": "2", "path": "", "type": "st_quantize.FlexibleQuantizer"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, POOLING_KEYS[pooling]: True}))
    (directory / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None}))
    return directory


def reference(path: Path, sequences: list, pooling: str, device: str = "cpu") -> np.ndarray:
    """transformers' Qwen3Model, one sequence at a time, pooled like sentence-transformers.

    Eager attention: its mask follows the config's is_causal, whereas SDPA without a mask falls
    back on the layer's own is_causal=True and would stay causal.
    """
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).to(device).eval()
    vectors = []
    with torch.no_grad():
        for seq in sequences:
            hidden = model(torch.as_tensor(np.asarray(seq), dtype=torch.long, device=device)[None]).last_hidden_state[0]
            pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]
            vectors.append(pooled.float().cpu().numpy())
    return np.stack(vectors)


def random_sequences(lengths: list[int], seed: int = 0, high: int = 30000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, high, n).astype(np.int32) for n in lengths]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


LENGTHS = [7, 1, 60, 23, 130, 2, 41]


@pytest.mark.parametrize("model_class", ["Qwen3Model", "Qwen3ForCausalLM"])  # no prefix / "model." + lm_head
@pytest.mark.parametrize(("causal", "pooling"), [(True, "last"), (False, "mean")])
@pytest.mark.parametrize("tied", [True, False])
def test_matches_transformers_in_any_packing(tmp_path, model_class: str, causal: bool, pooling: str, tied: bool) -> None:
    path = save_random_qwen3(tmp_path / "qwen3", model_class, causal=causal, pooling=pooling, tie_word_embeddings=tied)
    if model_class == "Qwen3ForCausalLM":
        assert any(name.startswith("model.") for name in load_file(path / "model.safetensors"))
        assert ("lm_head.weight" in load_file(path / "model.safetensors")) == (not tied)
    sequences = random_sequences(LENGTHS)
    expected = reference(path, sequences, pooling)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    assert (engine.model.causal, engine.pooling, engine.dim) == (causal, pooling, 64)
    np.testing.assert_allclose(engine.embed(sequences), expected, atol=2e-5, rtol=1e-4)
    rng = np.random.default_rng(1)
    for _ in range(3):  # random groupings and orders in one step each
        order = rng.permutation(len(sequences))
        packed = np.empty_like(expected)
        for part in np.split(order, np.sort(rng.choice(np.arange(1, len(sequences)), size=2, replace=False))):
            packed[part] = engine.step(PackedBatch.of([sequences[i] for i in part])).result()
        np.testing.assert_allclose(packed, expected, atol=2e-5, rtol=1e-4)


def test_causal_and_bidirectional_differ_where_they_should(tmp_path) -> None:
    causal = Engine.load(str(save_random_qwen3(tmp_path / "causal", pooling="mean")), EngineConfig(device="cpu"))
    bidirectional = Engine.load(str(save_random_qwen3(tmp_path / "bi", causal=False, pooling="mean")),
                                EngineConfig(device="cpu"))
    one_token, longer = random_sequences([1, 40])
    # Same weights: a lone token sees only itself either way; a longer sequence does not.
    np.testing.assert_allclose(causal.embed([one_token]), bidirectional.embed([one_token]), atol=1e-6)
    assert cosine(causal.embed([longer]), bidirectional.embed([longer]))[0] < 0.999


def test_pplx_model_type_is_bidirectional_with_int8_output(tmp_path) -> None:
    path = save_random_qwen3(tmp_path / "pplx", causal=False, pooling="mean", quantize=True)
    sequences = random_sequences(LENGTHS)
    expected = np.round(np.tanh(reference(path, sequences, "mean")) * 127)
    config = json.loads((path / "config.json").read_text())
    del config["is_causal"]
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bidirectional_pplx_qwen3",
                                                  "architectures": ["PPLXQwen3Model"]}))
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    vectors = engine.embed(sequences)
    assert engine.vector_dtype == "int8" and vectors.dtype == np.int8 and vectors.shape == (len(LENGTHS), 64)
    assert engine.settings()["quantization"] == "int8" and engine.settings()["normalize"] == "false"
    # Rounding may flip where tanh(x) * 127 sits within float error of a half.
    assert np.abs(vectors.astype(np.int32) - expected).max() <= 1 and (vectors == expected).mean() > 0.99
    assert np.abs(vectors).max() > 64  # tanh and the scale were applied, not a cast of raw values
    stepped = engine.step(PackedBatch.of(sequences)).result()
    assert stepped.dtype == np.float32 and np.array_equal(stepped.astype(np.int8), vectors)
    with pytest.raises(UserError, match="int8 vectors.*drop --normalize"):
        Engine.load(str(path), EngineConfig(device="cpu", normalize=True))
    short = Engine.load(str(path), EngineConfig(device="cpu", dim=16)).embed(sequences)
    np.testing.assert_array_equal(short, vectors[:, :16])  # Matryoshka cut, then the same elementwise quantisation


def test_float_models_have_no_quantization_setting(tmp_path) -> None:
    engine = Engine.load(str(save_random_qwen3(tmp_path / "qwen3")), EngineConfig(device="cpu"))
    assert engine.vector_dtype == "float32" and "quantization" not in engine.settings()
    assert engine.embed(random_sequences([3])).dtype == np.float32


def test_prompts_come_from_config_sentence_transformers_like_sentence_transformers(tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    path = save_random_qwen3(tmp_path / "qwen3")
    files = Engine.load(str(path), EngineConfig(device="cpu")).files
    assert files.prompts == {"query": QUERY_PROMPT, "document": ""} and files.default_prompt_name is None
    st = SentenceTransformer(str(path), device="cpu")
    assert (files.prompts, files.default_prompt_name) == (st.prompts, st.default_prompt_name)
    config = json.loads((path / "config_sentence_transformers.json").read_text())
    (path / "config_sentence_transformers.json").write_text(json.dumps({**config, "default_prompt_name": "query"}))
    assert Engine.load(str(path), EngineConfig(device="cpu")).files.default_prompt_name == "query"


def test_transformers_4_config_format_loads_the_same(tmp_path) -> None:
    path = save_random_qwen3(tmp_path / "qwen3")
    sequences = random_sequences([30, 5])
    expected = Engine.load(str(path), EngineConfig(device="cpu")).embed(sequences)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps({**config, "rope_theta": rope["rope_theta"], "rope_scaling": None}))
    np.testing.assert_array_equal(Engine.load(str(path), EngineConfig(device="cpu")).embed(sequences), expected)
    (path / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))  # the angle's base matters
    assert cosine(Engine.load(str(path), EngineConfig(device="cpu")).embed(sequences), expected).min() < 0.9999


def test_long_sequence_packed_with_short_ones_raises_the_default_budget(tmp_path) -> None:
    path = save_random_qwen3(tmp_path / "qwen3", max_position_embeddings=4096)
    engine = Engine.load(str(path), EngineConfig(device="cpu"))
    assert engine.max_length == 4096 and engine.max_batch_tokens == 4096  # the CPU default of 2,048, raised
    sequences = random_sequences([3, 4000, 9, 1])
    batch = PackedBatch.of(sequences)
    np.testing.assert_allclose(engine.step(batch).result(), reference(path, sequences, "last"), atol=5e-5, rtol=1e-4)
    with pytest.raises(UserError, match="--max-batch-tokens 2048 is smaller than the max length 4096"):
        Engine.load(str(path), EngineConfig(device="cpu", max_batch_tokens=2048))
    assert Engine.load(str(path), EngineConfig(device="cpu", max_length=1024)).max_batch_tokens == 2048


def test_checkpoint_mismatches_are_errors_but_lm_head_is_ignored(tmp_path) -> None:
    path = save_random_qwen3(tmp_path / "qwen3", "Qwen3ForCausalLM", tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" in weights
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_norm.weight"}, path / "model.safetensors")
    with pytest.raises(UserError, match=r"Qwen3 model.*missing \['layers.1.self_attn.k_norm.weight'\]"):
        Engine.load(str(path), EngineConfig(device="cpu"))
    save_file({**weights, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, path / "model.safetensors")
    with pytest.raises(UserError, match="unexpected.*layers.0.self_attn.extra.weight"):
        Engine.load(str(path), EngineConfig(device="cpu"))
    save_file({**weights, "model.norm.weight": torch.ones(32)}, path / "model.safetensors")
    with pytest.raises(UserError, match="norm.weight has shape"):
        Engine.load(str(path), EngineConfig(device="cpu"))


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope type 'yarn'"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"model_type": "qwen2"}, "model type 'qwen2' is not supported"),
])
def test_unsupported_configs_are_refused(tmp_path, change: dict, message: str) -> None:
    path = save_random_qwen3(tmp_path / "qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message):
        Engine.load(str(path), EngineConfig(device="cpu"))


def test_graph_seqlen_buckets_bound_every_batch_and_leave_bert_alone() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        longest = int(rng.integers(1, 32769))
        tokens = bucket_for(int(rng.integers(longest, 32769)))
        cap = seqlen_for(longest, tokens, 32768)
        assert longest <= cap <= tokens and (cap == tokens or cap >= 512 and cap & (cap - 1) == 0)
        assert cap < 2 * max(longest, 512)  # short batches never bake in the model's full 32k
    for longest in (1, 100, 300, 512):  # BERT-family max lengths: one graph per (tokens, slots), as before
        assert {seqlen_for(longest, t, 512) for t in (64, 512, 16384)} == {64, 512}


def test_sdpa_grouped_query_heads_share_consecutive_kv_heads() -> None:
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    attention = SdpaAttention(causal=True)
    attention.plan(AttentionLayout(torch.tensor([0, 3, 10], dtype=torch.int32), [0, 3, 10], 7, 10))
    expected = SdpaAttention(causal=True)
    expected.plan(attention.layout)
    repeated = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    torch.testing.assert_close(attention(q, k, v), expected(q, *repeated))


@pytest.mark.parametrize("causal", [True, False])
def test_pooled_attention_is_the_full_attention_at_the_pooled_rows(causal: bool) -> None:
    lengths = [3, 0, 7, 1]
    cu = [0] + np.cumsum(lengths).tolist()
    q, k, v = torch.randn(cu[-1], 4, 8), torch.randn(cu[-1], 2, 8), torch.randn(cu[-1], 2, 8)
    attention = SdpaAttention(causal=causal)
    attention.plan(AttentionLayout(torch.tensor(cu, dtype=torch.int32), cu, max(lengths), cu[-1]))
    last_rows = [end - 1 for end in cu[1:]]
    pooled = attention.pooled(q[last_rows], k, v)
    full = attention(q, k, v)
    for slot, length in enumerate(lengths):
        if length:  # a sequence's last token sees all of it, with or without a causal mask
            torch.testing.assert_close(pooled[slot], full[last_rows[slot]])
        else:
            assert not pooled[slot].any()


# CLS pooling under a causal mask reads a row that saw only itself in every layer: nothing to prune.
@pytest.mark.parametrize(("pooling", "causal", "pruned"), [("last", True, True), ("last", False, True), ("mean", True, False),
                                                           ("cls", True, False), ("cls", False, True)])
def test_last_layer_computes_only_the_pooled_rows_where_pooling_allows(tmp_path, pooling: str, causal: bool,
                                                                      pruned: bool) -> None:
    engine = Engine.load(str(save_random_qwen3(tmp_path / "qwen3", causal=causal, pooling=pooling)), EngineConfig(device="cpu"))
    rows: dict[int, int] = {}
    for index in (0, -1):
        engine.model.layers[index].gate_up.register_forward_hook(
            lambda module, args, out, index=index: rows.__setitem__(index, out.shape[0]))
    sequences = random_sequences([7, 30, 3])
    vectors = engine.step(PackedBatch.of(sequences)).result()
    assert rows == {0: 40, -1: 3 if pruned else 40}
    assert engine.prune == pruned
    np.testing.assert_allclose(vectors, reference(tmp_path / "qwen3", sequences, pooling), atol=2e-5, rtol=1e-4)


# ---- on a CUDA GPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory) -> Path:
    return save_random_qwen3(tmp_path_factory.mktemp("qwen3-0.6b") / "model", device="cuda", **QWEN3_06B)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (4, 2, 64), (12, 4, 256), (6, 6, 32)])
def test_triton_qk_norm_rope_equals_the_torch_steps(heads: int, kv_heads: int, head_dim: int) -> None:
    from engine.models.qwen3 import _qk_norm_rope, rotary
    from engine.triton_kernels import qk_norm_rope

    tokens = 300
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    q_weight, k_weight = (1 + 0.3 * torch.randn(head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = rotary(torch.arange(tokens, device="cuda") * 3, head_dim, 1e6, torch.bfloat16)
    args = (q_weight, k_weight, cos, sin, 1e-6, heads, kv_heads)
    ours, steps = qk_norm_rope(qkv, *args), _qk_norm_rope(qkv, *args)
    # The kernel rotates in float32 and rounds once, the torch steps round after each bf16 op: a few
    # units in the last place apart; a wrong head, half or weight is off by the values' own size.
    for out, expected in zip(ours[:2], steps[:2]):
        assert out.shape == expected.shape
        torch.testing.assert_close(out.float(), expected.float(), rtol=0.03, atol=0.03)
    assert torch.equal(ours[2], steps[2])  # v: the projection's own values


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "triton", pytest.param("flashinfer", marks=needs_flashinfer)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [[4096, 17, 300, 1], [6, 511, 100, 62, 300, 1]])
def test_gqa_attention_backends_match_exact_sdpa(backend: str, causal: bool, lengths: list[int]) -> None:
    cu = [0] + np.cumsum(lengths).tolist()
    q = torch.randn(cu[-1], 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(cu[-1], 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layout = AttentionLayout(torch.tensor(cu, dtype=torch.int32, device="cuda"), cu, max(lengths), cu[-1])
    exact = SdpaAttention(causal=causal)
    exact.plan(layout)
    expected = exact(q.float(), k.float(), v.float())
    if backend == "varlen":
        attention = VarlenAttention(causal=causal)
    elif backend == "triton":
        attention = TritonAttention(causal=causal)
    else:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        attention = FlashInferAttention(16, 128, torch.bfloat16, workspace, causal=causal, num_kv_heads=8, pooled=True)
    attention.plan(layout)
    out = attention(q, k, v).float()
    assert torch.linalg.norm(out - expected) / torch.linalg.norm(expected) < 1e-2
    last_rows = [end - 1 for end in cu[1:]]
    pooled_expected = exact.pooled(q[last_rows].float(), k.float(), v.float())
    pooled = attention.pooled(q[last_rows], k, v).float()
    assert torch.linalg.norm(pooled - pooled_expected) / torch.linalg.norm(pooled_expected) < 1e-2


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("lengths", [[32] * 512, [16384 - 511] + [1] * 511])
def test_a_graph_shapes_plan_fits_its_workspace_at_the_largest_shape(lengths: list[int]) -> None:
    # The most plan a graph shape can need: GRAPH_MAX_TOKENS tokens in 512 slots (the default max_seqs),
    # Qwen3-0.6B's 16 query heads, through a workspace sized by plan_workspace_bytes, not FlashInfer's 8 MiB.
    cu = [0] + np.cumsum(lengths).tolist()
    q = torch.randn(cu[-1], 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(cu[-1], 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layout = AttentionLayout(torch.tensor(cu, dtype=torch.int32, device="cuda"), cu, max(lengths), cu[-1])
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    attention = FlashInferAttention(16, 128, torch.bfloat16, workspace, causal=True, slots=len(lengths), num_kv_heads=8,
                                    pooled=True, max_tokens=GRAPH_MAX_TOKENS)
    assert attention.wrapper._int_workspace_buffer.numel() < 2 << 20  # FlashInfer's own is 8 MiB
    attention.plan(layout)
    exact = SdpaAttention(causal=True)
    exact.plan(layout)
    out, expected = attention(q, k, v).float(), exact(q.float(), k.float(), v.float())
    assert torch.linalg.norm(out - expected) / torch.linalg.norm(expected) < 1e-2
    last_rows = [end - 1 for end in cu[1:]]
    pooled, pooled_expected = attention.pooled(q[last_rows], k, v).float(), exact.pooled(q[last_rows].float(), k.float(), v.float())
    assert torch.linalg.norm(pooled - pooled_expected) / torch.linalg.norm(pooled_expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "triton", pytest.param("flashinfer", marks=needs_flashinfer)])
@pytest.mark.parametrize(("causal", "pooling"), [(True, "last"), (False, "mean")])
def test_qwen3_06b_shape_in_bf16_equals_transformers_fp32(qwen3_06b: Path, backend: str, causal: bool,
                                                          pooling: str) -> None:
    config = json.loads((qwen3_06b / "config.json").read_text())
    (qwen3_06b / "config.json").write_text(json.dumps({**config, "is_causal": causal}))
    pooling_file = qwen3_06b / "1_Pooling" / "config.json"
    pooling_file.write_text(json.dumps({"word_embedding_dimension": 1024, POOLING_KEYS[pooling]: True}))
    short = random_sequences([6, 511, 100, 62, 300, 1], seed=2)
    long_mix = random_sequences([4096, 17, 300, 1], seed=3)  # one graph bucket of 4,416 tokens
    past_graphs = random_sequences([9000, 7000, 500], seed=4)  # 16,500 tokens: eager by rule
    engine = Engine.load(str(qwen3_06b), EngineConfig(attention=backend))
    assert engine.attention == backend and engine.dtype == torch.bfloat16 and engine.model.causal == causal
    assert engine.max_length == 32768 and engine.max_batch_tokens == 32768
    for sequences in (short, long_mix, past_graphs):
        expected = reference(qwen3_06b, sequences, pooling, device="cuda")
        before = engine.stats.captures
        for _ in range(3):  # eager, capture, replay (past GRAPH_MAX_TOKENS: eager, eager, eager)
            vectors = engine.step(PackedBatch.of(sequences)).result()
            # bf16 through 28 layers against fp32: last-token vectors carry one row's rounding.
            assert cosine(vectors, expected).min() >= 0.998
        if bucket_for(sum(map(len, sequences))) > GRAPH_MAX_TOKENS:
            assert engine.stats.captures == before
        else:
            assert engine.stats.captures == before + 1
    assert engine.stats.replays >= 2
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_warmup_of_a_long_context_model_covers_short_sequences_and_leaves_long_ones_lazy(tmp_path: Path) -> None:
    path = save_random_qwen3(tmp_path / "model", device="cuda", max_position_embeddings=4096)
    engine = Engine.load(str(path), EngineConfig(max_batch_tokens=2048, max_length=2048, warmup=True))
    assert engine.stats.captures == len(all_shapes(2048, 512, SEQLEN_FLOOR)) and engine.stats.eager_runs == 0
    short = random_sequences([6, 300, 100, 512], seed=5)
    engine.step(PackedBatch.of(short)).result()
    assert (engine.stats.eager_runs, engine.stats.replays) == (0, 1)  # captured at warm-up
    long_mix = random_sequences([1500, 17], seed=6)  # a sequence past 512 tokens: its shape was left out
    first, second = (engine.step(PackedBatch.of(long_mix)).result() for _ in range(2))
    assert engine.stats.eager_runs == 1 and engine.stats.captures == len(all_shapes(2048, 512, SEQLEN_FLOOR)) + 1
    assert cosine(first, second).min() >= 0.999  # the eager run and the graph captured on the second hit agree
