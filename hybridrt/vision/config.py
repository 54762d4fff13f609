"""The vision side of a published Qwen3.5 ``config.json``: the tower's ``vision_config``, the
token ids that mark images and video, and the text rotary's ``mrope_section`` (defaults as
transformers' ``Qwen3_5VisionConfig`` / ``Qwen3_5Config`` have them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrt.config import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, ...] = (11, 11, 10)

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size",
                     "out_hidden_size", "in_channels", "patch_size", "temporal_patch_size",
                     "spatial_merge_size", "num_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"vision_config.{name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision_config: hidden_size {self.hidden_size} over num_heads "
                              f"{self.num_heads} must give a head dim divisible by 4 (2D rotary)")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not supported "
                              f"(one of {', '.join(ACTIVATIONS)})")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"vision_config.num_position_embeddings "
                              f"{self.num_position_embeddings} must be a square (a learned grid)")
        if len(self.mrope_section) != 3:
            raise ConfigError(f"mrope_section must have 3 entries (t, h, w), got "
                              f"{list(self.mrope_section)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """The learned position grid's side (48 for 2304 embeddings)."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def merge_unit(self) -> int:
        """Patches per LLM token (spatial_merge_size squared)."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """The vision settings of a config.json (None where it has no ``vision_config``)."""
        vision = raw.get("vision_config") if isinstance(raw, dict) else None
        if not isinstance(vision, dict):
            return None
        known = {k: vision[k] for k in (
            "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
            "hidden_act", "in_channels", "patch_size", "temporal_patch_size",
            "spatial_merge_size", "num_position_embeddings") if k in vision}
        for k in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size"):
            if k not in known:
                raise ConfigError(f"vision_config is missing required field {k!r}")
        rope = vision.get("rope_parameters") or {}
        if isinstance(rope, dict) and "rope_theta" in rope:
            known["rope_theta"] = float(rope["rope_theta"])
        for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                  "vision_end_token_id"):
            if k in raw:
                known[k] = int(raw[k])
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        text_rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if isinstance(text_rope, dict) and text_rope.get("mrope_section") is not None:
            known["mrope_section"] = tuple(int(s) for s in text_rope["mrope_section"])
        return cls(**known)
