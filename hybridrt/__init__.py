"""hybridrt: a small inference runtime for hybrid Gated-DeltaNet + attention models.

The public names are imported on first use, so that ``import hybridrt.cli`` (and with it the
command line's flag checks) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hybridrt.llm",
    "CheckpointError": "hybridrt.loader",
    "CompletionOutput": "hybridrt.outputs",
    "ConfigError": "hybridrt.config",
    "ForwardBatch": "hybridrt.forward_batch",
    "ModelConfig": "hybridrt.config",
    "ModelNotFoundError": "hybridrt.model_path",
    "RequestOutput": "hybridrt.outputs",
    "SamplingParams": "hybridrt.sampling_params",
    "StructuredOutputsParams": "hybridrt.sampling_params",
    "load_model": "hybridrt.loader",
}

__all__ = [
    "LLM",
    "CheckpointError",
    "CompletionOutput",
    "ConfigError",
    "ForwardBatch",
    "ModelConfig",
    "ModelNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "load_model",
]

if TYPE_CHECKING:
    from hybridrt.config import ConfigError, ModelConfig
    from hybridrt.forward_batch import ForwardBatch
    from hybridrt.llm import LLM
    from hybridrt.loader import CheckpointError, load_model
    from hybridrt.model_path import ModelNotFoundError
    from hybridrt.outputs import CompletionOutput, RequestOutput
    from hybridrt.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
