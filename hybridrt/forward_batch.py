"""The flat per-step batch the model runs on, built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    | state_slots | [B] | GDN state slot a sequence starts from (and, unless verifying, ends in) |
    | has_initial_state | [B] | False for a sequence's first chunk (start from zero state) |
    | logits_indices | [N] | rows of the hidden states whose logits are wanted, ascending |
    | verify_slots | B lists or None | per-token state slots of verifying sequences (see below) |

    ``verify_slots``: for a verifying sequence, the slot receiving the state after each of its
    tokens; None otherwise. ``gdn_checkpoints``: per sequence, (offset, slot) pairs: the GDN
    state after its first ``offset`` new tokens (0 < offset < its new tokens) is copied into
    ``slot`` (prefix-cache checkpoints inside a prompt chunk); None: none in the step.
    ``state_copies``: (src, dst) slots whose GDN states the runner copies after the step (the
    checkpoints at the end of a sequence's new tokens).

    Host-side copies (``query_lens``, ``context_lens``, ``state_slot_list``, ``initial_list``)
    come from the runner, which has them as lists (derived here, once, for a batch built
    from tensors alone): the backend's ``plan_step`` builds the step's metadata from them, so
    that no layer reads a device tensor back. ``meta`` is that metadata, set by the model;
    ``arrays`` the buffers it goes into (the engine's ``StepBuffers``, kernels/meta.py).
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
    gdn_checkpoints: list[list[tuple[int, int]]] | None = None
    state_copies: list[tuple[int, int]] | None = None
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    state_slot_list: list[int] = field(default_factory=list)
    initial_list: list[bool] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=list)
    meta: Any = None
    arrays: Any = None  # where the backend's plans go (kernels/meta.py); new arrays if None
    vision: Any = None  # image rows: embeddings and M-RoPE (hybridrt.vision.step.VisionStep)

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
        if not self.state_slot_list:
            self.state_slot_list = self.state_slots.tolist()
        if not self.initial_list:
            self.initial_list = self.has_initial_state.tolist()
        acc, self.query_starts = 0, []
        for n in self.query_lens:
            self.query_starts.append(acc)
            acc += n
        verify = self.verify_slots or [None] * B
        if len(verify) != B:
            raise ValueError("verify_slots needs one entry per sequence")
        for b in range(B):
            if verify[b] is not None and (len(verify[b]) != self.query_lens[b]
                                          or not self.initial_list[b]):
                raise ValueError(f"sequence {b}: verify needs a state and one slot per token")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
