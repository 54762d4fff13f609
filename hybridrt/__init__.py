"""hybridrt: a small inference runtime for hybrid Gated-DeltaNet + attention models."""

from hybridrt.config import ConfigError, ModelConfig
from hybridrt.forward_batch import ForwardBatch
from hybridrt.loader import CheckpointError, ModelNotFoundError, load_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ForwardBatch",
    "ModelConfig",
    "ModelNotFoundError",
    "load_model",
]
