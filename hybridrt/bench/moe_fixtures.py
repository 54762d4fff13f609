"""Random-weight Qwen3.5 MoE checkpoints for tests and benchmarks (no download needed): tiny
configs, transformers' ``Qwen3_5MoeForCausalLM`` holding the same weights, and checkpoints on
disk in the published layout with per-expert or fused experts (``hybridrt/moe_checkpoint.py``).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from hybridrt.bench.fixtures import TINY_TEXT_CONFIG, random_state_dict
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
    cfg = copy.deepcopy(TINY_MOE_TEXT_CONFIG)
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(n)]
    return cfg


def hf_moe_reference(text_config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32):
    """transformers' ``Qwen3_5MoeForCausalLM`` holding ``state_dict``'s weights (ours, as
    ``random_state_dict`` names them; the MTP head left out): the numerical oracle."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = copy.deepcopy(text_config)
    cfg.pop("model_type", None)
    hf_cfg = Qwen3_5MoeTextConfig(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(hf_cfg).to(dtype)
    sd = {k: v for k, v in to_fused(state_dict).items() if not k.startswith("mtp.")}
    if hf_cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()},
                                                strict=False)
    if missing or unexpected:
        raise RuntimeError(f"reference model load: missing {missing}, unexpected {unexpected}")
    return model.eval()


def write_moe_checkpoint(directory: str | Path, text_config: dict[str, Any], seed: int = 0,
                         dtype: torch.dtype = torch.float32, experts: str = "per_expert",
                         with_mtp: bool = True, num_shards: int = 1,
                         state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json (``qwen3_5_moe`` with ``text_config``) + safetensors with random (or given,
    our naming) weights under ``model.language_model.*`` and ``mtp.*``, the experts
    ``"per_expert"`` or ``"fused"`` -> the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(text_config)
    sd = state_dict if state_dict is not None else random_state_dict(config, seed, dtype,
                                                                     with_mtp)
    layouts = {"per_expert": to_per_expert, "fused": to_fused}
    if experts not in layouts:
        raise ValueError(f"unknown experts layout {experts!r}: per_expert or fused")
    sd = layouts[experts](sd)
    text = copy.deepcopy(text_config)
    tie = text.pop("tie_word_embeddings", True)
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": tie, "text_config": text}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n):
               t.contiguous() for n, t in sd.items() if not (tie and n == "lm_head.weight")}
    keys = sorted(tensors)
    per = math.ceil(len(keys) / max(num_shards, 1))
    weight_map = {}
    for i in range(max(num_shards, 1)):
        part = keys[i * per:(i + 1) * per]
        fname = ("model.safetensors" if num_shards <= 1
                 else f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors")
        save_file({k: tensors[k] for k in part}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    if num_shards > 1:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return directory
