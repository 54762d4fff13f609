"""Turns a StepPlan into a flat ForwardBatch and runs the model on it."""

from __future__ import annotations

import torch

from hybridrt.forward_batch import ForwardBatch
from hybridrt.kernels.backend import select_backend
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.scheduler import StepPlan
from hybridrt.statecache import HybridCacheManager


def build_batch(
    token_lists: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    state_slots: list[int] | None = None,
    logits_rows: list[str] | None = None,
    verify_slots: list[list[int] | None] | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Flat batch for sequences whose new tokens ``token_lists[b]`` sit at positions
    ``starts[b]..``. Per-token quantities (positions, KV slots) are computed with tensor ops.

    logits_rows[b]: "none", "last" (the row of the sequence's last token) or "all" (every row,
    draft verification). Default: "last" for every sequence.
    """
    B = len(token_lists)
    ids: list[int] = []
    for t in token_lists:
        ids.extend(t)
    q_lens_list = [len(t) for t in token_lists]
    q_lens = torch.tensor(q_lens_list, dtype=torch.long)
    computed = torch.tensor(starts, dtype=torch.long)
    cu = torch.zeros(B + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=cu[1:])
    T = len(ids)
    seq_idx = torch.repeat_interleave(torch.arange(B), q_lens)
    positions = computed[seq_idx] + torch.arange(T) - cu[:-1][seq_idx]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    slot_mapping = tables[seq_idx, positions // block_size] * block_size + positions % block_size
    modes = logits_rows or ["last"] * B
    want_last = torch.tensor([m == "last" for m in modes], dtype=torch.bool)
    want_all = torch.tensor([m == "all" for m in modes], dtype=torch.bool)
    is_last = torch.zeros(T, dtype=torch.bool)
    is_last[cu[1:] - 1] = True
    rows = (want_all[seq_idx] | (want_last[seq_idx] & is_last)).nonzero().view(-1)
    slot_list = list(state_slots) if state_slots is not None else [0] * B
    slots = torch.tensor(slot_list, dtype=torch.long)
    dev = torch.device(device)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long).to(dev),
        positions=positions.to(dev),
        cu_seqlens=cu.to(dev),
        seq_lens=(computed + q_lens).to(dev),
        slot_mapping=slot_mapping.to(dev),
        block_tables=tables.to(dev),
        state_slots=slots.to(dev),
        has_initial_state=(computed > 0).to(dev),
        logits_indices=rows.to(dev),
        verify_slots=verify_slots,
        query_lens=q_lens_list,
        context_lens=[c + n for c, n in zip(starts, q_lens_list)],
        state_slot_list=slot_list,
        initial_list=[c > 0 for c in starts],
    )


class ModelRunner:
    def __init__(self, model: Qwen35ForCausalLM, cache: HybridCacheManager,
                 device: torch.device | str = "cpu", backend: str | None = None):
        self.backend = select_backend(model.config, device, backend)
        model.set_backend(self.backend)
        self.backend.attach(cache)
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.block_size = cache.block_size

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """The step's batch: each request's uncomputed tokens (plus its drafts when verifying)
        from its state slot; logits rows: the last token of sampling requests, every token
        of verifying ones."""
        tokens, starts, tables, slots, modes, verify = [], [], [], [], [], []
        for s in plan.seqs:
            req = s.request
            c = req.num_computed_tokens
            real = s.num_new_tokens - s.num_drafts
            tokens.append(req.token_ids[c:c + real] + req.draft_token_ids[:s.num_drafts])
            starts.append(c)
            tables.append(self.cache.block_tables[req.request_id])
            own = self.cache.state_slots[req.request_id]
            slots.append(own[req.slot_cursor])
            modes.append("all" if s.num_drafts else ("last" if s.sample else "none"))
            verify.append(own[:s.num_drafts + 1] if s.num_drafts else None)
        return build_batch(tokens, starts, tables, self.block_size, slots, modes,
                           verify if any(v is not None for v in verify) else None, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden]."""
        return self.model(batch, self.cache.tensors)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """-> fp32 logits [N, vocab] for the rows in ``batch.logits_indices`` only."""
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
