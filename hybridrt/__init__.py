"""hybridrt: a small inference runtime for hybrid Gated-DeltaNet + attention models."""

from hybridrt.config import ConfigError, ModelConfig
from hybridrt.forward_batch import ForwardBatch
from hybridrt.llm import LLM
from hybridrt.loader import CheckpointError, ModelNotFoundError, load_model
from hybridrt.outputs import CompletionOutput, RequestOutput
from hybridrt.sampling_params import SamplingParams

__version__ = "0.1.0"

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
    "load_model",
]
