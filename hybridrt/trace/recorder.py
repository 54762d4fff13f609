"""The trace recorder: an engine observer that writes down, per step and per request, the five
variables the source documents follow (docs/five-variables.md), in the runtime's own terms.

``TraceRecorder.attach(engine)`` sets it as ``LLMEngine.observer``; the engine calls its three
hooks: ``phase(name)`` (every phase, timed), ``executed(launched, logits)`` (the runner, after
sampling: the step's plan and ForwardBatch are read here, before the next step reuses the
batch's buffers) and ``applied(launched, update)`` (after the scheduler's update: tokens,
accepted drafts, the state slot kept, finish). A step's record is complete at ``applied``; it
goes into ``steps`` and to ``sink`` (e.g. a JSON-lines writer). Nothing here writes to the
engine, its requests or its cache.

A record is plain JSON data: ``{"step", "kind", "chained", "num_tokens", "input_ids",
"positions", "cu_seqlens", "preempted", "phase_s", "seqs": [...]}``, one entry of ``seqs`` per
scheduled request with the five variables under ``hidden``, ``positions``, ``attention``,
``cache`` and ``decoding`` (the field-by-field table is in docs/five-variables.md).
``header()``: what every step shares (layer types, block size, widths, RoPE).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

TOP_LOGITS = 3  # candidates kept per sampled row (raw logits, before penalties and filters)


class TraceRecorder:
    def __init__(self, engine, sink: Callable[[dict], None] | None = None):
        self.engine = engine
        self.sink = sink
        self.steps: list[dict] = []
        self._pending: dict[int, dict] = {}  # id(plan) -> its record until it is applied
        self._active: set[str] = set()  # requests admitted and not preempted or finished since
        self._times: dict[str, float] = {}  # phase -> seconds, since the last record took them
        self._t0 = time.perf_counter()

    @classmethod
    def attach(cls, engine, sink: Callable[[dict], None] | None = None) -> TraceRecorder:
        """A recorder set as ``engine.observer`` (refused if another observer is set)."""
        if engine.observer is not None:
            raise ValueError(f"the engine already has an observer "
                             f"({type(engine.observer).__name__}): one at a time")
        rec = cls(engine, sink)
        engine.observer = rec
        return rec

    def detach(self) -> None:
        if self.engine.observer is self:
            self.engine.observer = None

    # What every step shares --------------------------------------------------------------
    def header(self) -> dict:
        cfg, cache, args = self.engine.config, self.engine.cache, self.engine.args
        return {
            "trace": "hybridrt",
            "layers": [("attention" if t == "full_attention" else "gdn")
                       for t in cfg.layer_types],
            "mtp_layers": cfg.mtp_num_hidden_layers if self.engine.proposer else 0,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "block_size": cache.block_size,
            "num_blocks": cache.sizing.num_blocks,
            "num_state_slots": cache.sizing.num_slots,
            "rope": {"theta": cfg.rope_theta, "rotary_dim": cfg.rotary_dim,
                     "head_dim": cfg.head_dim, "rows": 1},
            "prefix_caching": cache.prefix_caching,
            "speculative_tokens": args.speculative_tokens,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        }

    # Observer hooks ----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t

    def executed(self, launched, logits) -> None:
        plan, batch = launched.plan, launched.batch
        chained = any(s.chained for s in plan.seqs)
        if not chained:  # a chained step still pending here was dropped by the engine (every
            self._pending.clear()  # request of it finished): it is never applied
        for req in plan.preempted:
            self._active.discard(req.request_id)
        times, self._times = self._times, {}
        rec = {
            "step": None,  # numbered when applied: steps in the order they land
            "kind": plan.kind,
            "chained": chained,
            "num_tokens": batch.num_tokens,
            "input_ids": batch.input_ids.tolist(),
            "positions": batch.positions.tolist(),
            "cu_seqlens": batch.cu_seqlens.tolist(),
            "preempted": [r.request_id for r in plan.preempted],
            "t_s": round(time.perf_counter() - self._t0, 6),
            "phase_s": {k: round(v, 6) for k, v in times.items()},
            "seqs": [],
        }
        row = 0  # the sequence's first row in ``logits``
        for b, s in enumerate(plan.seqs):
            n_rows = s.num_new_tokens if s.num_drafts else int(s.sample)
            rec["seqs"].append(self._seq(b, s, batch, rec, logits[row:row + n_rows]))
            row += n_rows
        self._pending[id(plan)] = rec

    def applied(self, launched, update) -> None:
        rec = self._pending.pop(id(launched.plan), None)
        if rec is None:  # the step was launched before the recorder was attached
            return
        rec["step"] = len(self.steps)
        rec["phase_s"]["update"] = round(self._times.pop("update", 0.0), 6)
        emitted = launched.sampled.emitted()  # on the host already: the update read it
        for b, (s, seq) in enumerate(zip(launched.plan.seqs, rec["seqs"])):
            req = s.request
            dec = seq["decoding"]
            em = emitted[b]
            seq["progress"] = {"settled": update.settled[b],
                               "num_computed_tokens": req.num_computed_tokens}
            dec["emitted"] = [] if em is None else list(em.token_ids)
            if em is not None and em.verified is not None:
                dec["accepted"] = em.verified.num_accepted
                gdn = seq["cache"]["gdn"]
                # the slot the request goes on from (None: it finished, its slots released)
                gdn["restored"] = None if req.is_finished else gdn["written"][req.slot_cursor]
            dec["drafts_next"] = list(req.draft_token_ids)
            dec["finish_reason"] = req.finish_reason
            if req.is_finished:
                self._active.discard(req.request_id)
                seq["cache"]["kept_checkpoint"] = self._kept(req, seq["cache"]["gdn"])
        self.steps.append(rec)
        if self.sink is not None:
            self.sink(rec)

    # One request's part of a step ----------------------------------------------------------
    def _seq(self, b: int, s, batch, step: dict, logits) -> dict:
        req = s.request
        cache, bs = self.engine.cache, self.engine.cache.block_size
        q0, q1 = batch.query_starts[b], batch.query_starts[b] + batch.query_lens[b]
        ids = step["input_ids"][q0:q1]
        positions = step["positions"][q0:q1]
        real = s.num_new_tokens - s.num_drafts
        prompt = req.num_prompt_tokens
        n_prompt = max(0, min(real, prompt - s.start))
        source = ["prompt"] * n_prompt + ["output"] * (real - n_prompt) + ["draft"] * s.num_drafts
        if s.chained:
            source = ["chained"]  # the previous step's token, copied on the device
        context = batch.context_lens[b]
        table = list(cache.block_table(req.request_id))
        slots = list(cache.state_slots(req.request_id))
        slot_map = batch.slot_mapping[q0:q1].tolist()
        admitted = req.request_id not in self._active
        self._active.add(req.request_id)
        gdn = {"read": batch.state_slot_list[b] if batch.initial_list[b] else None,
               "written": (batch.verify_slots[b] if batch.verify_slots
                           and batch.verify_slots[b] is not None
                           else [batch.state_slot_list[b]]),
               "checkpoints": [[ck.num_tokens, ck.slot] for ck in s.checkpoints],
               "own_slots": slots}
        return {
            "request": req.request_id,
            "index": b,
            "hidden": {"token_ids": ids, "source": source, "rows": [q0, q1],
                       "shape": [q1 - q0, self.engine.config.hidden_size]},
            "positions": self._positions(req, s.start, positions, source),
            "attention": {"rows": [q0, q1], "block_table": table[:-(-context // bs)],
                          "blocks_held": len(table), "context_len": context,
                          "queries": [s.start, s.start + q1 - q0 - 1],
                          "keys": [0, context - 1]},
            "cache": {"kv_written": _unique([p // bs for p in slot_map]),
                      "slot_mapping": slot_map,
                      "kv_read": table[:-(-context // bs)],
                      "admitted": admitted,
                      "prefix": self._prefix(req, table) if admitted else None,
                      "gdn": gdn},
            "decoding": {"logits_rows": self._logit_rows(batch, b, s),
                         "params": _params(req.params),
                         "top": _top(logits),
                         "drafts_verified": list(req.draft_token_ids[:s.num_drafts])},
        }

    @staticmethod
    def _positions(req, start: int, positions: list[int], source: list[str]) -> dict:
        """Text: the step's positions, C..C+T-1. With images (``req.vision``): the sequence
        positions C..C+T-1 and the M-RoPE rows RoPE got (t, h, w), the image tokens among them
        (their ``source`` becomes "image"), the rope delta."""
        v = getattr(req, "vision", None)
        if v is None:
            return {"positions": positions, "start": start, "rope_delta": 0}
        idx = np.arange(start, start + len(positions))
        in_prompt = idx < v.prompt_len
        rows = np.stack([idx + v.delta] * 3)
        rows[:, in_prompt] = v.positions[:, idx[in_prompt]]
        image = np.zeros(len(idx), dtype=bool)
        image[in_prompt] = v.embed_row[idx[in_prompt]] >= 0
        if len(source) == len(idx):
            for i in np.flatnonzero(image):
                source[i] = "image"
        return {"positions": idx.tolist(), "start": start, "rope_delta": int(v.delta),
                "mrope": {"rows": rows.tolist(), "image_tokens": np.flatnonzero(image).tolist(),
                          "prompt_len": int(v.prompt_len)}}

    @staticmethod
    def _logit_rows(batch, b: int, s) -> list[int]:
        """The rows of the packed hidden states whose logits the step computes for it."""
        q0, n = batch.query_starts[b], batch.query_lens[b]
        if s.num_drafts:
            return list(range(q0, q0 + n))
        return [q0 + n - 1] if s.sample else []

    def _prefix(self, req, table: list[int]) -> dict:
        """What the request's admission took from the prefix cache: its cached tokens and the
        checkpoint it resumed from (its GDN state slot, shared blocks, copied KV tail)."""
        cache = self.engine.cache
        n = req.metrics.num_cached_tokens
        out: dict[str, Any] = {"cached_tokens": n, "checkpoint_at": list(req.checkpoint_at)}
        if cache.prefix is not None and req.block_hashes is not None:
            # why a hit is no longer: the leading full blocks of its tokens the index held
            # (a hit needs a GDN checkpoint at its end as well)
            chain = req.block_hashes.upto(req.token_ids,
                                          req.block_hashes.num_hashable(len(req.token_ids)))
            run = 0
            while run < len(chain) and chain[run] in cache.prefix.block_of:
                run += 1
            out["cached_blocks"] = run
        if n and cache.prefix is not None:
            key = cache.checkpoint_key(req.token_ids, req.block_hashes, n)[0]
            ck = cache.prefix.checkpoints.get(key)
            if ck is not None:
                out["checkpoint"] = {"num_tokens": ck.num_tokens, "slot": ck.slot,
                                     "shared_blocks": table[:ck.num_shared],
                                     "tail_block": table[ck.num_shared] if ck.tail_len else None,
                                     "tail_len": ck.tail_len}
        return out

    def _kept(self, req, gdn: dict) -> dict | None:
        """The checkpoint of a finished request's tokens the cache holds after its release
        (None: none): ``own`` says whether it is the request's state, kept from one of its
        slots, or one the cache held already (the same tokens computed by another request)."""
        cache = self.engine.cache
        n = req.num_computed_tokens
        if cache.prefix is None or req.block_hashes is None or n == 0:
            return None
        ck = cache.prefix.checkpoints.get(cache.checkpoint_key(req.token_ids, req.block_hashes,
                                                               n)[0])
        return None if ck is None else {"num_tokens": ck.num_tokens, "slot": ck.slot,
                                        "own": ck.slot in gdn["own_slots"]}


def _unique(xs: list[int]) -> list[int]:
    return list(dict.fromkeys(xs))


def _params(p) -> dict:
    """The sampling parameters a row applies (the ones that differ from greedy defaults)."""
    out = {"temperature": p.temperature}
    for name, default in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("seed", None), ("max_tokens", None)):
        v = getattr(p, name)
        if v != default:
            out[name] = v
    if p.structured_outputs is not None:
        out["structured_outputs"] = True
    return out


def _top(logits) -> list[list[list]]:
    """Per logits row: the TOP_LOGITS highest [token, logit] pairs."""
    if logits.shape[0] == 0:
        return []
    k = min(TOP_LOGITS, logits.shape[-1])
    vals, idx = logits.float().topk(k, dim=-1)
    return [[[int(t), round(float(v), 4)] for t, v in zip(ti, vi)]
            for ti, vi in zip(idx.tolist(), vals.tolist())]
