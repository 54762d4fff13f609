"""A model step's share of the requests' images (the runner's hook): each token of a request
with images takes its M-RoPE position (its row t in ``batch.positions``: the prompt's text after
an image, and every token after the prompt, sit at index + delta), and the step's image tokens
their embeddings and (t, h, w) rotary rows (``VisionStep``, applied by the model), and their
pad token's id back in place of the prefix cache's content key (``VisionInputs.keyed``)."""

from __future__ import annotations

import numpy as np
import torch


class VisionStep:
    """The rows of a step's batch that are image tokens, their merged embeddings and their
    M-RoPE positions [3, rows]."""

    def __init__(self, tower, rows: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        self.tower, self.rows, self.embeds, self.positions = tower, rows, embeds, positions

    def apply(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(embedded tokens, cos, sin) with the image rows replaced."""
        h = h.index_copy(0, self.rows, self.embeds.to(h.device, h.dtype))
        c, s = self.tower.rope_rows(self.positions, cos.dtype)
        return h, cos.index_copy(0, self.rows, c), sin.index_copy(0, self.rows, s)


def vision_step(seqs, batch) -> VisionStep | None:
    """Set the positions of the step's tokens of requests with images (``seqs``: the step's
    scheduled sequences, in batch order) -> their image rows, or None where the step has
    none."""
    rows, embeds, positions, ids, tower = [], [], [], [], None
    for b, s in enumerate(seqs):
        v = s.request.vision
        if v is None:
            continue
        off, n = batch.query_starts[b], batch.query_lens[b]
        idx = np.arange(s.start, s.start + n)
        in_prompt = idx < v.prompt_len
        pos = idx + v.delta
        pos[in_prompt] = v.positions[0, idx[in_prompt]]
        batch.positions[off:off + n] = torch.from_numpy(pos).to(batch.positions.device)
        image = np.zeros(n, dtype=bool)
        image[in_prompt] = v.embed_row[idx[in_prompt]] >= 0
        if image.any():
            at = idx[image]
            rows.append(torch.from_numpy(off + np.flatnonzero(image)))
            embeds.append(v.embeddings()[torch.from_numpy(v.embed_row[at])])
            ids.append(torch.from_numpy(v.row_token[v.embed_row[at]]))
            positions.append(torch.from_numpy(v.positions[:, at]))
            tower = v.tower
    if not rows:
        return None
    device = batch.positions.device
    rows = torch.cat(rows).to(device)
    batch.input_ids[rows] = torch.cat(ids).to(device, batch.input_ids.dtype)  # were cache keys
    return VisionStep(tower, rows, torch.cat(embeds), torch.cat(positions, dim=1).to(device))
