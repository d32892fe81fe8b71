"""The embedding runtime: token ids in, vectors out, on the CPU or an NVIDIA GPU.

It knows token ids, offsets and vectors. It never imports pyarrow, fsspec, a tokenizer or an HTTP
layer; pipelines/ and embedctl/ do that and drive it through Engine.step().

The names that need torch (Engine, LazyTensor) load on first use: what a model outputs
(engine.spec) and how to run it (EngineConfig) are known without torch, which an up-to-date re-index
relies on to finish without loading the model.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from engine.batch import Packer, PackedBatch
from engine.config import EngineConfig
from engine.errors import UserError
from engine.spec import ModelSpec

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.lazy import LazyTensor

_LAZY = {"Engine": "engine.engine", "LazyTensor": "engine.lazy"}

__all__ = ["Engine", "EngineConfig", "LazyTensor", "ModelSpec", "Packer", "PackedBatch", "UserError"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
