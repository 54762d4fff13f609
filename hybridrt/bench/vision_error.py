"""The vision tower's embedding error by weight format: ``python -m hybridrt.bench.vision_error``
encodes one image with random weights at a vision shape (default: Qwen3.5-0.8B's tower) in
fp32 (plain torch, the exact result), in bf16 and with the tower's linears in int8 and int4
(bf16 activations, the CPU backend's kernels: ``hybridrt.vision.kernels``), and prints each
format's error against bf16 and against fp32, one JSON line per format: ``rel_max`` (max |a -
b| / max |b|), ``rel_l2`` (||a - b|| / ||b||), ``cos_mean`` / ``cos_min`` (the cosine
similarity of each token's embedding with the reference's, mean and worst)."""

from __future__ import annotations

import argparse
import json
import math

import torch

from hybridrt.bench.vision import QWEN35_08B_VISION, grid_of, random_encoder
from hybridrt.kernels.backend import select_backend
from hybridrt.vision.config import VisionConfig
from hybridrt.vision.kernels import quantize_tower

FORMATS = ("bf16", "int8", "int4")


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """``got`` against ``ref`` [tokens, width]: rel_max, rel_l2, cos_mean, cos_min."""
    got, ref = got.double(), ref.double()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {"rel_max": ((got - ref).abs().max() / ref.abs().max()).item(),
            "rel_l2": ((got - ref).norm() / ref.norm()).item(),
            "cos_mean": cos.mean().item(), "cos_min": cos.min().item()}


def measure(config: VisionConfig, height: int, width: int, formats=FORMATS,
            seed: int = 0) -> list[dict]:
    """-> per format: its errors against bf16 ("vs_bf16") and fp32 ("vs_fp32")."""
    grid = grid_of(config, height, width)
    px = torch.randn(math.prod(grid), config.in_channels * config.temporal_patch_size
                     * config.patch_size ** 2, generator=torch.Generator().manual_seed(seed + 1))
    with torch.inference_mode():
        exact = random_encoder(config, torch.float32, seed)(px, [grid])
        outs = {}
        for fmt in ("bf16", *(f for f in formats if f != "bf16")):
            enc = random_encoder(config, torch.bfloat16, seed)
            if fmt != "bf16":
                quantize_tower(enc, fmt)
            enc.set_backend(select_backend(None, "cpu"))
            outs[fmt] = enc(px, [grid]).float()
    return [{"format": f, "size": f"{height}x{width}", "tokens": outs[f].shape[0],
             "vs_bf16": errors(outs[f], outs["bf16"]), "vs_fp32": errors(outs[f], exact)}
            for f in formats]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="448x448", help="HxW")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--config", default=None,
                    help="a vision_config as JSON (default: Qwen3.5-0.8B's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    formats = a.formats.split(",")
    if any(f not in FORMATS for f in formats):
        ap.error(f"--formats: choose from {', '.join(FORMATS)}")
    config = VisionConfig(**(json.loads(a.config) if a.config else QWEN35_08B_VISION))
    height, width = (int(v) for v in a.size.split("x"))
    for row in measure(config, height, width, formats):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
