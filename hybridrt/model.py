"""Qwen3.5 text model over paged KV and GDN state slots.

The decoder is a layer-type dispatcher: ``layer_types[i]`` routes layer i to the gated
full-attention mixer (paged KV, partial RoPE, sigmoid output gate) or to the Gated DeltaNet
mixer (causal conv1d + gated delta rule over state slots). Parameter names follow the
``Qwen3_5ForCausalLM`` checkpoint layout (``model.layers.{i}...``, ``lm_head``, ``mtp.*``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrt.config import ModelConfig
from hybridrt.forward_batch import ForwardBatch
from hybridrt.kernels.attention import write_kv
from hybridrt.kernels.backend import (
    AttentionLayer,
    DecoderLayerRecord,
    GDNLayer,
    ModelRecord,
    ReferenceBackend,
    StepMeta,
)
from hybridrt.kernels.quant import kernel_weight
from hybridrt.statecache import CacheTensors
from hybridrt.weights import place_weights


class Linear(nn.Linear):
    """nn.Linear without bias, computed by the model's backend, which gets the weight the
    product reads (``quant.kernel_weight``) and may run several projections as one GEMM. In an int8
    model ``weight`` is None and ``qweight`` holds the int8 values (kernels/quant.py)."""

    qweight = None  # a class attribute: looked up on every call

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.backend = _REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, kernel_weight(self))


def _weights(modules) -> tuple:
    return tuple(kernel_weight(m) for m in modules)


_REFERENCE = ReferenceBackend()


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.backend = _REFERENCE

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> norm(x), or with ``residual``: (norm(residual + x), residual + x)."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.backend = _REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.backend.project(x, _weights((self.gate_proj, self.up_proj)))
        return self.down_proj(self.backend.silu_mul(gate, up))


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
        self.backend = _REFERENCE
        self._spec = None

    @property
    def spec(self) -> AttentionLayer:
        """What the backend reads of this layer besides its projections (built once)."""
        if self._spec is None:
            self._spec = AttentionLayer(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                        self.num_heads, self.num_kv_heads, self.head_dim,
                                        self.cache_index)
        return self._spec

    @property
    def in_projections(self) -> tuple[Linear, ...]:
        """The projections of the layer's input, in output order: q (with the gate), k, v."""
        return self.q_proj, self.k_proj, self.v_proj

    @property
    def out_projection(self) -> Linear:
        return self.o_proj

    def forward(self, x, batch: ForwardBatch, cache: CacheTensors, cos, sin):
        be = self.backend
        qg, k, v = be.project(x, _weights(self.in_projections))
        o = be.gated_attention(batch.meta, batch, self.spec, qg, k, v,
                               cache.key_caches[self.cache_index],
                               cache.value_caches[self.cache_index], cos, sin)
        return self.o_proj(o)

    def write_kv(self, x, batch: ForwardBatch, cache: CacheTensors, cos, sin) -> None:
        """Only the K/V that ``forward`` writes for rows ``x`` (the same products, norm and
        RoPE), without the attention: the MTP layer's KV of positions nothing drafts from."""
        be, T = self.backend, x.shape[0]
        HKV, D = self.num_kv_heads, self.head_dim
        # k and v alone (q and its gate are four fifths of the products' outputs), each column
        # the same dot product as in the merged one
        k, v = be.project(x, _weights((self.k_proj, self.v_proj)))
        _, k = be.qk_norm_rope(k.new_zeros(T, 1, D), k.view(T, HKV, D), self.q_norm.weight,
                               self.k_norm.weight, self.q_norm.eps, cos, sin)
        write_kv(k, v.view(T, HKV, D), cache.key_caches[self.cache_index],
                 cache.value_caches[self.cache_index], batch.slot_mapping)


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
        self.backend = _REFERENCE
        self._spec = None

    @property
    def spec(self) -> GDNLayer:
        """What the backend reads of this layer besides its projections (built once)."""
        if self._spec is None:
            self._spec = GDNLayer(self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                                  self.norm.eps, self.num_k_heads, self.head_k_dim,
                                  self.num_v_heads, self.head_v_dim, self.state_index)
        return self._spec

    @property
    def in_projections(self) -> tuple[Linear, ...]:
        """The projections of the layer's input, in output order: qkv, z, b, a."""
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    @property
    def out_projection(self) -> Linear:
        return self.out_proj

    def forward(self, x, batch: ForwardBatch, cache: CacheTensors, cos=None, sin=None):
        be = self.backend
        mixed, z, b, a = be.project(x, _weights(self.in_projections))
        y = be.gdn(batch.meta, self.spec, mixed, z, a, b, cache.conv_states[self.state_index],
                   cache.ssm_states[self.state_index])
        return self.out_proj(y)


class _GatedNorm(nn.Module):
    """The GDN output norm's weight and eps (the backend's ``gdn`` applies it, fused or not)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


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
        if config.num_experts:
            from hybridrt.moe_block import SparseMoeBlock  # it builds on this module's

            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == "full_attention" else self.linear_attn

    def record(self) -> DecoderLayerRecord:
        """What a backend's own decode loop reads of this layer (``DecoderLayerRecord``): the
        mixer's record, the norms, the weights of its products as they are now."""
        m, mlp = self.mixer, self.mlp
        sparse = not isinstance(mlp, MLP)  # a sparse MoE block: no dense MLP products
        return DecoderLayerRecord(
            m.spec, self.input_layernorm.weight, self.post_attention_layernorm.weight,
            self.input_layernorm.eps, _weights(m.in_projections), kernel_weight(m.out_projection),
            () if sparse else _weights((mlp.gate_proj, mlp.up_proj)),
            None if sparse else kernel_weight(mlp.down_proj), sparse,
            mlp.record() if sparse else None)

    def forward(self, h, residual, batch, cache, cos, sin):
        """(h, residual) -> (mlp output, residual stream before it): the residual adds are
        fused into the next norm (``RMSNorm(x, residual)``); ``residual`` None on the first
        layer."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.mixer(x, batch, cache, cos, sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # _weight skips the random init: its normal_ on the meta device imports torch._dynamo
        # (seconds of start-up), and the loader replaces the weight anyway
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
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
        self.mtp = None
        if with_mtp and config.mtp_num_hidden_layers > 0:
            self.mtp = MTPHead(config, len(config.full_attention_layers))
        self.backend = ReferenceBackend(config)
        self.register_load_state_dict_post_hook(_forget_specs)

    def set_backend(self, backend) -> None:
        """Route every layer's kernels through ``backend`` (see hybridrt.kernels.backend), the
        weights laid out as it asks (hybridrt/weights.py)."""
        self.backend = backend
        _forget_specs(self)
        for m in self.modules():
            if "backend" in m.__dict__:
                m.backend = backend
        groups = place_weights(self, backend.merges_projections, backend.huge_pages)
        backend.bind(self.record(), groups)

    def record(self) -> ModelRecord:
        """What a backend reads of the decoder (``ModelRecord``), built from the weights as
        they lie now (``set_backend`` hands it to ``bind`` after laying them out)."""
        return ModelRecord([layer.record() for layer in self.model.layers],
                           self.model.norm.weight, self.model.norm.eps)

    def projection_groups(self) -> list[tuple[Linear, ...]]:
        """The projections of each group that read the same input (a GDN layer's four,
        attention's q/k/v, the MLP's gate/up), in output order: what a backend may run as one
        product (``hybridrt.weights.merge_projections``)."""
        groups = []
        for m in self.modules():
            if isinstance(m, (GatedDeltaNet, GatedAttention)):
                groups.append(m.in_projections)
            elif isinstance(m, MLP):
                groups.append((m.gate_proj, m.up_proj))
        return groups

    def plan_step(self, batch: ForwardBatch) -> StepMeta:
        """The step's metadata, built by the backend once per batch (``batch.meta``)."""
        if batch.meta is None:
            batch.meta = self.backend.plan_step(batch)
        return batch.meta

    @property
    def num_attention_caches(self) -> int:
        n = len(self.config.full_attention_layers)
        return n + (len(self.mtp.layers) if self.mtp is not None else 0)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (that of the weights, unless they are quantized)."""
        return self.model.norm.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        c = self.config
        return self.backend.rope(positions, c.rotary_dim, c.rope_theta, dtype, c.rope_scaling)

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] for every token of the batch: the
        backend's replay of a captured step (``graph_step``), else its whole-step loop from
        the embedded tokens (``forward``), else the layers here."""
        self.plan_step(batch)
        be = self.backend
        out = be.graph_step(batch, cache, self.forward_eager) if batch.vision is None else None
        if out is not None:
            return out
        h, cos, sin = self.step_inputs(batch)
        out = be.forward(batch, cache, h, cos, sin)
        return out if out is not None else self.run_layers(h, cos, sin, batch, cache)

    def forward_eager(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """The step through the layers here (what a CUDA graph captures)."""
        return self.run_layers(*self.step_inputs(batch), batch, cache)

    def step_inputs(self, batch: ForwardBatch):
        """(embedded tokens [T, hidden], cos, sin [T, rotary_dim]) of the batch; image tokens
        with their embeddings and M-RoPE rows (``batch.vision``)."""
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        if batch.vision is not None:
            return batch.vision.apply(h, cos, sin)
        return h, cos, sin

    def run_layers(self, h, cos, sin, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """The decoder layers and the final norm over the embedded tokens ``h``."""
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch, cache, cos, sin)
        return self.model.norm(h, residual)[0]

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                    cache: CacheTensors, kv_only: bool = False) -> torch.Tensor | None:
        """One MTP pass: token ``input_ids[i]`` (= t[p+1]) and the hidden state ``hidden[i]``
        at position p (the target's final-normed output, or the MTP's own output when
        drafting further) -> the MTP's normed output [n, hidden], whose logits predict t[p+2].
        ``batch`` holds positions p, KV slots and block tables of the MTP's own KV cache, and
        ``batch.vision`` the image tokens among t[p+1] and the M-RoPE rows of p.
        ``kv_only``: only the MTP layer's KV of these positions is written (None returned)."""
        if self.mtp is None:
            raise RuntimeError("this model was loaded without its MTP head")
        m = self.mtp
        self.plan_step(batch)
        e = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(batch.positions, e.dtype)
        if batch.vision is not None:  # image tokens' embeddings, M-RoPE rows (vision.mtp)
            e, cos, sin = batch.vision.apply(e, cos, sin)
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(e), m.pre_fc_norm_hidden(hidden)], dim=-1))
        if kv_only:
            layer = m.layers[0]
            layer.self_attn.write_kv(layer.input_layernorm(x), batch, cache, cos, sin)
            return None
        x, residual = m.layers[0](x, None, batch, cache, cos, sin)
        return m.norm(x, residual)[0]

    def bytes_read(self, mtp: bool = False) -> int:
        """Bytes of weights one batch-1 decode step reads: every parameter (and int8 weight)
        of the model but the MTP head's, with the token embedding counted only where it is
        also the LM head (tied; an untied embedding is one row looked up per token), and of an
        MoE block's routed experts only the k a token chooses (hybridrt/moe_block.py: all
        experts are one size). ``mtp``: those of one MTP layer pass instead, the LM head it
        drafts through left out (``specdec.mtp`` adds the one it reads)."""
        def nbytes(module) -> int:  # a plain weight, or packed values + scales
            return kernel_weight(module).nbytes

        root = self.mtp if mtp else self
        if root is None:
            return 0
        mine = [(n, m) for n, m in root.named_modules() if mtp or not n.startswith("mtp.")]
        total = sum(p.numel() * p.element_size() for n, m in mine
                    for p in m.parameters(recurse=False))
        total += sum(m.qweight.nbytes for _, m in mine if getattr(m, "qweight", None) is not None)
        if not mtp and self.lm_head is not None:
            total -= nbytes(self.model.embed_tokens)
        for layer in root.layers if mtp else self.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                unread = 1 - layer.mlp.top_k / len(experts)
                total -= int(unread * sum(nbytes(e.gate_up_proj) + nbytes(e.down_proj)
                                          for e in experts))
        return total

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows to sample) -> fp32 logits [N, vocab], rounded to
        the model's dtype first (what a half-precision LM head returns); ``fp32=False``: in
        that dtype, not widened (enough for an argmax)."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        return self.backend.logits(hidden, kernel_weight(head), fp32)


def _forget_specs(model: nn.Module, incompatible_keys=None) -> None:
    """Drop the layers' backend records, built again from the current parameters at the next
    use (a ``load_state_dict(assign=True)`` puts new parameter objects in place)."""
    for m in model.modules():
        if "_spec" in m.__dict__:
            m._spec = None
