"""The sparse-MoE settings of a Qwen3.5 MoE config (``qwen3_5_moe`` / ``qwen3_5_moe_text``, as
Qwen3.5-35B-A3B and Qwen3.6-35B-A3B publish it): read (``moe_fields``) and checked
(``check_moe``) for ``ModelConfig``. Every decoder layer, the MTP one included, then has a
sparse MoE block in place of the dense MLP (``hybridrt/moe_block.py``)."""

from __future__ import annotations

from typing import Any

MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def moe_fields(model_type: str, text: dict[str, Any], error) -> dict[str, Any]:
    """The MoE fields of an MoE config's text settings ({} for a dense one). Settings of
    related MoE families that this architecture does not have (dense layers among the sparse
    ones, top-k weights left unnormalised) are refused, not ignored."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    missing = [k for k in MOE_FIELDS if k not in text]
    if missing:
        raise error(f"MoE config is missing required field(s) {missing}")
    if text.get("mlp_only_layers"):
        raise error(f"mlp_only_layers {text['mlp_only_layers']!r} is not supported (every "
                    f"Qwen3.5 MoE layer is sparse)")
    if text.get("decoder_sparse_step", 1) != 1:
        raise error(f"decoder_sparse_step {text['decoder_sparse_step']!r} is not supported "
                    f"(only 1)")
    if text.get("norm_topk_prob", True) is not True:
        raise error("norm_topk_prob=false is not supported (Qwen3.5 MoE renormalises the "
                    "top-k weights)")
    return {k: text[k] for k in MOE_FIELDS}


def check_moe(config, error) -> None:
    """A dense config has no experts (every MoE field 0); an MoE one (its ``model_type``)
    positive sizes and 1 <= num_experts_per_tok <= num_experts."""
    values = {k: getattr(config, k) for k in MOE_FIELDS}
    for k, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise error(f"config field {k!r} must be a non-negative integer, got {v!r}")
    if config.model_type not in MOE_MODEL_TYPES:
        if any(values.values()):
            raise error(f"MoE fields set for the dense model_type {config.model_type!r}: "
                        f"{values}")
        return
    for k, v in values.items():
        if v <= 0:
            raise error(f"config field {k!r} must be a positive integer, got {v!r}")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise error(f"num_experts_per_tok ({values['num_experts_per_tok']}) exceeds "
                    f"num_experts ({values['num_experts']})")
