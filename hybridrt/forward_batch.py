"""The flat per-step batch the model runs on, built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ForwardBatch:
    """One model step over B sequences with T tokens in all (packed, no padding).

    | field | shape | meaning |
    | --- | --- | --- |
    | input_ids | [T] | token ids, sequence after sequence |
    | positions | [T] | num_computed_tokens[seq] + arange(q_len) |
    | cu_seqlens | [B+1] | token offsets of each sequence in the packed batch |
    | seq_lens | [B] | context length after this step (cached + new) |
    | slot_mapping | [T] | flat KV slot (block * block_size + offset) each token writes |
    | block_tables | [B, M] | KV blocks of each sequence, in order (pad with any valid id) |
    | state_slots | [B] | GDN state slot of each sequence |
    | has_initial_state | [B] | False for a sequence's first chunk (start from zero state) |
    | logits_indices | [N] | rows of the hidden states whose logits are wanted |
    | state_slots_out | [B, L] or None | verify steps: slot receiving the state after token t |

    Host-side copies (``query_lens``, ``context_lens``) are derived once here so that kernels do
    not sync on device tensors.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    logits_indices: torch.Tensor
    state_slots_out: torch.Tensor | None = None
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    # GDN routing: sequences continuing from a state with one new token take the recurrent
    # path together; all others (prompt chunks) take the chunked path.
    recurrent_seqs: torch.Tensor | None = None
    recurrent_rows: torch.Tensor | None = None
    chunk_seqs: list[int] = field(default_factory=list)
    chunk_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        B = self.cu_seqlens.numel() - 1
        if self.seq_lens.numel() != B or self.state_slots.numel() != B:
            raise ValueError("seq_lens and state_slots need one entry per sequence")
        if self.input_ids.numel() != self.positions.numel() or (
            self.input_ids.numel() != self.slot_mapping.numel()
        ):
            raise ValueError("input_ids, positions and slot_mapping need one entry per token")
        if not self.query_lens:
            self.query_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        if not self.context_lens:
            self.context_lens = self.seq_lens.tolist()
        if sum(self.query_lens) != self.input_ids.numel():
            raise ValueError("cu_seqlens does not cover input_ids")
        if self.state_slots_out is not None:
            return
        init = self.has_initial_state.tolist()
        starts = self.cu_seqlens[:-1].tolist()
        rec = [b for b in range(B) if self.query_lens[b] == 1 and init[b]]
        self.chunk_seqs = [b for b in range(B) if not (self.query_lens[b] == 1 and init[b])]
        dev = self.input_ids.device
        if rec:
            self.recurrent_seqs = torch.tensor(rec, device=dev)
            self.recurrent_rows = torch.tensor([starts[b] for b in rec], device=dev)
        if self.chunk_seqs and rec:
            self.chunk_rows = torch.cat([
                torch.arange(starts[b], starts[b] + self.query_lens[b], device=dev)
                for b in self.chunk_seqs
            ])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
