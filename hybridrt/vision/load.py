"""Loading a checkpoint's vision tower: ``vision_config`` (hybridrt.vision.config), the
``model.visual.*`` tensors into a ``VisionEncoder``, the image processor. The text model loads
without them (hybridrt.loader ignores ``model.visual.*``); ``language_model_only`` skips this."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hybridrt.config import ConfigError, ModelConfig
from hybridrt.loader import CheckpointError, _weight_files
from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder
from hybridrt.vision.encoder_cache import EncoderCache, parse_cache_bytes
from hybridrt.vision.kernels import quantize_tower
from hybridrt.vision.preprocess import ImageProcessor
from hybridrt.vision.tower import TextRotary, VisionTower

PREFIXES = ("model.visual.", "visual.")


def load_vision_tower(path: str | os.PathLike, text: ModelConfig, dtype: torch.dtype,
                      device: torch.device | str = "cpu",
                      mmproj: str | os.PathLike | None = None,
                      quantization: str | None = None,
                      max_images: int | None = None, video: dict | None = None
                      ) -> VisionTower | None:
    """The checkpoint's tower in ``dtype`` on ``device``, or None where it has none (no
    ``vision_config``, or one without ``model.visual.*`` weights, as the demo model's).
    Missing, unexpected and mis-shaped tensors fail together in one CheckpointError. A GGUF
    file's tower is its projector file ``mmproj`` (None: one found beside it; hybridrt.gguf
    .mmproj). ``quantization`` ("int8", "int4"): its linear weights quantized
    (``hybridrt.vision.kernels.quantize_tower``). ``max_images``: the most images one prompt
    may hold (None: no limit). ``video``: the tower's video settings (``max_videos``,
    ``video_fps``, ``video_max_frames``; VisionTower)."""
    path = Path(path)
    if path.is_file():
        from hybridrt.gguf.mmproj import load_mmproj_tower

        tower = load_mmproj_tower(path, text, dtype, device, mmproj)
    else:
        tower = _load_checkpoint_tower(path, text, dtype, device)
    if tower is not None and quantization:
        quantize_tower(tower.encoder, quantization)
    if tower is not None:
        tower.max_images = max_images
        tower.model_path = path.parent if path.is_file() else path
        for name, value in (video or {}).items():
            setattr(tower, name, value)
    return tower


def load_for_engine(model_path, text: ModelConfig, dtype: torch.dtype, device,
                    args) -> tuple[VisionTower | None, str]:
    """``LLM``'s tower as its ``EngineArgs`` ask (none with ``language_model_only``; int8
    linears with ``vision_quantization``; ``limit_mm_per_prompt``'s limits; video sampling) ->
    (the tower or None, why images are refused without it). The checkpoint is searched for a
    tower only where it was not loaded on purpose."""
    from hybridrt.vision import inputs

    skip = args.language_model_only
    tower = None if skip else load_vision_tower(model_path, text, dtype, device, args.mmproj,
                                                args.vision_quantization, args.image_limit,
                                                args.video_settings)
    if tower is not None:
        tower.cache = EncoderCache(parse_cache_bytes(args.encoder_cache_memory))
    if tower is None and args.vision_quantization and not skip:
        raise ValueError(f"vision_quantization={args.vision_quantization!r}: the model at "
                         f"{model_path} has no vision tower")
    refusal = inputs.refusal_reason(skip and inputs.has_vision_tower(model_path, args.mmproj),
                                    skip)
    return tower, refusal


def _load_checkpoint_tower(path: Path, text: ModelConfig, dtype: torch.dtype,
                           device: torch.device | str) -> VisionTower | None:
    """A checkpoint directory's ``model.visual.*`` (``load_vision_tower``)."""
    from safetensors import safe_open

    raw = json.loads((path / "config.json").read_text())
    cfg = VisionConfig.from_dict(raw)
    if cfg is None:
        return None
    tensors = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                for prefix in PREFIXES:
                    if name.startswith(prefix):
                        tensors[name[len(prefix):]] = h.get_tensor(name)
    if not tensors:
        return None
    if cfg.out_hidden_size != text.hidden_size:
        raise ConfigError(f"vision_config.out_hidden_size {cfg.out_hidden_size} differs from the "
                          f"text model's hidden_size {text.hidden_size}")
    if sum(cfg.mrope_section) != text.rotary_dim // 2:
        raise ConfigError(f"mrope_section {list(cfg.mrope_section)} must sum to half the rotary "
                          f"dims ({text.rotary_dim // 2})")
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    expected = {n: tuple(p.shape) for n, p in encoder.state_dict().items()}
    missing = [f"model.visual.{n}" for n in expected if n not in tensors]
    unexpected = [f"model.visual.{n}" for n in tensors if n not in expected]
    mismatched = [f"model.visual.{n}: expected {list(s)}, found {list(tensors[n].shape)}"
                  for n, s in expected.items() if n in tensors and tuple(tensors[n].shape) != s]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{path}: the vision tower's tensors do not fit its vision_config:"
                              f" missing {missing}, unexpected {unexpected}, "
                              f"mis-shaped {mismatched}")
    encoder.load_state_dict({n: t.to(device, dtype) for n, t in tensors.items()}, assign=True)
    encoder.eval()
    rotary = TextRotary(text.rotary_dim, text.rope_theta, cfg.mrope_section, text.rope_scaling)
    return VisionTower(cfg, encoder, ImageProcessor(path, cfg), rotary)
