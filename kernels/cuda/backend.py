"""The CUDA backend: Triton kernels over the same slot pools and paged KV, fla for prefill,
CUDA graphs for decode and verify steps.

- projections that read the same input (q|k|v, the GDN in_proj qkv|z|b|a, gate|up): one
  cuBLAS GEMM on a weight concatenated once at bind time (each module keeps a view of it);
- norms, silu x up, q/k norm + partial RoPE: ``fused.py``, one launch each, the reference's
  rounding;
- attention: KV write + ``paged_attention_decode`` (``attention.py``) for decode and verify;
  in a step with prompt chunks, SDPA's flash kernel on each fresh prompt's own K/V and
  ``paged_attention_varlen`` for every other sequence (continued chunks, decodes, verifies);
- GDN: ``conv_update`` + ``gdn_recurrent`` (``gdn.py``) in place over the slot pool for
  decode and verify; ``conv_prefill`` + ``chunk_prefill`` (fla, ``prefill.py``) for prompt
  chunks.

A step whose sequences all continue from a state with the same number of tokens L (a batch of
decodes, L = 1, or of verifications of k drafts, L = 1 + k) runs as a captured CUDA graph for
the smallest captured batch size that holds it: the step's inputs are copied into persistent
buffers, padding rows carry slot -1 and sequence length 0 so that every kernel skips them.
Everything else runs eagerly. ``graphs=False`` (backend "triton") runs every step eagerly and
also runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).

Batch-invariant mode (``options.batch_invariant``, docs/batch_invariance.md): every product
through ``matmul.matmul_rows`` (one tile configuration, K walked in order, no split) instead of
cuBLAS; every query row, prompt tokens included, through the paged attention kernel as a
program of its own that scores the keys in tiles counted from position 0 (no SDPA, no
split-KV); prompt chunks through the recurrent GDN kernel token by token (not fla's chunks),
its launch parameters fixed; RoPE from a table by position. CUDA graphs still run decode and
verify steps (their padding rows change no other row).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import attention_plan
from ..backend.plan import (
    ChunkedSeqs,
    GDNMeta,
    RecurrentGroup,
    StepMeta,
    gdn_split,
    step_arrays,
)
from ..backend.reference import ReferenceBackend
from ..rope import RopeTable
from . import attention as attn_k
from . import fused, prefill
from . import gdn as gdn_k
from .matmul import matmul_rows

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass(slots=True)
class UniformAttention:
    """Every sequence has L query rows continuing its cached context (decode / verify)."""

    num_queries_per_seq: int
    seq_lens: torch.Tensor  # [B]
    max_seq_len: int  # sizing hint for the split-KV partition count


@dataclass(slots=True)
class VarlenAttention:
    """Any other step (prompt chunks, possibly beside decodes and verifications): prompts with
    no cached prefix by SDPA's flash kernel over their own K/V, every other sequence by
    ``paged_attention_varlen`` over the paged cache."""

    tile_seq: torch.Tensor | None  # [n_tiles] sequence of each program; None: no tiles
    tile_q0: torch.Tensor | None  # [n_tiles] its first new token
    tokens_per_tile: int
    fresh: list[tuple[int, int]]  # (start, n) of the fresh prompts


class CudaBackend(ReferenceBackend):
    name = "cuda"
    merges_projections = True

    def __init__(self, config=None, device: torch.device | str = "cuda", graphs: bool = True,
                 options=None):
        super().__init__(config, device, options)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.groups: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.cache = None
        self.max_model_len = 4096
        self.max_num_seqs = 1
        self.max_drafts = 0
        self.mempool = None
        D = config.head_dim if config is not None else 256
        self.triton_attention = D >= 16 and D & (D - 1) == 0
        self.tokens_per_tile = attn_k.varlen_tokens_per_tile(
            config.num_attention_heads, config.num_key_value_heads) if config is not None else 16
        # batch-invariant mode: the kernels whose per-row arithmetic is fixed (module doc)
        self.invariant = self.options.batch_invariant
        self.rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.invariant:
            if not self.triton_attention:
                raise ValueError(f"batch_invariant: the Triton attention needs a power-of-two "
                                 f"head dim >= 16, got {D}")
            self.tokens_per_tile = 1  # one program per query row, whatever the step

    # Binding ------------------------------------------------------------------------------
    def bind(self, record, groups) -> None:
        """``groups``: the weights of projections that read the same input, concatenated (each
        module's weight a view into its group's: no extra memory). An MoE model's steps run
        eagerly: its routing picks the experts on the host (``kernels/moe.py``), which a graph
        cannot capture."""
        self.groups = groups
        if any(layer.sparse_mlp for layer in record.decoder):
            self.use_graphs = False

    def attach(self, cache) -> None:
        """Engine limits for the CUDA graphs' buffers (called by the runner)."""
        self.cache = cache
        self.max_model_len = cache.sizing.max_model_len
        self.max_num_seqs = cache.sizing.max_num_seqs
        self.max_drafts = cache.slots_per_request - 1

    # Per step -----------------------------------------------------------------------------
    def plan_step(self, batch) -> StepMeta:
        dev = batch.input_ids.device
        gdn = gdn_split(batch, step_arrays(batch), False, 0)
        if (len(gdn.groups) == 1 and gdn.chunked is None and gdn.groups[0].rows is None
                and self.triton_attention):
            L = gdn.groups[0].num_tokens_per_seq
            attn = UniformAttention(L, batch.seq_lens, max(batch.context_lens))
        elif self.triton_attention:
            attn = self._varlen_plan(batch)
        else:
            attn = attention_plan(batch.query_lens, batch.context_lens, batch.block_tables, dev)
        return StepMeta(attn, gdn, batch.num_tokens)

    def _varlen_plan(self, batch) -> VarlenAttention:
        ql, cl = batch.query_lens, batch.context_lens
        # prompts with no cached prefix by SDPA (batch-invariant mode: none)
        fresh = [b for b in range(len(ql)) if 1 < ql[b] == cl[b] and not self.invariant]
        rest = [b for b in range(len(ql)) if b not in fresh]
        tile_seq, tile_q0 = attn_k.varlen_tiles(ql, rest, self.tokens_per_tile)
        ts = tq = None
        if tile_seq:
            arr = step_arrays(batch)
            ts, tq = arr.tensor(arr.put([tile_seq, tile_q0])).unbind(0)
        return VarlenAttention(ts, tq, self.tokens_per_tile,
                               [(batch.query_starts[b], ql[b]) for b in fresh])

    # Linear layers and elementwise ops ----------------------------------------------------
    def linear(self, x, w):
        if self.invariant:
            if not isinstance(w, torch.Tensor):
                raise ValueError("batch_invariant: the CUDA backend has no invariant product "
                                 "for quantized weights")
            return matmul_rows(x, w)
        return super().linear(x, w)

    def project(self, x, weights):
        group = self.groups.get(tuple(id(w) for w in weights))
        if group is None:
            return [self.linear(x, w) for w in weights]
        w, sizes = group
        if self.invariant:
            return matmul_rows(x, w).split(sizes, dim=-1)
        return F.linear(x, w).split(sizes, dim=-1)

    def rope(self, positions, rotary_dim, theta, dtype, scaling=None):
        """Batch-invariant mode: cos / sin looked up by position in a table made once for
        every position the engine can reach (no host sync after: CUDA graphs capture the
        look-up)."""
        if not self.invariant:
            return super().rope(positions, rotary_dim, theta, dtype, scaling)
        key = (rotary_dim, theta, scaling, dtype, positions.device)
        tables = self.rope_tables.get(key)
        if tables is None:
            n = self.max_model_len + self.max_drafts + 2
            tables = RopeTable(rotary_dim, theta, scaling)(
                torch.arange(n, device=positions.device), dtype)
            self.rope_tables[key] = tables
        return tables[0][positions], tables[1][positions]

    def rms_norm(self, x, weight, eps, residual=None):
        return fused.rms_norm(x, weight, eps, residual)

    def gated_rms_norm(self, x, z, weight, eps):
        return fused.gated_rms_norm(x, z, weight, eps)

    def silu_mul(self, gate, up):
        n = gate.shape[-1]
        if (up.shape == gate.shape and up.stride() == gate.stride() and gate.stride(-1) == 1
                and up.data_ptr() == gate.data_ptr() + n * gate.element_size()):
            merged = gate.as_strided((*gate.shape[:-1], 2 * n), gate.stride())
            return fused.silu_mul(merged)
        return F.silu(gate) * up

    def qk_norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        return fused.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    # Mixers -------------------------------------------------------------------------------
    def attention(self, meta: StepMeta, batch, q, k, v, key_cache, value_cache, scale):
        a = meta.attention
        if not self.triton_attention:
            return super().attention(meta, batch, q, k, v, key_cache, value_cache, scale)
        attn_k.write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        if self.invariant:
            return self._invariant_attention(a, batch, q, key_cache, value_cache, scale)
        if isinstance(a, UniformAttention):
            return attn_k.paged_attention_decode(
                q, key_cache, value_cache, batch.block_tables, a.seq_lens, scale,
                num_queries_per_seq=a.num_queries_per_seq, max_seq_len=a.max_seq_len)
        out = q.new_empty(q.shape)
        if a.tile_seq is not None:
            attn_k.paged_attention_varlen(q, key_cache, value_cache, batch.block_tables,
                                          batch.seq_lens, batch.cu_seqlens, a.tile_seq,
                                          a.tile_q0, scale, a.tokens_per_tile, out=out)
        H, HKV = q.shape[1], k.shape[1]
        for start, n in a.fresh:
            # 4-D: SDPA's flash kernel takes only 4-D inputs (3-D falls back to the math path)
            o = F.scaled_dot_product_attention(
                q[None, start:start + n].transpose(1, 2), k[None, start:start + n].transpose(1, 2),
                v[None, start:start + n].transpose(1, 2), is_causal=True, scale=scale,
                enable_gqa=H != HKV)
            out[start:start + n] = o[0].transpose(0, 1)
        return out

    def _invariant_attention(self, a, batch, q, key_cache, value_cache, scale):
        """Every query row a program of its own (``paged_attention_varlen``, one token a
        tile): its keys in BLOCK_N tiles from position 0, up to its own position, whatever
        the step; a decode, a verification row and a prompt token at position p compute the
        same. Tiles past a row's position are masked out entirely (in a one-token tile there
        are none)."""
        if isinstance(a, UniformAttention):  # decode / verify (CUDA graphs): tiles on device
            L = a.num_queries_per_seq
            rows = torch.arange(q.shape[0], device=q.device)
            tile_seq, tile_q0 = rows // L, rows % L
        else:
            tile_seq, tile_q0 = a.tile_seq, a.tile_q0
        return attn_k.paged_attention_varlen(
            q, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens,
            tile_seq, tile_q0, scale, 1)

    def gdn_recurrent(self, layer, grp: RecurrentGroup, mixed, a, b, conv_states, ssm_states):
        n, L = grp.num_seqs, grp.num_tokens_per_seq
        m = gdn_k.conv_update(mixed.view(n, L, -1), layer.conv_weight, conv_states, grp.slots,
                              grp.slots_out)
        q, k, v = layer.split(m.view(n * L, -1))
        return gdn_k.gdn_recurrent(
            q.view(n, L, *q.shape[1:]), k.view(n, L, *k.shape[1:]), v.view(n, L, *v.shape[1:]),
            a.view(n, L, -1), b.view(n, L, -1), layer.A_log, layer.dt_bias, ssm_states,
            grp.slots, grp.slots_out, fixed_blocks=self.invariant,
        ).view(n * L, *v.shape[1:])

    def gdn_prompts(self, layer, c: ChunkedSeqs, mixed, z, a, b, conv_states, ssm_states):
        """Batch-invariant mode: each prompt chunk through the recurrent kernels token by
        token (one call a sequence, its state in place), which compute what decoding the same
        tokens computes; fla's chunked form sums in 64-token chunks counted from the chunk's
        start, which the step budget moves. Otherwise fla's chunked form."""
        if not self.invariant:
            return super().gdn_prompts(layer, c, mixed, z, a, b, conv_states, ssm_states)
        # sequences without a state start from zeros (a select: an unused slot may hold NaN)
        keep = c.has_initial_state
        for pool in (conv_states, ssm_states):
            old = pool.index_select(0, c.slots)
            pool.index_copy_(0, c.slots, torch.where(
                keep.view(-1, *[1] * (old.dim() - 1)), old, torch.zeros((), dtype=old.dtype,
                                                                         device=old.device)))
        cu = c.cu_seqlens_cpu.tolist()
        cores = []
        for i, n in enumerate(c.lens):
            s, e = cu[i], cu[i + 1]
            grp = RecurrentGroup(None, 1, n, c.slots[i:i + 1], None, [])
            cores.append(self.gdn_recurrent(layer, grp, mixed[s:e], a[s:e], b[s:e],
                                            conv_states, ssm_states))
        core = cores[0] if len(cores) == 1 else torch.cat(cores)
        return self._gdn_norm(layer, core, z)

    def gdn_chunked(self, layer, c: ChunkedSeqs, mixed, a, b, conv_states, ssm_states):
        m = prefill.conv_prefill(mixed, layer.conv_weight, c.cu_seqlens, conv_states, c.slots,
                                 c.has_initial_state, cu_seqlens_cpu=c.cu_seqlens_cpu)
        q, k, v = layer.split(m)
        return prefill.chunk_prefill(q, k, v, a, b, layer.A_log, layer.dt_bias, c.cu_seqlens,
                                     ssm_states, c.slots, c.has_initial_state,
                                     cu_seqlens_cpu=c.cu_seqlens_cpu)

    # CUDA graphs --------------------------------------------------------------------------
    def graph_step(self, batch, cache, eager):
        """The step as a replay of its shape's capture of ``eager(batch, cache)`` (the model's
        layers), or None: run eagerly."""
        if not self.use_graphs or self.cache is None:
            return None
        meta: StepMeta = batch.meta
        if not isinstance(meta.attention, UniformAttention):
            return None
        n, L = batch.num_seqs, meta.attention.num_queries_per_seq
        sizes = [s for s in GRAPH_BATCH_SIZES if s <= self.max_num_seqs] + [self.max_num_seqs]
        bs = next((s for s in sorted(set(sizes)) if s >= n), None)
        if bs is None:
            return None
        graph = self.graphs.get((bs, L))
        if graph is None:
            if self.mempool is None:
                self.mempool = torch.cuda.graph_pool_handle()
            graph = _Graph(eager, batch, cache, self, bs, L)
            self.graphs[(bs, L)] = graph
        return graph.run(batch)


class _Graph:
    """One captured model step (``eager(batch, cache)``) for ``bs`` sequences of ``L`` tokens
    each."""

    def __init__(self, eager, batch, cache, backend: CudaBackend, bs: int, L: int):
        dev = backend.device
        block_size = cache.block_size
        width = -(-(backend.max_model_len + backend.max_drafts) // block_size) + 1
        T = bs * L
        self.bs, self.L = bs, L
        self.input_ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.positions = torch.zeros(T, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(bs, width, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(bs, dtype=torch.long, device=dev)
        self.state_slots = torch.full((bs,), -1, dtype=torch.long, device=dev)
        self.slots_out = torch.full((bs, L), -1, dtype=torch.long, device=dev) if L > 1 else None
        cu = torch.arange(0, T + 1, L, device=dev)
        # the step's batch with persistent buffers in its place (of the runner's batch type)
        self.batch = dataclasses.replace(
            batch, input_ids=self.input_ids, positions=self.positions, cu_seqlens=cu,
            seq_lens=self.seq_lens, slot_mapping=self.slot_mapping,
            block_tables=self.block_tables, state_slots=self.state_slots,
            has_initial_state=torch.ones(bs, dtype=torch.bool, device=dev),
            logits_indices=torch.arange(T, device=dev),
            query_lens=[L] * bs, context_lens=[L] * bs, state_slot_list=[-1] * bs,
            initial_list=[True] * bs, query_starts=[], verify_slots=None, meta=None,
            arrays=None,
        )
        self.batch.meta = StepMeta(
            UniformAttention(L, self.seq_lens, backend.max_model_len + backend.max_drafts),
            GDNMeta([RecurrentGroup(None, bs, L, self.state_slots, self.slots_out, [])], None),
            T,
        )
        tensors = cache  # the CacheTensors the model reads and writes
        # warm up (compiles the Triton kernels) on a side stream, then capture; every row is
        # padding meanwhile, so neither writes anything to the caches
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                eager(self.batch, tensors)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=backend.mempool):
            self.hidden = eager(self.batch, tensors)

    def run(self, batch) -> torch.Tensor:
        n = batch.num_seqs
        T = n * self.L
        self.input_ids[:T].copy_(batch.input_ids, non_blocking=True)
        self.positions[:T].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:T].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[T:].fill_(-1)
        w = batch.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(batch.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.seq_lens[n:].fill_(0)
        self.state_slots[:n].copy_(batch.state_slots, non_blocking=True)
        self.state_slots[n:].fill_(-1)
        if self.slots_out is not None:
            slots_out = batch.meta.gdn.groups[0].slots_out
            self.slots_out[:n].copy_(slots_out, non_blocking=True)
            self.slots_out[n:].fill_(-1)
        self.graph.replay()
        return self.hidden[:T]
