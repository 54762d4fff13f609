"""Kernel backends: the one place that decides which kernel runs.

A backend is chosen once, when the engine starts (``select_backend``), and bound to the model
(``Qwen35ForCausalLM.set_backend``). Each step the model asks it to ``prepare`` the batch:
every piece of per-step metadata (decode rows, prefill chunk groups, slot indices, per-position
verify slots, block tables, sequence lengths) is built there, once, from the host-side lists
the runner already has. The layers then call the backend with that metadata and only index
into it: no layer converts a tensor to Python or decides on a kernel.

- ``ReferenceBackend``: plain torch everywhere, the definition of correct.
- ``CPUBackend``: the compiled GDN decode step and half-precision GEMV/GEMM on the weights as
  the model holds them, int8 GEMV/GEMM on quantized ones (``kernels/csrc``) where they built
  for this CPU; plain torch (and an fp32 copy of each half weight for batched products)
  otherwise.
- ``CudaBackend`` (``kernels/cuda/backend.py``): Triton kernels for decode and verification
  (GDN over the slot pool, paged attention, fused norms), fla and SDPA for prompt chunks,
  merged projections through cuBLAS, CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import native, quant
from .attention import attention_plan, paged_attention, write_kv
from .conv import ConvPlan, causal_conv1d_update, causal_conv1d_varlen, conv_plan
from .delta_rule import (
    ChunkGroup,
    chunk_gated_delta_rule,
    chunk_plan,
    recurrent_gated_delta_rule,
    slot_runs,
)
from .linear import linear as cpu_linear
from .linear import pack_weight, use_fp32_gemm
from .memory import huge_pages_enabled
from .meta import arrays_for
from .norm import gated_rms_norm, rms_norm
from .rope import apply_partial_rope


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
    """Everything a model step's layers need beyond the tensors of the batch."""

    attention: Any
    gdn: GDNMeta
    num_tokens: int
    uniform_tokens: int = 0  # CPU: every sequence has this many new tokens (1 to
    # FUSED_MAX_TOKENS) and their KV slots, blocks and lengths were checked against the caches
    # (csrc/attn_decode.c indexes them unchecked); 0 otherwise


def gdn_split(batch, device, with_plans: bool, kernel_size: int) -> GDNMeta:
    """Route each sequence of ``batch`` (its host lists) to the recurrent kernel (one new token
    from a state, or draft verification, grouped by length) or the chunked one (prompts).
    ``device``: a device, or the step's arrays (kernels/meta.py) the index tensors go into."""
    arr = arrays_for(device)
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


class ReferenceBackend:
    """Plain torch everywhere: the definition of correct that other backends are tested
    against. Runs on any device torch runs on."""

    name = "reference"
    merges_projections = False  # wants the model's projection groups merged (bind's groups)
    huge_pages = False  # wants the streamed weights in transparent-huge-page memory

    def __init__(self, config=None, device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)

    # Binding ------------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module, groups: dict) -> None:
        """Called once by ``set_backend``, the weights laid out as ``merges_projections`` and
        ``huge_pages`` ask: ``groups`` {ids of the modules: (merged weight, output sizes)}."""

    def attach(self, cache) -> None:
        """Called once by the runner with the engine's cache manager (sizes, pools)."""

    # Per step -----------------------------------------------------------------------------
    def prepare(self, batch) -> StepMeta:
        arr = batch.arrays if batch.arrays is not None else batch.input_ids.device
        K = self.config.linear_conv_kernel_dim if self.config is not None else 4
        attn = attention_plan(batch.query_lens, batch.context_lens, batch.block_tables, arr)
        return StepMeta(attn, gdn_split(batch, arr, True, K), batch.num_tokens)

    # Linear layers and elementwise ops ----------------------------------------------------
    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        qweight = getattr(module, "qweight", None)  # int8 weights (kernels/quant.py)
        if qweight is not None:
            return quant.reference_linear(x, qweight)
        return F.linear(x, module.weight)

    def project(self, x: torch.Tensor, modules) -> list[torch.Tensor]:
        """Several projections of the same input (a backend may run them as one GEMM)."""
        return [self.linear(m, x) for m in modules]

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        return self.linear(head, hidden).float()

    def rms_norm(self, x, weight, eps, residual=None):
        """Zero-centred RMSNorm; with ``residual``: (norm(residual + x), residual + x)."""
        if residual is None:
            return rms_norm(x, weight, eps)
        r = residual + x
        return rms_norm(r, weight, eps), r

    def gated_rms_norm(self, x, z, weight, eps):
        return gated_rms_norm(x, z, weight, eps)

    def silu_mul(self, gate, up):
        return F.silu(gate) * up

    def qk_norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        return (apply_partial_rope(rms_norm(q, q_weight, eps), cos, sin),
                apply_partial_rope(rms_norm(k, k_weight, eps), cos, sin))

    # Mixers -------------------------------------------------------------------------------
    def gated_attention(self, meta: StepMeta, batch, layer, qg, k, v, key_cache, value_cache,
                        cos, sin):
        """A gated attention layer from its projections' outputs to o_proj's input: q/k norms
        and partial RoPE, this step's K/V into the paged cache, attention, the sigmoid gate.
        qg: [T, H * 2D] (per head D query then D gate values), k, v: [T, HKV * D] ->
        [T, H * D]."""
        T = qg.shape[0]
        H, HKV, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, gate = qg.view(T, H, 2 * D).chunk(2, dim=-1)
        q, k = self.qk_norm_rope(q, k.view(T, HKV, D), layer.q_norm.weight,
                                 layer.k_norm.weight, layer.q_norm.eps, cos, sin)
        o = self.attention(meta, batch, q, k, v.view(T, HKV, D), key_cache, value_cache,
                           layer.scale)
        return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))

    def attention(self, meta: StepMeta, batch, q, k, v, key_cache, value_cache, scale):
        """Write this step's K/V into the paged cache, then causal attention of ``q`` over
        each sequence's blocks -> [T, H, D]."""
        write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        return paged_attention(q, key_cache, value_cache, batch.cu_seqlens, batch.seq_lens,
                               batch.block_tables, scale, plan=meta.attention)

    def gdn(self, meta: StepMeta, layer, mixed, z, a, b, conv_states, ssm_states):
        """One GDN layer over its state slots, from the in-projections' outputs to out_proj's
        input: conv, gated delta rule, gated output norm.

        mixed: [T, conv_dim] (q | k | v channels), z: [T, HV * DV], a, b: [T, HV] raw
        projections -> [T, HV * DV]. Each recurrent group and the prompt chunks get their own
        rows of the inputs (no copy when they are the whole batch) from ``gdn_recurrent_out``
        / ``gdn_chunked_out``."""
        T = mixed.shape[0]
        out = None
        gm: GDNMeta = meta.gdn
        parts = [(g.rows, self.gdn_recurrent_out, g) for g in gm.groups]
        if gm.chunked is not None:
            parts.append((gm.chunked.rows, self.gdn_chunked_out, gm.chunked))
        for rows, kernel, part in parts:
            x = [t if rows is None else t[rows] for t in (mixed, z, a, b)]
            o = kernel(layer, part, *x, conv_states, ssm_states)
            if rows is None:
                out = o
            else:
                if out is None:
                    out = o.new_empty(T, *o.shape[1:])
                out[rows] = o
        return out

    def gdn_recurrent_out(self, layer, grp: RecurrentGroup, mixed, z, a, b, conv_states,
                          ssm_states):
        """A recurrent group's rows -> the gated-normed output [n * L, HV * DV]."""
        core = self.gdn_recurrent(layer, grp, mixed, a, b, conv_states, ssm_states)
        return self._gdn_norm(layer, core, z)

    def gdn_chunked_out(self, layer, c: ChunkedSeqs, mixed, z, a, b, conv_states, ssm_states):
        """The prompt chunks' rows -> the gated-normed output [t, HV * DV]."""
        return self._gdn_norm(layer, self.gdn_chunked(layer, c, mixed, a, b, conv_states,
                                                      ssm_states), z)

    def _gdn_norm(self, layer, core, z):
        n = core.shape[0]
        y = self.gated_rms_norm(core, z.reshape(n, layer.num_v_heads, layer.head_v_dim),
                                layer.norm.weight, layer.norm.eps)
        return y.reshape(n, layer.value_dim)

    def gdn_recurrent(self, layer, grp: RecurrentGroup, mixed, a, b, conv_states, ssm_states):
        """The group's n sequences of L tokens each (rows in order) -> core [n * L, HV, DV]."""
        n, L = grp.num_seqs, grp.num_tokens_per_seq
        g, beta = _gates(layer, a, b)
        m = causal_conv1d_update(mixed.view(n, L, -1), _conv_weight(layer), conv_states,
                                 grp.slots, state_slots_out=grp.slots_out)
        q, k, v = layer.split(m.reshape(n * L, -1))
        return recurrent_gated_delta_rule(
            q.view(n, L, *q.shape[1:]), k.view(n, L, *k.shape[1:]), v.view(n, L, *v.shape[1:]),
            g.view(n, L, -1), beta.view(n, L, -1), ssm_states, grp.slots,
            state_slots_out=grp.slots_out, runs=grp.runs, step=self._decode_step(),
        ).reshape(n * L, *v.shape[1:])

    def gdn_chunked(self, layer, c: ChunkedSeqs, mixed, a, b, conv_states, ssm_states):
        """The prompt chunks' tokens (packed as ``c.cu_seqlens``) -> core [t, HV, DV]."""
        g, beta = _gates(layer, a, b)
        m = causal_conv1d_varlen(mixed, _conv_weight(layer), c.cu_seqlens, conv_states, c.slots,
                                 c.has_initial_state, plan=c.conv)
        q, k, v = layer.split(m)
        return chunk_gated_delta_rule(q, k, v, g, beta, c.cu_seqlens, ssm_states, c.slots,
                                      c.has_initial_state, plan=c.delta)

    def _decode_step(self):
        return None

    # Whole steps (CUDA graphs) ------------------------------------------------------------
    def forward(self, model, batch, cache) -> torch.Tensor | None:
        """Run a whole model step another way (a captured graph) -> hidden, or None to let
        the model run eagerly."""
        return None


class CPUBackend(ReferenceBackend):
    """The CPU path: the compiled GDN decode step and half-precision GEMV/GEMM
    (``kernels/csrc``, built at first use for this CPU's features, see ``kernels/native.py``)
    where they built; the reference ops otherwise."""

    name = "cpu"

    def __init__(self, config=None, device: torch.device | str = "cpu"):
        super().__init__(config, device)
        self.native = native.load() is not None
        self.half_simd = native.half_gemm_available()  # decided once, not per call
        self.int8_isa = quant.select_isa()  # likewise (None: no compiled kernels)
        native.fused_simd()  # the fused layers' vector loops (HYBRIDRT_FUSED_SIMD), checked
        # without the compiled half kernels a half weight's products need an fp32 copy, kept
        # per module (``_packed``): the projections stay apart there
        self.merges_projections = self.half_simd
        self.huge_pages = huge_pages_enabled()
        self.num_slots: int | None = None
        self.kv_shape: tuple[int, int] | None = None  # (blocks, block size) of the KV caches
        self.groups: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}
        self.gdn_params: dict[int, tuple[torch.Tensor, ...]] = {}  # _gdn_params, per layer
        self.fast: list[_FastLayer] | None = None  # forward's decode loop (bind, attach)

    def bind(self, model, groups) -> None:
        self.groups = groups
        self.fast = self._fast_layers(model)

    def attach(self, cache) -> None:
        t = cache.tensors
        self.num_slots = t.num_slots
        if t.key_caches:
            self.kv_shape = tuple(t.key_caches[0].shape[:2])
        pools = [*t.key_caches, *t.value_caches, *t.conv_states]
        if not (all(p.dtype == torch.bfloat16 and p.is_contiguous() for p in pools)
                and t.ssm_states.dtype == torch.float32 and t.ssm_states.is_contiguous()):
            self.fast = None

    # Decode steps without the modules ------------------------------------------------------
    def _fast_layers(self, model) -> list[_FastLayer] | None:
        """Per decoder layer what ``forward``'s decode loop calls, or None where some layer's
        weights do not suit it (it needs a bf16 model, the compiled kernels, and every
        layer's projections merged: bf16 weights on the half kernels, or int8 ones)."""
        if not (self.native and self.half_simd and model.dtype == torch.bfloat16):
            return None
        layers = []
        for dl in model.model.layers:
            m = dl.mixer
            mods = ((m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
                    if dl.layer_type == "linear_attention" else (m.q_proj, m.k_proj, m.v_proj))
            mixer_in = self.groups.get(tuple(id(x) for x in mods))
            mlp_in = self.groups.get((id(dl.mlp.gate_proj), id(dl.mlp.up_proj)))
            outs = [_weight_of(x) for x in (m.out_proj if dl.layer_type == "linear_attention"
                                            else m.o_proj, dl.mlp.down_proj)]
            if mixer_in is None or mlp_in is None or None in outs:
                return None
            if isinstance(mixer_in[0], quant.QuantWeight) and self.int8_isa is None:
                return None
            norms = [dl.input_layernorm.weight, dl.post_attention_layernorm.weight]
            if dl.layer_type == "full_attention":
                norms += [m.q_norm.weight, m.k_norm.weight]
            if any(w.dtype != torch.bfloat16 for w in norms):
                return None
            gdn = None
            if dl.layer_type == "linear_attention":
                if m.kernel_size > 16:  # csrc/gdn_fused.c's window
                    return None
                gdn = self._gdn_weights(m, torch.bfloat16)
            layers.append(_FastLayer(dl, m, mixer_in, outs[0], mlp_in, outs[1], gdn))
        if model.model.norm.weight.dtype != torch.bfloat16:
            return None
        return layers

    def _product(self, x, w):
        if isinstance(w, quant.QuantWeight):
            return quant.linear(x, w, self.int8_isa)
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w)
        return cpu_linear(x, w, None, self.half_simd)

    def forward(self, model, batch, cache):
        """Steps of only decodes (one new token per sequence from its state), or only
        verifications of the same number of drafts, in a loop over ``_FastLayer``s: the same
        compiled calls as the model's layers make for them, without the modules and backend
        dispatch around each (a model step of the 0.8B shape makes some 250 module calls).
        Other steps: None, the model's own loop."""
        meta, fast = batch.meta, self.fast
        if fast is None or not _recurrent_only(meta):
            return None
        h = model.model.embed_tokens(batch.input_ids)
        cos, sin = model.rope(batch.positions, h.dtype)
        grp = meta.gdn.groups[0]
        L = meta.uniform_tokens
        product, norm = self._product, native.rms_norm
        residual = None
        for f in fast:
            if residual is None:
                x, residual = norm(h, f.in_norm, f.eps), h
            else:
                x, residual = norm(h, f.in_norm, f.eps, residual)
            parts = product(x, f.mixer_in).split(f.mixer_sizes, dim=-1)
            m = f.mixer
            if f.gdn is not None:
                mixed, z, b, a = parts
                taps, neg_exp_a, dt_bias, norm_w = f.gdn
                y = native.gdn_fused(mixed, z, a, b, taps, cache.conv_states[m.state_index],
                                     cache.ssm_states[m.state_index], grp.slots, grp.slots_out,
                                     neg_exp_a, dt_bias, norm_w, m.norm.eps, L, m.num_k_heads,
                                     m.head_k_dim)
            else:
                qg, k, v = parts
                y = native.attn_decode(qg, k, v, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps,
                                       cos, sin, cache.key_caches[m.cache_index],
                                       cache.value_caches[m.cache_index], batch.slot_mapping,
                                       batch.block_tables, batch.seq_lens, m.scale, L,
                                       m.num_heads, m.num_kv_heads, m.head_dim)
            x, residual = norm(product(y, f.mixer_out), f.post_norm, f.eps, residual)
            gate, up = product(x, f.mlp_in).split(f.mlp_sizes, dim=-1)
            h = product(F.silu(gate) * up, f.mlp_out)
        final = model.model.norm
        return norm(h, final.weight, final.eps, residual)[0]

    def gated_attention(self, meta, batch, layer, qg, k, v, key_cache, value_cache, cos, sin):
        """Steps where every sequence has the same few new tokens (decode, verification) in
        one compiled call per layer (csrc/attn_decode.c) where it runs for these tensors: fp32
        or bf16 throughout, contiguous caches, unit column strides."""
        dtype = qg.dtype
        L = meta.uniform_tokens
        if not L and self.kv_shape is None:  # not attached to an engine: no per-step check
            L = _uniform_len(batch.query_lens)
            if L and self.native:
                _check_kv(batch, tuple(key_cache.shape[:2]))
        if not (self.native and L and native.fused_dtype_code(dtype) is not None
                and key_cache.dtype == value_cache.dtype == cos.dtype == dtype
                and k.dtype == v.dtype == layer.q_norm.weight.dtype == dtype
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and qg.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos.is_contiguous()
                and sin.is_contiguous() and batch.slot_mapping.dtype == batch.seq_lens.dtype
                == batch.block_tables.dtype == torch.int64):
            return super().gated_attention(meta, batch, layer, qg, k, v, key_cache,
                                           value_cache, cos, sin)
        return native.attn_decode(qg, k, v, layer.q_norm.weight, layer.k_norm.weight,
                                  layer.q_norm.eps, cos, sin, key_cache, value_cache,
                                  batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                  layer.scale, L, layer.num_heads, layer.num_kv_heads,
                                  layer.head_dim)

    def project(self, x, modules):
        """One product for the group (``merge_projections``), split into its outputs."""
        group = self.groups.get(tuple(id(m) for m in modules))
        if group is None:
            return [self.linear(m, x) for m in modules]
        w, sizes = group
        if isinstance(w, quant.QuantWeight):
            return quant.linear(x, w, self.int8_isa).split(sizes, dim=-1)
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w).split(sizes, dim=-1)
        return cpu_linear(x, w, None, self.half_simd).split(sizes, dim=-1)

    def _decode_gemv(self, x, w) -> bool:
        """Whether x W^T is a bf16 product of a few rows for ``native.gemv_bf16`` (decode and
        verification steps: the common case, without ``cpu_linear``'s path choice)."""
        return (self.half_simd and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
                and x.dim() == 2 and 0 < x.shape[0] <= native.HALF_GEMV_MAX_ROWS
                and x.is_contiguous() and w.is_contiguous())

    def rms_norm(self, x, weight, eps, residual=None):
        if (not self.native or x.dtype != torch.bfloat16 or weight.dtype != x.dtype
                or x.device.type != "cpu" or x.stride(-1) != 1
                or not (x.dim() == 2 or x.is_contiguous()) or not weight.is_contiguous()
                or (residual is not None and (residual.dtype != x.dtype
                                              or residual.shape != x.shape
                                              or not residual.is_contiguous()))):
            return super().rms_norm(x, weight, eps, residual)
        return native.rms_norm(x, weight, eps, residual)

    def gdn_recurrent_out(self, layer, grp, mixed, z, a, b, conv_states, ssm_states):
        """The group in one compiled call (csrc/gdn_fused.c) where it runs for these tensors:
        fp32 or bf16 activations throughout, contiguous pools, unit column strides."""
        params = self._fused_params(layer, mixed, z, a, b, conv_states, ssm_states,
                                    (grp.slots, grp.slots_out))
        if params is None:
            return super().gdn_recurrent_out(layer, grp, mixed, z, a, b, conv_states, ssm_states)
        taps, neg_exp_a, dt_bias, norm_w = params
        return native.gdn_fused(mixed, z, a, b, taps, conv_states, ssm_states, grp.slots,
                                grp.slots_out, neg_exp_a, dt_bias, norm_w, layer.norm.eps,
                                grp.num_tokens_per_seq, layer.num_k_heads, layer.head_k_dim)

    def gdn_chunked_out(self, layer, c, mixed, z, a, b, conv_states, ssm_states):
        """Prompt chunks through the same compiled call, token after token, one call per
        sequence (its state in place): the recurrence itself rather than the chunked form, the
        state kept in cache from one token to the next. A sequence with no initial state
        starts from zeros."""
        params = self._fused_params(layer, mixed, z, a, b, conv_states, ssm_states, (c.slots,))
        if params is None:
            return super().gdn_chunked_out(layer, c, mixed, z, a, b, conv_states, ssm_states)
        taps, neg_exp_a, dt_bias, norm_w = params
        init = c.has_initial_state
        conv_states.index_copy_(0, c.slots, torch.where(
            init.view(-1, 1, 1), conv_states.index_select(0, c.slots), 0))
        ssm_states.index_copy_(0, c.slots, torch.where(
            init.view(-1, 1, 1, 1), ssm_states.index_select(0, c.slots), 0))
        # (sequence, first row, end row) of each call: a long chunk in pieces, one after the
        # other over the state in place (the same result), to bound the call's scratch memory
        pieces, end = [], 0
        for i, n in enumerate(c.lens):
            pieces += [(i, s, min(s + GDN_FUSED_MAX_ROWS, end + n))
                       for s in range(end, end + n, GDN_FUSED_MAX_ROWS)]
            end += n
        out = None if len(pieces) == 1 else mixed.new_empty(end, layer.value_dim)
        for i, s, e in pieces:
            o = native.gdn_fused(
                mixed[s:e], z[s:e], a[s:e], b[s:e], taps, conv_states, ssm_states,
                c.slots[i:i + 1], None, neg_exp_a, dt_bias, norm_w, layer.norm.eps, e - s,
                layer.num_k_heads, layer.head_k_dim)
            if out is None:
                return o
            out[s:e] = o
        return out

    def _fused_params(self, layer, mixed, z, a, b, conv_states, ssm_states, slot_tensors):
        """``_gdn_params`` where the compiled GDN call runs for these tensors (fp32 or bf16
        activations throughout, contiguous pools, unit column strides), else None; slot ranges
        checked here when no engine checks them per step."""
        params = self._gdn_params(layer, mixed, conv_states)
        if params is None or not (ssm_states.dtype == torch.float32
                                  and ssm_states.is_contiguous() and all(
                                      t.stride(-1) == 1 and t.dtype == mixed.dtype
                                      for t in (z, a, b))):
            return None
        if self.num_slots is None:  # not attached to an engine: no per-step check was made
            for t in slot_tensors:
                if t is not None and t.numel() and not (
                        0 <= int(t.min()) <= int(t.max()) < ssm_states.shape[0]):
                    raise IndexError(f"state slots out of range [0, {ssm_states.shape[0]})")
        return params

    def _gdn_params(self, layer, mixed, conv_states):
        """fp32 conv taps [K, C], -exp(A_log), dt_bias and the norm weight in the
        activations' dtype for ``native.gdn_fused``, made at the layer's first call; None where
        the fused call does not run."""
        if not self.native or mixed.device.type != "cpu":
            return None
        dtype = mixed.dtype
        if (native.fused_dtype_code(dtype) is None or conv_states.dtype != dtype
                or not conv_states.is_contiguous() or layer.kernel_size > 16):
            return None
        return self._gdn_weights(layer, dtype)

    def _gdn_weights(self, layer, dtype):
        """``_gdn_params``' tensors, without the checks (kept per layer)."""
        params = self.gdn_params.get(id(layer))
        if params is None or params[3].dtype != dtype:
            params = (
                _conv_weight(layer).float().t().contiguous(),
                -layer.A_log.detach().float().exp(),
                layer.dt_bias.detach().float().contiguous(),
                layer.norm.weight.detach().to(dtype).contiguous(),
            )
            self.gdn_params[id(layer)] = params
        return params

    def prepare(self, batch) -> StepMeta:
        meta = super().prepare(batch)
        if self.num_slots is not None:  # the compiled step indexes the pool unchecked
            slots = [s for v in (batch.verify_slots or ()) if v for s in v]
            slots += batch.state_slot_list
            if slots and not 0 <= min(slots) <= max(slots) < self.num_slots:
                raise IndexError(f"state slots out of range [0, {self.num_slots})")
            L = _uniform_len(batch.query_lens) if self.kv_shape is not None else 0
            if L:
                _check_kv(batch, self.kv_shape)
                meta.uniform_tokens = L
        return meta

    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        qweight = getattr(module, "qweight", None)
        if qweight is not None:
            return quant.linear(x, qweight, self.int8_isa)
        w = module.weight
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w)
        return cpu_linear(x, w, self._packed(module, x), self.half_simd)

    def _packed(self, module, x: torch.Tensor):
        """The weight's fp32 copy for the batched CPU GEMM where the compiled half kernels do not
        run (kernels/linear.py), made at first use and kept on the module."""
        weight = module.weight
        if not use_fp32_gemm(x, weight, self.half_simd):
            return None
        cached = getattr(module, "weight_packed", None)
        if cached is None or cached.shape != weight.shape:
            cached = pack_weight(weight)
            module.weight_packed = cached
        return cached

    def _decode_step(self):
        if not self.native:
            return None
        return _checked_step if self.num_slots is not None else native.gdn_decode_step


class _FastLayer:
    """One decoder layer as ``CPUBackend.forward``'s decode loop runs it: its mixer, norms, the
    weights of its four products (merged where ``merge_projections`` merged them) and, for a
    GDN layer, ``gdn``: the tensors ``native.gdn_fused`` takes besides the activations (None
    for an attention layer)."""

    __slots__ = ("gdn", "mixer", "in_norm", "post_norm", "eps", "mixer_in", "mixer_sizes",
                 "mixer_out", "mlp_in", "mlp_sizes", "mlp_out")

    def __init__(self, layer, mixer, mixer_in, mixer_out, mlp_in, mlp_out, gdn):
        self.gdn = gdn
        self.mixer = mixer
        self.in_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.mixer_in, self.mixer_sizes = mixer_in
        self.mixer_out = mixer_out
        self.mlp_in, self.mlp_sizes = mlp_in
        self.mlp_out = mlp_out


def _weight_of(module):
    """A Linear's int8 or bf16 weight for ``CPUBackend._product``, or None."""
    if module.qweight is not None:
        return module.qweight
    w = module.weight
    return w if w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() else None


GDN_FUSED_MAX_ROWS = 1024  # prompt tokens per compiled GDN call (its fp32 scratch: ~25 MB at 0.8B)
FUSED_MAX_TOKENS = 8  # new tokens per sequence up to which csrc/attn_decode.c runs a step


def _uniform_len(query_lens: list[int]) -> int:
    """L when every sequence has L new tokens, 1 <= L <= FUSED_MAX_TOKENS; 0 otherwise."""
    L = query_lens[0] if query_lens else 0
    return L if 0 < L <= FUSED_MAX_TOKENS and query_lens.count(L) == len(query_lens) else 0


def _recurrent_only(meta) -> bool:
    """A step of one recurrent group over the whole batch (decodes, or verifications of the
    same number of drafts), its KV indices checked (``CPUBackend.prepare``)."""
    if meta is None or not meta.uniform_tokens:
        return False
    gm = meta.gdn
    if gm.chunked is not None or len(gm.groups) != 1:
        return False
    g = gm.groups[0]
    return g.rows is None and g.num_tokens_per_seq == meta.uniform_tokens


def _check_kv(batch, kv_shape: tuple[int, int]) -> None:
    """Every KV slot, block table entry and context length of ``batch`` inside caches of
    ``kv_shape`` (blocks, block size), or IndexError."""
    blocks, bs = kv_shape
    tables, slots = batch.block_tables.numpy(), batch.slot_mapping.numpy()  # host memory
    if slots.size and not 0 <= slots.min() <= slots.max() < blocks * bs:
        raise IndexError(f"KV slots out of range [0, {blocks * bs})")
    if tables.size and not 0 <= tables.min() <= tables.max() < blocks:
        raise IndexError(f"block table entries out of range [0, {blocks})")
    if batch.context_lens and not 0 < min(batch.context_lens) <= max(
            batch.context_lens) <= tables.shape[-1] * bs:
        raise IndexError(f"context lengths out of range [1, {tables.shape[-1] * bs}]")


def _checked_step(*args):
    return native.gdn_decode_step(*args, checked=True)


def _gates(layer, a, b):
    """GDN decay (log space) and write strength from the raw projections, in fp32."""
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, torch.sigmoid(b).float()


def _conv_weight(layer) -> torch.Tensor:
    return layer.conv1d.weight[:, 0, :]  # [C, K]


def select_backend(config, device: torch.device | str = "cpu", name: str | None = None):
    """The backend for ``device``: "cpu" -> CPUBackend, "cuda" -> CudaBackend; ``name``
    forces one ("reference", "cpu", "cuda", or "triton": the CUDA backend's kernels without
    CUDA graphs, which also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    if name is None:
        name = "cuda" if device.type == "cuda" else "cpu"
    if name == "reference":
        return ReferenceBackend(config, device)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu backend runs on the CPU, not {device}")
        return CPUBackend(config, device)
    if name in ("cuda", "triton"):
        from .cuda.backend import CudaBackend

        return CudaBackend(config, device, graphs=name == "cuda")
    raise ValueError(f"unknown backend {name!r}: use reference, cpu, cuda or triton")
