"""Random-weight Qwen3.5 MoE checkpoints for tests and benchmarks (no download needed): tiny
configs, transformers' ``Qwen3_5MoeForCausalLM`` holding the same weights, and checkpoints on
disk in the published layout with per-expert or fused experts (``hybridrt/moe_checkpoint.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridrt.bench.fixtures import (
    TINY_TEXT_CONFIG,
    hf_reference_model,
    random_state_dict,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.config import ModelConfig
from hybridrt.moe_checkpoint import to_fused, to_per_expert

TINY_MOE_TEXT_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 20,
    "shared_expert_intermediate_size": 24,
}


def tiny_moe_config(**overrides: Any) -> dict[str, Any]:
    return tiny_text_config(TINY_MOE_TEXT_CONFIG, **overrides)


def hf_moe_reference(text_config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32):
    """transformers' ``Qwen3_5MoeForCausalLM`` holding ``state_dict``'s weights (ours, as
    ``random_state_dict`` names them; the MTP head left out): the numerical oracle."""
    return hf_reference_model(text_config, to_fused(state_dict), dtype,
                              "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig")


def write_moe_checkpoint(directory: str | Path, text_config: dict[str, Any], seed: int = 0,
                         dtype: torch.dtype = torch.float32, experts: str = "per_expert",
                         with_mtp: bool = True, num_shards: int = 1,
                         state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json (``qwen3_5_moe`` with ``text_config``) + safetensors with random (or given,
    our naming) weights under ``model.language_model.*`` and ``mtp.*``, the experts
    ``"per_expert"`` or ``"fused"`` -> the directory."""
    layouts = {"per_expert": to_per_expert, "fused": to_fused}
    if experts not in layouts:
        raise ValueError(f"unknown experts layout {experts!r}: per_expert or fused")
    sd = state_dict if state_dict is not None else random_state_dict(
        ModelConfig.from_dict(text_config), seed, dtype, with_mtp)
    return write_random_checkpoint(directory, text_config, num_shards=num_shards,
                                   state_dict=layouts[experts](sd))
