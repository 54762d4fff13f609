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
    M-RoPE positions [3, rows]; ``rope_rows``: where the rows that take those positions differ
    from the embeddings' (the MTP layer's, ``hybridrt.vision.mtp``)."""

    def __init__(self, tower, rows: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 rope_rows: torch.Tensor | None = None):
        self.tower, self.rows, self.embeds, self.positions = tower, rows, embeds, positions
        self.rope_rows = rows if rope_rows is None else rope_rows

    def apply(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(embedded tokens, cos, sin) with the image rows replaced."""
        h = h.index_copy(0, self.rows, self.embeds.to(h.device, h.dtype))
        c, s = self.tower.rope_rows(self.positions, cos.dtype)
        return h, cos.index_copy(0, self.rope_rows, c), sin.index_copy(0, self.rope_rows, s)


def vision_step(seqs, batch) -> VisionStep | None:
    """Set the positions of the step's tokens of requests with images (``seqs``: the step's
    scheduled sequences, in batch order) -> their image rows, or None where the step has
    none. The images and videos the scheduler gave this step are encoded first, in one run."""
    scheduled = [(s.request.vision, i) for s in seqs if s.request.vision is not None
                 for i in s.request.vision.scheduled]
    if scheduled:
        scheduled[0][0].tower.encode_images(scheduled)
        for s in seqs:
            if s.request.vision is not None:
                s.request.vision.scheduled = []
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
            embeds.append(v.embeddings_at(at))
            ids.append(v.pad_ids(at))
            positions.append(torch.from_numpy(v.positions[:, at]))
            tower = v.tower
    if not rows:
        return None
    device = batch.positions.device
    rows = torch.cat(rows).to(device)
    batch.input_ids[rows] = torch.cat(ids).to(device, batch.input_ids.dtype)  # were cache keys
    return VisionStep(tower, rows, torch.cat(embeds), torch.cat(positions, dim=1).to(device))
