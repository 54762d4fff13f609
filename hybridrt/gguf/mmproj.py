"""A GGUF model's vision tower from its ``mmproj`` projector file (llama.cpp's converter run with
``--mmproj``: ``conversion/qwen3vl.py``, ``Qwen3VLVisionModel``, architecture ``clip``,
projector type ``qwen3vl_merger``), as ``hybridrt.vision`` runs a checkpoint's
``model.visual.*``.

The file: given (``mmproj=`` / ``--mmproj``), or found beside the model (``find_mmproj``:
llama-server's choice of a repository's projector, within the model file's folder).

The converter, undone:

- renames ``visual.blocks.{i}.attn.qkv`` / ``attn.proj`` / ``mlp.linear_fc1`` / ``linear_fc2``
  / ``norm1`` / ``norm2`` to ``v.blk.{i}.attn_qkv`` / ``attn_out`` / ``ffn_up`` / ``ffn_down``
  / ``ln1`` / ``ln2``, the merger's ``norm`` / ``linear_fc1`` / ``linear_fc2`` to
  ``v.post_ln`` / ``mm.0`` / ``mm.2``, ``pos_embed`` to ``v.position_embd``;
- splits the patch Conv3d [C, 3, 2, p, p] along time into ``v.patch_embd.weight`` and
  ``v.patch_embd.weight.1`` (stacked back here);
- writes the tower's sizes as ``clip.vision.*`` (``image_size`` = grid side x patch),
  ``image_mean`` / ``image_std``, ``clip.use_gelu`` (the blocks' tanh GELU).

Not in the file, so taken as the converter assumes them: the temporal patch of 2 (it refuses
others) and the rotary base 10000 (llama.cpp's too); the token ids (``<|image_pad|>`` ...)
come from the model file's vocabulary, the M-RoPE sections from its
``rope.dimension_sections``, the image size limits from llama.cpp's for this projector (8 to
4096 tokens an image; the checkpoint's ``preprocessor_config.json`` is not in the file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from hybridrt.config import ModelConfig
from hybridrt.gguf import tensors
from hybridrt.gguf.reader import GGUFError, GGUFFile

PROJECTOR = "qwen3vl_merger"
# llama.cpp's image token limits for the Qwen-VL projectors (clip.cpp: set_limit_image_tokens)
MIN_TOKENS, MAX_TOKENS = 8, 4096
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>", "image_token_id": "<|image_pad|>",
                 "video_token_id": "<|video_pad|>"}
_BLOCK = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up",
          "mlp.linear_fc2": "ffn_down", "norm1": "ln1", "norm2": "ln2"}
_TOP = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight",
        "merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
_PATCH = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # the Conv3d's two time steps


def _bits(path: Path) -> int:
    """llama.cpp's quantization bits of a file name (its last ``-TAG`` / ``.TAG``'s first
    number: Q4_K_M 4, BF16 16, F32 32; 0 without one)."""
    m = re.search(r"[-.]([A-Za-z0-9_]+)$", path.name[:-len(".gguf")])
    digits = re.search(r"\d+", m.group(1)) if m else None
    return int(digits.group()) if digits else 0


def find_mmproj(model: str | os.PathLike) -> Path | None:
    """The projector beside GGUF file ``model``: of the files ``*mmproj*.gguf`` in its folder,
    the one whose quantization bits are nearest the model's (the first by name among equals),
    as llama-server picks a repository's projector for ``-hf``; None when there is none."""
    model = Path(model)
    found = sorted(p for p in model.parent.glob("*mmproj*.gguf")
                   if p.is_file() and p != model)
    if not found:
        return None
    want = _bits(model)
    return min(found, key=lambda p: abs(_bits(p) - want))


def _sources(cfg) -> dict[str, str]:
    """Our encoder's parameter name -> its GGUF tensor (the patch weight: ``_PATCH``)."""
    out = {}
    for ours, theirs in _TOP.items():
        if ours.endswith((".weight", ".bias")):
            out[ours] = theirs
        else:
            out[f"{ours}.weight"], out[f"{ours}.bias"] = f"{theirs}.weight", f"{theirs}.bias"
    for i in range(cfg.depth):
        for ours, theirs in _BLOCK.items():
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{ours}.{kind}"] = f"v.blk.{i}.{theirs}.{kind}"
    return out


def _need(f: GGUFFile, key: str):
    value = f.metadata.get(key)
    if value is None:
        raise GGUFError(f"{f.path}: metadata {key} is missing")
    return value


def _vision_config(f: GGUFFile, model: GGUFFile, text: ModelConfig):
    """The ``VisionConfig`` of projector ``f`` for the text model in ``model``."""
    from hybridrt.config import ConfigError
    from hybridrt.vision.config import VisionConfig

    if f.metadata.get("clip.projector_type") != PROJECTOR:
        raise GGUFError(f"{f.path}: projector type {f.metadata.get('clip.projector_type')!r} is "
                        f"not one hybridrt runs (it runs Qwen3.5's {PROJECTOR})")
    if not f.metadata.get("clip.has_vision_encoder"):
        raise GGUFError(f"{f.path}: the projector has no vision encoder")
    if any(f.metadata.get("clip.vision.is_deepstack_layers") or []):
        raise GGUFError(f"{f.path}: deepstack layers (Qwen3-VL's) are not run by hybridrt")
    if not f.metadata.get("clip.use_gelu"):
        raise GGUFError(f"{f.path}: clip.use_gelu is not set; Qwen3.5's tower uses GELU")
    patch = int(_need(f, "clip.vision.patch_size"))
    side, rest = divmod(int(_need(f, "clip.vision.image_size")), patch)
    if rest or side <= 0:
        raise GGUFError(f"{f.path}: clip.vision.image_size {_need(f, 'clip.vision.image_size')} "
                        f"is not a whole number of patches of {patch}")
    vocab = model.get("tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(vocab) if t in VISION_TOKENS.values()}
    missing = [t for t in VISION_TOKENS.values() if t not in index]
    if missing:
        raise GGUFError(f"{model.path}: the vocabulary has no {', '.join(missing)} token(s), "
                        f"which image prompts need")
    sections = [int(s) for s in model.get("rope.dimension_sections") or [] if int(s)]
    try:
        cfg = VisionConfig(
            depth=int(_need(f, "clip.vision.block_count")),
            hidden_size=int(_need(f, "clip.vision.embedding_length")),
            num_heads=int(_need(f, "clip.vision.attention.head_count")),
            intermediate_size=int(_need(f, "clip.vision.feed_forward_length")),
            out_hidden_size=int(_need(f, "clip.vision.projection_dim")),
            patch_size=patch, temporal_patch_size=len(_PATCH),
            spatial_merge_size=int(f.metadata.get("clip.vision.spatial_merge_size", 2)),
            num_position_embeddings=side * side,
            **{k: index[t] for k, t in VISION_TOKENS.items()},
            **({"mrope_section": tuple(sections)} if sections else {}))
    except ConfigError as e:
        raise GGUFError(f"{f.path}: {e}") from None
    if cfg.out_hidden_size != text.hidden_size:
        raise GGUFError(f"{f.path}: the projector's output width {cfg.out_hidden_size} is not "
                        f"the model's hidden size {text.hidden_size} (a projector of another "
                        f"model?)")
    if sum(cfg.mrope_section) != text.rotary_dim // 2:
        raise GGUFError(f"{model.path}: rope.dimension_sections {list(cfg.mrope_section)} must "
                        f"sum to half the rotary dims ({text.rotary_dim // 2})")
    return cfg


def _processor_settings(f: GGUFFile, cfg) -> dict:
    """The image processor's settings: the tower's sizes, the file's ``image_mean`` /
    ``image_std`` and llama.cpp's token limits as pixel limits."""
    mean, std = (_need(f, f"clip.vision.image_{k}") for k in ("mean", "std"))
    unit = (cfg.patch_size * cfg.spatial_merge_size) ** 2  # an image token's pixels
    return {"patch_size": cfg.patch_size, "temporal_patch_size": cfg.temporal_patch_size,
            "merge_size": cfg.spatial_merge_size, "min_pixels": MIN_TOKENS * unit,
            "max_pixels": MAX_TOKENS * unit, "image_mean": [float(x) for x in mean],
            "image_std": [float(x) for x in std]}


def _check(f: GGUFFile, expected: dict, srcs: dict) -> None:
    """Every tensor present, of its shape and a type hybridrt reads, and none else."""
    problems = []
    wants = {theirs: expected[ours] for ours, theirs in srcs.items()}
    patch = expected["patch_embed.proj.weight"]
    wants.update({n: patch[:2] + patch[3:] for n in _PATCH})
    for name, want in wants.items():
        t = f.tensors.get(name)
        if t is None:
            problems.append(f"tensor {name} is missing")
        elif GGUFFile.shape(t) != tuple(want):
            problems.append(f"tensor {name} has shape {list(GGUFFile.shape(t))}, expected "
                            f"{list(want)}")
        elif not tensors.supported(t):
            problems.append(f"tensor {name} has type {tensors.type_name(t)}, which hybridrt "
                            f"does not load")
    problems += [f"tensor {n} is not one of a Qwen3.5 vision tower's" for n in f.tensors
                 if n not in wants]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise GGUFError(f"{f.path}: {problems[0]}{more}")


def load_mmproj_tower(model_path: str | os.PathLike, text: ModelConfig, dtype: torch.dtype,
                      device: torch.device | str = "cpu", mmproj: str | os.PathLike | None = None):
    """The vision tower of GGUF model ``model_path`` from projector ``mmproj`` (None: the one
    ``find_mmproj`` finds; no tower where there is none), in ``dtype`` on ``device``.
    Everything is checked (``GGUFError``, one line) before a weight is read."""
    from hybridrt.vision.encoder import VisionEncoder
    from hybridrt.vision.preprocess import ImageProcessor
    from hybridrt.vision.tower import TextRotary, VisionTower

    path = Path(mmproj) if mmproj is not None else find_mmproj(model_path)
    if path is None:
        return None
    f = GGUFFile(path, architectures=("clip",))
    cfg = _vision_config(f, GGUFFile(model_path), text)
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    expected = {n: tuple(p.shape) for n, p in encoder.state_dict().items()}
    srcs = _sources(cfg)
    _check(f, expected, srcs)

    def read(name: str) -> torch.Tensor:
        t = f.tensors[name]
        return tensors.dequantized(t, GGUFFile.shape(t)).to(device, dtype)

    state = {ours: read(theirs) for ours, theirs in srcs.items()}
    state["patch_embed.proj.weight"] = torch.stack([read(n) for n in _PATCH], dim=2)
    encoder.load_state_dict(state, assign=True, strict=True)
    encoder.eval()
    processor = ImageProcessor(path.parent, cfg, settings=_processor_settings(f, cfg))
    rotary = TextRotary(text.rotary_dim, text.rope_theta, cfg.mrope_section, text.rope_scaling)
    return VisionTower(cfg, encoder, processor, rotary)
