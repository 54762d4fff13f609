"""Random-weight Qwen3.5 checkpoints for tests and benchmarks (no download needed).

``write_random_checkpoint`` writes the published layout by default: a ``qwen3_5`` config with
``text_config``, tensors under ``model.language_model.``, ``mtp.*`` and no ``lm_head``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from hybridrt.config import ModelConfig

QWEN35_08B_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "eos_token_id": 248044,
    "tie_word_embeddings": True,
}

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 88,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "attn_output_gate": True,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 10,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "eos_token_id": 1,
    "tie_word_embeddings": True,
}


def tiny_text_config(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A copy of ``base`` (TINY_TEXT_CONFIG) with ``overrides``; a new num_hidden_layers gets
    the 3:1 GDN / attention pattern unless layer_types is given too."""
    cfg = copy.deepcopy(TINY_TEXT_CONFIG if base is None else base)
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(n)]
    return cfg


def published_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """Wrap a text config the way Qwen/Qwen3.5-* publish it (``qwen3_5`` + ``text_config``
    and a vision_config; an MoE text config as ``qwen3_5_moe``, without one)."""
    text = copy.deepcopy(text_config)
    tie = text.pop("tie_word_embeddings", True)
    if text.get("model_type") == "qwen3_5_moe_text":
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe", "tie_word_embeddings": tie, "text_config": text}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": tie,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32,
                          "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 48},
    }


def random_state_dict(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, with_mtp: bool = True
) -> dict[str, torch.Tensor]:
    """Random weights in our (``Qwen3_5ForCausalLM``) naming, scaled so that activations and
    logits have O(1) spread at any width."""
    from hybridrt.model import Qwen35ForCausalLM

    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=with_mtp)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in net.state_dict().items():
        shape = tuple(p.shape)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif "norm" in leaf:
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
        else:  # linear [out, in]
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = t.to(dtype)
    return out


def write_random_checkpoint(
    directory: str | Path,
    text_config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layout: str = "published",
    with_mtp: bool = True,
    num_shards: int = 1,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write config.json + safetensors with random (or given) weights -> the directory.

    layout ``published``: qwen3_5 config, ``model.language_model.*`` names, ``mtp.*``, no lm_head;
    layout ``causal_lm``: flat qwen3_5_text config and ``model.*`` names.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(text_config)
    sd = state_dict if state_dict is not None else random_state_dict(config, seed, dtype, with_mtp)
    if layout == "published":
        cfg = published_config(text_config)
        names = {n: ("model.language_model." + n[len("model."):] if n.startswith("model.") else n)
                 for n in sd}
    elif layout == "causal_lm":
        cfg = copy.deepcopy(text_config)
        cfg.setdefault("architectures", ["Qwen3_5ForCausalLM"])
        names = {n: n for n in sd}
    else:
        raise ValueError(f"unknown layout {layout!r}")
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {names[n]: t.contiguous() for n, t in sd.items()
               if not (config.tie_word_embeddings and n == "lm_head.weight")}
    keys = sorted(tensors)
    if num_shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    per = math.ceil(len(keys) / num_shards)
    for i in range(num_shards):
        part = keys[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    return directory


def hf_reference_model(text_config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                       dtype: torch.dtype = torch.float32, model_class: str = "Qwen3_5ForCausalLM",
                       config_class: str = "Qwen3_5TextConfig"):
    """transformers' ``model_class`` (``Qwen3_5ForCausalLM``) holding the same weights, named
    as transformers names them (the numerical oracle)."""
    import transformers

    cfg = copy.deepcopy(text_config)
    cfg.pop("model_type", None)
    hf_cfg = getattr(transformers, config_class)(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(hf_cfg).to(dtype)
    sd = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    if hf_cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()},
                                                strict=False)
    if missing or unexpected:
        raise RuntimeError(f"reference model load: missing {missing}, unexpected {unexpected}")
    return model.eval()


CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def write_char_tokenizer(directory: str | Path, vocab_size: int = 97) -> Path:
    """A character-level tokenizer (ids 0..2 special, then characters) with a ChatML chat
    template, for tests of text prompts, stop strings and chat on tiny random models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127) if chr(c) != "`"]
    vocab = {t: i for i, t in enumerate((specials + chars)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(directory))
    return Path(directory)
