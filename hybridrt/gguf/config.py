"""A ``ModelConfig`` from a GGUF file's metadata (``qwen35.*`` as llama.cpp's converter writes
them), through the same checks as a config.json."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridrt.config import ConfigError, ModelConfig
from hybridrt.gguf.reader import GGUFError, GGUFFile

# end-of-generation tokens llama.cpp recognises by their text (llama-vocab.cpp), besides the
# file's eos_token_id: Qwen's chat turns end in <|im_end|>, its documents in <|endoftext|>
_EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not
    9.999999974752427e-07)."""
    return float(str(np.float32(x)))


def text_config(f: GGUFFile) -> dict[str, Any]:
    """The metadata as a Hugging Face ``qwen3_5_text`` config dict."""
    n_mtp = int(f.get("nextn_predict_layers", 0) or 0)
    n_layers = int(f.require("block_count")) - n_mtp
    recurrent = f.get("attention.recurrent_layers")
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention"
                       for r in list(recurrent)[:n_layers]]
    else:
        interval = int(f.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    head_dim = int(f.require("attention.key_length"))
    if int(f.get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{f.path}: attention key and value lengths differ "
                        f"({head_dim} and {f.get('attention.value_length')}); Qwen3.5 has one "
                        f"head size")
    v_heads = int(f.require("ssm.time_step_rank"))
    inner = int(f.require("ssm.inner_size"))
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{f.path}: tensor token_embd.weight is missing")
    rope = {"rope_type": "default", "rope_theta": _f32(f.get("rope.freq_base", 1e7)),
            "partial_rotary_factor": int(f.require("rope.dimension_count")) / head_dim}
    sections = f.get("rope.dimension_sections")
    if sections is not None:
        rope["mrope_section"] = [int(s) for s in sections if int(s)]
        rope["mrope_interleaved"] = True
    eos = [int(e) for e in [f.get("tokenizer.ggml.eos_token_id")] if e is not None]
    eos += [i for i in f.find_strings("tokenizer.ggml.tokens", _EOG_TEXTS) if i not in eos]
    ffn = _moe_fields(f) if f.arch == "qwen35moe" else {
        "model_type": "qwen3_5_text", "intermediate_size": int(f.require("feed_forward_length"))}
    return {
        **ffn,
        "vocab_size": GGUFFile.shape(embd)[0],
        "hidden_size": int(f.require("embedding_length")),
        "num_hidden_layers": n_layers,
        "layer_types": layer_types,
        "num_attention_heads": int(f.require("attention.head_count")),
        "num_key_value_heads": int(f.require("attention.head_count_kv")),
        "head_dim": head_dim,
        "linear_num_key_heads": int(f.require("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(f.require("ssm.state_size")),
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": int(f.get("ssm.conv_kernel", 4)),
        "rope_parameters": rope,
        "rms_norm_eps": _f32(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(f.get("context_length", 262144)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "mtp_num_hidden_layers": n_mtp,
        "eos_token_id": eos,
        "hidden_act": "silu",
    }


def _moe_fields(f: GGUFFile) -> dict[str, Any]:
    """``qwen35moe.expert_*`` as the MoE config fields (``hybridrt/moe_config.py``). The
    experts' width may be written per layer; hybridrt runs one width."""
    width = f.require("expert_feed_forward_length")
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise GGUFError(f"{f.path}: metadata {f.arch}.expert_feed_forward_length differs "
                            f"between layers ({sorted(set(width))}); hybridrt runs one width")
        width = width[0]
    return {"model_type": "qwen3_5_moe_text",
            "num_experts": int(f.require("expert_count")),
            "num_experts_per_tok": int(f.require("expert_used_count")),
            "moe_intermediate_size": int(width),
            "shared_expert_intermediate_size": int(f.require("expert_shared_feed_forward_length"))}


# general.sampling.* (what the converter copies from generation_config.json) -> SamplingParams
_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}


def sampling_defaults(path) -> dict[str, Any]:
    """A GGUF file's recommended sampling settings as SamplingParams fields ({} if none, or if
    the file cannot be read: the loader reports that)."""
    try:
        f = GGUFFile(path)
    except GGUFError:
        return {}
    out = {}
    for theirs, ours in _SAMPLING.items():
        value = f.get(f"general.sampling.{theirs}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[ours] = value if isinstance(value, int) else _f32(value)
    return out


def model_config(f: GGUFFile) -> ModelConfig:
    """``text_config(f)`` checked as ``ModelConfig`` checks a config.json (a bad value: a
    GGUFError naming the file)."""
    try:
        return ModelConfig.from_dict(text_config(f))
    except (ConfigError, TypeError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{f.path}: {e}") from None
