"""The flat per-step batch the model runs on, built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrt.kernels.delta_rule import slot_runs


@dataclass(slots=True)
class RecurrentGroup:
    """Sequences that continue from a GDN state with the same number L of new tokens (decode:
    L = 1; draft verification: L = 1 + k). ``rows`` are their tokens' rows in the batch."""

    seqs: torch.Tensor  # [n]
    rows: torch.Tensor  # [n, L]
    state_slots_out: torch.Tensor | None  # [n, L] slot receiving the state after each token
    slots: torch.Tensor  # [n] the state slot each starts from
    slot_runs: list[tuple[int, int, int]]  # kernels.delta_rule.slot_runs(slots)


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
    | state_slots | [B] | GDN state slot a sequence starts from (and, unless verifying, ends in) |
    | has_initial_state | [B] | False for a sequence's first chunk (start from zero state) |
    | logits_indices | [N] | rows of the hidden states whose logits are wanted |
    | verify_slots | B lists or None | per-token state slots of verifying sequences (see below) |

    ``verify_slots``: for a verifying sequence, the slot receiving the state after each of its
    tokens; None otherwise.

    Host-side copies (``query_lens``, ``context_lens``) are derived once here so that kernels do
    not sync on device tensors. GDN routing: sequences continuing from a state with one new
    token, or verifying drafts, take the recurrent kernel (grouped by length); all others (prompt
    chunks) take the chunked kernel.
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
    verify_slots: list[list[int] | None] | None = None
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    recurrent_groups: list[RecurrentGroup] = field(default_factory=list)
    chunk_seqs: list[int] = field(default_factory=list)
    chunk_rows: torch.Tensor | None = None  # None: every token belongs to a chunked sequence

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
        verify = self.verify_slots or [None] * B
        if len(verify) != B:
            raise ValueError("verify_slots needs one entry per sequence")
        init = self.has_initial_state.tolist()
        slot_list = self.state_slots.tolist()
        starts = self.cu_seqlens[:-1].tolist()
        groups: dict[tuple[int, bool], list[int]] = {}
        for b in range(B):
            n = self.query_lens[b]
            if verify[b] is not None:
                if len(verify[b]) != n or not init[b]:
                    raise ValueError(f"sequence {b}: verify needs a state and one slot per token")
                groups.setdefault((n, True), []).append(b)
            elif n == 1 and init[b]:
                groups.setdefault((1, False), []).append(b)
            else:
                self.chunk_seqs.append(b)
        dev = self.input_ids.device
        self.recurrent_groups = [
            RecurrentGroup(
                seqs=torch.tensor(bs, device=dev),
                rows=torch.tensor([[starts[b] + t for t in range(n)] for b in bs], device=dev),
                state_slots_out=torch.tensor([verify[b] for b in bs], device=dev) if v else None,
                slots=torch.tensor([slot_list[b] for b in bs], device=dev),
                slot_runs=slot_runs([slot_list[b] for b in bs]),
            )
            for (n, v), bs in groups.items()
        ]
        if self.chunk_seqs and self.recurrent_groups:
            self.chunk_rows = torch.cat([
                torch.arange(starts[b], starts[b] + self.query_lens[b], device=dev)
                for b in self.chunk_seqs
            ])
