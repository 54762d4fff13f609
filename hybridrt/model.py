"""Qwen3.5 text model over paged KV and GDN state slots.

The decoder is a layer-type dispatcher: ``layer_types[i]`` routes layer i to the gated
full-attention mixer (paged KV, partial RoPE, sigmoid output gate) or to the Gated DeltaNet
mixer (causal conv1d + gated delta rule over state slots). Parameter names follow the
``Qwen3_5ForCausalLM`` checkpoint layout (``model.layers.{i}...``, ``lm_head``, ``mtp.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrt.config import ModelConfig
from hybridrt.forward_batch import ForwardBatch
from hybridrt.kernels import (
    apply_partial_rope,
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    gated_rms_norm,
    linear,
    pack_weight,
    paged_attention,
    recurrent_gated_delta_rule,
    rms_norm,
    rope_cos_sin,
    use_fp32_gemm,
    write_kv,
)
from hybridrt.statecache import CacheTensors


class Linear(nn.Linear):
    """nn.Linear without bias, through ``hybridrt.kernels.linear``. With half-precision weights
    on CPU, batched calls use a repacked copy of the weight kept here after first use (16-column
    half-precision panels for the compiled GEMM: the weights' size once more; without it an fp32
    copy, twice that; see kernels/linear.py for why)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.weight_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, _packed_copy(self, "weight_packed", x, self.weight))


def _packed_copy(owner: nn.Module, attr: str, x: torch.Tensor, weight: torch.Tensor):
    if not use_fp32_gemm(x, weight):
        return None
    cached = getattr(owner, attr)
    if cached is None or cached.shape != weight.shape:
        cached = pack_weight(weight)
        setattr(owner, attr, cached)
    return cached


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial RoPE, GQA and a sigmoid output gate."""

    def __init__(self, config: ModelConfig, cache_index: int):
        super().__init__()
        H, HKV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, HKV, D
        self.cache_index = cache_index  # which key/value cache pair this layer owns
        self.scale = D**-0.5
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, H * D * 2)  # per head: D query + D gate rows
        self.k_proj = Linear(hidden, HKV * D)
        self.v_proj = Linear(hidden, HKV * D)
        self.o_proj = Linear(H * D, hidden)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, x, batch: ForwardBatch, cache: CacheTensors, cos, sin):
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, -1)), cos, sin)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        k_cache = cache.key_caches[self.cache_index]
        v_cache = cache.value_caches[self.cache_index]
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        o = paged_attention(
            q, k_cache, v_cache, batch.cu_seqlens, batch.seq_lens, batch.block_tables,
            self.scale, query_lens=batch.query_lens, context_lens=batch.context_lens,
        )
        o = o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """Linear attention: causal depthwise conv1d + gated delta rule over state slots."""

    def __init__(self, config: ModelConfig, state_index: int):
        super().__init__()
        self.state_index = state_index  # row of conv_states / ssm_states this layer owns
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        conv_dim = config.conv_dim
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, conv_dim)
        self.in_proj_z = Linear(hidden, self.value_dim)
        self.in_proj_b = Linear(hidden, self.num_v_heads)
        self.in_proj_a = Linear(hidden, self.num_v_heads)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel_size, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = _GatedNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden)

    def forward(self, x, batch: ForwardBatch, cache: CacheTensors, cos=None, sin=None):
        T = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(T, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        conv_states = cache.conv_states[self.state_index]
        ssm_states = cache.ssm_states[self.state_index]
        weight = self.conv1d.weight[:, 0, :]
        core = torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)

        for grp in batch.recurrent_groups:
            n, L = grp.rows.shape
            rows = grp.rows.reshape(-1)
            whole = n * L == T  # a batch of decodes only: every row in order, no gather
            pick = (lambda t: t) if whole else (lambda t, rows=rows: t[rows])
            slots = grp.slots
            m = causal_conv1d_update(pick(mixed).view(n, L, -1), weight, conv_states, slots,
                                     state_slots_out=grp.state_slots_out)
            q, k, v = self._split(m.reshape(n * L, -1))
            o = recurrent_gated_delta_rule(
                q.view(n, L, *q.shape[1:]), k.view(n, L, *k.shape[1:]),
                v.view(n, L, *v.shape[1:]), pick(g).view(n, L, -1), pick(beta).view(n, L, -1),
                ssm_states, slots, state_slots_out=grp.state_slots_out, runs=grp.slot_runs,
            ).reshape(n * L, self.num_v_heads, self.head_v_dim)
            if whole:
                core = o
            else:
                core[rows] = o
        if batch.chunk_seqs:
            idx = batch.chunk_seqs
            rows = batch.chunk_rows
            lens = [batch.query_lens[b] for b in idx]
            cu = torch.tensor([0] + lens, device=x.device).cumsum(0)
            sel = torch.tensor(idx, device=x.device)
            slots = batch.state_slots[sel]
            init = batch.has_initial_state[sel]
            part = (lambda t: t) if rows is None else (lambda t: t[rows])
            m = causal_conv1d_varlen(part(mixed), weight, cu, conv_states, slots, init,
                                     seq_lens=lens)
            q, k, v = self._split(m)
            o = chunk_gated_delta_rule(q, k, v, part(g), part(beta), cu, ssm_states, slots, init,
                                       seq_lens=lens)
            if rows is None:
                core = o
            else:
                core[rows] = o
        y = self.norm(core, z).reshape(T, self.value_dim)
        return self.out_proj(y)

    def _split(self, mixed: torch.Tensor):
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )


class _GatedNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, cache_index: int):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(config, cache_index)
        elif layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, cache_index)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == "full_attention" else self.linear_attn

    def forward(self, h, batch, cache, cos, sin):
        h = h + self.mixer(self.input_layernorm(h), batch, cache, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, n_attn, n_gdn = [], 0, 0
        for t in config.layer_types:
            if t == "full_attention":
                layers.append(DecoderLayer(config, t, n_attn))
                n_attn += 1
            else:
                layers.append(DecoderLayer(config, t, n_gdn))
                n_gdn += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPHead(nn.Module):
    """The checkpoint's multi-token-prediction module (``mtp.*``); used by ``hybridrt.specdec``."""

    def __init__(self, config: ModelConfig, first_cache_index: int):
        super().__init__()
        H = config.hidden_size
        self.fc = Linear(2 * H, H)
        self.pre_fc_norm_embedding = RMSNorm(H, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(config, "full_attention", first_cache_index + i)
            for i in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """Qwen3.5 text model: ``forward(batch, cache) -> hidden`` and ``compute_logits(hidden)``."""

    def __init__(self, config: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tied_head_packed: torch.Tensor | None = None  # see Linear
        self.mtp = None
        if with_mtp and config.mtp_num_hidden_layers > 0:
            self.mtp = MTPHead(config, len(config.full_attention_layers))

    @property
    def num_attention_caches(self) -> int:
        n = len(self.config.full_attention_layers)
        return n + (len(self.mtp.layers) if self.mtp is not None else 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        c = self.config
        return rope_cos_sin(positions, c.rotary_dim, c.rope_theta, dtype)

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] for every token of the batch."""
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, batch, cache, cos, sin)
        return self.model.norm(h)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                    cache: CacheTensors) -> torch.Tensor:
        """One MTP pass: token ``input_ids[i]`` (= t[p+1]) and the hidden state ``hidden[i]``
        at position p (the target's final-normed output, or the MTP's own output when
        drafting further) -> the MTP's normed output [n, hidden], whose logits predict t[p+2].
        ``batch`` holds positions p, KV slots and block tables of the MTP's own KV cache."""
        if self.mtp is None:
            raise RuntimeError("this model was loaded without its MTP head")
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rope(batch.positions, x.dtype)
        x = m.layers[0](x, batch, cache, cos, sin)
        return m.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows to sample) -> fp32 logits [N, vocab], rounded to
        the model's dtype first (what a half-precision LM head returns)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        weight = self.model.embed_tokens.weight
        return linear(hidden, weight,
                      _packed_copy(self, "tied_head_packed", hidden, weight)).float()
