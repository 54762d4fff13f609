"""Qwen3.5 text-model configuration, read from a Hugging Face ``config.json``.

Accepts both the published multimodal form (``model_type: qwen3_5`` with the text settings
under ``text_config``) and the flat text form (``model_type: qwen3_5_text``), and the same two
of the MoE family (``qwen3_5_moe`` / ``qwen3_5_moe_text``, see ``hybridrt/moe_config.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrt.moe_config import MOE_MODEL_TYPES, check_moe, moe_fields

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", *MOE_MODEL_TYPES)
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json that hybridrt cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN's parameters (a config's ``rope_parameters`` with ``rope_type: "yarn"``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's 0.1 ln(s) + 1 by default)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    @classmethod
    def from_rope_parameters(cls, rope: dict, max_position_embeddings: int) -> RopeScaling:
        """A config's yarn ``rope_parameters`` -> RopeScaling (ConfigError naming a bad
        field); ``original_max_position_embeddings`` defaults to ``max_position_embeddings``."""
        def number(name: str, default=None, lo: float = 0.0):
            value = rope.get(name, default)
            if value is None:
                return None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= lo:
                raise ConfigError(f"rope_parameters.{name} must be a number > {lo:g}, "
                                  f"got {value!r}")
            return float(value)

        if "factor" not in rope:
            raise ConfigError("rope_parameters with rope_type 'yarn' needs 'factor'")
        original = rope.get("original_max_position_embeddings", max_position_embeddings)
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ConfigError(f"rope_parameters.original_max_position_embeddings must be a "
                              f"positive integer, got {original!r}")
        factor = number("factor")
        if factor < 1:
            raise ConfigError(f"rope_parameters.factor must be >= 1 (YaRN extends the "
                              f"context), got {rope['factor']!r}")
        return cls(factor=factor, original_max_position_embeddings=original,
                   beta_fast=number("beta_fast", 32.0) or 32.0,
                   beta_slow=number("beta_slow", 1.0) or 1.0,
                   attention_factor=number("attention_factor"), mscale=number("mscale"),
                   mscale_all_dim=number("mscale_all_dim"),
                   truncate=bool(rope.get("truncate", True)))


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    layer_types: list[str] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    rope_scaling: RopeScaling | None = None  # YaRN; None: plain RoPE
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True
    attn_output_gate: bool = True
    mtp_num_hidden_layers: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    model_type: str = "qwen3_5_text"
    # sparse MoE (hybridrt/moe_config.py): 0 for a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        check_moe(self, ConfigError)  # first: an MoE config's intermediate_size is its experts'
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"config field {name!r} must be a positive integer, got {value!r}"
                )
        if self.mtp_num_hidden_layers < 0:
            raise ConfigError("config field 'mtp_num_hidden_layers' must be >= 0")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"unknown layer_types {unknown}; supported: {list(LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(
                f"rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} "
                "must be even and > 0"
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.attn_output_gate:
            raise ConfigError("attn_output_gate=false is not supported (Qwen3.5 always gates)")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    # Construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; "
                f"hybridrt runs {list(SUPPORTED_MODEL_TYPES)}"
            )
        text = raw
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"model_type {model_type!r} needs a 'text_config' object")
            text_type = text.get("model_type", f"{model_type}_text")
            if text_type != f"{model_type}_text":
                raise ConfigError(f"unsupported text_config.model_type {text_type!r}")

        def get(key: str, default: Any = ...) -> Any:
            if key in text:
                return text[key]
            if default is ...:
                raise ConfigError(f"config is missing required field {key!r}")
            return default

        num_layers = get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(
                    f"full_attention_interval must be a positive int, got {interval!r}"
                )
            if not isinstance(num_layers, int) or num_layers <= 0:
                raise ConfigError(f"num_hidden_layers must be a positive int, got {num_layers!r}")
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(num_layers)
            ]
        if not isinstance(layer_types, list):
            raise ConfigError("layer_types must be a list")

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None, "yarn"):
            raise ConfigError(f"rope_type {rope_type!r} is not supported ('default' or 'yarn')")
        max_positions = get("max_position_embeddings", 262144)
        scaling = None
        if rope_type == "yarn":
            scaling = RopeScaling.from_rope_parameters(rope, max_positions)
            # YaRN reaches factor x the original context (vLLM derives max_model_len so too)
            max_positions = max(max_positions, int(scaling.factor
                                                   * scaling.original_max_position_embeddings))
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 1e7))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

        hidden = get("hidden_size")
        num_heads = get("num_attention_heads")
        head_dim = text.get("head_dim") or (
            hidden // num_heads if isinstance(hidden, int) and isinstance(num_heads, int) else None
        )
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        moe = moe_fields(model_type, text, ConfigError)
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            # an MoE config has no dense MLP width: its experts' stands in (unused)
            intermediate_size=get("intermediate_size", moe.get("moe_intermediate_size", ...)),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=get("linear_num_key_heads"),
            linear_num_value_heads=get("linear_num_value_heads"),
            linear_key_head_dim=get("linear_key_head_dim"),
            linear_value_head_dim=get("linear_value_head_dim"),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
            layer_types=list(layer_types),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            partial_rotary_factor=float(partial),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(tie),
            attn_output_gate=bool(get("attn_output_gate", True)),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", 0) or 0),
            eos_token_ids=[int(e) for e in eos_ids],
            hidden_act=get("hidden_act", "silu"),
            model_type=model_type,
            **moe,
        )

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict | None = None) -> ModelConfig:
        """``overrides``: entries merged into the file's (objects key by key, anything else
        replaced), as vLLM's ``hf_overrides``."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(merged(raw, overrides or {}))


def merged(raw: dict, overrides: dict) -> dict:
    """``raw`` with ``overrides`` merged in: objects key by key, other values replaced."""
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out
