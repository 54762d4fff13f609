"""A tiny random Qwen3.5 checkpoint with a vision tower (fp32), its tokenizer with the vision
tokens, and transformers' ``Qwen3_5ForConditionalGeneration`` holding the same weights."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch

from hybridrt.bench.fixtures import random_state_dict, tiny_text_config, write_char_tokenizer
from hybridrt.config import ModelConfig

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# a ChatML template that renders image and video parts as Qwen's does
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 40,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh"}


def text_config(**overrides) -> dict:
    """Head dim 32 with half of it rotary: 8 frequencies, M-RoPE sections [3, 3, 2]."""
    return tiny_text_config(**{
        "vocab_size": 104, "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
                            "mrope_interleaved": True},
        **overrides})


def hf_config(text: dict, ids: dict, vision: dict | None = None):
    from transformers import Qwen3_5Config

    text = copy.deepcopy(text)
    text.pop("model_type", None)
    vision = {**VISION, **(vision or {}), "out_hidden_size": text["hidden_size"]}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "sdpa"
    return cfg


def write_vision_checkpoint(directory, seed: int = 0, text: dict | None = None,
                            tokenizer: Path | None = None, with_mtp: bool = False,
                            vision: dict | None = None):
    """-> (directory, transformers' model with the same fp32 weights). ``tokenizer``: a
    directory whose tokenizer is taken (the vision tokens added after its own) instead of
    the character-level one. ``with_mtp``: random ``mtp.*`` weights too (transformers'
    model has none; ``mtp_weights`` reads them back). ``vision``: entries of the tower's
    config replacing ``VISION``'s."""
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    directory = Path(directory)
    text = text or text_config()
    if tokenizer is None:
        write_char_tokenizer(directory)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer or directory))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(directory))
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), tok.convert_tokens_to_ids(VISION_TOKENS)))
    assert max(ids.values()) < text["vocab_size"]
    ref = Qwen3_5ForConditionalGeneration(hf_config(text, ids, vision)).eval()
    sd = random_state_dict(ModelConfig.from_dict(text), seed, with_mtp=with_mtp)
    mtp = {n: sd.pop(n) for n in [n for n in sd if n.startswith("mtp.")]}
    full = {("model.language_model." + n[len("model."):]): t for n, t in sd.items()}
    gen = torch.Generator().manual_seed(seed + 100)
    for name, p in ref.model.visual.state_dict().items():
        if name.endswith("bias"):
            t = 0.1 * torch.randn(p.shape, generator=gen)
        elif "norm" in name:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            t = torch.randn(p.shape, generator=gen)
        else:
            fan_in = math.prod(p.shape[1:])
            t = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
        full["model.visual." + name] = t
    full["lm_head.weight"] = full["model.language_model.embed_tokens.weight"]
    missing, unexpected = ref.load_state_dict(full, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ref.save_pretrained(str(directory))
    if mtp:
        from safetensors.torch import load_file, save_file

        (f,) = directory.glob("*.safetensors")
        save_file({**load_file(str(f)), **mtp}, str(f), metadata={"format": "pt"})
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             min_pixels=8 * 8, max_pixels=64 * 64).save_pretrained(str(directory))
    video_processor().save_pretrained(str(directory))
    return directory, ref


def video_processor():
    """transformers' Qwen3-VL video processor at the tiny tower's sizes, its torchvision calls
    made with torch (hybridrt.vision.video: torchvision is not installed here)."""
    from hybridrt.vision.video import _processor_class

    return _processor_class()(patch_size=4, temporal_patch_size=2, merge_size=2,
                              size={"shortest_edge": 8 * 8 * 2, "longest_edge": 48 * 48 * 8},
                              cap_pixels_per_frame=False)


def image(h: int, w: int, seed: int):
    """A random RGB PIL image of h x w pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def bf16_tower_runs(seed: int, prepare):
    """The 0.8B's vision widths (two blocks), random weights, a 448x448 image through
    transformers in fp32 and in bf16 and through our encoder with the same weights, made
    ready by ``prepare(encoder) -> encoder`` (to bf16, a backend, ...) -> (ours, transformers'
    bf16, transformers' fp32) merged embeddings, fp32."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from hybridrt.bench.vision import QWEN35_08B_VISION, randomize_
    from hybridrt.vision.config import VisionConfig
    from hybridrt.vision.encoder import VisionEncoder

    kw = {**QWEN35_08B_VISION, "depth": 2}
    hc = Qwen3_5VisionConfig(**kw)
    hc._attn_implementation = "sdpa"
    ref = Qwen3_5VisionModel(hc).eval()
    g = torch.Generator().manual_seed(seed)
    randomize_(ref, g)
    with torch.no_grad():
        ours = VisionEncoder(VisionConfig(**kw))
        ours.load_state_dict(ref.state_dict())
        ours = prepare(ours)
        grid = torch.tensor([(1, 28, 28)])
        px = torch.randn(784, 3 * 2 * 16 * 16, generator=g)
        exact = ref(px, grid_thw=grid).pooler_output
        want = ref.to(torch.bfloat16)(px.bfloat16(), grid_thw=grid).pooler_output.float()
        got = ours(px, [(1, 28, 28)]).float()
    return got, want, exact


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()
