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
    # GDN state checkpoints inside the chunks: the chunks run as ``rounds`` instead, one after
    # the other, each a piece of every chunk up to its next checkpoint; after a round the
    # states of the pieces that end at a checkpoint are copied, ``copies``: (src, dst) slots
    rounds: list[ChunkedSeqs] | None = None
    copies: tuple[torch.Tensor, torch.Tensor] | None = None


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
    few_tokens: tuple = ()  # CPU: where every sequence has 1 to FUSED_MAX_TOKENS new tokens,
    # not all the same (a verification beside decodes), the KV indices checked likewise: per
    # count L, (L, the sequences' rows, the sequences) as int64 tensors; empty otherwise


def step_arrays(batch) -> StepArrays:
    """Where ``batch``'s plans go: its ``arrays`` (the engine's buffers), else new arrays on
    its device."""
    return as_arrays(batch.arrays if batch.arrays is not None else batch.input_ids.device)


def gdn_split(batch, arrays: StepArrays, with_plans: bool, kernel_size: int) -> GDNMeta:
    """Route each sequence of ``batch`` (its host lists) to the recurrent kernel (one new token
    from a state, or draft verification, grouped by length) or the chunked one (prompts; in
    rounds where the batch asks for GDN checkpoints inside them: ``batch.gdn_checkpoints``).
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
        marks = getattr(batch, "gdn_checkpoints", None)
        if marks is not None and any(marks[b] for b in chunk):
            chunked.rounds = _rounds(batch, chunk, marks, arr, with_plans, kernel_size)
    return GDNMeta(rec, chunked)


def _rounds(batch, chunk: list[int], marks, arr: StepArrays, with_plans: bool,
            kernel_size: int) -> list[ChunkedSeqs]:
    """The prompt chunks cut at their checkpoints (``marks[b]``: (offset, slot) pairs, 0 <
    offset < the chunk's length, ascending): round r holds piece r of every chunk that has one,
    continuing from the state piece r - 1 left; its ``copies`` save the states of the pieces
    that end at a checkpoint."""
    pieces = []  # per sequence: [(start, end, checkpoint slot or None)]
    for b in chunk:
        cuts = [(o, slot) for o, slot in marks[b]]
        n, prev, own = batch.query_lens[b], 0, []
        for o, slot in cuts:
            if not prev < o < n:
                raise ValueError(f"sequence {b}: checkpoint offset {o} outside (0, {n})")
            own.append((prev, o, slot))
            prev = o
        own.append((prev, n, None))
        pieces.append(own)
    starts, slot_list, init = batch.query_starts, batch.state_slot_list, batch.initial_list
    rounds = []
    for r in range(max(len(p) for p in pieces)):
        bs = [i for i, p in enumerate(pieces) if r < len(p)]
        segs = [pieces[i][r] for i in bs]
        seqs = [chunk[i] for i in bs]
        lens = [e - s for s, e, _ in segs]
        rows = [starts[b] + t for b, (s, e, _) in zip(seqs, segs) for t in range(s, e)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slots = [slot_list[b] for b in seqs]
        inits = [bool(init[b]) or r > 0 for b in seqs]
        cu_host = arr.put(cu)
        c = ChunkedSeqs(arr.tensor(arr.put(rows)), arr.tensor(cu_host), lens,
                        arr.tensor(arr.put(slots)), arr.tensor(arr.put(inits, np.bool_)),
                        torch.from_numpy(cu_host))
        if with_plans:
            c.conv = conv_plan(lens, kernel_size, arr)
            c.delta = chunk_plan(lens, slots, inits, arr)
        pairs = [(slot_list[b], dst) for b, (_, _, dst) in zip(seqs, segs) if dst is not None]
        if pairs:
            src, dst = zip(*pairs)
            c.copies = (arr.tensor(arr.put(list(src))), arr.tensor(arr.put(list(dst))))
        rounds.append(c)
    return rounds
