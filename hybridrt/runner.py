"""The model runner: one call runs a scheduled step (``ModelRunner.execute``).

``execute(plan)``: the step's flat ForwardBatch ("prepare"), the forward ("forward"), the
logits of the rows that sample or verify ("logits", in the LM head's own dtype when every row
only takes the argmax), sampling and draft verification ("sample") -> a ``LaunchedStep`` whose
tokens stay on the device until the step is applied. Each of those phases runs inside
``observer.phase(name)`` when an observer is set (see ``hybridrt.engine``). The runner owns
the backend, the step's index buffers and the sampler (its shared generator).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from hybridrt import env
from hybridrt.async_chain import lookahead_rows
from hybridrt.engine_args import EngineArgs
from hybridrt.forward_batch import ForwardBatch
from hybridrt.kernels.backend import select_backend
from hybridrt.kernels.meta import FreshArrays, StepArrays, StepBuffers
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.sampled_tokens import LaunchedStep, sample_step
from hybridrt.sampler import Sampler, plain_greedy
from hybridrt.statecache import HybridCacheManager
from hybridrt.step_plan import StepPlan
from hybridrt.vision.step import vision_step


def build_batch(
    token_lists: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    state_slots: list[int] | None = None,
    logits_rows: list[str] | None = None,
    verify_slots: list[list[int] | None] | None = None,
    device: torch.device | str = "cpu",
    arrays: StepArrays | None = None,
) -> ForwardBatch:
    """Flat batch for sequences whose new tokens ``token_lists[b]`` sit at positions
    ``starts[b]..``. Per-token quantities (positions, KV slots) are computed with array ops,
    into ``arrays`` (the engine's persistent ``StepBuffers``; new arrays by default).

    logits_rows[b]: "none", "last" (the row of the sequence's last token) or "all" (every row,
    draft verification). Default: "last" for every sequence.
    """
    arr = arrays if arrays is not None else FreshArrays(device)
    B = len(token_lists)
    q_lens_list = [len(t) for t in token_lists]
    if B and q_lens_list.count(1) == B and (logits_rows is None
                                            or logits_rows.count("last") == B):
        return _decode_batch(token_lists, starts, block_tables, block_size, state_slots,
                             verify_slots, arr)
    q_lens = np.asarray(q_lens_list, dtype=np.int64)
    computed = np.asarray(starts, dtype=np.int64)
    T = int(q_lens.sum())
    ids = arr.longs(T)
    if T:
        ids[:] = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    cu = arr.longs(B + 1)
    cu[0] = 0
    np.cumsum(q_lens, out=cu[1:])
    seq_idx = np.repeat(np.arange(B), q_lens)
    positions = arr.longs(T)
    np.add(computed[seq_idx], np.arange(T) - cu[:-1][seq_idx], out=positions)
    seq_lens = arr.longs(B)
    np.add(computed, q_lens, out=seq_lens)
    tables = _padded_tables(block_tables, arr)
    slot_mapping = arr.longs(T)
    np.add(tables[seq_idx, positions // block_size] * block_size, positions % block_size,
           out=slot_mapping)
    modes = logits_rows or ["last"] * B
    want = arr.bools(T)
    want.fill(False)
    for b, m in enumerate(modes):
        if m == "all":
            want[cu[b]:cu[b + 1]] = True
        elif m == "last" and q_lens_list[b]:
            want[cu[b + 1] - 1] = True
    rows = arr.longs(int(want.sum()))
    rows[:] = np.flatnonzero(want)
    slot_list = list(state_slots) if state_slots is not None else [0] * B
    initial = [c > 0 for c in starts]
    return ForwardBatch(
        input_ids=arr.tensor(ids),
        positions=arr.tensor(positions),
        cu_seqlens=arr.tensor(cu),
        seq_lens=arr.tensor(seq_lens),
        slot_mapping=arr.tensor(slot_mapping),
        block_tables=arr.tensor(tables),
        state_slots=arr.tensor(arr.put(slot_list)),
        has_initial_state=arr.tensor(arr.put(initial, np.bool_)),
        logits_indices=arr.tensor(rows),
        verify_slots=verify_slots,
        query_lens=q_lens_list,
        context_lens=[c + n for c, n in zip(starts, q_lens_list)],
        state_slot_list=slot_list,
        initial_list=initial,
        arrays=arr,
    )


def _padded_tables(block_tables: list[list[int]], arr) -> np.ndarray:
    """The sequences' block tables as one [B, longest] array from ``arr``, padded with 0."""
    B = len(block_tables)
    tables = arr.longs(B * max(len(t) for t in block_tables)).reshape(B, -1)
    tables.fill(0)
    for b, t in enumerate(block_tables):
        tables[b, :len(t)] = t
    return tables


def _decode_batch(token_lists, starts, block_tables, block_size, state_slots, verify_slots,
                  arr) -> ForwardBatch:
    """``build_batch`` where every sequence has one new token and wants its logits (a decode
    step): the same batch, its few values computed in Python (the array ops' fixed costs were
    most of a decode step's preparation)."""
    B = len(token_lists)
    tables = _padded_tables(block_tables, arr)
    slot_list = list(state_slots) if state_slots is not None else [0] * B
    initial = [c > 0 for c in starts]
    return ForwardBatch(
        input_ids=arr.tensor(arr.put([t[0] for t in token_lists])),
        positions=arr.tensor(arr.put(starts)),
        cu_seqlens=arr.tensor(arr.put(range(B + 1))),
        seq_lens=arr.tensor(arr.put([c + 1 for c in starts])),
        slot_mapping=arr.tensor(arr.put([t[c // block_size] * block_size + c % block_size
                                         for t, c in zip(block_tables, starts)])),
        block_tables=arr.tensor(tables),
        state_slots=arr.tensor(arr.put(slot_list)),
        has_initial_state=arr.tensor(arr.put(initial, np.bool_)),
        logits_indices=arr.tensor(arr.put(range(B))),
        verify_slots=verify_slots,
        query_lens=[1] * B,
        context_lens=[c + 1 for c in starts],
        state_slot_list=slot_list,
        initial_list=initial,
        arrays=arr,
    )


class ModelRunner:
    def __init__(self, model: Qwen35ForCausalLM, cache: HybridCacheManager, args: EngineArgs):
        options = env.kernel_options()
        if args.batch_invariant:
            options = dataclasses.replace(options, batch_invariant=True)
        self.backend = select_backend(model.config, args.device, args.backend, options)
        model.set_backend(self.backend)
        self.backend.attach(cache)
        self.model = model
        self.cache = cache
        self.device = torch.device(args.device)
        self.block_size = cache.block_size
        # shared generator for requests without a seed; positional draws for seeded ones when
        # batch-invariant (hybridrt/sampler.py)
        self.sampler = Sampler(seed=args.seed, positional=args.batch_invariant)
        self.observer = None  # sees the phases of each step (hybridrt.engine's docstring)
        # every step's index metadata in buffers sized here, once (kernels/meta.py); a device
        # other than the CPU copies fresh arrays over each step (its CUDA graphs keep their own
        # persistent inputs)
        self.arrays = FreshArrays(self.device)
        if self.device.type == "cpu":
            self.arrays = StepBuffers.for_limits(
                args.max_num_seqs, args.max_num_batched_tokens,
                -(-args.max_model_len // self.block_size), model.config.linear_conv_kernel_dim)

    def execute(self, plan: StepPlan, after: LaunchedStep | None = None) -> LaunchedStep:
        """Run one scheduled step: build its batch, forward, logits, sample / verify -> the
        launched step, its sampled tokens left on the device. ``after``: the step ``plan`` is
        chained to (``Scheduler.schedule_chained``): its sampled tokens are ``plan``'s inputs,
        copied on the device, and the sampling rows are as if they were emitted."""
        with self._phase("prepare"):
            batch = self.build_step_batch(plan)
            if after is not None:
                batch.input_ids.copy_(after.sampled.tokens, non_blocking=True)
        if after is not None:
            rows = lookahead_rows(plan)
        else:  # the plain rows' (sampling, not verifying), as sample_step orders them
            rows = [s.request.sampling_row() for s in plan.seqs if s.sample and not s.num_drafts]
        # rows that only take the argmax need no fp32 copy of the logits: the argmax of the
        # head's own dtype is the same token (verification keeps fp32)
        fp32 = any(s.num_drafts for s in plan.seqs) or not plain_greedy(rows)
        with self._phase("forward"):
            hidden = self.forward(batch)
        with self._phase("logits"):
            logits = self.logits(hidden, batch, fp32)
        with self._phase("sample"):
            sampled = sample_step(self.sampler, plan, logits, rows)
        launched = LaunchedStep(plan, batch, hidden, sampled)
        if self.observer is not None and hasattr(self.observer, "executed"):
            self.observer.executed(launched, logits)  # a tracer (hybridrt.trace) reads it
        return launched

    def _phase(self, name: str):
        """The observer's context for one phase of a step."""
        return _NO_PHASE if self.observer is None else self.observer.phase(name)

    def build_step_batch(self, plan: StepPlan) -> ForwardBatch:
        """The step's batch: each request's uncomputed tokens (plus its drafts when verifying)
        from its state slot; logits rows: the last token of sampling requests, every token
        of verifying ones."""
        tokens, starts, tables, slots, modes, verify = [], [], [], [], [], []
        marks, copies = [], []  # GDN checkpoints inside the new tokens / at their end
        for s in plan.seqs:
            req = s.request
            c = s.start
            real = s.num_new_tokens - s.num_drafts
            if s.chained:  # a placeholder: the sampled token is copied over it on the device
                tokens.append([0])
            else:
                tokens.append(req.token_ids[c:c + real] + req.draft_token_ids[:s.num_drafts])
            starts.append(c)
            tables.append(self.cache.block_table(req.request_id))
            own = self.cache.state_slots(req.request_id)
            slots.append(own[req.slot_cursor])
            modes.append("all" if s.num_drafts else ("last" if s.sample else "none"))
            verify.append(own[:s.num_drafts + 1] if s.num_drafts else None)
            inside = []
            for ck in s.checkpoints:
                offset = ck.num_tokens - c
                if offset < s.num_new_tokens:
                    inside.append((offset, ck.slot))
                else:
                    copies.append((slots[-1], ck.slot))
            marks.append(inside)
        self.arrays.begin()
        batch = build_batch(tokens, starts, tables, self.block_size, slots, modes,
                            verify if any(v is not None for v in verify) else None, self.device,
                            self.arrays)
        if any(marks):
            batch.gdn_checkpoints = marks
        batch.state_copies = copies or None
        if any(s.request.vision is not None for s in plan.seqs):
            batch.vision = vision_step(plan.seqs, batch)
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] (the states that end the step copied
        where ``batch.state_copies`` says)."""
        hidden = self.model(batch, self.cache.tensors)
        for src, dst in batch.state_copies or ():
            self.cache.copy_state(src, dst)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, batch: ForwardBatch,
               fp32: bool = True) -> torch.Tensor:
        """-> fp32 logits [N, vocab] for the rows in ``batch.logits_indices`` only (with
        ``fp32=False`` in the LM head's dtype: for rows that only take the argmax)."""
        n = batch.logits_indices.numel()
        if n == 0:
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        # ascending distinct rows: as many as the hidden states' are all of them, in order
        return self.model.compute_logits(hidden if n == hidden.shape[0] else
                                         hidden[batch.logits_indices], fp32)


_NO_PHASE = contextlib.nullcontext()
