"""Interleaved M-RoPE positions of a prompt holding images (transformers' ``get_rope_index``
for Qwen3.5) and their rotary rows.

Text tokens have equal (t, h, w) positions, counting on from the last position before them;
an image's tokens take (start + t, start + row, start + column) of its merged grid, and the
text after it continues from start + max(rows, columns). A request's tokens after its prompt
therefore sit at ``index + delta`` (all three rows equal), ``delta`` = the prompt's largest
position + 1 - its length: decode needs no more than that shift of the 1-D positions.

The text rotary's frequencies (``rotary_dim / 2``) take their angle from the t row, except
every third from index 1 (h, ``mrope_section[1]`` of them) and from index 2 (w,
``mrope_section[2]``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridrt.kernels.rope import cos_sin, inv_freq

# an image or frame in the prompt: (offset of its first token, merged grid (t, h, w))
Span = tuple[int, tuple[int, int, int]]


def mrope_positions(num_tokens: int, spans: Sequence[Span]) -> tuple[np.ndarray, int]:
    """(positions [3, num_tokens] int64, rope delta) of a prompt whose image tokens are the
    ``spans`` (in order, each t*h*w tokens from its offset)."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    at, nxt = 0, 0  # next token index, next position
    for offset, (t, h, w) in spans:
        if offset < at:
            raise ValueError(f"image spans overlap or are out of order at token {offset}")
        pos[:, at:offset] = np.arange(nxt, nxt + offset - at)
        nxt += offset - at
        n = t * h * w
        if offset + n > num_tokens:
            raise ValueError(f"an image of {n} tokens at {offset} overruns the prompt")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[0, offset:offset + n] = tt.ravel() + nxt
        pos[1, offset:offset + n] = hh.ravel() + nxt
        pos[2, offset:offset + n] = ww.ravel() + nxt
        nxt += max(h, w)
        at = offset + n
    pos[:, at:] = np.arange(nxt, nxt + num_tokens - at)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


def mrope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                  section: Sequence[int], dtype: torch.dtype, scaling=None):
    """positions [3, T] -> (cos, sin) [T, rotary_dim] in ``dtype``, interleaved as
    transformers' ``Qwen3_5TextRotaryEmbedding`` does (fp32 angles, rounded after;
    ``scaling``: YaRN's ``RopeScaling`` or None)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq(
        rotary_dim, theta, scaling, positions.device)  # [3, T, R/2]
    out = freqs[0].clone()
    for row, first in ((1, 1), (2, 2)):
        idx = slice(first, section[row] * 3, 3)
        out[:, idx] = freqs[row][:, idx]
    return cos_sin(out, dtype, scaling)
