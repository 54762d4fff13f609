"""Turns a StepPlan into a flat ForwardBatch and runs the model on it."""

from __future__ import annotations

import torch

from hybridrt.forward_batch import ForwardBatch
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.scheduler import StepPlan
from hybridrt.statecache import HybridCacheManager


class ModelRunner:
    def __init__(self, model: Qwen35ForCausalLM, cache: HybridCacheManager,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.block_size = cache.block_size

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Vectorised batch construction: per-sequence lists are concatenated once, every
        per-token quantity (positions, KV slots) is computed with tensor ops."""
        seqs = plan.seqs
        ids: list[int] = []
        for s in seqs:
            c = s.request.num_computed_tokens
            ids.extend(s.request.token_ids[c:c + s.num_new_tokens])
        dev = self.device
        q_lens_list = [s.num_new_tokens for s in seqs]
        computed_list = [s.request.num_computed_tokens for s in seqs]
        q_lens = torch.tensor(q_lens_list, dtype=torch.long)
        computed = torch.tensor(computed_list, dtype=torch.long)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=cu[1:])
        T = int(cu[-1])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = computed[seq_idx] + torch.arange(T) - cu[:-1][seq_idx]
        tables = [self.cache.block_tables[s.request.request_id] for s in seqs]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        bs = self.block_size
        slot_mapping = block_tables[seq_idx, positions // bs] * bs + positions % bs
        seq_lens = computed + q_lens
        state_slots = torch.tensor(
            [self.cache.state_slots[s.request.request_id][0] for s in seqs], dtype=torch.long
        )
        sample = torch.tensor([s.sample for s in seqs], dtype=torch.bool)
        logits_indices = (cu[1:] - 1)[sample]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev),
            positions=positions.to(dev),
            cu_seqlens=cu.to(dev),
            seq_lens=seq_lens.to(dev),
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            state_slots=state_slots.to(dev),
            has_initial_state=(computed > 0).to(dev),
            logits_indices=logits_indices.to(dev),
            query_lens=q_lens_list,
            context_lens=[c + n for c, n in zip(computed_list, q_lens_list)],
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """-> fp32 logits [N, vocab] for the rows in ``batch.logits_indices`` only."""
        hidden = self.model(batch, self.cache.tensors)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
