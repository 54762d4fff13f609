"""The CPU backend: the compiled kernels of ``kernels/csrc`` (GDN layer, attention decode,
norms, half-precision and int8 GEMV/GEMM) where they built and run for the tensors at hand,
the reference's ops otherwise (a ``ReferenceBackend`` it holds, and ``reference.plan`` /
``run_gdn``); and ``forward``'s loop over whole decode steps over the model's record
(``_FastLayer``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import int4, int4_prefetch, native, prefill_attention, quant
from ..linear import linear as cpu_linear
from ..linear import pack_weight, use_fp32_gemm
from ..memory import weights_on_huge_pages
from ..moe import sparse_moe
from ..moe_step import moe_fits
from ..options import KernelOptions
from ..rope import RopeRows, RopeTable
from ..step import StepProgram
from .layers import AttentionLayer, DecoderLayerRecord, GDNLayer, ModelRecord
from .plan import StepMeta
from .reference import ReferenceBackend, plan, run_gdn


class CPUBackend:
    """The CPU path: the compiled GDN decode step and half-precision GEMV/GEMM
    (``kernels/csrc``, built at first use for this CPU's features, see ``kernels/native.py``)
    where they built; the reference's ops otherwise (``ref``, a ``ReferenceBackend`` sharing
    its GDN decode step)."""

    name = "cpu"
    fused_max_rows = 1024  # prompt tokens per compiled GDN call (bounds its fp32 scratch)

    def __init__(self, config=None, device: torch.device | str = "cpu",
                 options: KernelOptions | None = None):
        self.ref = ReferenceBackend(config, device, options)
        self.config, self.device, self.options = config, self.ref.device, self.ref.options
        opts = self.options
        # every kernel choice decided once, here, from the options (not per call)
        self.native = opts.native and native.load(opts.cache_dir, opts.march) is not None
        self.half_simd = self.native and native.half_gemm_available()
        self.half_path = native.half_path(opts.half_path) if self.native else None
        self.int8_isa = quant.select_isa(opts.int8_isa, self.native)  # None: no compiled ones
        self.int4_isa = int4.select_isa(opts.int4_isa, self.native)
        if self.native:
            int4_prefetch.configure(opts.int4_prefetch)
        self.fused_simd = opts.fused_simd  # the fused layers' vector loops
        # the in-place decode step the reference's recurrent GDN form runs
        self.ref.gdn_step = native.gdn_decode_step if self.native else None
        # prompt chunks' attention over their context in tiles (torch's CPU flash kernel)
        if prefill_attention.available():
            self.ref.prefill_attention = prefill_attention.TiledPrefill()
        # without the compiled half kernels a half weight's products need an fp32 copy, kept
        # per module (``_packed``): the projections stay apart there
        self.merges_projections = self.half_simd
        self.huge_pages = weights_on_huge_pages(opts)
        self.num_slots: int | None = None
        self.kv_shape: tuple[int, int] | None = None  # (blocks, block size) of the KV caches
        self.groups: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}
        self.fp32_copies: dict[int, tuple] = {}  # id(weight) -> (weight, its fp32 copy)
        self.gdn_params: dict[int, tuple] = {}  # _gdn_weights, per layer: (layer, tensors)
        self.fast: list[_FastLayer] | None = None  # forward's decode loop (bind, attach)
        self.final_norm: tuple[torch.Tensor, float] | None = None  # (weight, eps), bind's
        # the same loop as one compiled call per step shape (kernels/step.py); None where a
        # shape has none (the loop in Python then)
        self.programs: dict[tuple, StepProgram | None] = {}
        self.step_buffers: dict[str, torch.Tensor] = {}  # their activations, shared
        # batch-invariant mode (docs/batch_invariance.md): every product, attention and
        # activation through the kernels whose per-row arithmetic is fixed
        self.invariant = opts.batch_invariant
        self.rope_table: RopeTable | RopeRows | None = None
        if self.invariant and not self.half_simd:
            raise ValueError("batch_invariant=True needs hybridrt's compiled CPU kernels (a C "
                             "compiler with OpenMP, a CPU with AVX2 + FMA + F16C, "
                             "HYBRIDRT_NATIVE not 0)")

    def bind(self, record: ModelRecord, groups) -> None:
        self.groups = groups
        self.final_norm = (record.norm_weight, record.norm_eps)
        self.fast = self._fast_layers(record)
        self.programs, self.step_buffers = {}, {}

    def attach(self, cache) -> None:
        t = cache.tensors
        self.num_slots = t.num_slots
        self.programs, self.step_buffers = {}, {}
        if self.native:  # plan_step checks the slots once per step: the step need not
            self.ref.gdn_step = _checked_step
        if t.key_caches:
            self.kv_shape = tuple(t.key_caches[0].shape[:2])
        pools = [*t.key_caches, *t.value_caches, *t.conv_states]
        kv = [*t.key_caches, *t.value_caches]
        if kv and all(p.dtype == torch.int8 and p.is_contiguous() for p in kv):
            pools = list(t.conv_states)  # kernels/kvquant.py's rows: csrc/attn_decode.c's too
        if not (all(p.dtype == torch.bfloat16 and p.is_contiguous() for p in pools)
                and t.ssm_states.dtype == torch.float32 and t.ssm_states.is_contiguous()):
            self.fast = None

    # Decode steps over the model's record -------------------------------------------------
    def _fast_layers(self, record: ModelRecord) -> list[_FastLayer] | None:
        """Per decoder layer what ``forward``'s decode loop calls, or None where some layer's
        weights do not suit it (it needs a bf16 model, the compiled kernels, and every layer's
        projections merged: bf16 weights on the half kernels, or int8 ones; an MoE layer's
        experts on the compiled products, ``moe_step.moe_fits``)."""
        if not (self.native and self.half_simd and record.dtype == torch.bfloat16):
            return None
        layers = []
        for dl in record.decoder:
            moe = dl.moe  # an MoE layer: its shared expert in the MLP's place
            if dl.sparse_mlp and not (moe is not None and moe_fits(self, moe)):
                return None
            m = dl.mixer_layer
            mixer_in = self.groups.get(tuple(id(w) for w in dl.mixer_in))
            mlp_in = self.groups.get(tuple(id(w) for w in (moe.shared_in if moe else dl.mlp_in)))
            outs = [_weight_of(w) for w in (dl.mixer_out, moe.shared_out if moe else dl.mlp_out)]
            if mixer_in is None or mlp_in is None or None in outs:
                return None
            if any(self._quant_isa(w) is None for w in (mixer_in[0], mlp_in[0], *outs)
                   if isinstance(w, quant.PackedWeight)):
                return None
            norms = [dl.input_norm_weight, dl.post_norm_weight]
            if isinstance(m, AttentionLayer):
                norms += [m.q_norm_weight, m.k_norm_weight]
            if any(w.dtype != torch.bfloat16 for w in norms):
                return None
            gdn = None
            if isinstance(m, GDNLayer):
                if m.kernel_size > 16:  # csrc/gdn_fused.c's window
                    return None
                gdn = self._gdn_weights(m, torch.bfloat16)
            layers.append(_FastLayer(dl, mixer_in, outs[0], mlp_in, outs[1], gdn, moe))
        return layers

    def _quant_isa(self, w) -> str | None:
        """The compiled path for quantized weights ``w`` (None: none, the torch fallback)."""
        return self.int4_isa if isinstance(w, int4.Int4Weight) else self.int8_isa

    def _quant_linear(self, x, w):
        """x W^T for quantized weights (int8 or 4-bit)."""
        if isinstance(w, int4.Int4Weight):
            return int4.linear(x, w, self.int4_isa)
        return quant.linear(x, w, self.int8_isa)

    def _product(self, x, w):
        if self.invariant:
            return self._invariant_product(x, w)
        if isinstance(w, quant.PackedWeight):
            return self._quant_linear(x, w)
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w, self.half_path)
        return cpu_linear(x, w, None, self.half_simd, self.half_path)

    def graph_step(self, batch, cache, eager):
        return None

    def forward(self, batch, cache, h, cos, sin):
        """Steps where every sequence continues from its state with 1 to FUSED_MAX_TOKENS new
        tokens (decodes, verifications, or both: adaptive k drafts for some requests only),
        from the embedded tokens ``h`` and the RoPE rows, in a loop over ``_FastLayer``s: the
        same compiled calls as the model's layers make for them, without the modules and
        backend dispatch around each (a model step of the 0.8B shape makes some 250 module
        calls). Steps where every sequence has as many tokens run as one step program. Other
        steps (prompt chunks): None, the model's own loop."""
        meta, fast = batch.meta, self.fast
        if fast is None or not _recurrent_only(meta):
            return None
        groups = meta.gdn.groups
        L = meta.uniform_tokens
        if L and len(groups) == 1:  # a program's GDN calls take the whole step as one group
            program = self._program(cache, h.shape[0], L)
            if program is not None:
                return program.run(h, groups[0], cos, sin, batch)
        product, norm = self._product, native.rms_norm
        residual = None
        for f in fast:
            if residual is None:
                x, residual = norm(h, f.in_norm, f.eps), h
            else:
                x, residual = norm(h, f.in_norm, f.eps, residual)
            parts = product(x, f.mixer_in).split(f.mixer_sizes, dim=-1)
            m = f.mixer_layer
            if f.gdn is not None:
                y = self._fast_gdn(f, parts, cache, meta)
            elif L:
                qg, k, v = parts
                y = native.attn_decode(qg, k, v, m.q_norm_weight, m.k_norm_weight, m.eps,
                                       cos, sin, cache.key_caches[m.cache_index],
                                       cache.value_caches[m.cache_index], batch.slot_mapping,
                                       batch.block_tables, batch.seq_lens, m.scale, L,
                                       m.num_heads, m.num_kv_heads, m.head_dim,
                                       self.fused_simd)
            else:
                y = self._attention_by_length(meta.few_tokens, batch, m, *parts,
                                              cache.key_caches[m.cache_index],
                                              cache.value_caches[m.cache_index], cos, sin)
            x, residual = norm(product(y, f.mixer_out), f.post_norm, f.eps, residual)
            if f.moe is not None:
                h = sparse_moe(x, f.moe, self)
                continue
            gate, up = product(x, f.mlp_in).split(f.mlp_sizes, dim=-1)
            h = product(self.silu_mul(gate, up), f.mlp_out)
        return norm(h, *self.final_norm, residual)[0]

    def _fast_gdn(self, f, parts, cache, meta):
        """A GDN layer of ``forward``'s loop: the reference's routing (``run_gdn``: each
        recurrent group on its own rows) through ``native.gdn_fused`` with the layer's kept
        tensors (``_FastLayer.gdn``), without ``gdn_group``'s per-call checks."""
        mixed, z, b, a = parts
        taps, neg_exp_a, dt_bias, norm_w = f.gdn
        m = f.mixer_layer

        def group(layer, g, mixed, z, a, b, conv, ssm):
            return native.gdn_fused(mixed, z, a, b, taps, conv, ssm, g.slots, g.slots_out,
                                    neg_exp_a, dt_bias, norm_w, layer.eps, g.num_tokens_per_seq,
                                    layer.num_k_heads, layer.head_k_dim, self.fused_simd)

        return run_gdn(meta, m, mixed, z, a, b, cache.conv_states[m.state_index],
                       cache.ssm_states[m.state_index], group, None)

    def _program(self, cache, rows: int, L: int) -> StepProgram | None:
        """The step program of this shape (built at its first step), or None: the option is
        off, the batch-invariant mode (its own products), or a product it has no operation
        for."""
        if self.invariant or not self.options.step_program:
            return None
        key = (rows, L, id(cache))
        if key not in self.programs:
            grown = []

            def buffer(name, numel, dtype):
                t = self.step_buffers.get(name)
                if t is None or t.numel() < numel:  # room for twice as many rows
                    old = 0 if t is None else t.numel()
                    t = self.step_buffers[name] = torch.empty(max(numel, 2 * old), dtype=dtype)
                    grown.append(name)
                return t

            try:
                program = StepProgram(self, self.fast, self.final_norm, cache, rows, L, buffer)
            except ValueError:
                program = None
            if grown:  # the other programs point into the buffers replaced
                self.programs = {}
            self.programs[key] = program
        return self.programs[key]

    def qk_norm_rope(self, q, k, q_weight, k_weight, eps, cos, sin):
        return self.ref.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    def gated_attention(self, meta, batch, layer, qg, k, v, key_cache, value_cache, cos, sin):
        """Steps where every sequence has the same few new tokens (decode, verification) in
        one compiled call per layer (csrc/attn_decode.c) where it runs for these tensors: fp32
        or bf16 throughout, contiguous caches, unit column strides."""
        dtype = qg.dtype
        L = meta.uniform_tokens
        if self.invariant:
            return self._invariant_attention(batch, layer, qg, k, v, key_cache, value_cache,
                                             cos, sin)
        few = () if L else meta.few_tokens
        if not L and self.kv_shape is None:  # not attached to an engine: no per-step check
            L = _uniform_len(batch.query_lens)
            few = () if L else _length_groups(batch.query_lens)
            if (L or few) and self.native:
                _check_kv(batch, tuple(key_cache.shape[:2]))
        if not ((L or few) and self.native and native.fused_dtype_code(dtype) is not None
                and _kv_dtype_ok(key_cache, value_cache, dtype) and cos.dtype == dtype
                and k.dtype == v.dtype == layer.q_norm_weight.dtype == dtype
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and qg.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos.is_contiguous()
                and sin.is_contiguous() and batch.slot_mapping.dtype == batch.seq_lens.dtype
                == batch.block_tables.dtype == torch.int64):
            return self.ref.gated_attention(meta, batch, layer, qg, k, v, key_cache,
                                            value_cache, cos, sin)
        if few:  # one call per count of new tokens (a row's arithmetic is the same in any
            # call, csrc/attn_decode.c), not the reference's gathered attention over the context
            return self._attention_by_length(few, batch, layer, qg, k, v, key_cache,
                                             value_cache, cos, sin)
        return native.attn_decode(qg, k, v, layer.q_norm_weight, layer.k_norm_weight,
                                  layer.eps, cos, sin, key_cache, value_cache,
                                  batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                  layer.scale, L, layer.num_heads, layer.num_kv_heads,
                                  layer.head_dim, self.fused_simd)

    def _attention_by_length(self, groups, batch, layer, qg, k, v, key_cache, value_cache, cos,
                             sin):
        """``gated_attention`` of a step whose sequences have few new tokens, not all as
        many: the sequences of each count in one ``native.attn_decode`` call (``groups``:
        ``_length_groups``), their rows gathered and the outputs put back in the step's row
        order."""
        out = qg.new_empty(qg.shape[0], layer.num_heads * layer.head_dim)
        for L, rows, idx in groups:
            out[rows] = native.attn_decode(
                qg[rows], k[rows], v[rows], layer.q_norm_weight, layer.k_norm_weight,
                layer.eps, cos[rows], sin[rows], key_cache, value_cache,
                batch.slot_mapping[rows], batch.block_tables[idx], batch.seq_lens[idx],
                layer.scale, L, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                self.fused_simd)
        return out

    def project(self, x, weights):
        """One product for the group (merged at bind time), split into its outputs."""
        group = self.groups.get(tuple(id(w) for w in weights))
        if group is None:
            return [self.linear(x, w) for w in weights]
        w, sizes = group
        if self.invariant:
            return self._invariant_product(x, w).split(sizes, dim=-1)
        if isinstance(w, quant.PackedWeight):
            return self._quant_linear(x, w).split(sizes, dim=-1)
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w, self.half_path).split(sizes, dim=-1)
        return cpu_linear(x, w, None, self.half_simd, self.half_path).split(sizes, dim=-1)

    def logits(self, hidden, head, fp32: bool = True):
        """The LM head's product (``linear``) in fp32, or with ``fp32=False`` in its own
        dtype."""
        y = self.linear(hidden, head)
        return y.float() if fp32 else y

    def rope(self, positions, rotary_dim, theta, dtype, scaling=None):
        """By position from a table (the batch-invariant mode's own, else ``rope_cos_sin``'s
        rows: the same bits as computing them)."""
        if positions.device.type != "cpu" or not self.invariant and rotary_dim % 32:
            return self.ref.rope(positions, rotary_dim, theta, dtype, scaling)
        if self.rope_table is None or self.rope_table.key != (rotary_dim, theta, scaling):
            self.rope_table = (RopeTable if self.invariant else RopeRows)(rotary_dim, theta,
                                                                          scaling)
        return self.rope_table(positions, dtype)

    def silu_mul(self, gate, up):
        # bf16 always on csrc/norm.c's silu_mul, which the step programs run too; fp32 there
        # only in the batch-invariant mode
        if ((self.invariant or (self.native and gate.dtype == torch.bfloat16))
                and gate.dim() == 2 and native.fused_dtype_code(gate.dtype) is not None
                and gate.dtype == up.dtype and gate.stride(-1) == up.stride(-1) == 1):
            return native.silu_mul(gate, up)
        return F.silu(gate) * up

    # Batch-invariant mode ------------------------------------------------------------------
    def _invariant_product(self, x, w):
        """x W^T with each row's sums fixed by the row alone: int8 and 4-bit weights on their
        kernels (row-invariant at every row count: a row's operations are the same in the GEMV
        and in every GEMM tile), half weights on the few-row GEMV's tiles
        (``native.gemv_rows``), fp32 weights on ``native.f32_gemm_rows``."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if isinstance(w, int4.Int4Weight):
            y = int4.linear(x2, w, self.int4_isa)
        elif isinstance(w, quant.QuantWeight):
            y = quant.linear(x2, w, self.int8_isa)
        elif self._decode_gemv(x, w):  # up to 8 rows: gemv_rows' own call, without its checks
            return native.gemv_bf16(x, w, self.half_path)
        elif w.dtype in (torch.bfloat16, torch.float16):
            out = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
            y = native.gemv_rows(x2, w.contiguous(), self.half_path, out)
        elif w.dtype == torch.float32:
            y = native.f32_gemm_rows(x2, w.contiguous())
        else:
            raise ValueError(f"batch_invariant: no invariant product for {w.dtype} weights")
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def _invariant_attention(self, batch, layer, qg, k, v, key_cache, value_cache, cos, sin):
        """Every query row through csrc/attn_decode.c, which scores a row's keys in blocks
        fixed by absolute position: a prompt token computes what decoding it would. One call
        per run of sequences with the same number of new tokens."""
        dtype = qg.dtype
        if not (native.fused_dtype_code(dtype) is not None
                and _kv_dtype_ok(key_cache, value_cache, dtype)
                and cos.dtype == k.dtype == v.dtype == layer.q_norm_weight.dtype == dtype
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and qg.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            raise ValueError(f"batch_invariant: attention needs fp32 or bf16 activations and "
                             f"caches, got {dtype} / {key_cache.dtype}")
        if self.kv_shape is None:  # not attached to an engine: checked here, not per step
            _check_kv(batch, tuple(key_cache.shape[:2]))
        cos, sin = cos.contiguous(), sin.contiguous()
        lens = batch.query_lens
        out = qg.new_empty(qg.shape[0], layer.num_heads * layer.head_dim)
        b, row = 0, 0
        while b < len(lens):
            e = b
            while e < len(lens) and lens[e] == lens[b]:
                e += 1
            L, n = lens[b], (e - b) * lens[b]
            whole = b == 0 and e == len(lens)
            rows = slice(row, row + n)
            o = native.attn_decode(
                qg[rows], k[rows], v[rows], layer.q_norm_weight, layer.k_norm_weight, layer.eps,
                cos[rows], sin[rows], key_cache, value_cache, batch.slot_mapping[rows],
                batch.block_tables[b:e], batch.seq_lens[b:e], layer.scale, L,
                layer.num_heads, layer.num_kv_heads, layer.head_dim, self.fused_simd)
            if whole:
                return o
            out[rows] = o
            b, row = e, row + n
        return out

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
            return self.ref.rms_norm(x, weight, eps, residual)
        return native.rms_norm(x, weight, eps, residual)

    def gdn(self, meta, layer, mixed, z, a, b, conv_states, ssm_states):
        """The reference's routing (``run_gdn``) over ``gdn_group`` and ``gdn_prompts``."""
        return run_gdn(meta, layer, mixed, z, a, b, conv_states, ssm_states, self.gdn_group,
                       self.gdn_prompts)

    def gdn_group(self, layer, grp, mixed, z, a, b, conv_states, ssm_states):
        """The group in one compiled call (csrc/gdn_fused.c) where it runs for these tensors:
        fp32 or bf16 activations throughout, contiguous pools, unit column strides."""
        params = self._fused_params(layer, mixed, z, a, b, conv_states, ssm_states,
                                    (grp.slots, grp.slots_out))
        if params is None:
            self._no_invariant_gdn(mixed, conv_states)
            return self.ref.gdn_group(layer, grp, mixed, z, a, b, conv_states, ssm_states)
        taps, neg_exp_a, dt_bias, norm_w = params
        return native.gdn_fused(mixed, z, a, b, taps, conv_states, ssm_states, grp.slots,
                                grp.slots_out, neg_exp_a, dt_bias, norm_w, layer.eps,
                                grp.num_tokens_per_seq, layer.num_k_heads, layer.head_k_dim,
                                self.fused_simd)

    def gdn_prompts(self, layer, c, mixed, z, a, b, conv_states, ssm_states):
        """Prompt chunks through the same compiled call as a recurrent group, token after
        token, one call per sequence (its state in place): the recurrence itself rather than
        the chunked form, the state kept in cache from one token to the next. A sequence with
        no initial state starts from zeros."""
        params = self._fused_params(layer, mixed, z, a, b, conv_states, ssm_states, (c.slots,))
        if params is None:
            self._no_invariant_gdn(mixed, conv_states)
            return self.ref.gdn_prompts(layer, c, mixed, z, a, b, conv_states, ssm_states)
        taps, neg_exp_a, dt_bias, norm_w = params
        # zeros into the slots of sequences without a state, in place: a copy of every slot
        # through index_select and where took 2 x 32 MiB a layer for 32 prompts at the 0.8B
        # shape, which the heap kept (peak RSS)
        fresh = c.slots[~c.has_initial_state]
        conv_states.index_fill_(0, fresh, 0)
        ssm_states.index_fill_(0, fresh, 0)
        # (sequence, first row, end row) of each call: a long chunk in pieces, one after the
        # other over the state in place (the same result), to bound the call's scratch memory
        pieces, end, most = [], 0, self.fused_max_rows
        for i, n in enumerate(c.lens):
            pieces += [(i, s, min(s + most, end + n)) for s in range(end, end + n, most)]
            end += n
        out = None if len(pieces) == 1 else mixed.new_empty(end, layer.value_dim)
        for i, s, e in pieces:
            o = native.gdn_fused(
                mixed[s:e], z[s:e], a[s:e], b[s:e], taps, conv_states, ssm_states,
                c.slots[i:i + 1], None, neg_exp_a, dt_bias, norm_w, layer.eps, e - s,
                layer.num_k_heads, layer.head_k_dim, self.fused_simd)
            if out is None:
                return o
            out[s:e] = o
        return out

    def _no_invariant_gdn(self, mixed, conv_states) -> None:
        """Batch-invariant mode has no GDN path but the compiled one (the torch forms differ
        between prompt chunks and decode): a clear error instead of a silent one."""
        if self.invariant:
            raise ValueError(f"batch_invariant: the GDN layers need fp32 or bf16 activations "
                             f"and contiguous state pools, got {mixed.dtype} activations and "
                             f"{conv_states.dtype} conv states")

    def _fused_params(self, layer, mixed, z, a, b, conv_states, ssm_states, slot_tensors):
        """``_gdn_weights`` where the compiled GDN call runs for these tensors (CPU, fp32 or
        bf16 activations throughout, contiguous pools, unit column strides, a conv window of
        at most 16), else None; slot ranges checked here when no engine checks them per
        step."""
        dtype = mixed.dtype
        if not (self.native and mixed.device.type == "cpu"
                and native.fused_dtype_code(dtype) is not None and conv_states.dtype == dtype
                and conv_states.is_contiguous() and layer.kernel_size <= 16
                and ssm_states.dtype == torch.float32 and ssm_states.is_contiguous()
                and all(t.stride(-1) == 1 and t.dtype == dtype for t in (z, a, b))):
            return None
        if self.num_slots is None:  # not attached to an engine: no per-step check was made
            for t in slot_tensors:
                if t is not None and t.numel() and not (
                        0 <= int(t.min()) <= int(t.max()) < ssm_states.shape[0]):
                    raise IndexError(f"state slots out of range [0, {ssm_states.shape[0]})")
        return self._gdn_weights(layer, dtype)

    def _gdn_weights(self, layer, dtype):
        """fp32 conv taps [K, C], -exp(A_log), dt_bias and the norm weight in the
        activations' dtype for ``native.gdn_fused``, made at the layer's first call and kept."""
        kept = self.gdn_params.get(id(layer))
        params = kept[1] if kept is not None and kept[0] is layer else None
        if params is None or params[3].dtype != dtype:
            params = (
                layer.conv_weight.float().t().contiguous(),
                -layer.A_log.detach().float().exp(),
                layer.dt_bias.detach().float().contiguous(),
                layer.norm_weight.detach().to(dtype).contiguous(),
            )
            self.gdn_params[id(layer)] = (layer, params)
        return params

    def plan_step(self, batch) -> StepMeta:
        """The reference's plan (``reference.plan``); attached to an engine, the slots and KV
        indices checked against its pools once here (the compiled kernels index them
        unchecked) and ``uniform_tokens`` set where every sequence has the same few."""
        meta = plan(batch, self.config.linear_conv_kernel_dim if self.config is not None else 4)
        if self.num_slots is not None:  # the compiled step indexes the pool unchecked
            slots = [s for v in (batch.verify_slots or ()) if v for s in v]
            slots += batch.state_slot_list
            if slots and not 0 <= min(slots) <= max(slots) < self.num_slots:
                raise IndexError(f"state slots out of range [0, {self.num_slots})")
            L = _uniform_len(batch.query_lens) if self.kv_shape is not None else 0
            few = () if L or self.kv_shape is None else _length_groups(batch.query_lens)
            if L or few or (self.invariant and self.kv_shape is not None):
                _check_kv(batch, self.kv_shape)
            if L:
                meta.uniform_tokens = L
            meta.few_tokens = few  # once a step, for every attention layer
        return meta

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x W^T (``ReferenceBackend.linear``'s weights) on the compiled products."""
        if self.invariant:
            return self._invariant_product(x, w)
        if isinstance(w, quant.PackedWeight):
            return self._quant_linear(x, w)
        if self._decode_gemv(x, w):
            return native.gemv_bf16(x, w, self.half_path)
        return cpu_linear(x, w, self._packed(w, x), self.half_simd, self.half_path)

    def _packed(self, weight: torch.Tensor, x: torch.Tensor):
        """The weight's fp32 copy for the batched CPU GEMM where the compiled half kernels do not
        run (kernels/linear.py), made at first use and kept here, by the weight's identity."""
        if not use_fp32_gemm(x, weight, self.half_simd):
            return None
        cached = self.fp32_copies.get(id(weight))
        if cached is None or cached[0] is not weight:
            cached = (weight, pack_weight(weight))
            self.fp32_copies[id(weight)] = cached
        return cached[1]


class _FastLayer:
    """One decoder layer as ``CPUBackend.forward``'s decode loop runs it: its mixer's record
    (``AttentionLayer`` / ``GDNLayer``), norms, the weights of its four products (its merged
    groups; an MoE layer's shared expert's) and, for a GDN layer, ``gdn``: the tensors
    ``native.gdn_fused`` takes besides the activations (None for an attention layer); ``moe``
    an MoE layer's record (None for a dense MLP)."""

    __slots__ = ("gdn", "mixer_layer", "in_norm", "post_norm", "eps", "mixer_in", "mixer_sizes",
                 "mixer_out", "mlp_in", "mlp_sizes", "mlp_out", "moe")

    def __init__(self, layer: DecoderLayerRecord, mixer_in, mixer_out, mlp_in, mlp_out, gdn,
                 moe=None):
        self.gdn = gdn
        self.moe = moe
        self.mixer_layer = layer.mixer_layer
        self.in_norm = layer.input_norm_weight
        self.post_norm = layer.post_norm_weight
        self.eps = layer.eps
        self.mixer_in, self.mixer_sizes = mixer_in
        self.mixer_out = mixer_out
        self.mlp_in, self.mlp_sizes = mlp_in
        self.mlp_out = mlp_out


def _weight_of(w):
    """A product's quantized or bf16 weight for ``CPUBackend._product``, or None."""
    if isinstance(w, quant.PackedWeight):
        return w
    return w if w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() else None


def _kv_dtype_ok(key_cache, value_cache, dtype) -> bool:
    """Whether csrc/attn_decode.c reads these caches with ``dtype`` activations: caches in that
    dtype, or int8 ones (kernels/kvquant.py)."""
    return key_cache.dtype == value_cache.dtype and key_cache.dtype in (dtype, torch.int8)


FUSED_MAX_TOKENS = 8  # new tokens per sequence up to which csrc/attn_decode.c runs a step


def _uniform_len(query_lens: list[int]) -> int:
    """L when every sequence has L new tokens, 1 <= L <= FUSED_MAX_TOKENS; 0 otherwise."""
    L = query_lens[0] if query_lens else 0
    return L if 0 < L <= FUSED_MAX_TOKENS and query_lens.count(L) == len(query_lens) else 0


def _length_groups(query_lens: list[int]) -> tuple:
    """Where every sequence has 1 to FUSED_MAX_TOKENS new tokens: per count L, (L, the rows of
    its sequences in the step, those sequences) as int64 tensors; () otherwise."""
    if not query_lens or min(query_lens) < 1 or max(query_lens) > FUSED_MAX_TOKENS:
        return ()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    groups = []
    for L in sorted(set(query_lens)):
        seqs = [b for b, n in enumerate(query_lens) if n == L]
        rows = [starts[b] + t for b in seqs for t in range(L)]
        groups.append((L, torch.tensor(rows), torch.tensor(seqs)))
    return tuple(groups)


def _recurrent_only(meta) -> bool:
    """A step of recurrent groups only (decodes and verifications, no prompt chunk) where
    every sequence has 1 to FUSED_MAX_TOKENS new tokens, its KV indices checked
    (``CPUBackend.plan_step``)."""
    if meta is None or not (meta.uniform_tokens or meta.few_tokens):
        return False
    gm = meta.gdn
    if gm.chunked is not None or not gm.groups:
        return False
    if meta.uniform_tokens and len(gm.groups) == 1:
        g = gm.groups[0]
        return g.rows is None and g.num_tokens_per_seq == meta.uniform_tokens
    return all(g.rows is not None for g in gm.groups)


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

