"""Qwen3.5's vision tower in torch (the ``model.visual.*`` weights, transformers'
``Qwen3_5VisionModel``): patches -> a linear patch embedding plus the learned position grid
resampled to each image's grid (bilinear, corners aligned), blocks of pre-norm attention with
2D rotary over (row, column) and a GELU MLP, attention within each image only, then the merger
(one LLM token per ``spatial_merge_size``^2 patches, projected to the text model's width)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridrt.vision.config import VisionConfig
from hybridrt.vision.kernels import VisionKernels

TORCH = VisionKernels()  # plain torch ops, until ``VisionEncoder.set_backend``

Grid = tuple[int, int, int]  # (t, h, w) in patches


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch), computed as the linear product
    over each flattened patch that it is."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, k, stride=k, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.kernels = TORCH

    def forward(self, x: torch.Tensor, bounds: Sequence[int], cos, sin) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.kernels.linear(x, self.qkv).view(n, 3, self.num_heads, -1)
        q, k = _rotate(qkv[:, :2], cos[:, None, None], sin[:, None, None]).unbind(1)
        out = self.kernels.attention(q, k, qkv[:, 2], bounds)
        return self.kernels.linear(out.reshape(n, -1), self.proj)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head (the last dimension), in fp32, back to ``x``'s
    dtype (``cos`` and ``sin`` broadcast against ``x``)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.kernels = TORCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.kernels.linear(x, self.linear_fc1), approximate=self.approximate)
        return self.kernels.linear(h, self.linear_fc2)


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, bounds, cos, sin):
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm per patch, then each group of merge_size^2 patches (adjacent in the
    processor's order) concatenated and projected: fc1, exact GELU, fc2."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(width, width)
        self.linear_fc2 = nn.Linear(width, cfg.out_hidden_size)
        self.width = width
        self.kernels = TORCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.width)
        return self.kernels.linear(F.gelu(self.kernels.linear(x, self.linear_fc1)),
                                   self.linear_fc2)


class VisionEncoder(nn.Module):
    """``forward(pixel_values, grids)``: the patches of several images (the image processor's
    rows, images one after another) -> their merged embeddings [tokens, out_hidden_size].
    Its products and attention run on plain torch ops until ``set_backend``."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)

    def set_backend(self, backend) -> None:
        """Compute the products and attention on ``backend`` (a kernel backend, e.g. the
        engine's; None: plain torch ops), see hybridrt.vision.kernels."""
        kernels = VisionKernels(backend)
        for m in self.modules():
            if "kernels" in m.__dict__:
                m.kernels = kernels

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        rows, cols, bounds = _patch_coordinates(grids, self.cfg.spatial_merge_size)
        device = self.pos_embed.weight.device
        rows, cols = rows.to(device), cols.to(device)
        if pixels.shape[0] != rows.numel():
            raise ValueError(f"{pixels.shape[0]} patches for grids {list(grids)} "
                             f"({rows.numel()} patches)")
        x = self.patch_embed(pixels.to(device))
        x = x + self._grid_embedding(grids, rows, cols).to(x.dtype)
        half = self.cfg.head_dim // 2  # rows and columns take half the frequencies each
        inv_freq = 1.0 / self.cfg.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
        freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x)

    def _grid_embedding(self, grids, rows, cols) -> torch.Tensor:
        """The learned square grid resampled bilinearly (align_corners) to each image's
        (h, w): four taps per patch."""
        side = self.cfg.grid_side
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids]).to(rows)
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids]).to(rows)
        r_taps, r_wts = _taps(rows, heights, side)
        c_taps, c_wts = _taps(cols, widths, side)
        idx = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
        wts = (r_wts[:, :, None] * c_wts[:, None, :]).reshape(-1, 4)
        table = self.pos_embed.weight
        return (table[idx] * wts[:, :, None]).sum(1)


def _taps(index: torch.Tensor, size: torch.Tensor, side: int):
    """Bilinear taps (floor, floor + 1, clamped to the grid) and their weights along one axis
    for target coordinates ``index`` on an axis of ``size`` cells."""
    src = index * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _patch_coordinates(grids: Sequence[Grid], merge: int):
    """Each patch's (row, column) in its image, in the processor's order (merge blocks of
    merge x merge patches, frame after frame), and the attention segments' bounds (one per
    frame)."""
    rows, cols, bounds = [], [], [0]
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)} is not a multiple of spatial_merge_size {merge}")
        r = torch.arange(h)[:, None].expand(h, w)
        c = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        r = r.reshape(shape).transpose(1, 2).flatten()
        c = c.reshape(shape).transpose(1, 2).flatten()
        for _ in range(t):
            rows.append(r)
            cols.append(c)
            bounds.append(bounds[-1] + h * w)
    return torch.cat(rows).float(), torch.cat(cols).float(), bounds
