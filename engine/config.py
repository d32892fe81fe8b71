"""EngineConfig: every knob of the runtime in one frozen value, checked once when it is built.

Building and checking one imports no torch (only torch_device and torch_dtype do), so commands
that end before any model loads, such as an up-to-date re-index, start fast.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DEVICE_NAME = re.compile(r"cpu(:0)?|cuda(:(0|[1-9]\d{0,3}))?")  # as torch.device reads them: no "cuda:01"
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "flashinfer", "triton")
GPU_ATTENTION = "attention backend {!r} needs a CUDA GPU; use --attention sdpa on the CPU"
GPU_FP32 = ("--dtype fp32 runs on the CPU only: the GPU attention kernels take bf16 or fp16; "
            "pass --dtype bf16 (the default on a GPU) or --device cpu")


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model. None means "decide from the hardware or the model's own files".

    device: "cpu", "cuda" or "cuda:N"; None picks CUDA when there is a GPU.
    dtype: float32, bfloat16 or float16 (or fp32/bf16/fp16); None is bf16 on a GPU, fp32 on a CPU.
    max_batch_tokens / max_seqs: the packer's budget per engine step (tokens, sequences); None picks
        the measured best for the device, raised to the model's max length (batch_tokens()).
    cuda_graphs: whole-model CUDA graphs per token bucket, captured lazily (GPU only).
    compile: fuse residual-add + LayerNorm and the embedding sum with torch.compile (GPU only).
    warmup: capture every graph shape of batches of sequences up to 512 tokens at load instead of on
        each shape's second hit (engine.graphs; `embedctl serve` warms up by default).
    attention: backend name; "auto" picks per model and device (engine.attention says how).
    normalize: L2-normalise outputs; None follows the model's sentence-transformers modules.
    dim: keep the first `dim` components (Matryoshka), then re-normalise if normalising.
    max_length: truncate inputs to this many tokens; None follows the model's config.
    pinned_slots: page-locked host buffers in the readback ring (batches in flight).
    lanes: CUDA streams that batches in flight run on at once (GPU only; engine.graphs says why and
        what was measured). 3 for batch work; `embedctl serve` runs one.
    """

    device: str | None = None
    dtype: str | None = None
    max_batch_tokens: int | None = None
    max_seqs: int = 512
    cuda_graphs: bool = True
    compile: bool = True
    warmup: bool = False
    attention: str = "auto"
    normalize: bool | None = None
    dim: int | None = None
    max_length: int | None = None
    pinned_slots: int = 4
    lanes: int = 3

    def __post_init__(self) -> None:
        # The Python API passes these as the caller gives them: dim=2.5 or normalize="no" must not load.
        for name in ("max_batch_tokens", "max_seqs", "dim", "max_length", "pinned_slots", "lanes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise UserError(f"{name} must be a whole number, not {value!r}")
        for name in ("cuda_graphs", "compile", "warmup"):
            if not isinstance(value := getattr(self, name), bool):
                raise UserError(f"{name} must be True or False, not {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise UserError(f"normalize must be True or False or None, not {self.normalize!r}")
        for name in ("device", "dtype", "attention"):
            if (value := getattr(self, name)) is not None and not isinstance(value, str):
                raise UserError(f"{name} must be a string, not {value!r}")
        if self.device is not None and not DEVICE_NAME.fullmatch(self.device):  # here, not in torch_device: a cron
            # job's typo must fail on the runs that load no model too
            raise UserError(f"--device {self.device or repr(self.device)} is not a device embedctl runs on; use cpu, "
                            "cuda or cuda:N")
        if self.dtype is not None and DTYPE_ALIASES.get(self.dtype, self.dtype) not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; use one of bf16, fp16, fp32")
        if self.attention not in ATTENTION_BACKENDS:
            raise UserError(f"unknown attention backend {self.attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
        if (self.max_batch_tokens is not None and self.max_batch_tokens < 1) or self.max_seqs < 1:
            raise UserError("--max-batch-tokens and --max-seqs must be at least 1")
        if self.dim is not None and self.dim < 1:
            raise UserError(f"--dim must be a positive number of components, not {self.dim}")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"--max-length must be at least 2 (room for the special tokens), not {self.max_length}")
        on_cpu = self.device == "cpu"
        if on_cpu and self.attention in ("varlen", "flashinfer", "triton"):
            raise UserError(GPU_ATTENTION.format(self.attention))
        if not on_cpu and self.device is not None and DTYPE_ALIASES.get(self.dtype, self.dtype) == "float32":
            raise UserError(GPU_FP32)
        if self.pinned_slots < 2:
            raise UserError("pinned_slots must be at least 2 so one batch can be read back while the next runs")
        if self.lanes < 1:
            raise UserError(f"--lanes must be at least 1, not {self.lanes}")

    def torch_device(self) -> torch.device:
        import torch

        if self.device is not None:
            device = torch.device(self.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise UserError(f"--device {self.device} asked for a GPU but CUDA is not available here; use --device cpu")
            if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
                names = "cuda:0 only" if count == 1 else f"cuda:0 to cuda:{count - 1}"
                raise UserError(f"--device {self.device}: this machine's GPUs are {names}; pick one of them")
            return device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def batch_tokens(self, device: torch.device, max_length: int) -> int:
        """The token budget: the user's, or where throughput stops growing on this kind of device,
        raised to `max_length` where a model reads longer inputs (Qwen3: 32,768 tokens).

        A sequence runs in one step (attention needs all of it at once), so the budget must hold the
        longest one; refusing instead would make every long-context model need a flag. The raise
        changes nothing for BERT-family models (max length at most 512). For a 32k model it lets
        steps of short documents grow to 32k tokens: the same tokens/s on a GPU (throughput is flat
        past 8k), twice the time per step. A budget the user set is theirs: the engine refuses one
        below max_length (lower --max-length with it) instead of overriding it.

        On a GPU (bench/results/gpu-2026-11-30-run2, H200), BERT-base is flat past 8,192 tokens per
        batch (2.18M -> 2.24M tokens/s at 16,384) and MiniLM still gains 13% from 8,192 to 16,384.
        On a CPU, activations of more than about 2,048 tokens spill out of cache and every step
        slows down: in bench/results/cpu_budget.txt, 1,024-2,048 are fastest and 16,384 is 1.27x
        slower.
        """
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return max(16384 if device.type == "cuda" else 2048, max_length)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, DTYPE_ALIASES.get(self.dtype, self.dtype))
