"""A step's metadata, built once by the backend's ``plan_step`` from the runner's host lists:
``StepMeta`` (attention plan, GDN routing, token count) and the GDN routing itself
(``gdn_split``: recurrent groups of sequences continuing from a state, and the prompt chunks).
Layers only index into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..conv import ConvPlan, conv_plan
from ..delta_rule import ChunkGroup, chunk_plan, slot_runs
from ..meta import StepArrays, as_arrays


@dataclass(slots=True)
class RecurrentGroup:
    """Sequences that continue from a GDN state with the same number L of new tokens (decode:
    L = 1; draft verification: L = 1 + k)."""

    rows: torch.Tensor | None  # [n * L] their tokens' rows in the batch; None: the whole batch
    num_seqs: int
    num_tokens_per_seq: int
    slots: torch.Tensor  # [n] the state slot each starts from
    slots_out: torch.Tensor | None  # [n, L] slot receiving the state after each token
    runs: list[tuple[int, int, int]]  # slot_runs(slots), for in-place updates over slices


@dataclass(slots=True)
class ChunkedSeqs:
    """Sequences that run the chunked (prefill) kernels: prompt chunks."""

    rows: torch.Tensor | None  # [t] their tokens' rows; None: the whole batch
    cu_seqlens: torch.Tensor  # [n + 1]
    lens: list[int]
    slots: torch.Tensor  # [n]
    has_initial_state: torch.Tensor  # [n] bool
    cu_seqlens_cpu: torch.Tensor  # [n + 1], a host copy (fla takes it to avoid a sync)
    conv: ConvPlan | None = None
    delta: list[ChunkGroup] | None = None


@dataclass(slots=True)
class GDNMeta:
    groups: list[RecurrentGroup]
    chunked: ChunkedSeqs | None


@dataclass(slots=True)
class StepMeta:
    """Everything a model step's layers need beyond the tensors of the batch (the backend's
    ``plan_step``)."""

    attention: Any
    gdn: GDNMeta
    num_tokens: int
    uniform_tokens: int = 0  # CPU: every sequence has this many new tokens (1 to
    # FUSED_MAX_TOKENS) and their KV slots, blocks and lengths were checked against the caches
    # (csrc/attn_decode.c indexes them unchecked); 0 otherwise


def step_arrays(batch) -> StepArrays:
    """Where ``batch``'s plans go: its ``arrays`` (the engine's buffers), else new arrays on
    its device."""
    return as_arrays(batch.arrays if batch.arrays is not None else batch.input_ids.device)


def gdn_split(batch, arrays: StepArrays, with_plans: bool, kernel_size: int) -> GDNMeta:
    """Route each sequence of ``batch`` (its host lists) to the recurrent kernel (one new token
    from a state, or draft verification, grouped by length) or the chunked one (prompts).
    ``arrays``: the step's arrays (kernels/meta.py) the index tensors go into."""
    arr = arrays
    B = batch.num_seqs
    starts = batch.query_starts
    verify = batch.verify_slots or [None] * B
    init, slot_list = batch.initial_list, batch.state_slot_list
    groups: dict[tuple[int, bool], list[int]] = {}
    chunk = []
    for b in range(B):
        n = batch.query_lens[b]
        if verify[b] is not None:
            groups.setdefault((n, True), []).append(b)
        elif n == 1 and init[b]:
            groups.setdefault((1, False), []).append(b)
        else:
            chunk.append(b)
    T = batch.num_tokens
    rec = []
    for (n, v), bs in groups.items():
        whole = len(bs) * n == T
        rows = None if whole else arr.tensor(arr.put(
            [starts[b] + t for b in bs for t in range(n)]))
        slots = [slot_list[b] for b in bs]
        rec.append(RecurrentGroup(
            rows, len(bs), n, arr.tensor(arr.put(slots)),
            arr.tensor(arr.put([verify[b] for b in bs])) if v else None,
            slot_runs(slots),
        ))
    chunked = None
    if chunk:
        lens = [batch.query_lens[b] for b in chunk]
        rows = None
        if rec:
            rows = arr.tensor(arr.put(
                [starts[b] + t for b in chunk for t in range(batch.query_lens[b])]))
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slots = [slot_list[b] for b in chunk]
        inits = [bool(init[b]) for b in chunk]
        cu_host = arr.put(cu)
        chunked = ChunkedSeqs(
            rows, arr.tensor(cu_host), lens, arr.tensor(arr.put(slots)),
            arr.tensor(arr.put(inits, np.bool_)), torch.from_numpy(cu_host),
        )
        if with_plans:
            chunked.conv = conv_plan(lens, kernel_size, arr)
            chunked.delta = chunk_plan(lens, slots, inits, arr)
    return GDNMeta(rec, chunked)
