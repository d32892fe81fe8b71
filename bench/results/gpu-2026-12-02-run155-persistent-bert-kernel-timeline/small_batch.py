"""A BERT encoder for batches of at most SMALL_BATCH_TOKENS tokens as one persistent CUDA kernel.

A lone short query through the per-operation path is some fifty kernels of a few microseconds each
(MiniLM: 47, 120 us; BERT-base: 101, 330 us: bench/results/gpu-2026-12-01-run130-breakdown-bert-peers),
each reading its weights and little else, with a launch gap between each two. small_batch.cu runs
the embeddings, every layer and the last LayerNorm in one kernel, one block per SM, the blocks
meeting at grid-wide barriers (cooperative launch) five times a layer. The figures that decided
for it are in bench/results (see README.md there).

The kernel is compiled by nvcc on first use, for this GPU's architecture, into the user's cache
(~/.cache/embedctl/kernels), and called through ctypes; where nvcc is missing, or the model's shape or
the GPU does not fit the kernel, small_batch_for() says why and the engine keeps the per-operation path.
Not here: choosing when to use it (engine.engine), pooling (engine.pooling).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine.models.bert import BertModel

SMALL_BATCH_TOKENS = 64  # the smallest graph bucket (engine.graphs.SMALL_STEP)
ROWS = 16  # token rows per pass through shared memory: small_batch.cu's ROWS
SOURCE = Path(__file__).with_name("small_batch.cu")
ACTIVATIONS = {"gelu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "relu": 2}  # small_batch.cu's Activation
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
PER_LAYER = 12


class _Params(ctypes.Structure):
    """small_batch.cu's SmallBertParams, field for field."""

    _fields_ = [("inputs", ctypes.c_void_p), ("tokens", ctypes.c_int), ("slots", ctypes.c_int),
                ("word", ctypes.c_void_p), ("position", ctypes.c_void_p), ("token_type", ctypes.c_void_p),
                ("embed_norm_w", ctypes.c_void_p), ("embed_norm_b", ctypes.c_void_p), ("layers", ctypes.c_void_p),
                ("num_layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("intermediate", ctypes.c_int), ("activation", ctypes.c_int), ("position_offset", ctypes.c_int),
                ("eps", ctypes.c_float), ("y", ctypes.c_void_p), ("x", ctypes.c_void_p), ("qkv", ctypes.c_void_p),
                ("context", ctypes.c_void_p), ("up", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("timeline", ctypes.c_void_p)]


class SmallBatchBert:
    """The whole encoder of a BertModel on inputs laid out by PackedBatch.write_inputs -> [tokens, hidden]
    last hidden states (rows past the real tokens are zeros), in the model's dtype."""

    def __init__(self, model: BertModel, library: ctypes.CDLL, blocks: int, shared_bytes: int) -> None:
        config, embeddings = model.config, model.embeddings
        self.library, self.blocks, self.shared_bytes = library, blocks, shared_bytes
        self.hidden, self.intermediate = config.hidden_size, config.intermediate_size
        weight = embeddings.word_embeddings.weight
        self.dtype, self.device = weight.dtype, weight.device
        layers = []
        for layer in model.encoder.layer:
            attention_out, output = layer.attention.output, layer.output
            layers.append([layer.qkv.weight, layer.qkv.bias, attention_out.dense.weight, attention_out.dense.bias,
                           attention_out.LayerNorm.weight, attention_out.LayerNorm.bias,
                           layer.intermediate.dense.weight, layer.intermediate.dense.bias,
                           output.dense.weight, output.dense.bias, output.LayerNorm.weight, output.LayerNorm.bias])
        self.layer_table = torch.tensor([[t.data_ptr() for t in tensors] for tensors in layers], dtype=torch.int64,
                                        device=self.device)
        self.params = _Params(
            word=weight.data_ptr(), position=embeddings.position_embeddings.weight.data_ptr(),
            token_type=embeddings.token_type_embeddings.weight.data_ptr(),
            embed_norm_w=embeddings.LayerNorm.weight.data_ptr(), embed_norm_b=embeddings.LayerNorm.bias.data_ptr(),
            layers=self.layer_table.data_ptr(), num_layers=len(layers), hidden=self.hidden,
            heads=config.num_attention_heads, intermediate=self.intermediate,
            activation=ACTIVATIONS[config.hidden_act], position_offset=config.position_offset,
            eps=config.layer_norm_eps)
        self.model = model  # the weights the table points at stay alive with it

    def __call__(self, inputs: torch.Tensor, tokens: int, slots: int) -> torch.Tensor:
        hidden, rows = self.hidden, SMALL_BATCH_TOKENS
        scratch = torch.empty(rows * (6 * hidden + self.intermediate), dtype=torch.float32, device=self.device)
        y, x, qkv, context, up = scratch.split([rows * hidden, rows * hidden, rows * 3 * hidden, rows * hidden,
                                                rows * self.intermediate])
        out = torch.empty(tokens, hidden, dtype=self.dtype, device=self.device)
        params = self.params
        params.inputs, params.tokens, params.slots = inputs.data_ptr(), tokens, slots
        params.y, params.x, params.qkv, params.context, params.up = (t.data_ptr() for t in (y, x, qkv, context, up))
        params.out = out.data_ptr()
        status = self.library.small_bert_launch(ctypes.byref(params), DTYPES[self.dtype], self.blocks,
                                                self.shared_bytes, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if status:
            raise RuntimeError(f"the small-batch kernel failed to launch: {self.library.small_bert_error(status).decode()}")
        return out


def small_batch_for(model: torch.nn.Module) -> tuple[SmallBatchBert | None, str]:
    """The kernel for this model on its GPU, or None and why not."""
    if not isinstance(model, BertModel):
        return None, "not a BERT-family model"
    config = model.config
    weight = model.embeddings.word_embeddings.weight
    head_dim = config.hidden_size // config.num_attention_heads
    if weight.device.type != "cuda" or weight.dtype not in DTYPES:
        return None, "runs bf16 or fp16 on a GPU only"
    if config.hidden_act not in ACTIVATIONS:
        return None, f"no {config.hidden_act} activation in the kernel"
    if head_dim % 32 or head_dim > 128 or config.hidden_size % 4 or config.intermediate_size % 4:
        return None, f"a hidden size of {config.hidden_size} in heads of {head_dim} does not fit the kernel"
    library = _library(torch.cuda.get_device_capability(weight.device))
    if isinstance(library, str):
        return None, library
    shared_bytes = ROWS * max(config.hidden_size, config.intermediate_size) * 4
    if library.small_bert_blocks_per_sm(DTYPES[weight.dtype], shared_bytes) < 1:
        return None, f"{shared_bytes} bytes of shared memory a block do not fit this GPU"
    blocks = torch.cuda.get_device_properties(weight.device).multi_processor_count
    return SmallBatchBert(model, library, blocks, shared_bytes), "on"


@cache
def _library(capability: tuple[int, int]) -> ctypes.CDLL | str:
    """The compiled kernel for a GPU architecture, built once into the user's cache; or why it cannot be."""
    source = SOURCE.read_bytes()
    arch = f"sm_{capability[0]}{capability[1]}{'a' if capability[0] >= 9 else ''}"
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedctl" / "kernels"
    path = folder / f"small_batch-{hashlib.sha256(source).hexdigest()[:16]}-{arch}.so"
    if not path.is_file():
        nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local/cuda/bin").glob("nvcc")), None)
        if nvcc is None:
            return "nvcc, which builds the kernel, is not on the PATH"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            built = Path(scratch) / path.name  # then renamed: another process never loads half a file
            command = [nvcc, "-O3", f"-arch={arch}", "--shared", "-Xcompiler", "-fPIC", "-o", str(built), str(SOURCE)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                return f"nvcc failed: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}"
            built.replace(path)
    library = ctypes.CDLL(str(path))
    library.small_bert_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    library.small_bert_blocks_per_sm.argtypes = [ctypes.c_int, ctypes.c_int]
    library.small_bert_error.restype = ctypes.c_char_p
    if library.small_bert_sizeof_params() != ctypes.sizeof(_Params):
        return "the kernel's parameters do not match engine/small_batch.py's"
    return library
