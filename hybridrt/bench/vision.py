"""Time the vision encoder: ``python -m hybridrt.bench.vision`` encodes images of given sizes
with random weights at a vision shape (default: Qwen3.5-0.8B's tower, bf16) on the CPU backend's
kernels (``hybridrt.vision.kernels``; ``--kernels torch``: plain torch ops, the encoder alone;
``--quantization int8``: the tower's linears in int8), preprocessing apart from encoding, best
of ``--repeat`` runs.

``--llamacpp DIR`` also times llama.cpp's ``llama-mtmd-cli`` on the same weights: a checkpoint
(``write_checkpoint``: the tower's weights as ours, a text model of the tower's output width
with few layers, the demo model's tokenizer with the vision tokens added, a
``preprocessor_config.json``) is written into DIR and converted by
``../shared/tools/llamacpp-bench`` (``convert`` for the text model, ``convert-mmproj`` for the
tower, bf16); ``mtmd`` then encodes a PNG of each size, and its encode time (the image's
slices, or its batch) stands beside ours with the ratio (llama.cpp's time / ours)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridrt import env
from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder

# Qwen/Qwen3.5-0.8B's vision_config
QWEN35_08B_VISION = {"depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072,
                     "out_hidden_size": 1024, "patch_size": 16, "temporal_patch_size": 2,
                     "spatial_merge_size": 2, "num_position_embeddings": 2304}
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT_LAYERS = 4  # the llama.cpp comparison's text model: one attention layer, three GDN
TOOL = Path(__file__).resolve().parents[2] / ".." / "shared" / "tools" / "llamacpp-bench"
# llama-mtmd-cli's encode times: per image slice (mtmd-helper), else its batch's (mtmd-cli)
_SLICE = re.compile(r"image slice encoded in\s+([0-9.]+)\s*ms")
_BATCH = re.compile(r"mtmd batch encoding done in\s+([0-9.]+)\s*ms")


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
                 repeat: int = 1, kernels: str = "cpu", quantization: str | None = None,
                 seed: int = 0) -> list[dict]:
    """-> per size: the grid, the LLM tokens and the best encode time in seconds.
    ``kernels``: "cpu" (the CPU backend, as an engine runs the tower) or "torch" (plain torch
    ops); ``quantization``: the tower's linears in "int8" / "int4"."""
    from hybridrt.kernels.backend import select_backend
    from hybridrt.vision.kernels import quantize_tower

    enc = random_encoder(config, dtype, seed)
    if quantization:
        quantize_tower(enc, quantization)
    if kernels == "cpu":
        enc.set_backend(select_backend(None, "cpu", options=env.kernel_options()))
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


def write_checkpoint(directory: str | Path, vision: dict, seed: int = 0,
                     text: dict | None = None) -> Path:
    """A checkpoint llama.cpp's converters take, whose tower holds ``random_encoder``'s bf16
    weights for ``vision`` and ``seed`` (the weights ``time_encoder`` times): a text model
    (``text``, default: Qwen3.5-0.8B's cut to ``TEXT_LAYERS`` layers at the tower's output
    width; its vocabulary grown where the vision tokens need it), the demo model's tokenizer
    with the vision tokens added, and a ``preprocessor_config.json`` (pixel limits of 64 to
    16384 merged patches)."""
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG, write_random_checkpoint
    from hybridrt.model_path import DEMO_MODEL_DIR

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(str(directory))
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    vocab = -(-(max(ids) + 1) // 64) * 64
    if text is None:
        text = {**copy.deepcopy(QWEN35_08B_TEXT_CONFIG), "num_hidden_layers": TEXT_LAYERS,
                "hidden_size": vision["out_hidden_size"], "vocab_size": vocab}
    text = {**copy.deepcopy(text), "vocab_size": max(text["vocab_size"], vocab),
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}
    write_random_checkpoint(directory, text, seed=seed, dtype=torch.bfloat16, with_mtp=False)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["vision_config"] = {"model_type": "qwen3_5_vision", **vision}
    cfg.update(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), ids))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    enc = random_encoder(VisionConfig(**vision), torch.bfloat16, seed)
    weights = load_file(str(directory / "model.safetensors"))
    weights.update({f"model.visual.{n}": t.contiguous() for n, t in enc.state_dict().items()})
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    merge, patch = vision["spatial_merge_size"], vision["patch_size"]
    unit = (merge * patch) ** 2  # pixels per merged patch; 0.8B: 65536 to 16777216 pixels
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch,
        "temporal_patch_size": vision["temporal_patch_size"], "merge_size": merge,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 64 * unit, "longest_edge": 16384 * unit}}, indent=2))
    return directory


def llamacpp_encode(directory: str | Path, vision: dict, sizes: list[tuple[int, int]],
                    threads: int, seed: int = 0, tool: str | Path | None = None) -> list[dict]:
    """llama.cpp's ``llama-mtmd-cli`` on the same weights (``write_checkpoint`` into
    ``directory``, converted to bf16 GGUFs there) -> per size its image encode time in seconds
    ("image slice encoded in", else "mtmd batch encoding done in"), None where it printed
    neither (with its output)."""
    from PIL import Image

    tool = Path(tool or env.read("HYBRIDRT_LLAMACPP_BENCH") or TOOL)
    child_env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}  # converters
    directory = Path(directory)
    ckpt = directory / "checkpoint"
    model, proj = directory / "text-BF16.gguf", directory / "mmproj-BF16.gguf"
    if not proj.exists():
        write_checkpoint(ckpt, vision, seed)
        for cmd, out in (("convert", model), ("convert-mmproj", proj)):
            res = subprocess.run([str(tool), cmd, str(ckpt), str(out), "bf16"],
                                 capture_output=True, text=True, env=child_env)
            if res.returncode or not out.exists():
                raise RuntimeError(f"llamacpp-bench {cmd} failed: "
                                   f"{(res.stderr or res.stdout).strip()[-2000:]}")
    rows = []
    for height, width in sizes:
        png = directory / f"image-{height}x{width}.png"
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(seed))
        Image.fromarray(pixels.numpy()).save(png)
        res = subprocess.run([str(tool), "mtmd", str(model), str(proj), str(png), str(threads)],
                             capture_output=True, text=True)
        text = res.stdout + res.stderr
        times = [float(m) / 1000 for m in _SLICE.findall(text) or _BATCH.findall(text)]
        row = {"size": f"{height}x{width}", "seconds": sum(times) if times else None}
        if not times:
            row["output"] = (res.stdout + res.stderr).strip()[-2000:]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="448x448,1024x768", help="HxW,HxW,...")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--kernels", default="cpu", choices=["cpu", "torch"],
                    help="cpu: the CPU backend's (as an engine runs the tower); torch: plain "
                         "torch ops")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="the tower's linears quantized (default: in --dtype)")
    ap.add_argument("--config", default=None,
                    help="a vision_config as JSON (default: Qwen3.5-0.8B's)")
    ap.add_argument("--llamacpp", default=None, metavar="DIR",
                    help="also time llama.cpp's llama-mtmd-cli on the same weights, converted "
                         "into DIR (kept: a second run reuses the GGUFs)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    vision = json.loads(a.config) if a.config else QWEN35_08B_VISION
    config = VisionConfig(**vision)
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    rows = time_encoder(config, sizes, getattr(torch, a.dtype), a.repeat, a.kernels,
                        a.quantization)
    if a.llamacpp:
        theirs = llamacpp_encode(a.llamacpp, vision, sizes, a.threads or torch.get_num_threads())
        for row, other in zip(rows, theirs):
            row["llamacpp_seconds"] = other["seconds"]
            row["ratio"] = other["seconds"] / row["seconds"] if other["seconds"] else None
            if "output" in other:
                row["llamacpp_output"] = other["output"]
    load = os.getloadavg()
    for row in rows:
        print(json.dumps({**row, "load": [round(v, 2) for v in load]}))


if __name__ == "__main__":
    main()
