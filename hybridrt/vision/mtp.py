"""The MTP layer's share of a request's images and videos (``specdec.mtp``'s hook).

The MTP row at position p reads token p+1 and the target's hidden state at p. Where token
p+1 is an image or video token, it takes the merged embedding the target saw there (its pad
token's id, ``<|image_pad|>`` or ``<|video_pad|>``, in place of the prefix cache's content
key). Position p takes the target's M-RoPE row: (t, h, w) inside an image or a video's frame
group, the prompt's own row elsewhere in it, and index + delta after the prompt (the drafting
passes included). vLLM's ``qwen3_5_mtp`` does the same: its ``inputs_embeds`` come with the
multimodal embeddings merged, and its positions are the target's M-RoPE positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridrt.vision.step import VisionStep


def mtp_vision(reqs: Sequence, starts: Sequence[int], batch) -> VisionStep | None:
    """``reqs[b]``'s rows in ``batch`` (an MTP batch, one sequence per request, in order) sit
    at positions ``starts[b]``, ``starts[b] + 1``, ...: set the positions of the requests with
    images or videos, put the pad token ids back in place of the prefix cache's content keys,
    and return the rows whose next token is an image or video token (their embeddings) and the
    rows at one (their M-RoPE positions), or None where there are neither."""
    rows, embeds, ids, rope_rows, positions, tower = [], [], [], [], [], None
    device = batch.positions.device
    for b, req in enumerate(reqs):
        v = req.vision
        if v is None:
            continue
        off, n = batch.query_starts[b], batch.query_lens[b]
        idx = np.arange(starts[b], starts[b] + n)
        at = _image_tokens(v, idx)
        pos = idx + v.delta
        in_prompt = idx < v.prompt_len
        pos[in_prompt] = v.positions[0, idx[in_prompt]]
        batch.positions[off:off + n] = torch.from_numpy(pos).to(device)
        if at.any():
            rope_rows.append(torch.from_numpy(off + np.flatnonzero(at)))
            positions.append(torch.from_numpy(v.positions[:, idx[at]]))
        nxt = _image_tokens(v, idx + 1)
        if nxt.any():
            rows.append(torch.from_numpy(off + np.flatnonzero(nxt)))
            embeds.append(v.embeddings_at(idx[nxt] + 1))
            ids.append(v.pad_ids(idx[nxt] + 1))
        tower = v.tower
    if not rows and not rope_rows:
        return None
    hidden = tower.config.out_hidden_size
    rows = torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device)
    if len(rows):
        batch.input_ids[rows] = torch.cat(ids).to(device, batch.input_ids.dtype)  # were keys
    return VisionStep(
        tower, rows, torch.cat(embeds) if embeds else torch.zeros(0, hidden),
        torch.cat(positions, dim=1).to(device) if positions else
        torch.zeros(3, 0, dtype=torch.long, device=device),
        torch.cat(rope_rows).to(device) if rope_rows else
        torch.zeros(0, dtype=torch.long, device=device))


def _image_tokens(v, idx: np.ndarray) -> np.ndarray:
    """Which positions ``idx`` are the prompt's image tokens."""
    out = np.zeros(len(idx), dtype=bool)
    inside = idx < v.prompt_len
    out[inside] = v.embed_row[idx[inside]] >= 0
    return out
