"""Time the vision encoder: ``python -m hybridrt.bench.vision`` encodes images of given sizes
with random weights at a vision shape (default: Qwen3.5-0.8B's tower, bf16), preprocessing
apart from encoding, best of ``--repeat`` runs."""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder

# Qwen/Qwen3.5-0.8B's vision_config
QWEN35_08B_VISION = {"depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072,
                     "out_hidden_size": 1024, "patch_size": 16, "temporal_patch_size": 2,
                     "spatial_merge_size": 2, "num_position_embeddings": 2304}


def randomize_(module: torch.nn.Module, g: torch.Generator) -> None:
    """Random weights of O(1) activations for a vision tower (ours or transformers', the same
    draws for the same parameter names): matrices scaled by their fan-in, norm weights 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(math.prod(p.shape[1:])))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def random_encoder(config: VisionConfig, dtype: torch.dtype, seed: int = 0) -> VisionEncoder:
    enc = VisionEncoder(config)
    randomize_(enc, torch.Generator().manual_seed(seed))
    return enc.to(dtype).eval()


def grid_of(config: VisionConfig, height: int, width: int) -> tuple[int, int, int]:
    """The patch grid transformers' processor gives an image of this size when it is within
    the pixel limits: each side rounded to a multiple of patch x merge."""
    f = config.patch_size * config.spatial_merge_size
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    return 1, h // config.patch_size, w // config.patch_size


def time_encoder(config: VisionConfig, sizes: list[tuple[int, int]], dtype: torch.dtype,
                 repeat: int = 1) -> list[dict]:
    """-> per size: the grid, the LLM tokens and the best encode time in seconds."""
    enc = random_encoder(config, dtype)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    out = []
    for height, w in sizes:
        grid = grid_of(config, height, w)
        px = torch.randn(math.prod(grid), width)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            with torch.inference_mode():
                enc(px, [grid])
            best = min(best, time.perf_counter() - t0)
        out.append({"size": f"{height}x{w}", "grid": list(grid),
                    "tokens": math.prod(grid) // config.merge_unit, "seconds": best})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="448x448,1024x768", help="HxW,HxW,...")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--config", default=None,
                    help="a vision_config as JSON (default: Qwen3.5-0.8B's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    config = VisionConfig(**(json.loads(a.config) if a.config else QWEN35_08B_VISION))
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    for row in time_encoder(config, sizes, getattr(torch, a.dtype), a.repeat):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
