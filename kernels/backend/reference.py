"""The reference backend: plain torch everywhere, the definition of correct that the other
backends are tested against. The math of one gated attention layer (``gated_attention``) and
of one GDN layer (``gdn``: conv, gated delta rule, gated output norm) reads top to bottom here.
The step's plan (``plan``) and the GDN layer's routing over its recurrent groups and prompt
chunks (``run_gdn``) are functions of their own, which the CPU backend calls with its own
kernels (it holds a ``ReferenceBackend`` for the steps it has none for). The CUDA backend
(``kernels/cuda/backend.py``) overrides single steps of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from ..attention import attention_plan, paged_attention, write_kv
from ..conv import causal_conv1d_update, causal_conv1d_varlen
from ..delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from ..norm import gated_rms_norm, rms_norm
from ..options import KernelOptions
from ..rope import apply_partial_rope, rope_cos_sin
from .layers import AttentionLayer, GDNLayer, ModelRecord
from .plan import ChunkedSeqs, GDNMeta, RecurrentGroup, StepMeta, gdn_split, step_arrays


class ReferenceBackend:
    """Plain torch everywhere: the definition of correct that other backends are tested
    against. Runs on any device torch runs on."""

    name = "reference"
    merges_projections = False  # wants the model's projection groups merged (bind's groups)
    huge_pages = False  # wants the streamed weights in transparent-huge-page memory

    def __init__(self, config=None, device: torch.device | str = "cpu",
                 options: KernelOptions | None = None):
        self.config = config
        self.device = torch.device(device)
        self.options = options if options is not None else KernelOptions()
        self.gdn_step = None  # the in-place decode step recurrent_gated_delta_rule runs (torch's)
        self.prefill_attention = None  # paged_attention's ``prefill`` (None: SDPA, whole context)

    # Binding ------------------------------------------------------------------------------
    def bind(self, record: ModelRecord, groups: dict) -> None:
        """Called once by ``set_backend``, the weights laid out as ``merges_projections`` and
        ``huge_pages`` ask: ``record`` the model's layers (``layers.ModelRecord``), ``groups``
        {ids of the projections' weights: (merged weight, output sizes)}."""

    def attach(self, cache) -> None:
        """Called once by the runner with the engine's cache manager (sizes, pools)."""

    # Per step -----------------------------------------------------------------------------
    def plan_step(self, batch) -> StepMeta:
        """The step's metadata (plan.py), built once from ``batch``'s host lists."""
        return plan(batch, self.config.linear_conv_kernel_dim if self.config is not None else 4)

    # Linear layers and elementwise ops ----------------------------------------------------
    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x W^T; ``w``: a weight [out, in] or quantized weights (``quant.PackedWeight``: int8
        or 4-bit), multiplied dequantized."""
        if isinstance(w, quant.PackedWeight):
            return F.linear(x, w.dequantize(x.dtype))
        return F.linear(x, w)

    def project(self, x: torch.Tensor, weights) -> list[torch.Tensor]:
        """Several projections of the same input (a backend may run them as one GEMM: the
        groups it was bound with, keyed by the ids of their weights)."""
        return [self.linear(x, w) for w in weights]

    def logits(self, hidden: torch.Tensor, head, fp32: bool = True) -> torch.Tensor:
        """The LM head's product (``head``: its weight, as ``linear`` takes it) in fp32, or
        with ``fp32=False`` in the product's own dtype (every value the same once widened)."""
        y = self.linear(hidden, head)
        return y.float() if fp32 else y

    def rope(self, positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
             scaling=None):
        """(cos, sin) [T, rotary_dim] of ``positions`` [T] in ``dtype`` (``scaling``: YaRN's
        ``kernels.rope.RopeScaling`` or None)."""
        return rope_cos_sin(positions, rotary_dim, theta, dtype, scaling)

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
    def gated_attention(self, meta: StepMeta, batch, layer: AttentionLayer, qg, k, v, key_cache,
                        value_cache, cos, sin):
        """A gated attention layer from its projections' outputs to o_proj's input: q/k norms
        and partial RoPE, this step's K/V into the paged cache, attention, the sigmoid gate.
        qg: [T, H * 2D] (per head D query then D gate values), k, v: [T, HKV * D] ->
        [T, H * D]."""
        T = qg.shape[0]
        H, HKV, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, gate = qg.view(T, H, 2 * D).chunk(2, dim=-1)
        q, k = self.qk_norm_rope(q, k.view(T, HKV, D), layer.q_norm_weight,
                                 layer.k_norm_weight, layer.eps, cos, sin)
        o = self.attention(meta, batch, q, k, v.view(T, HKV, D), key_cache, value_cache,
                           layer.scale)
        return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))

    def attention(self, meta: StepMeta, batch, q, k, v, key_cache, value_cache, scale):
        """Write this step's K/V into the paged cache, then causal attention of ``q`` over
        each sequence's blocks -> [T, H, D]."""
        write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        return paged_attention(q, key_cache, value_cache, batch.cu_seqlens, batch.seq_lens,
                               batch.block_tables, scale, plan=meta.attention,
                               prefill=self.prefill_attention)

    def gdn(self, meta: StepMeta, layer: GDNLayer, mixed, z, a, b, conv_states, ssm_states):
        """One GDN layer over its state slots, from the in-projections' outputs to out_proj's
        input: conv, gated delta rule, gated output norm.

        mixed: [T, conv_dim] (q | k | v channels), z: [T, HV * DV], a, b: [T, HV] raw
        projections -> [T, HV * DV]. Each recurrent group (``gdn_group``) and the prompt chunks
        (``gdn_prompts``; in rounds, with the states at their checkpoints copied between them)
        get their own rows of the inputs (no copy when they are the whole batch)."""
        return run_gdn(meta, layer, mixed, z, a, b, conv_states, ssm_states, self.gdn_group,
                       self.gdn_prompts)

    def gdn_group(self, layer: GDNLayer, grp: RecurrentGroup, mixed, z, a, b, conv_states,
                  ssm_states):
        """A recurrent group's rows (sequences continuing from a state) -> the gated-normed
        output [n * L, HV * DV]: ``gdn_recurrent``, then the norm."""
        core = self.gdn_recurrent(layer, grp, mixed, a, b, conv_states, ssm_states)
        return self._gdn_norm(layer, core, z)

    def gdn_prompts(self, layer: GDNLayer, c: ChunkedSeqs, mixed, z, a, b, conv_states, ssm_states):
        """The prompt chunks' rows -> the gated-normed output [t, HV * DV]: here the chunked
        form (``gdn_chunked``), then the norm."""
        core = self.gdn_chunked(layer, c, mixed, a, b, conv_states, ssm_states)
        return self._gdn_norm(layer, core, z)

    def _gdn_norm(self, layer, core, z):
        n = core.shape[0]
        y = self.gated_rms_norm(core, z.reshape(n, layer.num_v_heads, layer.head_v_dim),
                                layer.norm_weight, layer.eps)
        return y.reshape(n, layer.value_dim)

    def gdn_recurrent(self, layer: GDNLayer, grp: RecurrentGroup, mixed, a, b, conv_states,
                      ssm_states):
        """The group's n sequences of L tokens each (rows in order) -> core [n * L, HV, DV]."""
        n, L = grp.num_seqs, grp.num_tokens_per_seq
        g, beta = gates(layer, a, b)
        m = causal_conv1d_update(mixed.view(n, L, -1), layer.conv_weight, conv_states,
                                 grp.slots, state_slots_out=grp.slots_out)
        q, k, v = layer.split(m.reshape(n * L, -1))
        return recurrent_gated_delta_rule(
            q.view(n, L, *q.shape[1:]), k.view(n, L, *k.shape[1:]), v.view(n, L, *v.shape[1:]),
            g.view(n, L, -1), beta.view(n, L, -1), ssm_states, grp.slots,
            state_slots_out=grp.slots_out, runs=grp.runs, step=self.gdn_step,
        ).reshape(n * L, *v.shape[1:])

    def gdn_chunked(self, layer: GDNLayer, c: ChunkedSeqs, mixed, a, b, conv_states, ssm_states):
        """The prompt chunks' tokens (packed as ``c.cu_seqlens``) -> core [t, HV, DV]."""
        g, beta = gates(layer, a, b)
        m = causal_conv1d_varlen(mixed, layer.conv_weight, c.cu_seqlens, conv_states, c.slots,
                                 c.has_initial_state, plan=c.conv)
        q, k, v = layer.split(m)
        return chunk_gated_delta_rule(q, k, v, g, beta, c.cu_seqlens, ssm_states, c.slots,
                                      c.has_initial_state, plan=c.delta)

    # Whole steps --------------------------------------------------------------------------
    def graph_step(self, batch, cache, eager) -> torch.Tensor | None:
        """A whole step replayed from a capture of ``eager(batch, cache)`` -> hidden, or None:
        none here."""
        return None

    def forward(self, batch, cache, h, cos, sin) -> torch.Tensor | None:
        """A whole step from the embedded tokens ``h`` and RoPE rows -> hidden, or None to
        let the model run its layers: none here."""
        return None


def plan(batch, kernel_size: int) -> StepMeta:
    """The reference's step metadata: the attention plan and the GDN routing with the conv and
    chunked delta rule's plans (``kernel_size``: the conv window)."""
    arr = step_arrays(batch)
    attn = attention_plan(batch.query_lens, batch.context_lens, batch.block_tables, arr)
    return StepMeta(attn, gdn_split(batch, arr, True, kernel_size), batch.num_tokens)


def run_gdn(meta: StepMeta, layer: GDNLayer, mixed, z, a, b, conv_states, ssm_states, group,
            prompts):
    """A GDN layer's routing (``ReferenceBackend.gdn``): each recurrent group through
    ``group(layer, RecurrentGroup, mixed, z, a, b, conv_states, ssm_states)``, the prompt
    chunks (each round, the checkpoints' states copied after it) through ``prompts`` (same
    arguments with a ``ChunkedSeqs``), every part on its own rows -> [T, HV * DV]."""
    T = mixed.shape[0]
    out = None
    gm: GDNMeta = meta.gdn
    parts = [(g.rows, group, g) for g in gm.groups]
    c = gm.chunked
    if c is not None:
        parts += [(r.rows, prompts, r) for r in c.rounds or [c]]
    for rows, kernel, part in parts:
        x = [t if rows is None else t[rows] for t in (mixed, z, a, b)]
        o = kernel(layer, part, *x, conv_states, ssm_states)
        if rows is None:
            out = o
        else:
            if out is None:
                out = o.new_empty(T, *o.shape[1:])
            out[rows] = o
        copies = getattr(part, "copies", None)
        if copies is not None:
            src, dst = copies
            conv_states.index_copy_(0, dst, conv_states.index_select(0, src))
            ssm_states.index_copy_(0, dst, ssm_states.index_select(0, src))
    return out


def gates(layer: GDNLayer, a, b):
    """GDN decay (log space) and write strength from the raw projections, in fp32."""
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, torch.sigmoid(b).float()

